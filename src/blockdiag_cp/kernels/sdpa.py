"""`sdpa`: PyTorch's fused attention per document piece, in few calls, with no mask.

Note [Bottom-right causal from two fused calls]
-----------------------------------------------
PyTorch's fused kernels align ``is_causal`` top-left, so a piece whose document
began on an earlier rank (``q_len < k_len``) is split into two calls whose partial
results are merged by log-sum-exp:

    keys:   [ prefix (k_len - q_len) | square (q_len) ]
    call 1: square, is_causal    (top-left == bottom-right when square)
    call 2: prefix, no mask      (every query sees every earlier key), merged into 1

Backward runs the fused backward of each call with the *merged* output and
log-sum-exp, which yields exactly the gradients of the merged attention. Memory is
``O(L * D)``: no ``[L, N]`` score or mask tensor is ever built.

Note [Token-major rows and buckets]
-----------------------------------
A layer's outputs and gradients are written token-major, ``o [L, H, D]`` and K/V
gradients ``[N, Hk, D]`` (the layout the model and the exchange use), each
call's rows with one ``index_copy_``/``index_add_`` along dim 0, never a copy of a
whole ``[H, L, D]``. The call table, built once per step, groups the pieces:

- a causal square of at least ``SOLO_LEN`` queries is its own call: a slice of
  contiguous rows (no index);
- shorter causal squares (short documents, and the square part of short pieces)
  are padded at their end up to a bucket length (a grid 6-12% apart) and
  batched ``G`` at a time into one call. Causality hides the pad keys from every
  real query; pad queries write to a dummy row in forward and carry ``lse = +inf``
  in backward (their probabilities are exactly 0), so they contribute nothing. A
  call whose items need no padding and follow each other in the rows (512
  documents of 64 tokens: one call of them all) reads them as one slice and writes
  them with one ``copy_``: no gather, no scatter;
- prefix parts and full blocks (another rank's keys in the ring) are batched by
  exact shape.

Forward keeps each call's gathered q/k/v for backward, which gathers only dO, o and
lse (once per row) and writes dq/dk/dv (pads into the dummy rows).

Note [First-touch gradient rows]
--------------------------------
A row of dq, dk or dv is written by every call that reads it. The call table marks,
per call and side, whether the call is the *first* to touch each of its rows (no earlier
call read any of them, and no row repeats inside the call): such a call copies its
gradient rows in (`Rows.put`); later calls add (`Rows.add`). Only rows that no
first-touch call writes are zero-filled first (`zero_q_rows`, `zero_k_rows`: padding
rows, and keys only a merging call reads). So backward does not zero whole ``[L, H, D]``
and ``[N, Hk, D]`` buffers and then add every call into them: one write per row, one add
per further reader.

Note [Head-major call inputs]
-----------------------------
The fused CPU kernels run 5-10% faster forward and 3-5% backward when each head's
query and key rows are contiguous (row stride ``D``) than on token-major views
(row stride ``H * D``), measured per document at 1k-6k tokens; the layout of o and
dO makes no difference. So forward makes q and the K/V buffer head-major once per
layer (``contiguous``: no copy when they already are), a pass linear in the rows
against the layer's quadratic work; a solo call's rows are then a slice view of
those, and batched items one ``index_select`` along their token dimension. What the
calls read is what forward keeps for backward (`keeps_inputs`: one head-major copy
of q and of the buffer, plus the batched items' gathered rows), so the layer does
not also save q and the buffer, and backward gathers no input twice.

Note [Sliding windows from causal squares]
------------------------------------------
Under a window ``w`` a query at ``g`` sees ``(g - w, g]``. A piece is cut into query
blocks of ``c <= w`` queries starting at key index ``a``; each block is three exact
calls, merged by log-sum-exp, and no mask is built:

    own square   keys [a, a + c)              causal (every key is within the window)
    full part    keys [a + c - w, a)          no mask: every query of the block sees them
    triangle     keys [a - w + 1, a + c - w)  query t sees key j iff j >= t + (a - w + 1):
                 anti-causal; with the queries *and* the keys taken in reverse order it is
                 top-left causal (query t' sees keys j' <= t'), one fused causal call

(each clipped at the item's first key). Full blocks share one shape and batch together;
every key is gathered about twice per layer, and no query-key pair outside the band
is computed.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from ..errors import ensure
from .base import (CallOptions, ItemTable, LseKernel, accumulate_dtype, expand_heads, fold_heads, merge_partial,
                   pad_last, padded_width)
from ..plan.ranges import concat_ranges
from .fused_ops import MathOps, cpu_fused_ops, fused_ops_for

#: causal squares of at least this many queries get a call of their own
SOLO_LEN = 512

__all__ = ("SOLO_LEN", "FusedCall", "FusedCallTable", "Rows", "SdpaKernel", "bucket_length", "cpu_fused_ops",
           "fused_call_table", "fused_calls")


def bucket_length(n: int) -> int:
    """The padded length of a short causal square: `n` rounded up on a grid 6-12% apart (steps >= 8).

    (A grid 12-25% apart cost 10-15% more kernel time on rows of ~134-token documents,
    in padding; a finer one adds calls and gained nothing on power-law rows.)"""
    if n >= SOLO_LEN:
        return n
    step = max(8, 2 ** max(0, math.ceil(math.log2(n)) - 4))
    return -(-n // step) * step


@dataclass(frozen=True)
class Rows:
    """The rows of one fused call: ``G`` runs of ``length`` rows of a ``[R, ...]`` tensor.

    Either one contiguous run (``start``: a slice, no copy), or gather/scatter indices
    ``[G * length]`` on the device: pads gather a real row and scatter to the dummy
    row ``R`` (see Note [Token-major rows and buckets]); ``pad`` marks them. Writes
    (gradients) may go to other rows than reads (Note [Key gradients in the exchange's
    layout] in exchange/needed.py): a slice ``write_start`` or `scatter`.
    """

    count: int
    length: int
    start: Optional[int] = None
    gather: Optional[torch.Tensor] = None
    scatter: Optional[torch.Tensor] = None
    pad: Optional[torch.Tensor] = None
    write_start: Optional[int] = None  # writes are this slice (None: `scatter`), read and write rows may differ

    @property
    def rows(self) -> int:
        return self.count * self.length

    def take(self, t_RX: torch.Tensor) -> torch.Tensor:
        """``[G * length, ...]``: the rows (a view for a slice)."""
        if self.start is not None:
            return t_RX[self.start : self.start + self.rows]
        return t_RX.index_select(0, self.gather)

    def take_heads(self, t_HRD: torch.Tensor) -> torch.Tensor:
        """``[G, H, length, D]`` from a contiguous (head-major) `t_HRD`, each head's rows
        contiguous: a view for a slice, one gathered copy otherwise (Note [Head-major call inputs])."""
        heads = t_HRD[:, self.start : self.start + self.rows] if self.start is not None else t_HRD.index_select(
            1, self.gather)  # [H, G * length, D]
        return heads.unflatten(1, (self.count, self.length)).transpose(0, 1)

    def put(self, t_RX: torch.Tensor, value_TX: torch.Tensor) -> None:
        """Write the rows of `t_RX` (which has the dummy row) in place."""
        if self.write_start is not None:
            t_RX[self.write_start : self.write_start + self.rows].copy_(value_TX)
        else:
            t_RX.index_copy_(0, self.scatter, value_TX.to(t_RX.dtype))

    def add(self, t_RX: torch.Tensor, value_TX: torch.Tensor) -> None:
        """Add into the rows of `t_RX` (which has the dummy row) in place."""
        if self.write_start is not None:
            t_RX[self.write_start : self.write_start + self.rows].add_(value_TX)
        else:
            t_RX.index_add_(0, self.scatter, value_TX.to(t_RX.dtype))

    def batch(self, t_TX: torch.Tensor) -> torch.Tensor:
        """``[G * length, H, ...]`` -> ``[G, H, length, ...]`` (a view)."""
        return t_TX.reshape(self.count, self.length, *t_TX.shape[1:]).transpose(1, 2)

    def unbatch(self, t_GHX: torch.Tensor) -> torch.Tensor:
        """``[G, H, length, ...]`` -> ``[G * length, H, ...]``."""
        return t_GHX.transpose(1, 2).reshape(self.count * self.length, *t_GHX.shape[1:2], *t_GHX.shape[3:])


@dataclass(frozen=True)
class FusedCall:
    """One fused call over ``G`` items of one shape; `merge` if its rows already hold a partial result;
    `q_first` / `k_first`: it is the first call to touch its query / key rows (Note [First-touch gradient rows])."""

    causal: bool
    merge: bool
    q: Rows
    k: Rows
    q_first: bool = False
    k_first: bool = False


def _rows(starts: list[int], reals: list[int], length: int, dummy: int, device: torch.device, step: int = 1,
          write: Optional["WriteRows"] = None) -> Rows:
    """Rows for items of `reals` real rows from `starts` (ascending, or descending with ``step=-1``), padded to
    `length`; writes go to ``write.rows[row]`` (and pads to ``write.dummy``) when `write` is given.

    Items that need no padding and follow each other (``starts[i + 1] == starts[i] + length``) are one
    slice: read as a view, written in one ``copy_`` (Note [Token-major rows and buckets])."""
    run = step == 1 and all(r == length for r in reals) and all(
        b - a == length for a, b in zip(starts, starts[1:]))
    if run and write is None:
        return Rows(len(starts), length, start=starts[0], write_start=starts[0])
    start, real = torch.tensor(starts).unsqueeze(1), torch.tensor(reals).unsqueeze(1)
    offset = torch.arange(length).unsqueeze(0)
    is_pad = offset >= real
    gather = start + step * torch.minimum(offset, real - 1)
    target, dummy = (gather, dummy) if write is None else (write.rows[gather], write.dummy)
    scatter = torch.where(is_pad, dummy, target).reshape(-1)
    if run and bool((scatter[1:] == scatter[:-1] + 1).all()):
        return Rows(len(starts), length, start=starts[0], write_start=int(scatter[0]))
    pad = is_pad.reshape(-1).to(device) if bool(is_pad.any()) else None
    return Rows(len(starts), length, starts[0] if run else None, None if run else gather.reshape(-1).to(device),
                scatter.to(device), pad)


class WriteRows(NamedTuple):
    """Where gradient rows go when not to the rows read: ``rows[buffer row]``, pads to ``dummy``."""

    rows: torch.Tensor
    dummy: int


@dataclass(frozen=True)
class FusedCallTable:
    """A step's fused calls (first-touch calls first) and the rows to zero before they run.

    Attributes:
        untouched_rows: query rows no call touches (padding): their output is 0.
        zero_q_rows, zero_k_rows: the dq and dk/dv rows no first-touch call writes
            (Note [First-touch gradient rows]); ``[n]`` int64 on the device, like the above;
            dk/dv rows are the items' `key_grad_rows` when they have them.
    """

    calls: tuple[FusedCall, ...]
    untouched_rows: torch.Tensor
    zero_q_rows: torch.Tensor
    zero_k_rows: torch.Tensor
    k_grad_rows: int  # rows of the dk/dv backward writes: the items' key gradient rows, else the buffer's

    def __len__(self) -> int:
        return len(self.calls)

    def __iter__(self):
        return iter(self.calls)


def fused_call_table(items: ItemTable, device: torch.device) -> FusedCallTable:
    """`fused_calls`, the query rows they leave untouched and the gradient rows to zero first."""
    touch_q, touch_k = FirstTouch.of(items)
    calls = fused_calls(items, device, touch_q, touch_k)
    rows = (torch.nonzero(~mask).flatten().to(device) for mask in (touch_q.seen, touch_q.written, touch_k.written))
    return FusedCallTable(calls, *rows, k_grad_rows=touch_k.seen.numel())


class FirstTouch:
    """Which rows earlier calls touched, to mark each call's first-touch sides (Note [First-touch gradient rows])."""

    def __init__(self, rows: int, remap: Optional[torch.Tensor] = None) -> None:
        """`rows` written rows; `remap`: the written row of each row read (None: the same)."""
        self.seen, self.written = torch.zeros(rows, dtype=torch.bool), torch.zeros(rows, dtype=torch.bool)
        self.remap = remap

    @staticmethod
    def of(items: ItemTable) -> tuple["FirstTouch", "FirstTouch"]:
        """Fresh records of `items`' query rows and key gradient rows (the buffer's, or its `key_grad_rows`)."""
        keys = FirstTouch(items.num_k_rows) if items.key_grad_rows is None else FirstTouch(
            items.num_key_grad_rows, items.key_grad_rows)
        return FirstTouch(items.num_q_rows), keys

    def mark(self, starts: list[int], reals: list[int], step: int) -> bool:
        """Whether none of these rows (``reals[i]`` rows from ``starts[i]``, upwards or downwards) was
        touched before and none repeats; marks them touched, and written if so."""
        start, real = torch.tensor(starts), torch.tensor(reals)
        rows = concat_ranges(start if step == 1 else start - real + 1, real)
        rows = rows if self.remap is None else self.remap[rows]
        first = not bool(self.seen[rows].any()) and torch.unique(rows).numel() == rows.numel()
        self.seen[rows] = True
        if first:
            self.written[rows] = True
        return first


