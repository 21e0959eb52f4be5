"""`ShardPlan` (which padded-row positions each CP rank owns) and the attention work model.

A plan pads the packed row to ``padded_len`` and gives each rank its positions, listed in
ascending order; every position belongs to exactly one rank. The contiguous and balanced
layouts pad to a multiple of ``world`` and give every rank ``L = padded_len // world``
positions (equal shapes on every rank); the grouped layout may give ranks different lengths.

The work model: a real query at position ``g`` of a document starting at ``s`` sees
``g - s + 1`` keys (``min(g - s + 1, w)`` under a sliding window ``w``: a windowed
document's work is linear in its length), so the attention work of a rank is the sum
of that over the real positions it owns.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

import torch

from ..errors import ensure
from .ranges import concat_ranges
from .runs import doc_starts


@dataclass(frozen=True)
class Segments:
    """A plan as runs of consecutive positions of one rank, in position order (they tile ``[0, S_pad)``).

    All ``[G]`` int64 CPU: ``start``, ``length``, ``rank``, and ``local``: the row of the segment's first
    position in its rank's local order. A step localizes with them (Note [Localized geometry] in
    geometry.py): ``G`` grows with the documents and ranks, not with the tokens.
    """

    start: torch.Tensor
    length: torch.Tensor
    rank: torch.Tensor
    local: torch.Tensor

    @staticmethod
    def of(start: Any, length: Any, rank: Any, world: int) -> "Segments":
        """From runs ``[G]`` (tensors or arrays, any order, disjoint, tiling the row) of `world` ranks: sorted by
        position, with local rows."""
        start, length, rank = (np.asarray(a, dtype=np.int64) for a in (start, length, rank))
        keep = length > 0
        start, length, rank = start[keep], length[keep], rank[keep]
        by_rank = np.lexsort((start, rank))
        rows = np.cumsum(length[by_rank]) - length[by_rank]  # each run's first row in the ranks' concatenation
        rank_first = rows[np.minimum(np.searchsorted(rank[by_rank], np.arange(world)), max(rows.size - 1, 0))]
        local = np.empty_like(rows)
        local[by_rank] = rows - rank_first[rank[by_rank]]
        order = np.argsort(start, kind="stable")
        return Segments(*(torch.from_numpy(np.ascontiguousarray(a[order])) for a in (start, length, rank, local)))

    @property
    def end(self) -> torch.Tensor:
        return self.start + self.length

    def locate(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``([n] owner, [n] local row)`` of `positions` ``[n]``."""
        seg = torch.searchsorted(self.start, positions, right=True) - 1
        return self.rank.index_select(0, seg), self.local.index_select(0, seg) + positions - self.start.index_select(0, seg)

    def of_rank(self, rank: int) -> "Segments":
        """`rank`'s segments (position order = its local order)."""
        mine = self.rank == rank
        return Segments(self.start[mine], self.length[mine], self.rank[mine], self.local[mine])


