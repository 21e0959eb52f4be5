"""`EntryRoute`: deliver the entries other ranks need (conv halo rows, recurrent states), differentiably.

Note [Entry routes]
-------------------
A routed token mixer hands small things across ranks: the ``k - 1`` input rows before a
piece (a conv halo), the state a piece leaves for a later piece of its document. Each rank
``r`` has a list of *entries* ``E_r`` (rows others may need, or state slots), and every rank
knows, from the replicated geometry, which entries of ``src`` each ``dst`` needs. Two
transports deliver them, one interface (`deliver`, then `rows` to find an entry):

    gather   one all-gather of every rank's entries, padded to the longest list; rank src's
             entry i is row ``src * pad + i`` of what arrives (own entries included)
    peers    batched point-to-point: src sends dst exactly the entries dst needs; what
             arrives is ``[own entries | received, grouped by source]`` (the grouped layout:
             a rank talks only to the ranks that share its documents)

Backward is the adjoint (a reduce-scatter, or the reverse point-to-point added into the
entries' gradients). Every rank runs the transport in forward and backward, also one that
sends or receives nothing, so no rank waits on another: callers keep what arrives in their
graph (``+ 0 * sum``), as for the K/V exchanges.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from .collectives import AllGatherRows, p2p_rows


@dataclass(frozen=True)
class EntryRoute:
    """How this rank's entries reach the ranks that need them, and where others' entries arrive.

    Attributes:
        group, rank, world: the process group and this rank's place in it.
        pad: entries per rank in a gather (0 with `peers`).
        peers: point-to-point (else one all-gather).
        own: how many entries this rank has (``|E_rank|``).
        send_index: ``[T]`` (peers) own entries sent, grouped by destination; send_splits / recv_splits per rank.
        recv_lookup: ``{src: [|E_src|] int64}`` (peers): each entry's row among what src sends here (-1: not sent).
    """

    group: Any
    rank: int
    world: int
    pad: int
    peers: bool
    own: int
    send_index: Optional[torch.Tensor] = None
    send_splits: tuple[int, ...] = ()
    recv_splits: tuple[int, ...] = ()
    recv_lookup: Optional[dict] = None

    @staticmethod
    def gather(group: Any, rank: int, counts: Sequence[int]) -> "EntryRoute":
        """Every rank's `counts[r]` entries to every rank, one all-gather padded to the longest."""
        return EntryRoute(group, rank, len(counts), max(counts, default=0), False, counts[rank])

    @staticmethod
    def between_peers(group: Any, rank: int, counts: Sequence[int], wanted_from: Sequence[torch.Tensor],
                      wanted_by: Sequence[torch.Tensor]) -> "EntryRoute":
        """Point-to-point: `wanted_from[src]` the entries of src this rank needs (ascending), `wanted_by[dst]`
        the entries of this rank that dst needs (ascending); both ``[n]`` int64, empty for this rank itself."""
        W = len(counts)
        lookup = {}
        for src, wanted in enumerate(wanted_from):
            if src != rank and wanted.numel():
                rows = torch.full((counts[src],), -1, dtype=torch.long)
                rows[wanted] = torch.arange(wanted.numel())
                lookup[src] = rows
        sends = [wanted_by[d] if d != rank else wanted_by[d][:0] for d in range(W)]
        send_index = torch.cat(sends) if sends else torch.zeros(0, dtype=torch.long)
        return EntryRoute(group, rank, W, 0, True, counts[rank], send_index, tuple(int(s.numel()) for s in sends),
                          tuple(0 if s == rank else int(wanted_from[s].numel()) for s in range(W)), lookup)

    @property
    def moves_anything(self) -> bool:
        return (sum(self.send_splits) + sum(self.recv_splits)) > 0 if self.peers else self.pad > 0

    def moved(self) -> tuple[int, int, int, int]:
        """Entries this rank sends and receives, forward then backward (the gradients go back)."""
        if not self.peers:
            n = self.pad * (self.world - 1)  # an all-gather's ring, and its reduce-scatter
            return n, n, n, n
        sent, recv = sum(self.send_splits), sum(self.recv_splits)
        return sent, recv, recv, sent

    def deliver(self, entries_EX: torch.Tensor) -> torch.Tensor:
        """This rank's entries ``[own, ...]`` -> the buffer `rows` indexes (runs the transport)."""
        if not self.peers:
            if entries_EX.shape[0] < self.pad:
                entries_EX = torch.cat([entries_EX, entries_EX.new_zeros((self.pad - entries_EX.shape[0],
                                                                          *entries_EX.shape[1:]))])
            return AllGatherRows.apply(entries_EX, self.group)
        index = self.send_index.to(entries_EX.device)
        received = PeerRows.apply(entries_EX.index_select(0, index), self.send_splits, self.recv_splits, self.group)
        return torch.cat([entries_EX, received])

    def rows(self, src: int, entries: torch.Tensor) -> torch.Tensor:
        """Rows of the delivered buffer holding entries `entries` ``[n]`` of rank `src` (int64, CPU)."""
        if not self.peers:
            return src * self.pad + entries
        if src == self.rank:
            return entries
        offset = self.own + sum(self.recv_splits[:src])
        found = self.recv_lookup[src][entries]
        if bool((found < 0).any()):
            raise RuntimeError(f"rank {self.rank} reads entries of rank {src} that are not routed to it")
        return offset + found


class PeerRows(torch.autograd.Function):
    """`p2p_rows`: rows grouped by destination -> rows grouped by source; backward: the reverse exchange."""

    @staticmethod
    def forward(ctx, rows_TX: torch.Tensor, send_splits, recv_splits, group) -> torch.Tensor:
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        return p2p_rows(rows_TX, list(send_splits), list(recv_splits), group)

    @staticmethod
    def backward(ctx, grad_RX: torch.Tensor):
        send_splits, recv_splits = ctx.splits
        return p2p_rows(grad_RX.contiguous(), list(recv_splits), list(send_splits), ctx.group), None, None, None