class CallGroup(NamedTuple):
    """What items fused into one call share.

    Attributes:
        causal: the call's mask is causal (a square), else it attends to every key given.
        merge: the call merges into rows an earlier call wrote (by log-sum-exp), else it writes them first.
        q_rows, k_rows: the (bucketed) rows of q and k each member is padded to.
        step: +1: the members' rows run upwards from their start; -1: downwards (a window's triangle).
    """

    causal: bool
    merge: bool
    q_rows: int
    k_rows: int
    step: int = 1


#: members of each call group: ``(q start, q real rows, k start, k real rows)``
Groups = dict[CallGroup, list[tuple[int, int, int, int]]]


def fused_calls(items: ItemTable, device: torch.device, touch_q: Optional["FirstTouch"] = None,
                touch_k: Optional["FirstTouch"] = None) -> tuple[FusedCall, ...]:
    """The calls of `items` (Notes [Bottom-right causal...], [Token-major rows and buckets] and
    [Sliding windows from causal squares]). First-touch calls come first, merging calls after.
    `touch_q` / `touch_k` (filled in): the query / key rows the calls touch, and those first-touch calls write."""
    if touch_q is None or touch_k is None:
        touch_q, touch_k = FirstTouch.of(items)
    write_k = None if items.key_grad_rows is None else WriteRows(items.key_grad_rows, items.num_key_grad_rows)
    groups: Groups = defaultdict(list)
    rows = zip(*(t.tolist() for t in (items.q_start, items.q_len, items.k_start, items.k_len, items.causal)))
    for q0, ql, k0, kl, causal in rows:
        if not causal:
            groups[CallGroup(False, False, ql, kl)].append((q0, ql, k0, kl))
        elif items.window is None or items.window >= kl:
            _add_causal(groups, q0, ql, k0, kl)
        else:
            _add_windowed(groups, q0, ql, k0, kl, items.window)
    calls = []
    ordered = sorted(groups.items(), key=lambda kv: (kv[0].merge, -kv[0].q_rows, -kv[0].k_rows, kv[0].step))
    for group, members in ordered:
        q0s, qreal, k0s, kreal = (list(col) for col in zip(*members))
        q = _rows(q0s, qreal, group.q_rows, items.num_q_rows, device, group.step)
        k = _rows(k0s, kreal, group.k_rows, items.num_k_rows, device, group.step, write_k)
        q_first, k_first = touch_q.mark(q0s, qreal, group.step), touch_k.mark(k0s, kreal, group.step)
        calls.append(FusedCall(group.causal, group.merge, q, k, q_first, k_first))
    return tuple(calls)


