"""Linear recurrences per document across CP ranks: the gated delta rule (Qwen3-Next, Qwen3.5)
and Mamba2's state-space scan.

Note [Passing a recurrent state across ranks, in parallel]
----------------------------------------------------------
A gated delta rule keeps a state ``S [dk, dv]`` per head; each token updates it affinely,
``S <- a (I - b k k^T) S + b k v^T``, so a run of tokens maps its incoming state as
``S_out = P S_in + B``: ``B`` is the run's final state from zero, ``P [dk, dk]`` its
transition. The state's columns evolve independently, so one run from ``[I | 0]`` with
values ``[0 | v]`` gives ``[P_t | B_t]`` after every token t at once: its outputs are
``[P_t^T q_t | o_t from zero]`` and its final state is ``[P | B]``. A document's tokens
are cut into *pieces* (one rank's consecutive positions); in the balanced layout a
document's pieces may alternate ranks. From the replicated geometry every rank knows
every piece, so:

1. every piece that starts a document runs from zero (its output is final; if the
   document goes on, its final state ``B`` is kept); every other piece runs once from
   ``[I | 0]`` as above (about ``(dk + dv) / dv`` times the work of a plain run);
2. one all-gather over the CP group carries ``(P, B)`` of every piece a later piece
   needs (O(heads x dk x (dk + dv)) per piece, whatever the document's length);
3. each rank composes, for each of its pieces that continues a document, the incoming
   state ``S = P_j (... (P_2 B_1 + B_2) ...) + B_j`` over the pieces before it, in
   position order, and adds ``S^T (P_t^T q_t)`` to the zero-start outputs: one small
   matmul per token, nothing rerun after the all-gather.

No rank waits for another's recurrence (a prefix over pieces, not a pipeline over ranks);
backward is autograd's, the all-gather's backward a reduce-scatter on every rank. Pieces
run batched, right-padded with ``g = 0`` and ``beta = 0`` (padding leaves the state as it
is), in buckets that run the chunks each piece would run alone (`_buckets`), through the
chunked kernels of chunked.py.

Mamba2's scan (Nemotron-H, Falcon-H1, Bamba, Granite-4) is the same with a scalar
transition: a head's state decays by ``exp(sum dt A)`` over a run, so ``(P, B)`` is one
number and ``[P, N]`` per head, and a continuing piece runs plainly from zero: its
output is corrected by ``exp(c_t) (C_t S)``, ``c`` the cumulative log-decay from the
piece's start (`PieceSchedule.ssd`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from ..kernels.base import accumulate_dtype
from ..parallel.routes import EntryRoute
from ..plan.geometry import StepGeometry
from .chunked import CHUNK, chunked_gated_delta_rule, chunked_ssd


@dataclass(frozen=True)
class Piece:
    """One of this rank's pieces: local rows ``[local_start, local_start + length)`` of one document.

    Attributes:
        before: ``(rank, slot)`` of every earlier piece of its document, in position order
            (empty: it starts its document).
        slot: its slot among this rank's entries of the route (-1: no later piece needs it).
        before_rows: the rows of the delivered buffer holding `before`'s states, in the same order.
    """

    local_start: int
    length: int
    before: tuple[tuple[int, int], ...]
    slot: int
    before_rows: tuple[int, ...] = ()

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
        pad: the most slots a rank has (0: no document crosses a piece boundary, on any rank).
        route: how the slots' states reach the ranks whose later pieces read them (Note [Entry routes]).
    """

    local_len: int
    pieces: tuple[Piece, ...]
    pad: int
    route: EntryRoute

    @staticmethod
    def build(geometry: StepGeometry, rank: int, group: Any, peers: bool = False) -> "PieceSchedule":
        """`peers`: hand states point-to-point to the ranks that read them (the grouped layout), else one all-gather."""
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
        route = (_peer_route(group, rank, counts, pieces, by_document, slots) if peers and max(counts) else
                 EntryRoute.gather(group, rank, counts))
        pieces = [replace(p, before_rows=tuple(int(route.rows(r, torch.tensor([s]))[0]) for r, s in p.before))
                  for p in pieces]
        return PieceSchedule(geometry.plan.local_len_of(rank), tuple(pieces), max(counts), route)

    def gated_delta_rule(self, q_LHD, k_LHD, v_LHD, g_LH, beta_LH) -> torch.Tensor:
        """``o [L, Hv, dv]`` of the gated delta rule per document (q, k ``[L, Hk, dk]``, v ``[L, Hv, dv]``,
        g, beta ``[L, Hv]``); padding rows 0. Differentiable; runs the step's all-gather when a
        document crosses pieces (forward and backward)."""
        run = _PieceRunner((q_LHD, k_LHD, v_LHD, g_LH, beta_LH), chunked_gated_delta_rule)
        first = [p for p in self.pieces if p.starts_document]
        ran = run(first)
        out = v_LHD.new_zeros(v_LHD.shape) if ran is None else ran.written(v_LHD.new_zeros(v_LHD.shape))
        if self.pad == 0:
            return out if self.pieces else out + 0.0 * v_LHD.sum()  # a rank of only padding: still a graph
        dk = k_LHD.shape[-1]
        sent = v_LHD.new_zeros((self.pad, v_LHD.shape[1], dk, dk + v_LHD.shape[2]))  # (P, B) by slot
        kept = [i for i, p in enumerate(first) if p.continues]
        if kept:
            B = ran.finals.index_select(0, torch.tensor(kept, device=out.device))
            no_transition = B.new_zeros((*B.shape[:3], dk))  # a document's first piece: S_out = B
            sent = sent.index_copy(0, _slots([first[i] for i in kept], sent), torch.cat([no_transition, B], -1))
        later = [p for p in self.pieces if not p.starts_document]
        # one pass from [I | 0] with values [0 | v], before the all-gather: its outputs are
        # [q^T P_t | o_zero_t] per token and its final state [P | B] (Note [Passing a recurrent state ...])
        spread = run(later, rule=_delta_rule_transition_and_state)
        middle = [i for i, p in enumerate(later) if p.continues]
        if middle:
            finals = spread.finals.index_select(0, torch.tensor(middle, device=out.device))
            sent = sent.index_copy(0, _slots([later[i] for i in middle], sent), finals)
        # a rank with nothing to send still sends rows of its graph, so that every rank's backward
        # runs the all-gather's reduce-scatter (autograd skips a collective on an input without grad)
        sent = sent + 0.0 * v_LHD.reshape(-1)[:1].sum()
        gathered = self.route.deliver(sent[: self.route.own])  # the states each later piece reads
        if later:
            parts = spread.values.split([later[i].length for i in spread.order])
            entering = [_incoming(later[i], gathered) for i in spread.order]
            o = torch.cat([part[..., dk:] + torch.einsum("thk,hkv->thv", part[..., :dk], S)
                           for part, S in zip(parts, entering)])
            out = out.index_copy(0, spread.rows, o.to(out.dtype))
        return out + 0.0 * gathered.sum()  # every rank's backward joins the all-gather's reduce-scatter

    def ssd(self, x_LHP, dt_LH, A_H, B_LGN, C_LGN) -> torch.Tensor:
        """``y [L, H, P]`` of Mamba2's scan per document (without the ``D x`` skip): x ``[L, H, P]``,
        dt ``[L, H]`` (after softplus and clamping), A ``[H]``, B, C ``[L, G, N]``; padding rows 0.
        Differentiable; runs the step's all-gather when a document crosses pieces."""
        ran = _PieceRunner((x_LHP, dt_LH, B_LGN, C_LGN), lambda *rows, initial_state: chunked_ssd(
            rows[0], rows[1], A_H, rows[2], rows[3], initial_state=initial_state))(list(self.pieces))
        out = x_LHP.new_zeros(x_LHP.shape) if ran is None else ran.written(x_LHP.new_zeros(x_LHP.shape))
        if self.pad == 0:
            return out if self.pieces else out + 0.0 * x_LHP.sum()
        H, P, N = x_LHP.shape[1], x_LHP.shape[2], B_LGN.shape[2]
        dtype = accumulate_dtype(x_LHP.dtype)
        log_decay = dt_LH.to(dtype) * A_H.to(dtype)  # [L, H]
        sent = x_LHP.new_zeros((self.pad, H, 1 + P * N), dtype=dtype)  # (log transition, B) by slot
        kept = [i for i, p in enumerate(self.pieces) if p.continues]
        if kept:
            totals = torch.stack([log_decay[p.local_start : p.local_start + p.length].sum(0) for p in
                                  (self.pieces[i] for i in kept)])
            final = ran.finals.index_select(0, torch.tensor(kept, device=out.device))
            entries = torch.cat([totals.unsqueeze(-1), final.reshape(len(kept), H, P * N)], -1)
            sent = sent.index_copy(0, _slots([self.pieces[i] for i in kept], sent), entries)
        sent = sent + 0.0 * x_LHP.reshape(-1)[:1].sum()  # every rank's backward joins the transport
        gathered = self.route.deliver(sent[: self.route.own])  # [rows, H, 1 + P N]
        rows, corrections = [], []
        for p in self.pieces:
            if p.starts_document:
                continue
            incoming = _incoming_scalar(p, gathered).reshape(H, P, N)
            span = slice(p.local_start, p.local_start + p.length)
            C = C_LGN[span].repeat_interleave(H // C_LGN.shape[1], dim=1).to(dtype)  # [n, H, N]
            fade = log_decay[span].cumsum(0).exp()  # [n, H]
            corrections.append(fade.unsqueeze(-1) * torch.einsum("hpn,thn->thp", incoming, C))
            rows.append(torch.arange(p.local_start, p.local_start + p.length))
        if corrections:
            out = out.index_add(0, torch.cat(rows).to(out.device), torch.cat(corrections).to(out.dtype))
        return out + 0.0 * gathered.sum()


def piece_schedule(state: Any) -> PieceSchedule:
    """Where each document's recurrent state comes from, for this rank's pieces of the step (`state`: the active
    `StepState`; built on first use, then kept for the step)."""
    return state.derived("pieces", lambda: PieceSchedule.build(state.geometry, state.rank, state.group,
                                                               state.peer_routes))


def _peer_route(group: Any, rank: int, counts: list[int], pieces: list[Piece], by_document: dict,
                slots: dict) -> EntryRoute:
    """The states point-to-point: each slot to the ranks holding a later piece of its document."""
    W = len(counts)
    to: list[set[int]] = [set() for _ in range(W)]  # my slots each rank reads
    from_: list[set[int]] = [set() for _ in range(W)]  # each rank's slots I read
    for runs in by_document.values():
        order = sorted(runs)
        for k, (_, r, i) in enumerate(order[:-1]):
            later = {r2 for _, r2, _ in order[k + 1:] if r2 != r}
            if r == rank:
                for reader in later:
                    to[reader].add(slots[r, i])
            elif rank in later:
                from_[r].add(slots[r, i])
    as_tensor = lambda s: torch.tensor(sorted(s), dtype=torch.long)  # noqa: E731
    return EntryRoute.between_peers(group, rank, counts, [as_tensor(s) for s in from_], [as_tensor(s) for s in to])


def _slots(pieces, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor([p.slot for p in pieces], dtype=torch.long, device=like.device)


def _incoming(piece: Piece, gathered: torch.Tensor) -> torch.Tensor:
    """``[Hv, dk, dv]``: the state entering `piece`, composed over the pieces before it."""
    state = None
    for row in piece.before_rows:
        entry = gathered[row]
        dk = entry.shape[1]
        P, B = entry[..., :dk], entry[..., dk:]
        state = B if state is None else P @ state + B
    return state


def _incoming_scalar(piece: Piece, gathered: torch.Tensor) -> torch.Tensor:
    """``[H, P N]``: the scan state entering `piece` (each entry: log transition, then B)."""
    state = None
    for row in piece.before_rows:
        entry = gathered[row]
        B = entry[:, 1:]
        state = B if state is None else entry[:, :1].exp() * state + B
    return state


@dataclass(frozen=True)
class _Ran:
    """What a run over pieces gives: ``values [R, ...]`` of local ``rows [R]`` (every piece's rows),
    and the pieces' final states ``finals [n, ...]`` in the order they were given."""

    rows: torch.Tensor
    values: torch.Tensor
    finals: torch.Tensor
    order: tuple[int, ...]  # the pieces' indices in the order of `rows` / `values`

    def written(self, out: torch.Tensor) -> torch.Tensor:
        """`out` with these rows replaced (one out-of-place index_copy: a backward linear in the rows)."""
        return out.index_copy(0, self.rows, self.values.to(out.dtype))


class _PieceRunner:
    """Runs a chunked rule on pieces, batched in length buckets. `rows`: per-row inputs ``[L, ...]``
    (right-padded with zeros, which every rule here treats as "leave the state as it is");
    ``rule(*padded_rows, initial_state=)`` -> ``(outputs [n, T, ...], final states [n, ...])``.
    Every gather and scatter is one index op per bucket, so the backward is linear in the rows
    (per-piece slices would each allocate a whole bucket's gradient)."""

    def __init__(self, rows: tuple, rule) -> None:
        self.rows, self.rule = rows, rule

    def __call__(self, pieces, initial: Optional[list] = None, rule=None) -> Optional[_Ran]:
        if not pieces:
            return None
        device = self.rows[0].device
        rows, values, finals, order = [], [], [], []
        for bucket in _buckets([p.length for p in pieces]):
            chosen = [pieces[i] for i in bucket]
            init = None if initial is None else torch.stack([initial[i] for i in bucket])
            index, T = self._index(chosen)
            o, s = (rule or self.rule)(*self._take(index, len(chosen), T), initial_state=init)
            valid = torch.cat([j * T + torch.arange(p.length) for j, p in enumerate(chosen)]).to(device)
            values.append(o.reshape(-1, *o.shape[2:]).index_select(0, valid))
            rows.append(torch.cat([torch.arange(p.local_start, p.local_start + p.length) for p in chosen]))
            finals.append(s)
            order += bucket
        back = torch.empty(len(order), dtype=torch.long)
        back[torch.tensor(order)] = torch.arange(len(order))
        return _Ran(torch.cat(rows).to(device), torch.cat(values), torch.cat(finals).index_select(0, back.to(device)),
                    tuple(order))

    def _index(self, pieces) -> tuple[torch.Tensor, int]:
        """``[n T]`` local rows of `pieces`, right-padded with ``L`` (a zero row)."""
        T, L = max(p.length for p in pieces), self.rows[0].shape[0]
        index = torch.full((len(pieces), T), L, dtype=torch.long)
        for j, p in enumerate(pieces):
            index[j, : p.length] = torch.arange(p.local_start, p.local_start + p.length)
        return index.to(self.rows[0].device).flatten(), T

    def _take(self, index: torch.Tensor, n: int, T: int) -> list[torch.Tensor]:
        """Each input's rows at `index`, ``[n, T, ...]`` (zeros past a piece's end)."""
        return [torch.cat([x, x.new_zeros((1, *x.shape[1:]))]).index_select(0, index).reshape(n, T, *x.shape[1:])
                for x in self.rows]


def _delta_rule_transition_and_state(q, k, v, g, beta, initial_state=None):
    """The gated delta rule run with values ``[0 | v]`` from ``[I | 0]``: the state's columns evolve
    independently, so the final state is ``[P | B]`` (the run's transition, then its zero-start state)."""
    dk = k.shape[-1]
    values = torch.cat([v.new_zeros((*v.shape[:3], dk)), v], -1)
    start = q.new_zeros((q.shape[0], g.shape[-1], dk, dk + v.shape[-1]))
    start[..., :dk] = torch.eye(dk, dtype=q.dtype, device=q.device)
    return chunked_gated_delta_rule(q, k, values, g, beta, initial_state=start)


def _buckets(lengths: list[int]) -> list[list[int]]:
    """Indices grouped so that a batched run does the chunks each piece would run alone: pieces up
    to `CHUNK` tokens by their power of two (the chunk the kernel picks), longer ones by their
    number of chunks."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, n in enumerate(lengths):
        key = (0, max(n - 1, 0).bit_length()) if n <= CHUNK else (1, -(-n // CHUNK))
        groups.setdefault(key, []).append(i)
    return [groups[key] for key in sorted(groups)]
