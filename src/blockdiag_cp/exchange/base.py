"""The K/V exchange interface, and the buffer-based exchanges' shared machinery.

An exchange is a strategy that, once per step, routes the K/V rows this rank's
queries need (from the replicated `StepGeometry`, no collective): its *routing* is
what it holds. Per attention call it runs that routing and the attention. Buffer exchanges deliver the
needed rows into one key buffer ordered by position and run one kernel over it;
the ring interleaves delivery with attention instead.

Note [Fused K/V rows]
---------------------
A collective moves a token's K and V together as one row ``[Hk, Dk + Dv]``: each K/V head's
key (``Dk``) and value (``Dv``) side by side, so one transfer serves both tensors whatever
their widths (multi-head latent attention, MLA: DeepSeek-V2/V3, MiniCPM3, MiMo-V2-Flash
have ``Dv < Dk``). `fuse_rows` is one copy, as the stack ``[2, Hk, D]`` of equal widths
before it was (timed alike, fuse then the kernel's head-major copy: fastest of 200 runs,
4 shapes, token- and head-major inputs, within noise either way), and `unfuse_rows` two
views, so a model with equal widths pays nothing for it. Bytes count each tensor at
its own width: ``Hk (Dk + Dv)`` elements a row (`kv_row_elements`), never ``2 Hk Dk``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, ClassVar, Mapping, Optional

import torch

from ..errors import ensure
from ..plan.geometry import Pieces, StepGeometry
from ..plan.traffic import kv_row_elements
from ..kernels import AttentionKernel, CallOptions, ItemTable
from ..kernels.base import add_sinks, save_for_backward, saved_for_backward, sinks_grad


@dataclass(frozen=True)
class Traffic:
    """What this rank moves per attention call, forward and backward (``*_bwd``: the gradients).

    An exchange's `traffic` counts K/V rows (one row = one token's K and V, all K/V heads);
    `bytes` turns it into bytes (K at its head dim, V at its own: Note [Fused K/V rows]).
    """

    sent_fwd: int
    recv_fwd: int
    sent_bwd: int
    recv_bwd: int

    @property
    def sent(self) -> int:
        """Sent forward and backward."""
        return self.sent_fwd + self.sent_bwd

    def bytes(self, kv_heads: int, head_dim: int, dtype: torch.dtype, v_head_dim: Optional[int] = None) -> "Traffic":
        """The same four numbers in bytes, for K of `kv_heads` heads of `head_dim` and V of as many heads of
        `v_head_dim` (None: `head_dim`)."""
        row = kv_row_elements(kv_heads, head_dim, v_head_dim) * torch.empty(0, dtype=dtype).element_size()
        return Traffic(self.sent_fwd * row, self.recv_fwd * row, self.sent_bwd * row, self.recv_bwd * row)


@dataclass(frozen=True)
class LayerBytes:
    """Bytes one rank moves per attention layer (`StepState.bytes_per_layer`).

    Attributes:
        ulysses: the head all-to-alls (zeros without head parallelism).
        kv: K/V rows between ranks, or between head-parallel groups.
    """

    ulysses: Traffic
    kv: Traffic

    @property
    def sent(self) -> int:
        return self.ulysses.sent + self.kv.sent


@dataclass(frozen=True)
class ExchangeSetup:
    """What an exchange routes from: the replicated geometry and this rank's place in it."""

    geometry: StepGeometry
    rank: int
    group: Any
    kernels: tuple[AttentionKernel, ...]
    device: torch.device
    window: Optional[int] = None  # the sliding window of the layers this routing serves

    @property
    def world(self) -> int:
        return self.geometry.world

    @property
    def local_len(self) -> int:
        """This rank's shard length."""
        return self.geometry.plan.local_len_of(self.rank)

    def pieces(self) -> Pieces:
        return self.geometry.pieces(self.rank)


