"""The K/V exchange interface, and the buffer-based exchanges' shared machinery.

An exchange is a strategy that, once per step, routes the K/V rows this rank's
queries need (from the replicated `StepGeometry`, no collective): its *routing* is
what it holds. Per attention call it runs that routing and the attention. Buffer exchanges deliver the
needed rows into one key buffer ordered by position and run one kernel over it;
the ring interleaves delivery with attention instead.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Mapping

import torch

from ..errors import ensure
from ..geometry import Pieces, StepGeometry
from ..kernels import AttentionKernel, ItemTable


@dataclass(frozen=True)
class Traffic:
    """K/V rows (one row = one token's K and V, all K/V heads) this rank moves per attention call.

    ``sent_bwd``/``recv_bwd`` are the gradient rows of the backward pass.
    """

    sent_fwd: int
    recv_fwd: int
    sent_bwd: int
    recv_bwd: int

    def bytes(self, kv_heads: int, head_dim: int, dtype: torch.dtype) -> dict[str, int]:
        """The same four numbers in bytes, for K and V of `kv_heads` heads of `head_dim`."""
        row = 2 * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
        return {name: getattr(self, name) * row for name in ("sent_fwd", "recv_fwd", "sent_bwd", "recv_bwd")}


@dataclass(frozen=True)
class ExchangeSetup:
    """What an exchange routes from: the replicated geometry and this rank's place in it."""

    geometry: StepGeometry
    rank: int
    group: Any
    kernels: tuple[AttentionKernel, ...]
    device: torch.device

    @property
    def world(self) -> int:
        return self.geometry.world

    @property
    def local_len(self) -> int:
        return self.geometry.plan.local_len

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
        kernel: AttentionKernel, scale: float, dropout_p: float,
    ) -> torch.Tensor:
        """``o [H, L, D]``: attention of the local queries over the keys they may see."""


def fuse_kv(k_HLD: torch.Tensor, v_HLD: torch.Tensor) -> torch.Tensor:
    """``[L, 2, Hk, D]`` contiguous rows: one token's K and V, ready for one collective."""
    return torch.stack([k_HLD, v_HLD], dim=0).permute(2, 0, 1, 3).contiguous()


def split_kv(kv_N2HD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, 2, Hk, D]`` -> ``(k [Hk, N, D], v [Hk, N, D])`` views."""
    return kv_N2HD[:, 0].transpose(0, 1), kv_N2HD[:, 1].transpose(0, 1)


def items_over_buffer(pieces: Pieces, buffer_positions: torch.Tensor, num_q_rows: int) -> ItemTable:
    """Items for `pieces` over a key buffer holding `buffer_positions` (sorted), in order.

    Each piece sees its document's keys up to its last position, bottom-right causal;
    the buffer must hold that whole range.
    """
    g_end = pieces.global_start + pieces.length
    k_start = torch.searchsorted(buffer_positions, pieces.doc_start)
    k_len = g_end - pieces.doc_start
    if pieces.count:
        last = k_start + k_len - 1
        ensure(int(last.max()) < buffer_positions.numel(), "key buffer lacks a needed range")
        ensure(torch.equal(buffer_positions[last], g_end - 1), "key buffer range is not contiguous")
    causal = torch.ones(pieces.count, dtype=torch.bool)
    return ItemTable(pieces.local_start, pieces.length, k_start, k_len, causal, num_q_rows, buffer_positions.numel())


class BufferExchange(KVExchange):
    """An exchange that fills one key buffer (positions ascending) and attends once.

    Subclasses implement `fetch`; the buffer is the rows at `buffer_positions`.
    """

    def __init__(self, setup: ExchangeSetup, buffer_positions: torch.Tensor) -> None:
        self.buffer_positions = buffer_positions
        self.items = items_over_buffer(setup.pieces(), buffer_positions, setup.local_len)
        self.kernel_calls: Mapping[str, Any] = MappingProxyType(
            {k.name: k.prepare(self.items, setup.device) for k in setup.kernels}
        )

    @abstractmethod
    def fetch(self, kv_L2HD: torch.Tensor) -> torch.Tensor:
        """Differentiable: local rows ``[L, 2, Hk, D]`` -> key buffer ``[N, 2, Hk, D]``."""

    def attend(self, q_HLD, k_HLD, v_HLD, kernel, scale, dropout_p):
        buffer = self.fetch(fuse_kv(k_HLD, v_HLD))
        k_buf, v_buf = split_kv(buffer)
        out = kernel.attend(self.kernel_calls[kernel.name], q_HLD, k_buf, v_buf, scale, dropout_p)
        if self.items.size == 0:
            # A rank of only padding: its zeros must still depend on q and the fetched
            # buffer, so its backward runs the exchange's collectives like every other rank.
            out = out + 0.0 * (q_HLD.sum() + buffer.sum())
        return out