@dataclass(frozen=True)
class ShardPlan:
    """Which padded-sequence positions each CP rank owns.

    Attributes:
        layout: the planner that made it (``"contiguous"``, ``"balanced"`` or ``"grouped"``).
        seq_len: ``S``, the unpadded length.
        padded_len: ``S_pad``; positions ``>= S`` are padding.
        positions: ``[S_pad]`` int64 (CPU): rank 0's positions ascending, then rank 1's, ...
        local_lens: ``L_r``, how many positions each rank owns (sums to ``S_pad``).

    The contiguous and balanced layouts give every rank the same ``L`` (`equal_shards`;
    `positions_WL` is then ``[W, L]``); the grouped layout may give ranks different lengths
    (Note [Unequal shards] in grouped.py). A planner that knows its runs passes them as `runs`
    (`segments` derives them from `positions` otherwise).
    """

    layout: str
    seq_len: int
    padded_len: int
    given_positions: Optional[torch.Tensor]
    local_lens: tuple[int, ...]
    runs: Optional[Segments] = field(default=None, compare=False, repr=False)
    _rank_positions: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        ensure((self.given_positions is None) != (self.runs is None), "a plan is given by its positions or its runs")
        placed = self.runs.length.sum() if self.given_positions is None else self.given_positions.numel()
        ensure(sum(self.local_lens) == self.padded_len == int(placed), "a plan places every position once")
        ensure(min(self.local_lens) >= 1, "every rank owns at least one position")

    @staticmethod
    def of_runs(layout: str, seq_len: int, runs: Segments, world: int) -> "ShardPlan":
        """The plan of `runs` (its `segments`): positions listed only where asked (Note [Localized geometry])."""
        lens = torch.zeros(world, dtype=torch.long).index_add_(0, runs.rank, runs.length)
        return ShardPlan(layout, seq_len, int(lens.sum()), None, tuple(int(n) for n in lens), runs)

    @functools.cached_property
    def positions(self) -> torch.Tensor:
        """``[S_pad]`` int64: rank 0's positions ascending, then rank 1's, ... (built on first use for a
        plan given by its runs)."""
        if self.given_positions is not None:
            return self.given_positions
        order = torch.argsort(self.runs.rank * (self.padded_len + 1) + self.runs.start)
        return concat_ranges(self.runs.start.index_select(0, order), self.runs.length.index_select(0, order))

    @staticmethod
    def from_rows(layout: str, seq_len: int, positions_WL: torch.Tensor) -> "ShardPlan":
        """The plan giving rank ``r`` the positions ``positions_WL[r]`` (``[W, L]``, each row ascending)."""
        W, L = positions_WL.shape
        return ShardPlan(layout, seq_len, W * L, positions_WL.reshape(-1), (L,) * W)

    @property
    def world(self) -> int:
        return len(self.local_lens)

    @functools.cached_property
    def offsets(self) -> torch.Tensor:
        """``[W + 1]`` int64: rank ``r`` owns ``positions[offsets[r]:offsets[r + 1]]``."""
        return torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(torch.tensor(self.local_lens), 0)])

    @property
    def equal_shards(self) -> bool:
        """Every rank owns the same number of positions."""
        return len(set(self.local_lens)) == 1

    @property
    def max_local_len(self) -> int:
        return max(self.local_lens)

    @property
    def local_len(self) -> int:
        """``L``, the positions of every rank (a plan of equal shards only; see `local_len_of`)."""
        if not self.equal_shards:
            raise ValueError(f"the {self.layout} plan gives ranks different lengths ({min(self.local_lens)} to "
                             f"{max(self.local_lens)} positions): ask for one rank's, local_len_of(rank)")
        return self.local_lens[0]

    def local_len_of(self, rank: int) -> int:
        """How many positions `rank` owns."""
        return self.local_lens[rank]

    @property
    def positions_WL(self) -> torch.Tensor:
        """``[W, L]``: rank ``r``'s positions, ascending (a plan of equal shards only)."""
        return self.positions.reshape(self.world, self.local_len)

    def rank_positions(self, rank: int) -> torch.Tensor:
        """``[L_r]`` LongTensor: the padded-sequence positions `rank` owns, in local order."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside the plan's world of {self.world}")
        if self.given_positions is not None or "positions" in self.__dict__:
            return self.positions.narrow(0, int(self.offsets[rank]), self.local_lens[rank])
        if rank not in self._rank_positions:  # O(own positions + segments), kept for the plan
            mine = self.runs.of_rank(rank)
            self._rank_positions[rank] = concat_ranges(mine.start, mine.length)
        return self._rank_positions[rank]

    def contiguous_start(self, rank: int) -> Optional[int]:
        """First position of `rank` if it owns one contiguous range, else None."""
        pos = self.rank_positions(rank)
        first = int(pos[0])
        return first if int(pos[-1]) - first + 1 == pos.numel() else None

    @functools.cached_property
    def segments(self) -> Segments:
        """The plan's `Segments` (the planner's `runs`, else derived from `positions` in one pass)."""
        if self.runs is not None:
            return self.runs
        pos, rank = self.positions, self.rank_of_row
        new = torch.ones_like(pos, dtype=torch.bool)
        new[1:] = (pos[1:] != pos[:-1] + 1) | (rank[1:] != rank[:-1])
        first = torch.nonzero(new).flatten()
        length = torch.diff(first, append=torch.tensor([pos.numel()]))
        return Segments.of(pos[first], length, rank[first], self.world)

    @functools.cached_property
    def rank_of_row(self) -> torch.Tensor:
        """``[S_pad]`` int64: the rank of each entry of `positions` (0 for rank 0's rows, then 1, ...)."""
        return torch.arange(self.world).repeat_interleave(torch.tensor(self.local_lens))

    def owner(self) -> torch.Tensor:
        """``[S_pad]`` int64: the rank owning each position."""
        return torch.empty(self.padded_len, dtype=torch.long).scatter_(0, self.positions, self.rank_of_row)

    def local_index(self) -> torch.Tensor:
        """``[S_pad]`` int64: each position's index in its owner's local order."""
        local = torch.arange(self.padded_len) - self.offsets[:-1].index_select(0, self.rank_of_row)
        return torch.empty(self.padded_len, dtype=torch.long).scatter_(0, self.positions, local)


def pad_doc_ids(doc_ids_S: torch.Tensor, padded_len: int) -> torch.Tensor:
    """``[S_pad]``: `doc_ids_S` with padding (0) appended up to `padded_len`."""
    return torch.cat([doc_ids_S, doc_ids_S.new_zeros(padded_len - doc_ids_S.numel())])


def query_work(doc_ids_S: torch.Tensor, window: Optional[int] = None) -> torch.Tensor:
    """``[S]`` int64: keys each position's query sees (0 for padding), at most `window`."""
    index = torch.arange(doc_ids_S.numel(), device=doc_ids_S.device)
    seen = index - doc_starts(doc_ids_S) + 1
    if window is not None:
        seen = seen.clamp(max=window)
    return torch.where(doc_ids_S != 0, seen, 0)


def attention_work(plan: ShardPlan, doc_ids_S: torch.Tensor, window: Optional[int] = None) -> torch.Tensor:
    """``[W]`` int64: causal attention work (query-key pairs) per rank under `plan` (and `window`)."""
    work_S = query_work(pad_doc_ids(doc_ids_S.cpu(), plan.padded_len), window)
    return torch.zeros(plan.world, dtype=torch.long).index_add_(0, plan.rank_of_row, work_S[plan.positions])


def merge_consecutive_ranks(plan: ShardPlan, degree: int) -> tuple[ShardPlan, torch.Tensor]:
    """The plan of ``W / degree`` groups of `degree` consecutive ranks, each group owning its
    members' positions (ascending), and ``order [W / degree, degree * L]``: for each sorted row of a
    group, its row in the members' concatenation (member after member, each in local order).
    """
    W, L = plan.positions_WL.shape
    member_major = plan.positions_WL.reshape(W // degree, degree * L)
    positions, order = member_major.sort(dim=1)
    return ShardPlan.from_rows(plan.layout, plan.seq_len, positions), order
