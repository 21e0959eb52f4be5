"""`allgather`: every rank gathers every rank's K/V (the seed's exchange), fused [K;V].

One all-gather of ``[L, Hk, Dk + Dv]`` rows (Note [Fused K/V rows]) forward, one reduce-scatter
backward. The key buffer is then the needed part of the gathered rows: a view when the layout is
contiguous, an index otherwise. Under a plan whose ranks own different numbers of rows
(grouped), every rank's rows are padded to the longest shard for the collective.
"""

from __future__ import annotations

import torch

from ..errors import ensure
from .base import BufferExchange, ExchangeSetup, Traffic, fuse_rows, unfuse_rows
from ..parallel.collectives import all_gather_rows, reduce_scatter_rows


class AllGatherExchange(BufferExchange):
    name = "allgather"

    def __init__(self, setup: ExchangeSetup) -> None:
        geometry, W = setup.geometry, setup.world
        L = geometry.plan.max_local_len  # rows per rank in the collective
        needed = geometry.needed_positions(setup.rank, setup.window)
        self.group, self._world, self._block = setup.group, W, L
        self._moved = (W - 1) * L
        if geometry.plan.layout == "contiguous":
            lo = int(needed[0]) if needed.numel() else 0
            hi = int(needed[-1]) + 1 if needed.numel() else 0
            self._slice: tuple[int, int] | None = (lo, hi - lo)
            self._index = None
            buffer_positions = torch.arange(lo, hi)
        else:
            self._slice = None
            self._index = geometry.gathered_rows(needed).to(setup.device)
            buffer_positions = needed
        super().__init__(setup, buffer_positions)

    @property
    def traffic(self) -> Traffic:
        """A ring all-gather sends and receives every other rank's rows; a ring reduce-scatter
        likewise. (gloo implements reduce-scatter as an all-reduce and sends twice that.)"""
        return Traffic(self._moved, self._moved, self._moved, self._moved)

    def gather_rows(self, k_LHD: torch.Tensor, v_LHD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = fuse_rows(k_LHD, v_LHD)
        if rows.shape[0] < self._block:  # a shorter shard of a grouped plan: padded to the longest
            rows = torch.cat([rows, rows.new_zeros((self._block - rows.shape[0], *rows.shape[1:]))])
        gathered = all_gather_rows(rows, self.group)
        if self._slice is not None:
            return unfuse_rows(gathered.narrow(0, *self._slice), k_LHD.shape[-1])
        return unfuse_rows(gathered.index_select(0, self._index), k_LHD.shape[-1])

    def scatter_grads(self, dk_NHD: torch.Tensor, dv_NHD: torch.Tensor, in_grad_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        ensure(not in_grad_rows, "this exchange keeps no key gradient rows of its own")
        Hk, Dk, Dv = *dk_NHD.shape[1:], dv_NHD.shape[-1]
        d_gathered = dk_NHD.new_zeros((self._world * self._block, Hk, Dk + Dv))
        for d_half, d_rows in zip(unfuse_rows(d_gathered, Dk), (dk_NHD, dv_NHD)):
            if self._slice is not None:
                d_half.narrow(0, *self._slice).copy_(d_rows)
            else:
                d_half.index_add_(0, self._index, d_rows)
        return unfuse_rows(reduce_scatter_rows(d_gathered, self.group)[: self.local_len], Dk)