def _add_causal(groups: Groups, q0: int, ql: int, k0: int, kl: int) -> None:
    """A bottom-right causal item: its causal square (bucketed), then the prefix it merges."""
    b = bucket_length(ql)
    groups[CallGroup(True, False, b, b)].append((q0, ql, k0 + kl - ql, ql))
    if kl > ql:
        groups[CallGroup(False, True, ql, kl - ql)].append((q0, ql, k0, kl - ql))


def _add_windowed(groups: Groups, q0: int, ql: int, k0: int, kl: int, w: int) -> None:
    """A bottom-right causal item under window ``w < kl``, in query blocks of ``c <= w``
    (Note [Sliding windows from causal squares])."""
    off = kl - ql  # keys before the item's first query
    for bq in range(0, ql, w):
        c, a = min(w, ql - bq), off + bq  # block size; key index of the block's first query
        b = bucket_length(c)
        groups[CallGroup(True, False, b, b)].append((q0 + bq, c, k0 + a, c))  # the block's own causal square
        full = a - max(0, a + c - w)  # keys before the block that every query of it sees
        if full:
            groups[CallGroup(False, True, c, full)].append((q0 + bq, c, k0 + a - full, full))
        tri = max(0, a + c - w) - max(0, a - w + 1)  # keys that only the block's earlier queries see
        if tri > 0 and c > 1:
            groups[CallGroup(True, True, c - 1, tri, step=-1)].append((q0 + bq + c - 2, c - 1, k0 + a + c - w - 1, tri))


