"""The kernel interface: attention of local query rows over a key buffer, item by item.

Note [Items and bottom-right causal alignment]
----------------------------------------------
A CP rank's queries are a few *pieces*: runs of consecutive positions of one
document. The keys a piece may see are its document's keys up to the piece's last
position, a contiguous run of rows in the rank's key buffer. One *item* says:

    query rows  [q_start, q_start + q_len)   (rows of the local q tensor)
    key rows    [k_start, k_start + k_len)   (rows of the key buffer)
    causal      bottom-right aligned: query i sees keys j <= i + (k_len - q_len)

A piece whose document started on an earlier rank is the *bottom* of a causal block:

            keys ->  (k_len = 7)
           . . . . . . .
           . . . . . . .        rows above belong to another rank
           . . . . . . .
    q 0    x x x x x . .    <- q_len = 3 queries, the last 3 rows of the block
    q 1    x x x x x x .
    q 2    x x x x x x x

With ``causal=False`` every query sees every key of the item (keys that lie wholly
before the queries, e.g. a block received from another rank in the ring).

A table may carry a sliding ``window`` ``w`` (transformers' convention: a query sees
the keys at positions ``(q - w, q]``): then causal query ``i`` sees only keys
``i + (k_len - q_len) - w < j <= i + (k_len - q_len)``, a band:

            keys ->  (k_len = 7, w = 3)
    q 0    . . x x x . .
    q 1    . . . x x x .
    q 2    . . . . x x x

Every query row belongs to at most one item of a table. A kernel returns the output
``o`` and the log-sum-exp ``lse`` of each row (0 and -inf for rows in no item), so
partial results over different key sets merge exactly; its backward takes the final
(merged) ``o`` and ``lse``.

Note [Unequal head dims]
------------------------
Values may be narrower or wider than queries and keys (``Dv != Dk``: multi-head latent
attention, MLA, e.g. DeepSeek-V3's ``Dk = 192``, ``Dv = 128``); the output has ``Dv``
columns. `dense`, `flex` and plain tensor math take that as it is. Fused kernels that want
one head dim (torch's CPU flash kernel: "Q/K/V should have the same head size"; flash-attn 2;
TransformerEngine's backends vary) run at ``max(Dk, Dv)`` with the narrower side zero-padded
(`pad_last`), as transformers pads values for flash-attention: a zero value column gives a
zero output column (sliced off), zero query and key columns add exact zeros to every score,
and the scale is always passed explicitly, so the result and the log-sum-exp are those of
the unpadded attention, bit for bit up to the kernel's summation order; gradients of the
pad columns are dropped. Padding costs the fused kernel ``2 max(Dk, Dv) / (Dk + Dv)`` of
the arithmetic (1.2x for 192/128); nothing is padded on the wire (Note [Fused K/V rows] in
exchange/base.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import ensure

@dataclass(frozen=True)
class ItemTable:
    """Attention work items of one call (see Note [Items and bottom-right causal alignment]).

    Attributes:
        q_start, q_len, k_start, k_len: ``[n]`` int64 CPU tensors.
        causal: ``[n]`` bool CPU tensor (bottom-right aligned when True).
        num_q_rows: rows of the query tensor (``L``).
        num_k_rows: rows of the key buffer (``N``).
        window: the sliding window of every causal item (None: full causal).
        key_grad_rows: ``[N]`` int64 CPU: where each buffer row's K/V gradient goes in a gradient
            tensor of `num_key_grad_rows` rows (the exchange's own layout, e.g. ``[local | received]``),
            for kernels that `writes_key_grad_rows`; None: the buffer's order.
    """

    q_start: torch.Tensor
    q_len: torch.Tensor
    k_start: torch.Tensor
    k_len: torch.Tensor
    causal: torch.Tensor
    num_q_rows: int
    num_k_rows: int
    window: Optional[int] = None
    key_grad_rows: Optional[torch.Tensor] = None
    num_key_grad_rows: int = 0

    def __post_init__(self) -> None:
        if self.key_grad_rows is not None:
            rows = self.key_grad_rows
            ensure(rows.shape == (self.num_k_rows,) and (rows.numel() == 0 or (
                int(rows.min()) >= 0 and int(rows.max()) < self.num_key_grad_rows)), "key gradient rows out of bounds")
            ensure(torch.unique(rows).numel() == rows.numel(), "two buffer rows share a key gradient row")
        n = self.q_start.numel()
        ensure(all(t.numel() == n for t in (self.q_len, self.k_start, self.k_len, self.causal)), "ragged items")
        if n == 0:
            return
        ensure(bool((self.q_len > 0).all()) and bool((self.k_len > 0).all()), "empty item")
        ensure(bool((self.q_len[self.causal] <= self.k_len[self.causal]).all()), "causal needs q_len <= k_len")
        q_end = self.q_start + self.q_len
        ensure(bool((self.q_start[1:] >= q_end[:-1]).all()), "items must hold disjoint, ascending query rows")
        ensure(int(q_end[-1]) <= self.num_q_rows and int(self.q_start[0]) >= 0, "query rows out of bounds")
        ensure(int((self.k_start + self.k_len).max()) <= self.num_k_rows and int(self.k_start.min()) >= 0,
               "key rows out of bounds")
        ensure(self.window is None or self.window >= 1, "window must be >= 1")

    @property
    def size(self) -> int:
        return self.q_start.numel()

    def row_key_ranges(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``([L], [L])`` int64: each query row sees buffer keys ``[lo, hi)`` (empty: lo == hi)."""
        lo = torch.zeros(self.num_q_rows, dtype=torch.long)
        hi = torch.zeros(self.num_q_rows, dtype=torch.long)
        if self.size == 0:
            return lo, hi
        item = torch.repeat_interleave(torch.arange(self.size), self.q_len)
        first = torch.cumsum(self.q_len, dim=0) - self.q_len
        offset = torch.arange(item.numel()) - first[item]
        rows = self.q_start[item] + offset
        k_end = self.k_start[item] + self.k_len[item]
        causal_end = self.k_start[item] + (self.k_len - self.q_len)[item] + offset + 1
        start = self.k_start[item]
        if self.window is not None:
            start = torch.where(self.causal[item], torch.maximum(start, causal_end - self.window), start)
        lo[rows] = start
        hi[rows] = torch.where(self.causal[item], causal_end, k_end)
        return lo, hi

    def pairs(self) -> int:
        """Query-key pairs the table's masks allow (its attention work)."""
        lo, hi = self.row_key_ranges()
        return int((hi - lo).sum())


@dataclass(frozen=True)
class CallOptions:
    """The options of one attention call that every kernel call receives.

    Attributes:
        scale: the softmax scale (``1 / sqrt(D)`` unless the model sets it).
        dropout_p: attention dropout probability (0 unless training with dropout).
        softcap: logits become ``softcap * tanh(logit / softcap)`` (Gemma 2); None: no cap.
    """

    scale: float
    dropout_p: float = 0.0
    softcap: Optional[float] = None


class AttentionKernel(ABC):
    """A local attention kernel over an `ItemTable`.

    Tensors are one sequence's heads: ``q [H, L, Dk]``, ``k [Hk, N, Dk]``, ``v [Hk, N, Dv]``
    with ``H % Hk == 0`` (grouped-query attention) and the output ``[H, L, Dv]`` (``Dv`` may
    differ from ``Dk``: Note [Unequal head dims]). `prepare` runs once per step and
    returns the kernel's *call table*: whatever its calls need (index tensors, varlen
    ``cu_seqlens``, a block mask), so a layer call does no host work.
    """

    name: ClassVar[str]
    supports_dropout: ClassVar[bool] = False
    #: the kernel is an `LseKernel`: partial results over different key sets merge
    #: exactly by log-sum-exp (the ring exchange and attention sinks need this)
    supports_lse: ClassVar[bool] = False
    #: logit softcapping ``cap * tanh(score / cap)`` (Gemma 2)
    supports_softcap: ClassVar[bool] = False

    @classmethod
    def build(cls, device: torch.device) -> "AttentionKernel":
        """The kernel for `device` (what the kernel registry calls; most kernels need no device)."""
        return cls()

    def feature_problem(self, *, softcap: Optional[float] = None, sinks: bool = False) -> Optional[str]:
        """Why this kernel cannot serve a call with these features (None if it can)."""
        if softcap is not None and not self.supports_softcap:
            return f"kernel={self.name!r} has no logit softcapping"
        if sinks and not self.supports_lse:
            return f"kernel={self.name!r} exposes no log-sum-exp, which attention sinks need"
        return None

    @abstractmethod
    def prepare(self, items: ItemTable, device: torch.device) -> Any:
        """The call table for `items`, built once per step (host work happens here)."""

    def check(self, q_HLD: torch.Tensor, dropout_p: float) -> None:
        """Raise `ValueError` if this call's dtype/device/features are unsupported.

        Runs before any collective of the call, and depends only on what every rank
        shares (dtype, device type, dropout), so all ranks refuse alike.
        """

    @abstractmethod
    def attend(self, calls: Any, q_HLD, k_HND, v_HND, options: CallOptions) -> torch.Tensor:
        """Differentiable ``o [H, L, Dv]`` over the call table's items; rows in no item are 0."""


class LseKernel(AttentionKernel):
    """A kernel with explicit forward/backward that return/take the log-sum-exp."""

    supports_lse = True
    #: `forward`'s aux holds every value of q/k/v that `backward` reads, so callers keep
    #: only their shapes (`save_for_backward`)
    keeps_inputs: bool = False
    #: `backward` returns dk/dv in the items' `key_grad_rows` layout when they have one
    writes_key_grad_rows: bool = False

    @abstractmethod
    def forward(
        self, calls: Any, q_HLD: torch.Tensor, k_HND: torch.Tensor, v_HND: torch.Tensor, options: CallOptions,
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Return ``(o [H, L, Dv], lse [H, L] float, aux)``; rows in no item: 0 and -inf.

        ``aux`` is what `backward` needs besides the saved tensors: tensors or None, in
        nested lists/tuples (it is saved with ``ctx.save_for_backward``)."""

    @abstractmethod
    def backward(
        self,
        calls: Any,
        do_HLD: torch.Tensor,
        q_HLD: torch.Tensor,
        k_HND: torch.Tensor,
        v_HND: torch.Tensor,
        o_HLD: torch.Tensor,
        lse_HL: torch.Tensor,
        aux: Any,
        options: CallOptions,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients ``(dq, dk, dv)`` of this table's keys, given the final ``o`` and ``lse``."""

    def attend(self, calls: Any, q_HLD, k_HND, v_HND, options: CallOptions) -> torch.Tensor:
        return ItemAttention.apply(q_HLD, k_HND, v_HND, self, calls, options)


def save_for_backward(ctx, kernel: "LseKernel", inputs: tuple, tensors: tuple, aux: Any) -> None:
    """Save a layer's `inputs` (q/k/v as the kernel sees them), other `tensors` and the
    kernel's `aux` (tensors or None, in nested lists/tuples) with ``ctx.save_for_backward``,
    so activation checkpointing and saved-tensor hooks govern all of them (attributes on
    ctx would outlive a checkpointed forward). For a kernel that `keeps_inputs`, only the
    inputs' shapes, dtypes and devices are kept: backward gets one-element stand-ins.
    `saved_for_backward` returns ``(inputs, tensors, aux)``."""
    leaves, ctx.aux_spec = tree_flatten(aux)
    ctx.input_meta = [(t.shape, t.dtype, t.device) for t in inputs] if kernel.keeps_inputs else None
    saved_inputs = () if kernel.keeps_inputs else inputs
    ctx.saved_counts = (len(saved_inputs), len(tensors))
    ctx.save_for_backward(*saved_inputs, *tensors, *leaves)


def saved_for_backward(ctx) -> tuple[tuple, tuple, Any]:
    """``(inputs, tensors, aux)`` as `save_for_backward` received them (inputs as stand-ins
    with their shape, dtype and device when the kernel keeps what it reads)."""
    saved, (n_inputs, n_tensors) = ctx.saved_tensors, ctx.saved_counts
    inputs = saved[:n_inputs]
    if ctx.input_meta is not None:
        inputs = tuple(torch.empty((), dtype=dtype, device=device).expand(shape) for shape, dtype, device in ctx.input_meta)
    tensors = saved[n_inputs : n_inputs + n_tensors]
    return inputs, tensors, tree_unflatten(list(saved[n_inputs + n_tensors :]), ctx.aux_spec)


class ItemAttention(torch.autograd.Function):
    """``o = attention(q, k, v)`` over an item table; backward through the kernel."""

    @staticmethod
    def forward(ctx, q_HLD, k_HND, v_HND, kernel: "LseKernel", calls: Any, options: CallOptions):
        o_HLD, lse_HL, aux = kernel.forward(calls, q_HLD, k_HND, v_HND, options)
        save_for_backward(ctx, kernel, (q_HLD, k_HND, v_HND), (o_HLD, lse_HL), aux)
        ctx.kernel, ctx.calls, ctx.options = kernel, calls, options
        return o_HLD

    @staticmethod
    def backward(ctx, do_HLD):
        (q, k, v), (o, lse), aux = saved_for_backward(ctx)
        dq, dk, dv = ctx.kernel.backward(ctx.calls, do_HLD, q, k, v, o, lse, aux, ctx.options)
        return dq, dk, dv, None, None, None


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def expand_heads(t: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """Repeat K/V heads along `dim` so each serves ``heads // t.shape[dim]`` query heads."""
    groups = heads // t.shape[dim]
    return t if groups == 1 else t.repeat_interleave(groups, dim=dim)


def fold_heads(t: torch.Tensor, groups: int, dim: int) -> torch.Tensor:
    """Sum each run of `groups` heads along `dim` (the gradient of `expand_heads`)."""
    shape = list(t.shape)
    shape[dim : dim + 1] = [shape[dim] // groups, groups]
    return t.reshape(shape).sum(dim=dim + 1)


def pad_last(t: torch.Tensor, width: Optional[int]) -> torch.Tensor:
    """`t` with its last dimension zero-padded to `width` (a new contiguous tensor; `t` itself when
    `width` is None or already its size). Note [Unequal head dims]."""
    if width is None or t.shape[-1] == width:
        return t
    return torch.nn.functional.pad(t, (0, width - t.shape[-1]))


def padded_width(k_dim: int, v_dim: int) -> Optional[int]:
    """The one head dim a kernel that wants equal widths runs at: ``max(Dk, Dv)`` (None when equal).
    Note [Unequal head dims]."""
    return None if k_dim == v_dim else max(k_dim, v_dim)


def merge_partial(
    o_acc: torch.Tensor, lse_acc: torch.Tensor, o_new: torch.Tensor, lse_new: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two softmax partial results over disjoint key sets.

    ``o [..., D]`` and ``lse [...]``; rows where both lse are -inf stay (0, -inf).
    """
    lse = torch.logaddexp(lse_acc, lse_new)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w_acc = torch.exp(lse_acc - safe).unsqueeze(-1)
    w_new = torch.exp(lse_new - safe).unsqueeze(-1)
    o = o_acc.to(w_acc.dtype) * w_acc + o_new.to(w_acc.dtype) * w_new
    return o.to(o_acc.dtype), lse


def add_sinks(o_HLD: torch.Tensor, lse_HL: torch.Tensor, sinks_H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention sinks: one extra logit per head in every row's softmax denominator (gpt-oss).

    ``lse' = logaddexp(lse, sink)``, ``o' = o * exp(lse - lse')``; applied once, after every
    partial result of a row is merged, so the sink is counted once per query. Rows with
    no key (``lse = -inf``) stay 0.
    """
    lse = torch.logaddexp(lse_HL, sinks_H.to(lse_HL.dtype).unsqueeze(1))
    o = o_HLD.to(lse.dtype) * torch.exp(lse_HL - lse).unsqueeze(-1)
    return o.to(o_HLD.dtype), lse


def sinks_grad(do_HLD: torch.Tensor, o_HLD: torch.Tensor, lse_HL: torch.Tensor, sinks_H: torch.Tensor) -> torch.Tensor:
    """``[H]``: the gradient of the sinks, given the final (sink-including) ``o`` and ``lse``.

    The sink is a logit whose value vector is 0, so ``d sink = -sum_rows p_sink * (dO . o)``.
    """
    acc = lse_HL.dtype
    p_sink = torch.exp(sinks_H.to(acc).unsqueeze(1) - lse_HL)
    delta = (do_HLD.to(acc) * o_HLD.to(acc)).sum(dim=-1)
    return -(p_sink * delta).sum(dim=1)
