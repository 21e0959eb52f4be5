"""Linear recurrences per document across CP ranks: the gated delta rule (Qwen3-Next, Qwen3.5).

Note [Passing a recurrent state across ranks, in parallel]
----------------------------------------------------------
A gated delta rule keeps a state ``S [dk, dv]`` per head; each token updates it affinely,
``S <- a (I - b k k^T) S + b k v^T``, so a run of tokens maps its incoming state as
``S_out = P S_in + B``: ``B`` is the run's final state from zero, ``P [dk, dk]`` its
transition (the run with ``v = 0`` from the identity). A document's tokens are cut into
*pieces* (one rank's consecutive positions); in the balanced layout a document's pieces
may alternate ranks. From the replicated geometry every rank knows every piece, so:

1. every piece that starts a document runs from zero (its output is final; if the
   document goes on, its final state ``B`` is kept); a middle piece also runs from zero
   for ``B`` and once more for ``P``;
2. one all-gather over the CP group carries ``(P, B)`` of every piece a later piece
   needs (O(heads x dk x (dk + dv)) per piece, whatever the document's length);
3. each rank composes, for each of its pieces that continues a document, the incoming
   state ``S = P_j (... (P_2 B_1 + B_2) ...) + B_j`` over the pieces before it, in
   position order, and runs that piece again from ``S`` (its output replaces the
   zero-start one; a last piece runs only this way).

No rank waits for another's recurrence (a prefix over pieces, not a pipeline over ranks);
backward is autograd's, the all-gather's backward a reduce-scatter on every rank. Pieces
run batched, right-padded with ``g = 0`` and ``beta = 0`` (padding leaves the state as it
is), in buckets of lengths within a factor of two (padding at most doubles the work),
through `chunked_gated_delta_rule` (Note [The chunked gated delta rule]).

Note [The chunked gated delta rule]
-----------------------------------
Token by token (Qwen3-Next's convention, keys and queries L2-normalised, queries scaled by
``dk ** -0.5``): ``S <- exp(g) S``; ``S <- S + k (beta (v - S^T k))^T``; ``o = S^T q``.
Within a chunk of ``C`` tokens with cumulative log-decay ``c``, the updates form a
unit-lower-triangular system (the UT transform): with ``A = strict_lower((beta k) k^T *
exp(c_i - c_j))``, ``u = (I + A)^-1 (beta v)`` and ``w = (I + A)^-1 (beta k exp(c))``; then
per chunk, from the incoming state ``S``:

    v_new = u - w S
    o     = (q exp(c)) S + lower((q k^T) * exp(c_i - c_j)) v_new
    S    <- exp(c_last) S + (k exp(c_last - c))^T v_new

which equals the token loop exactly in exact arithmetic (the tests compare it with the
token loop in float64). It computes in the input dtype (float32 for half precision).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..kernels.base import accumulate_dtype
from ..parallel.collectives import AllGatherRows
from ..plan.geometry import StepGeometry


@dataclass(frozen=True)
class Piece:
    """One of this rank's pieces: local rows ``[local_start, local_start + length)`` of one document.

    Attributes:
        before: ``(rank, slot)`` of every earlier piece of its document, in position order
            (empty: it starts its document).
        slot: its slot in this rank's contribution to the all-gather (-1: no later piece needs it).
    """

    local_start: int
    length: int
    before: tuple[tuple[int, int], ...]
    slot: int

    @property
    def starts_document(self) -> bool:
        return not self.before

    @property
    def continues(self) -> bool:
        return self.slot >= 0


@dataclass(frozen=True)
class PieceSchedule:
    """This rank's pieces for the step's recurrences (Note [Passing a recurrent state across ranks ...]).

    Attributes:
        pieces: this rank's pieces, in local order.
        pad: slots per rank in the all-gather (0: no document crosses a piece boundary).
    """

    local_len: int
    pieces: tuple[Piece, ...]
    pad: int
    group: Any

    @staticmethod
    def build(geometry: StepGeometry, rank: int, group: Any) -> "PieceSchedule":
        by_document: dict[int, list[tuple[int, int, int]]] = {}  # doc start -> [(global start, rank, index)]
        per_rank = [geometry.pieces(r) for r in range(geometry.world)]
        for r, pieces in enumerate(per_rank):
            for i, (g0, d0) in enumerate(zip(pieces.global_start.tolist(), pieces.doc_start.tolist())):
                by_document.setdefault(d0, []).append((g0, r, i))
        slots: dict[tuple[int, int], int] = {}
        counts = [0] * geometry.world
        for runs in by_document.values():
            for _, r, i in sorted(runs)[:-1]:  # every piece but a document's last is needed later
                slots[r, i] = counts[r]
                counts[r] += 1
        mine = per_rank[rank]
        pieces = []
        for i, (start, length, d0) in enumerate(zip(*(t.tolist() for t in (mine.local_start, mine.length, mine.doc_start)))):
            order = sorted(by_document[d0])
            here = order.index((mine.global_start[i].item(), rank, i))
            before = tuple((r, slots[r, j]) for _, r, j in order[:here])
            pieces.append(Piece(start, length, before, slots.get((rank, i), -1)))
        return PieceSchedule(geometry.plan.local_len, tuple(pieces), max(counts), group)

    def gated_delta_rule(self, q_LHD, k_LHD, v_LHD, g_LH, beta_LH) -> torch.Tensor:
        """``o [L, Hv, dv]`` of the gated delta rule per document (q, k ``[L, Hk, dk]``, v ``[L, Hv, dv]``,
        g, beta ``[L, Hv]``); padding rows 0. Differentiable; runs the step's all-gather when a
        document crosses pieces (forward and backward)."""
        run = _PieceRunner(q_LHD, k_LHD, v_LHD, g_LH, beta_LH, chunked_gated_delta_rule)
        out = v_LHD.new_zeros(v_LHD.shape)
        first = [p for p in self.pieces if p.starts_document]
        o_first, b_first = run(first)
        _write(out, first, o_first)
        if self.pad == 0:
            return out if self.pieces else out + 0.0 * v_LHD.sum()  # a rank of only padding: still a graph
        dk = k_LHD.shape[-1]
        sent = v_LHD.new_zeros((self.pad, v_LHD.shape[1], dk, dk + v_LHD.shape[2]))  # (P, B) by slot
        kept = [i for i, p in enumerate(first) if p.continues]
        if kept:
            B = b_first[kept]
            no_transition = B.new_zeros((*B.shape[:3], dk))  # a document's first piece: S_out = B
            sent = sent.index_copy(0, _slots([first[i] for i in kept], sent), torch.cat([no_transition, B], -1))
        middle = [p for p in self.pieces if p.continues and not p.starts_document]
        if middle:
            B, P = run(middle)[1], run(middle, transition=True)[1]
            sent = sent.index_copy(0, _slots(middle, sent), torch.cat([P, B], -1))
        # a rank with nothing to send still sends rows of its graph, so that every rank's backward
        # runs the all-gather's reduce-scatter (autograd skips a collective on an input without grad)
        sent = sent + 0.0 * v_LHD.reshape(-1)[:1].sum()
        gathered = AllGatherRows.apply(sent, self.group)  # [W * pad, Hv, dk, dk + dv]
        later = [p for p in self.pieces if not p.starts_document]
        o_later, _ = run(later, initial=[_incoming(p, gathered, self.pad) for p in later])
        _write(out, later, o_later)
        return out + 0.0 * gathered.sum()  # every rank's backward joins the all-gather's reduce-scatter


def _slots(pieces, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor([p.slot for p in pieces], dtype=torch.long, device=like.device)


def _incoming(piece: Piece, gathered: torch.Tensor, pad: int) -> torch.Tensor:
    """``[Hv, dk, dv]``: the state entering `piece`, composed over the pieces before it."""
    state = None
    for rank, slot in piece.before:
        entry = gathered[rank * pad + slot]
        dk = entry.shape[1]
        P, B = entry[..., :dk], entry[..., dk:]
        state = B if state is None else P @ state + B
    return state


def _write(out: torch.Tensor, pieces, values: Optional[list]) -> None:
    for piece, value in zip(pieces, values or []):
        out[piece.local_start : piece.local_start + piece.length] = value


class _PieceRunner:
    """Runs the chunked rule on pieces, batched in length buckets; ``__call__(pieces, initial=, transition=)``
    returns ``(outputs per piece [n_i, Hv, dv] or None, final states [P, Hv, dk, dv or dk] or None)``."""

    def __init__(self, q, k, v, g, beta, chunk_rule) -> None:
        self.q, self.k, self.v, self.g, self.beta, self.rule = q, k, v, g, beta, chunk_rule

    def __call__(self, pieces, initial: Optional[list] = None, transition: bool = False):
        if not pieces:
            return [], None
        outputs, finals = [None] * len(pieces), [None] * len(pieces)
        for bucket in _buckets([p.length for p in pieces]):
            chosen = [pieces[i] for i in bucket]
            init = None if initial is None else torch.stack([initial[i] for i in bucket])
            o, s = self._run(chosen, init, transition)
            for j, i in enumerate(bucket):
                outputs[i], finals[i] = o[j, : pieces[i].length], s[j]
        return outputs, torch.stack(finals)

    def _run(self, pieces, initial, transition):
        T = max(p.length for p in pieces)
        L = self.q.shape[0]
        rows = torch.full((len(pieces), T), L, dtype=torch.long)
        for j, p in enumerate(pieces):
            rows[j, : p.length] = torch.arange(p.local_start, p.local_start + p.length)
        rows = rows.to(self.q.device)

        def take(x):
            return torch.cat([x, x.new_zeros((1, *x.shape[1:]))]).index_select(0, rows.flatten()).reshape(*rows.shape, *x.shape[1:])

        q, k, g, beta = take(self.q), take(self.k), take(self.g), take(self.beta)
        if transition:  # v = 0 from the identity: the final state is the pieces' transition P
            dk = k.shape[-1]
            v = q.new_zeros((*q.shape[:2], g.shape[-1], dk))
            eye = torch.eye(dk, dtype=q.dtype, device=q.device)
            initial = eye.expand(len(pieces), g.shape[-1], dk, dk).clone()
        else:
            v = take(self.v)
        return self.rule(q, k, v, g, beta, initial_state=initial)


def _buckets(lengths: list[int]) -> list[list[int]]:
    """Indices grouped so that each group's lengths are within a factor of two (by bit length)."""
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(max(n, 1).bit_length(), []).append(i)
    return [groups[key] for key in sorted(groups)]