class KVExchange(ABC):
    """Strategy: deliver the K/V a rank's queries need and attend over it."""

    name: ClassVar[str]
    #: sends point-to-point (NCCL needs a group-wide collective on the group first)
    uses_p2p: ClassVar[bool] = False

    @property
    @abstractmethod
    def traffic(self) -> Traffic:
        """Rows this rank sends and receives per attention call."""

    @abstractmethod
    def attend(
        self, q_HLD: torch.Tensor, k_HLD: torch.Tensor, v_HLD: torch.Tensor,
        kernel: AttentionKernel, options: CallOptions, sinks: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``o [H, L, Dv]``: attention of the local queries ``[H, L, Dk]`` over the keys ``[Hk, L, Dk]`` and
        values ``[Hk, L, Dv]`` they may see.

        `options` carry the scale, dropout and logit softcap of the call; `sinks` ``[H]`` adds
        one learned logit per head to every row's softmax denominator (an LSE kernel).
        """


def token_major(*tensors_HXD: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``[H, X, D]`` <-> ``[X, H, D]`` views (the same storage, token rows or head rows first)."""
    return tuple(t.transpose(0, 1) for t in tensors_HXD)


def fuse_rows(k_XHD: torch.Tensor, v_XHD: torch.Tensor) -> torch.Tensor:
    """``[X, Hk, Dk + Dv]`` contiguous rows (one copy): each token's K and V side by side, ready for one
    collective (Note [Fused K/V rows])."""
    return torch.cat([k_XHD, v_XHD], dim=-1)


def unfuse_rows(kv_XHC: torch.Tensor, k_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[X, Hk, Dk + Dv]`` -> ``(k [X, Hk, Dk], v [X, Hk, Dv])`` views (``Dk = k_dim``)."""
    return kv_XHC[..., :k_dim], kv_XHC[..., k_dim:]


def items_over_buffer(
    pieces: Pieces, buffer_positions: torch.Tensor, num_q_rows: int, window: Optional[int] = None
) -> ItemTable:
    """Items for `pieces` over a key buffer holding `buffer_positions` (sorted), in order.

    Each piece sees its document's keys up to its last position (the last ``window - 1``
    before its first query and on, under a sliding window), bottom-right causal; the
    buffer must hold that whole range.
    """
    g_end = pieces.global_start + pieces.length
    first = pieces.doc_start if window is None else torch.maximum(pieces.doc_start, pieces.global_start - window + 1)
    k_start = torch.searchsorted(buffer_positions, first)
    k_len = g_end - first
    if pieces.count:
        last = k_start + k_len - 1
        ensure(int(last.max()) < buffer_positions.numel(), "key buffer lacks a needed range")
        ensure(torch.equal(buffer_positions[last], g_end - 1), "key buffer range is not contiguous")
    causal = torch.ones(pieces.count, dtype=torch.bool)
    return ItemTable(
        pieces.local_start, pieces.length, k_start, k_len, causal, num_q_rows, buffer_positions.numel(), window
    )


class BufferExchange(KVExchange):
    """An exchange that fills one key buffer (positions ascending) and attends once.

    Subclasses move rows with two plain functions (their collectives included):
    `gather_rows` fills the K and V buffers of `buffer_positions` from the local rows,
    and `scatter_grads` is its adjoint. Rows are token-major ``[rows, Hk, D]`` (free
    views of the layer's ``[Hk, L, D]``; ``D`` is each tensor's own: ``Dk`` for K, ``Dv``
    for V); K and V travel fused ``[rows, Hk, Dk + Dv]`` (Note [Fused K/V rows])
    only inside a collective. With a log-sum-exp kernel the whole layer is one
    autograd node (`BufferAttention`): no intermediate view gradients to zero-fill.
    """

    def __init__(self, setup: ExchangeSetup, buffer_positions: torch.Tensor,
                 key_grad_rows: Optional[tuple[torch.Tensor, int]] = None) -> None:
        """`key_grad_rows`: ``([N] gradient row of each buffer row, number of gradient rows)`` when this
        exchange takes K/V gradients in a layout of its own (`scatter_grads` with ``in_grad_rows``)."""
        self.buffer_positions = buffer_positions
        self.local_len = setup.local_len
        items = items_over_buffer(setup.pieces(), buffer_positions, setup.local_len, setup.window)
        if key_grad_rows is not None:
            items = replace(items, key_grad_rows=key_grad_rows[0], num_key_grad_rows=key_grad_rows[1])
        self.items = items
        self.kernel_calls: Mapping[str, Any] = MappingProxyType(
            {k.name: k.prepare(self.items, setup.device) for k in setup.kernels}
        )

    @abstractmethod
    def gather_rows(self, k_LHD: torch.Tensor, v_LHD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Local rows ``[L, Hk, D]`` -> key buffers ``(k [N, Hk, D], v [N, Hk, D])`` (runs the forward collectives)."""

    @abstractmethod
    def scatter_grads(self, dk_NHD: torch.Tensor, dv_NHD: torch.Tensor,
                      in_grad_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The adjoint: buffer gradients ``[N, Hk, D]`` -> local-row gradients ``(dk [L, Hk, D], dv [L, Hk, D])``.

        ``in_grad_rows``: the gradients are already in this exchange's `key_grad_rows` layout
        (a kernel that `writes_key_grad_rows` wrote them there)."""

    def attend(self, q_HLD, k_HLD, v_HLD, kernel, options: CallOptions, sinks=None):
        calls = self.kernel_calls[kernel.name]
        if kernel.supports_lse:
            return BufferAttention.apply(q_HLD, k_HLD, v_HLD, sinks, self, kernel, calls, options)
        ensure(sinks is None, "attention sinks reached a kernel without log-sum-exp")
        k_buf, v_buf = FetchRows.apply(k_HLD, v_HLD, self)
        out = kernel.attend(calls, q_HLD, k_buf, v_buf, options)
        if self.items.size == 0:
            # A rank of only padding: its zeros must still depend on q and the fetched
            # buffer, so its backward runs the exchange's collectives like every other rank.
            # The zero is a tensor so that its product saves one: under non-reentrant
            # checkpointing, unpacking it makes this rank recompute (and run the forward
            # collectives) with the others; a float 0.0 saves nothing and the others hang.
            zero = q_HLD.new_zeros(())
            out = out + zero * (q_HLD.sum() + k_buf.sum() + v_buf.sum())
        return out


class FetchRows(torch.autograd.Function):
    """Differentiable `BufferExchange.gather_rows` on ``[Hk, L, D]`` -> ``[Hk, N, D]`` (for
    kernels whose backward is autograd's)."""

    @staticmethod
    def forward(ctx, k_HLD: torch.Tensor, v_HLD: torch.Tensor, exchange: BufferExchange):
        ctx.exchange = exchange
        return token_major(*exchange.gather_rows(*token_major(k_HLD, v_HLD)))

    @staticmethod
    def backward(ctx, dk_HND: torch.Tensor, dv_HND: torch.Tensor):
        return (*token_major(*ctx.exchange.scatter_grads(*token_major(dk_HND, dv_HND))), None)


class BufferAttention(torch.autograd.Function):
    """One layer as one node: gather the K/V buffer, attend (then the sinks); backward mirrors it.

    Backward always runs the exchange's collectives (also on a rank of only padding),
    so every rank's backward stays matched.
    """

    @staticmethod
    def forward(ctx, q_HLD, k_HLD, v_HLD, sinks_H, exchange: BufferExchange, kernel, calls, options: CallOptions):
        k_HND, v_HND = token_major(*exchange.gather_rows(*token_major(k_HLD, v_HLD)))
        o_HLD, lse_HL, aux = kernel.forward(calls, q_HLD, k_HND, v_HND, options)
        if sinks_H is not None:
            o_HLD, lse_HL = add_sinks(o_HLD, lse_HL, sinks_H)
        save_for_backward(ctx, kernel, (q_HLD, k_HND, v_HND), (o_HLD, lse_HL, sinks_H), aux)
        ctx.exchange, ctx.kernel, ctx.calls, ctx.options = exchange, kernel, calls, options
        return o_HLD

    @staticmethod
    def backward(ctx, do_HLD):
        (q, k_HND, v_HND), (o, lse, sinks_H), aux = saved_for_backward(ctx)
        dq, dk_HND, dv_HND = ctx.kernel.backward(ctx.calls, do_HLD, q, k_HND, v_HND, o, lse, aux, ctx.options)
        in_grad_rows = ctx.kernel.writes_key_grad_rows and ctx.exchange.items.key_grad_rows is not None
        dk_LHD, dv_LHD = ctx.exchange.scatter_grads(*token_major(dk_HND.to(k_HND.dtype), dv_HND.to(v_HND.dtype)),
                                                    in_grad_rows=in_grad_rows)
        d_sinks = None if sinks_H is None else sinks_grad(do_HLD, o, lse, sinks_H).to(sinks_H.dtype)
        return dq, *token_major(dk_LHD, dv_LHD), d_sinks, None, None, None, None
