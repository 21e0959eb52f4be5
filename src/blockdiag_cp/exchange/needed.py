"""Needed-only exchanges: each rank receives exactly the K/V rows its queries see.

Note [Needed-only routing]
--------------------------
From the replicated need matrix (Note [Who needs which keys]) every rank derives,
without a collective, for every pair (src, dst) the positions src owns that dst
needs. Rank r then:

    sends    rows of its local K/V, grouped by destination rank (ascending positions)
    receives rows grouped by source rank (ascending positions)
    buffer   local rows and received rows each copied once into their slots
             (ascending positions), head-major (Note [Head-major key buffer])

K and V are fused ``[rows, Hk, Dk + Dv]`` only for the sent rows (one collective, Note
[Fused K/V rows] in base.py); the buffers are filled from the layer's token-major K and V
directly. Backward reverses it: the received rows' gradients go back to their owners and
are added to the owners' local gradients. Only the transport differs:

    a2a    one all-to-all-v over the group (documents spanning any number of ranks)
    p2p    batched point-to-point with exactly the ranks that share a document with
           this one (the grouped layout: a document's group is a few nearby ranks of a
           large world, and a layer must not wait on a collective over all of it)
    halo   p2p where every rank's missing keys are owned by its left neighbour (with
           the contiguous layout, no document spans more than two ranks)

Note [Head-major key buffer]
----------------------------
The fused CPU calls read each head's key rows contiguously (Note [Head-major call
inputs] in kernels/sdpa.py), so the buffer is allocated ``[Hk, N, D]`` and handed on as
its token-major view ``[N, Hk, D]``: the kernel's ``contiguous()`` of the head-major view
is then free. Filling it by runs is a strided ``copy_`` per run (the transposition happens
in that one pass); an earlier version concatenated the runs token-major and the kernel
copied the result head-major again: two passes and two fresh buffers per tensor per layer.

Note [Key gradients in the exchange's layout]
---------------------------------------------
Backward needs the local rows' K/V gradients ``[L, Hk, D]`` (plus what came back for the
rows this rank sent) and the received rows' gradients grouped by source, to send back.
A kernel that `writes_key_grad_rows` (sdpa) writes each buffer row's gradient straight
into row ``assemble[j]`` of a ``[L + R]`` tensor, ``[local rows | received rows]``: the
local gradients are then its first ``L`` rows (a view; local rows no query needs are
zeroed by the kernel) and the received ones the rest, in the order they are sent. Other
kernels return the buffer's order and the exchange gathers both parts (two fresh
``[L, Hk, D]`` tensors and a pass each).

On glibc every fresh allocation past its mmap threshold (32 MiB at most, e.g. 16k rows of
8 x 64 fp32) is new pages, zero-filled on first touch: a fresh buffer costs about twice
a copy into memory already touched, so passes saved here are fresh buffers saved too.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import ensure
from .base import BufferExchange, ExchangeSetup, Traffic, fuse_rows, unfuse_rows
from ..parallel.collectives import all_to_all_rows, p2p_rows


class NeededOnlyExchange(BufferExchange):
    """Shared routing of `a2a` and `halo` (Note [Needed-only routing])."""

    def __init__(self, setup: ExchangeSetup) -> None:
        geometry, rank, L, W = setup.geometry, setup.rank, setup.local_len, setup.world
        self.group = setup.group
        self.any_transfer = geometry.documents_cross_ranks(setup.window)  # the same on every rank
        # rows this rank sends, grouped by destination, ascending positions (local rows)
        send_rows, send_to = geometry.send_rows_of(rank, setup.window)
        self.send_rows = send_rows.to(setup.device)
        # buffer row j holds local row assemble[j] (< L) or received row assemble[j] - L
        needed, src, local = geometry.sources_of(rank, setup.window)
        recv_from = torch.bincount(src, minlength=W)
        recv_from[rank] = 0
        self.send_splits, self.recv_splits = send_to.tolist(), recv_from.tolist()
        recv_offset = torch.cumsum(recv_from, dim=0) - recv_from
        assemble = torch.where(src == rank, local, L + recv_offset[src] + _rank_within(src, W))
        self.assemble_runs = _runs(assemble, L)
        self.slots = _Slots.of(assemble, L, sum(self.recv_splits), setup.device)
        # a kernel that writes key gradient rows writes them [local rows | received rows] (Note [Key
        # gradients in the exchange's layout]): buffer row j's gradient goes to row assemble[j]
        super().__init__(setup, needed, key_grad_rows=(assemble, L + sum(self.recv_splits)))

    @property
    def traffic(self) -> Traffic:
        sent, recv = sum(self.send_splits), sum(self.recv_splits)
        return Traffic(sent, recv, recv, sent)

    @abstractmethod
    def transport(self, rows_TX: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        """Rows grouped by destination -> rows grouped by source (a plain collective)."""

    def gather_rows(self, k_LHD: torch.Tensor, v_LHD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        received_k, received_v = k_LHD[:0], v_LHD[:0]
        if self.any_transfer:
            sent = fuse_rows(k_LHD.index_select(0, self.send_rows), v_LHD.index_select(0, self.send_rows))
            received = self.transport(sent, self.send_splits, self.recv_splits)
            received_k, received_v = unfuse_rows(received, k_LHD.shape[-1])
        return self._assemble(k_LHD, received_k), self._assemble(v_LHD, received_v)

    def _assemble(self, local_LHD: torch.Tensor, received_RHD: torch.Tensor) -> torch.Tensor:
        """``[N, Hk, D]``: each needed local and received row once, in buffer order, written straight
        into head-major storage (a token-major view of ``[Hk, N, D]``: the layout the fused calls read,
        Note [Head-major key buffer]); a view of the local rows when they are the whole buffer."""
        if self.assemble_runs is not None and len(self.assemble_runs) == 1 and self.assemble_runs[0][0] == 0:
            _, start, length = self.assemble_runs[0]
            return local_LHD.narrow(0, start, length)
        slots = self.slots
        Hk, D = local_LHD.shape[1:]
        buffer = local_LHD.new_empty((Hk, slots.size, D)).transpose(0, 1)
        if self.assemble_runs is not None:  # contiguous layouts: one strided copy per run
            sources, at = (local_LHD, received_RHD), 0
            for src, start, length in self.assemble_runs:
                buffer[at : at + length].copy_(sources[src].narrow(0, start, length))
                at += length
            return buffer
        local = local_LHD if slots.local_rows is None else local_LHD.index_select(0, slots.local_rows)
        buffer.index_copy_(0, slots.local, local)
        if received_RHD.shape[0]:
            buffer.index_copy_(0, slots.received, received_RHD)
        return buffer

    def scatter_grads(self, dk_NHD: torch.Tensor, dv_NHD: torch.Tensor,
                      in_grad_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        slots, L = self.slots, self.local_len
        if in_grad_rows:  # [local | received] already (Note [Key gradients in the exchange's layout])
            d_local = [dk_NHD[:L], dv_NHD[:L]]
            d_received = (dk_NHD[L:], dv_NHD[L:])
        elif dk_NHD.shape[0] == 0:  # a rank of only padding: no query, no gradient
            d_local = [d.new_zeros((L, *d.shape[1:])) for d in (dk_NHD, dv_NHD)]
            d_received = (dk_NHD, dv_NHD)
        else:  # each local row's buffer gradient; rows no query needs get 0
            d_local = [d.index_select(0, slots.of_local).index_fill_(0, slots.unused_local, 0.0) for d in (dk_NHD, dv_NHD)]
            d_received = tuple(d.index_select(0, slots.received) for d in (dk_NHD, dv_NHD))
        if self.any_transfer:  # every rank runs the reverse collective, also one that only sent
            returned = self.transport(fuse_rows(*d_received), self.recv_splits, self.send_splits)
            for d, d_returned in zip(d_local, unfuse_rows(returned, dk_NHD.shape[-1])):
                d.index_add_(0, self.send_rows, d_returned)
        return d_local[0], d_local[1]


@dataclass(frozen=True)
class _Slots:
    """Where rows go in the key buffer of `size` rows (indices on the device).

    ``local``: slot of each used local row (all rows when ``local_rows`` is None, else
    those rows); ``received``: slot of each received row; ``of_local`` ``[L]``: each
    local row's slot (0 for a row no query needs, listed in ``unused_local``).
    """

    size: int
    local_rows: Optional[torch.Tensor]
    local: torch.Tensor
    received: torch.Tensor
    of_local: torch.Tensor
    unused_local: torch.Tensor

    @staticmethod
    def of(assemble: torch.Tensor, local_len: int, received: int, device: torch.device) -> "_Slots":
        """From ``assemble`` (buffer slot -> local row, or ``local_len +`` received row)."""
        slot_of = torch.full((local_len + received,), -1, dtype=torch.long)
        slot_of[assemble] = torch.arange(assemble.numel())
        of_local, of_received = slot_of[:local_len], slot_of[local_len:]
        ensure(bool((of_received >= 0).all()), "a received K/V row has no slot in the key buffer")
        used = of_local >= 0
        local_rows = None if bool(used.all()) else torch.nonzero(used).flatten()
        local = of_local if local_rows is None else of_local[local_rows]
        unused_local = torch.nonzero(~used).flatten()
        tensors = (local_rows, local, of_received, of_local.clamp(min=0), unused_local)
        return _Slots(assemble.numel(), *(None if t is None else t.to(device) for t in tensors))


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


class PeerExchange(NeededOnlyExchange):
    """Needed-only rows over batched point-to-point, with the ranks that share documents only."""

    name = "p2p"
    uses_p2p = True

    def transport(self, rows_TX, send_splits, recv_splits):
        return p2p_rows(rows_TX, send_splits, recv_splits, self.group)


class HaloExchange(PeerExchange):
    """`p2p` where the only peers are the left and right neighbours."""

    name = "halo"

    def __init__(self, setup: ExchangeSetup) -> None:
        reason = halo_unsupported_reason(setup)
        ensure(reason is None, f"halo routed where it cannot serve: {reason}")
        super().__init__(setup)


def halo_unsupported_reason(setup: ExchangeSetup) -> str | None:
    """Why `halo` cannot serve this step (None if it can): a rank needs keys beyond its left neighbour."""
    dst, src = torch.nonzero(setup.geometry.transfer_under(setup.window), as_tuple=True)
    beyond = (src != dst - 1) | (dst == 0)
    if bool(beyond.any()):
        d, s = int(dst[beyond][0]), int(src[beyond][0])
        return f"rank {d} needs keys owned by rank {s}, not only its left neighbour"
    return None