def chunked_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None, chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over ``[B, T]`` rows (Note [The chunked gated delta rule]).

    Args:
        q, k: ``[B, T, Hk, dk]`` (each K head serves ``Hv / Hk`` value heads); v: ``[B, T, Hv, dv]``.
        g: ``[B, T, Hv]`` log-decays (<= 0); beta: ``[B, T, Hv]`` update strengths.
        initial_state: ``[B, Hv, dk, dv]`` (None: zeros).

    Returns:
        ``(o [B, T, Hv, dv] in v's dtype, final state [B, Hv, dk, dv])``.
    """
    dtype = accumulate_dtype(v.dtype)
    B, T, Hv, dv = v.shape
    q, k = (x.repeat_interleave(Hv // x.shape[2], dim=2) if x.shape[2] != Hv else x for x in (q, k))
    q, k, v, g, beta = (x.transpose(1, 2).to(dtype) for x in (q, k, v, g, beta))  # [B, H, T, ...]
    q, k = _l2norm(q), _l2norm(k)
    q = q * q.shape[-1] ** -0.5
    pad = (-T) % chunk
    q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (torch.nn.functional.pad(x, (0, pad)) for x in (g, beta))
    n = (T + pad) // chunk
    q, k, v = (x.reshape(B, Hv, n, chunk, -1) for x in (q, k, v))
    c = g.reshape(B, Hv, n, chunk).cumsum(-1)
    beta = beta.reshape(B, Hv, n, chunk, 1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (c.unsqueeze(-1) - c.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()  # exp(c_i - c_j), i >= j
    system = ((beta * k) @ k.transpose(-1, -2) * decay).tril(-1)  # A, strictly lower
    eye = torch.eye(chunk, dtype=dtype, device=q.device)
    u = torch.linalg.solve_triangular(eye + system, beta * v, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(eye + system, beta * k * c.exp().unsqueeze(-1), upper=False, unitriangular=True)
    state = q.new_zeros((B, Hv, k.shape[-1], dv)) if initial_state is None else initial_state.to(dtype)
    outputs = []
    for i in range(n):
        qi, ki, ci = q[:, :, i], k[:, :, i], c[:, :, i]
        v_new = u[:, :, i] - w[:, :, i] @ state
        attn = (qi @ ki.transpose(-1, -2)) * decay[:, :, i]
        outputs.append((qi * ci.exp().unsqueeze(-1)) @ state + attn @ v_new)
        last = ci[..., -1:]
        state = state * last.exp().unsqueeze(-1) + (ki * (last - ci).exp().unsqueeze(-1)).transpose(-1, -2) @ v_new
    o = torch.stack(outputs, dim=2).reshape(B, Hv, n * chunk, dv)[:, :, :T]
    return o.transpose(1, 2).to(v.dtype), state


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum x^2 + eps)`` over the last dimension (flash-linear-attention's form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)
