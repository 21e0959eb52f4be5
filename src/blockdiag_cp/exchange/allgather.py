"""`allgather`: every rank gathers every rank's K/V (the seed's exchange), fused [K;V].

One all-gather of ``[L, 2, Hk, D]`` rows forward, one reduce-scatter backward. The
key buffer is then the needed part of the gathered rows: a view when the layout is
contiguous, an index otherwise.
"""

from __future__ import annotations

import torch

from .base import BufferExchange, ExchangeSetup, Traffic
from .collectives import all_gather_rows, reduce_scatter_rows


class AllGatherExchange(BufferExchange):
    name = "allgather"

    def __init__(self, setup: ExchangeSetup) -> None:
        geometry, L, W = setup.geometry, setup.local_len, setup.world
        needed = geometry.needed_positions(setup.rank, setup.window)
        self.group, self._world = setup.group, W
        self._moved = (W - 1) * L
        if geometry.plan.layout == "contiguous":
            lo = int(needed[0]) if needed.numel() else 0
            hi = int(needed[-1]) + 1 if needed.numel() else 0
            self._slice: tuple[int, int] | None = (lo, hi - lo)
            self._index = None
            buffer_positions = torch.arange(lo, hi)
        else:
            self._slice = None
            self._index = geometry.gathered_row[needed].to(setup.device)
            buffer_positions = needed
        super().__init__(setup, buffer_positions)

    @property
    def traffic(self) -> Traffic:
        """A ring all-gather sends and receives every other rank's rows; a ring reduce-scatter
        likewise. (gloo implements reduce-scatter as an all-reduce and sends twice that.)"""
        return Traffic(self._moved, self._moved, self._moved, self._moved)

    def gather_rows(self, kv_L2HD: torch.Tensor) -> torch.Tensor:
        gathered = all_gather_rows(kv_L2HD, self.group)
        if self._slice is not None:
            return gathered.narrow(0, *self._slice)
        return gathered.index_select(0, self._index)

    def scatter_grads(self, d_buffer_N2HD: torch.Tensor) -> torch.Tensor:
        d_gathered = d_buffer_N2HD.new_zeros((self._world * self.local_len, *d_buffer_N2HD.shape[1:]))
        if self._slice is not None:
            d_gathered.narrow(0, *self._slice).copy_(d_buffer_N2HD)
        else:
            d_gathered.index_add_(0, self._index, d_buffer_N2HD)
        return reduce_scatter_rows(d_gathered, self.group)
