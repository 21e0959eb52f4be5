"""Needed-only exchanges: each rank receives exactly the K/V rows its queries see.

Note [Needed-only routing]
--------------------------
From the replicated need matrix (Note [Who needs which keys]) every rank derives,
without a collective, for every pair (src, dst) the positions src owns that dst
needs. Rank r then:

    sends    rows of its local K/V, grouped by destination rank (ascending positions)
    receives rows grouped by source rank (ascending positions)
    buffer = cat([local rows, received rows])[assemble]   # ascending positions

Backward reverses it: the received rows' gradients go back to their owners and are
added to the owners' local gradients. Only the transport differs:

    a2a    one all-to-all-v over the group (documents spanning any number of ranks)
    halo   point-to-point with the left neighbour only (valid while every rank's
           missing keys are owned by its left neighbour: with the contiguous layout,
           no document spans more than two ranks)
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Optional

import torch

from ..errors import ensure
from .base import BufferExchange, ExchangeSetup, Traffic
from .collectives import all_to_all_rows, p2p_rows


class NeededOnlyExchange(BufferExchange):
    """Shared routing of `a2a` and `halo` (Note [Needed-only routing])."""

    def __init__(self, setup: ExchangeSetup) -> None:
        geometry, rank, L, W = setup.geometry, setup.rank, setup.local_len, setup.world
        transfer = geometry.transfer_under(setup.window)  # [dst, src]
        self.group = setup.group
        self.send_splits = transfer[:, rank].tolist()
        self.recv_splits = transfer[rank, :].tolist()
        self.any_transfer = bool(transfer.any())
        # rows this rank sends, grouped by destination, ascending positions (local rows)
        needed_by_WL = geometry.need_at(geometry.plan.positions_WL[rank], setup.window)
        needed_by_WL[rank] = False
        self.send_rows = torch.cat([torch.nonzero(row).flatten() for row in needed_by_WL]).to(setup.device)
        # buffer = cat([local, received])[assemble]: received rows come grouped by source rank
        needed = geometry.needed_positions(rank, setup.window)
        src = geometry.owner[needed]
        recv_offset = torch.cumsum(torch.tensor([0] + self.recv_splits[:-1]), dim=0)
        assemble = torch.where(src == rank, geometry.local_index[needed], L + recv_offset[src] + _rank_within(src, W))
        self.assemble = assemble.to(setup.device)
        self.assemble_runs = _runs(assemble, L)
        # the adjoint as a gather: each local/received row's buffer row; rows no query needs get 0
        source_rows = L + sum(self.recv_splits)
        inverse = torch.zeros(source_rows, dtype=torch.long)
        inverse[assemble] = torch.arange(assemble.numel())
        unused = torch.ones(source_rows, dtype=torch.bool)
        unused[assemble] = False
        self.inverse, self.unused_rows = inverse.to(setup.device), torch.nonzero(unused).flatten().to(setup.device)
        super().__init__(setup, needed)

    @property
    def traffic(self) -> Traffic:
        sent, recv = sum(self.send_splits), sum(self.recv_splits)
        return Traffic(sent, recv, recv, sent)

    @abstractmethod
    def transport(self, rows_TX: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        """Rows grouped by destination -> rows grouped by source (a plain collective)."""

    def gather_rows(self, kv_L2HD: torch.Tensor) -> torch.Tensor:
        received = kv_L2HD[:0]
        if self.any_transfer:
            received = self.transport(kv_L2HD.index_select(0, self.send_rows), self.send_splits, self.recv_splits)
        if self.assemble_runs is None:
            return torch.cat([kv_L2HD, received]).index_select(0, self.assemble)
        sources = (kv_L2HD, received)
        parts = [sources[src].narrow(0, start, length) for src, start, length in self.assemble_runs]
        return parts[0] if len(parts) == 1 else torch.cat(parts)  # contiguous layouts: a view or one copy

    def scatter_grads(self, d_buffer_N2HD: torch.Tensor) -> torch.Tensor:
        L = self.local_len
        if d_buffer_N2HD.shape[0] == 0:  # a rank of only padding: no query, no gradient
            d_rows = d_buffer_N2HD.new_zeros((self.inverse.numel(), *d_buffer_N2HD.shape[1:]))
        else:
            d_rows = d_buffer_N2HD.index_select(0, self.inverse).index_fill_(0, self.unused_rows, 0.0)
        d_local = d_rows[:L]
        if self.any_transfer:  # every rank runs the reverse collective, also one that only sent
            returned = self.transport(d_rows[L:], self.recv_splits, self.send_splits)
            d_local.index_add_(0, self.send_rows, returned)
        return d_local


def _rank_within(group_of: torch.Tensor, groups: int) -> torch.Tensor:
    """``[n]``: each element's index among the elements of its group, in order."""
    counts = torch.bincount(group_of, minlength=groups)
    order = torch.argsort(group_of, stable=True)
    index = torch.empty_like(group_of)
    index[order] = torch.arange(group_of.numel()) - (torch.cumsum(counts, 0) - counts)[group_of[order]]
    return index


def _runs(assemble: torch.Tensor, local_len: int, max_runs: int = 8) -> Optional[list[tuple[int, int, int]]]:
    """`assemble` as a few ``(source, start, length)`` slices (source 0: local rows, 1:
    received rows), or None when it has more than `max_runs` runs (then index it)."""
    if assemble.numel() == 0:
        return [(0, 0, 0)]
    received = assemble >= local_len
    breaks = torch.nonzero((assemble[1:] != assemble[:-1] + 1) | (received[1:] != received[:-1]))
    starts = [0] + (breaks.flatten() + 1).tolist()
    if len(starts) > max_runs:
        return None
    ends = starts[1:] + [assemble.numel()]
    out = []
    for a, b in zip(starts, ends):
        first = int(assemble[a])
        out.append((1, first - local_len, b - a) if first >= local_len else (0, first, b - a))
    return out


class AllToAllExchange(NeededOnlyExchange):
    name = "a2a"

    def transport(self, rows_TX, send_splits, recv_splits):
        return all_to_all_rows(rows_TX, send_splits, recv_splits, self.group)


class HaloExchange(NeededOnlyExchange):
    name = "halo"
    uses_p2p = True

    def __init__(self, setup: ExchangeSetup) -> None:
        reason = halo_unsupported_reason(setup)
        ensure(reason is None, f"halo routed where it cannot serve: {reason}")
        super().__init__(setup)

    def transport(self, rows_TX, send_splits, recv_splits):
        return p2p_rows(rows_TX, send_splits, recv_splits, self.group)


def halo_unsupported_reason(setup: ExchangeSetup) -> str | None:
    """Why `halo` cannot serve this step (None if it can): a rank needs keys beyond its left neighbour."""
    dst, src = torch.nonzero(setup.geometry.transfer_under(setup.window), as_tuple=True)
    beyond = (src != dst - 1) | (dst == 0)
    if bool(beyond.any()):
        d, s = int(dst[beyond][0]), int(src[beyond][0])
        return f"rank {d} needs keys owned by rank {s}, not only its left neighbour"
    return None