class SdpaKernel(LseKernel):
    name = "sdpa"
    supports_dropout = False
    supports_softcap = True  # with the same call table, in plain math per call (`MathOps`)
    keeps_inputs = True  # each call's head-major q/k/v (Note [Head-major call inputs])
    writes_key_grad_rows = True  # dk/dv rows where the items' key_grad_rows say

    @classmethod
    def build(cls, device: torch.device) -> "SdpaKernel":
        return cls(device)

    def __init__(self, device: torch.device = torch.device("cpu")) -> None:
        self.device_type = device.type
        self._ops = fused_ops_for(device)

    def check(self, q_HLD: torch.Tensor, dropout_p: float) -> None:
        if self.device_type == "cuda" and q_HLD.dtype == torch.float64:
            raise ValueError("kernel='sdpa' on CUDA runs in float32/float16/bfloat16, not float64; use kernel='dense'")

    def prepare(self, items: ItemTable, device: torch.device) -> FusedCallTable:
        if device.type != self.device_type:
            raise ValueError(f"kernel='sdpa' was set up for {self.device_type}, got tensors on {device}")
        return fused_call_table(items, device)

    def _ops_for(self, softcap: Optional[float]):
        return self._ops if softcap is None else MathOps(softcap)

    @staticmethod
    def _width(ops, k_dim: int, v_dim: int) -> Optional[int]:
        """The head dim the fused calls run at when `ops` want one for q, k and v (None: as given)."""
        return padded_width(k_dim, v_dim) if ops.equal_head_dims else None

    def forward(self, calls, q_HLD, k_HND, v_HND, options: CallOptions):
        """``(o [H, L, Dv], lse [H, L], aux)``; aux holds each call's head-major q/k/v for backward (zero-padded
        to one head dim where the fused ops want it: Note [Unequal head dims] in base.py)."""
        ensure(options.dropout_p == 0.0, "callers route dropout to a kernel that supports it")
        ops, scale = self._ops_for(options.softcap), options.scale
        (H, L, Dk), Dv = q_HLD.shape, v_HND.shape[-1]
        width = self._width(ops, Dk, Dv)
        # + the dummy row that pads write into; every other row is written by a first-touch call or zeroed here
        o_LHD = q_HLD.new_empty(L + 1, H, Dv).index_fill_(0, calls.untouched_rows, 0.0)
        lse_LH = torch.empty((L + 1, H), dtype=accumulate_dtype(q_HLD.dtype), device=q_HLD.device)
        lse_LH.index_fill_(0, calls.untouched_rows, float("-inf"))
        # head-major, once per layer (padding, where needed, is that same copy)
        q_HLD, k_HND, v_HND = (pad_last(t, width).contiguous() for t in (q_HLD, k_HND, v_HND))
        kept = []
        for call in calls:
            q, k, v = call.q.take_heads(q_HLD), call.k.take_heads(k_HND), call.k.take_heads(v_HND)
            o_b, lse_b = ops.fwd(q, k, v, call.causal, scale)
            o, lse = call.q.unbatch(o_b[..., :Dv]), call.q.unbatch(lse_b.unsqueeze(-1)).squeeze(-1)
            if call.merge:
                o, lse = merge_partial(call.q.take(o_LHD), call.q.take(lse_LH), o, lse)
            call.q.put(o_LHD, o)
            call.q.put(lse_LH, lse)
            kept.append((q, k, v))
        return o_LHD[:L].transpose(0, 1), lse_LH[:L].transpose(0, 1), kept

    def backward(self, calls, do_HLD, q_HLD, k_HND, v_HND, o_HLD, lse_HL, aux, options: CallOptions):
        """``(dq [H, L, Dk], dk [Hk, N, Dk], dv [Hk, N, Dv])``: token-major storage (each call's rows added in
        place); dk/dv rows are the items' `key_grad_rows` when they have them (``N = num_key_grad_rows``)."""
        ops, scale = self._ops_for(options.softcap), options.scale
        (H, L, Dk), Dv, N = q_HLD.shape, v_HND.shape[-1], calls.k_grad_rows  # N: the exchange's layout or the buffer's
        width = self._width(ops, Dk, Dv)  # the calls kept their inputs padded to it; dO and o join them there
        do_LHD, o_LHD = (pad_last(t.transpose(0, 1), width) for t in (do_HLD, o_HLD))
        lse_LH, acc = lse_HL.transpose(0, 1), accumulate_dtype(q_HLD.dtype)
        # first-touch calls write their rows; only the rest is zeroed (Note [First-touch gradient rows])
        dq = torch.empty(L + 1, H, Dk, dtype=acc, device=q_HLD.device).index_fill_(0, calls.zero_q_rows, 0.0)
        dk, dv = (torch.empty(N + 1, k_HND.shape[0], d, dtype=acc, device=q_HLD.device).index_fill_(
            0, calls.zero_k_rows, 0.0) for d in (Dk, Dv))
        # In half precision the CPU fused backward sums grouped-query heads in that
        # precision; expand K/V heads and sum their gradients in float32 instead.
        groups = H // k_HND.shape[0] if q_HLD.element_size() < 4 and self.device_type == "cpu" else 1
        for call, (q, k, v) in zip(calls, aux):
            do, o, lse = call.q.take(do_LHD), call.q.take(o_LHD), call.q.take(lse_LH)
            if call.q.pad is not None:  # pad queries: probabilities exp(s - inf) = 0, so no gradient at all
                lse = lse.masked_fill(call.q.pad[:, None], float("inf"))
            k_b, v_b = (expand_heads(k, H, 1), expand_heads(v, H, 1)) if groups > 1 else (k, v)
            dq_b, dk_b, dv_b = ops.bwd(
                call.q.batch(do), q, k_b, v_b, call.q.batch(o),
                call.q.batch(lse.unsqueeze(-1)).squeeze(-1).contiguous(), call.causal, scale,
            )
            if width is not None:  # drop the pad columns' gradients
                dq_b, dk_b, dv_b = dq_b[..., :Dk], dk_b[..., :Dk], dv_b[..., :Dv]
            if groups > 1:
                dk_b, dv_b = (fold_heads(t.to(acc), groups, 1) for t in (dk_b, dv_b))
            (call.q.put if call.q_first else call.q.add)(dq, call.q.unbatch(dq_b))
            write_k = call.k.put if call.k_first else call.k.add
            write_k(dk, call.k.unbatch(dk_b))
            write_k(dv, call.k.unbatch(dv_b))
        return (dq[:-1].transpose(0, 1).to(q_HLD.dtype), dk[:-1].transpose(0, 1).to(k_HND.dtype),
                dv[:-1].transpose(0, 1).to(v_HND.dtype))
