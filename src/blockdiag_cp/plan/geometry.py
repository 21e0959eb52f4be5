"""Step geometry: what every rank's queries see, derived once from replicated doc ids.

Every rank holds the same document ids and plan, so every rank derives the same
geometry (and therefore the same exchange routing) without a collective.

Note [Who needs which keys]
---------------------------
Position ``g`` of document ``d`` is needed by rank ``j`` iff ``j`` owns a real query
of ``d`` at a position ``>= g``. With ``last[j, d]`` = the last position of ``d``
that ``j`` owns (one scatter-max over the row), ``need[j, g] = g <= last[j, doc(g)]``,
so rank ``j`` needs one prefix of each document: the ranges ``[start(d), last[j, d]]``.
Planning works with those ranges and evaluates ``need`` only at the positions it asks
about (`need_at`), never materializing the ``[W, S]`` matrix on the planning path.

Under a sliding window ``w`` a query at ``g`` sees only ``(g - w, g]`` of its document,
so a piece of rank ``j`` (positions ``[g0, g1)``) needs ``[max(start(d), g0 - w + 1), g1)``:
the union of those ranges over ``j``'s pieces is what it needs (`Needs`, one per
window, built on first use). A window of 4096 over a 128k document needs 4095 keys
before each piece, not the whole prefix.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .runs import doc_starts, run_starts
from .shard_plan import ShardPlan, pad_doc_ids
from .ranges import concat_ranges


@dataclass(frozen=True)
class Pieces:
    """A rank's query pieces: maximal runs of local rows at consecutive positions of one document.

    All ``[P]`` int64 CPU tensors: ``local_start`` (row of the first query),
    ``length``, ``global_start`` (its position), ``doc_start`` (its document's
    first position).
    """

    local_start: torch.Tensor
    length: torch.Tensor
    global_start: torch.Tensor
    doc_start: torch.Tensor

    @property
    def count(self) -> int:
        return self.length.numel()


@dataclass(frozen=True)
class Needs:
    """The keys each rank's queries see under one window: sorted, disjoint ranges per rank.

    ``lo[j]``, ``hi[j]``: ``[n_j]`` int64: rank ``j`` needs the positions of ``[lo, hi)``.
    """

    window: Optional[int]
    lo: tuple[torch.Tensor, ...]
    hi: tuple[torch.Tensor, ...]

    def positions(self, rank: int) -> torch.Tensor:
        """Sorted positions rank `rank` needs (its own included)."""
        return concat_ranges(self.lo[rank], self.hi[rank] - self.lo[rank])

    def at(self, positions: torch.Tensor) -> torch.Tensor:
        """``[W, n]`` bool: which ranks need the keys at `positions` ``[n]``."""
        rows = []
        for lo, hi in zip(self.lo, self.hi):
            index = torch.searchsorted(lo, positions, right=True) - 1
            inside = index >= 0
            rows.append(inside & (positions < hi.index_select(0, index.clamp(min=0))) if lo.numel() else inside)
        return torch.stack(rows)

    def transfer_of(self, plan: ShardPlan, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``([W], [W])``: the rows `rank` needs from each rank, and the rows each rank needs from `rank`
        (row `rank` and column `rank` of `transfer`, in ``O(W)`` searches, not ``O(W^2)``)."""
        W = plan.world
        needed = self.positions(rank)
        recv = torch.bincount(plan.owner().index_select(0, needed), minlength=W) if needed.numel() else \
            torch.zeros(W, dtype=torch.long)
        recv[rank] = 0
        owned = plan.rank_positions(rank)
        send = torch.zeros(W, dtype=torch.long)
        for dst in range(W):
            if dst != rank and self.lo[dst].numel():
                send[dst] = int((torch.searchsorted(owned, self.hi[dst]) - torch.searchsorted(owned, self.lo[dst])).sum())
        return recv, send

    def transfer(self, plan: ShardPlan) -> torch.Tensor:
        """``[W (dst), W (src)]``: rows ``dst`` needs that ``src`` owns (0 on the diagonal)."""
        W = plan.world
        counts = torch.zeros(W, W, dtype=torch.long)
        for dst in range(W):
            if not self.lo[dst].numel():
                continue
            for src in range(W):
                if src != dst:
                    owned = plan.rank_positions(src)
                    inside = torch.searchsorted(owned, self.hi[dst]) - torch.searchsorted(owned, self.lo[dst])
                    counts[dst, src] = int(inside.sum())
        return counts


@dataclass(frozen=True)
class StepGeometry:
    """Replicated per-step facts. All tensors are CPU int64/bool.

    Attributes:
        plan: the shard plan.
        doc_ids: ``[S_pad]`` padded document ids (0 = padding).
        doc_start: ``[S_pad]`` first position of each position's document.
        owner: ``[S_pad]`` owning rank.
        local_index: ``[S_pad]`` row in the owner's local order.
        run: ``[S_pad]`` index of each position's run (a document or a padding run).
        run_start: ``[runs]`` first position of each run.
        last_by_run: ``[W, runs]`` the last position of each run where rank ``j`` owns
            a real query, -1 where it owns none (Note [Who needs which keys]).
    """

    plan: ShardPlan
    doc_ids: torch.Tensor
    doc_start: torch.Tensor
    owner: torch.Tensor
    local_index: torch.Tensor
    run: torch.Tensor
    run_start: torch.Tensor
    last_by_run: torch.Tensor
    _needs: dict = field(default_factory=dict, compare=False, repr=False)
    _lock: Any = field(default_factory=threading.Lock, compare=False, repr=False)

    @staticmethod
    def build(plan: ShardPlan, doc_ids_S: torch.Tensor) -> "StepGeometry":
        ids = pad_doc_ids(doc_ids_S.reshape(-1).cpu().long(), plan.padded_len)
        starts = run_starts(ids)
        run = torch.cumsum(starts.long(), dim=0) - 1
        run_start = torch.nonzero(starts).flatten()
        last = _last_query_by_run(plan, ids, run, run_start.numel())
        return StepGeometry(plan, ids, doc_starts(ids), plan.owner(), plan.local_index(), run, run_start, last)

    @property
    def world(self) -> int:
        return self.plan.world

    def needs(self, window: Optional[int] = None) -> Needs:
        """Who needs which keys under `window` (None: full causal), built once per step and window."""
        with self._lock:
            if window not in self._needs:
                self._needs[window] = self._full_causal_needs() if window is None else self._windowed_needs(window)
            return self._needs[window]

    def _full_causal_needs(self) -> Needs:
        """Rank j needs ``[start(d), last[j, d]]`` of each document d it holds queries of."""
        lo, hi = [], []
        for last in self.last_by_run:
            seen = last >= 0
            lo.append(self.run_start[seen])
            hi.append(last[seen] + 1)
        return Needs(None, tuple(lo), tuple(hi))

    def _windowed_needs(self, window: int) -> Needs:
        """The union, per rank, of ``[max(start(d), g0 - w + 1), g1)`` over its pieces."""
        lo, hi = [], []
        for rank in range(self.world):
            pieces = self.pieces(rank)
            first = torch.maximum(pieces.doc_start, pieces.global_start - window + 1)
            lo_r, hi_r = _merge_ranges(first, pieces.global_start + pieces.length)
            lo.append(lo_r)
            hi.append(hi_r)
        return Needs(window, tuple(lo), tuple(hi))

    def need_at(self, positions: torch.Tensor, window: Optional[int] = None) -> torch.Tensor:
        """``[W, n]`` bool: which ranks' queries see the keys at `positions` ``[n]`` (under `window`)."""
        if window is not None:
            return self.needs(window).at(positions)
        last = self.last_by_run.index_select(1, self.run.index_select(0, positions))
        return (positions.unsqueeze(0) <= last) & (self.doc_ids.index_select(0, positions) != 0).unsqueeze(0)

    @functools.cached_property
    def need_WS(self) -> torch.Tensor:
        """``[W, S_pad]`` bool, the whole need matrix (for tools and tests; planning uses `need_at`)."""
        return self.need_at(torch.arange(self.plan.padded_len))

    def pieces(self, rank: int) -> Pieces:
        """The query pieces of `rank`, in local order."""
        every, first = self.every_rank_pieces
        lo, hi = int(first[rank]), int(first[rank + 1])
        return Pieces(*(t[lo:hi] for t in (every.local_start, every.length, every.global_start, every.doc_start)))

    @functools.cached_property
    def every_rank_pieces(self) -> tuple[Pieces, torch.Tensor]:
        """Every rank's pieces, rank after rank (one pass over the plan), and ``[W + 1]`` where each rank's begin."""
        plan = self.plan
        pos, rank = plan.positions, plan.rank_of_row
        ids = self.doc_ids.index_select(0, pos)
        new = torch.ones_like(ids, dtype=torch.bool)
        new[1:] = (ids[1:] != ids[:-1]) | (pos[1:] != pos[:-1] + 1) | (rank[1:] != rank[:-1])
        starts = torch.nonzero(new).flatten()
        lengths = torch.diff(starts, append=torch.tensor([pos.numel()]))
        real = ids.index_select(0, starts) != 0
        starts, lengths = starts[real], lengths[real]
        owner = rank.index_select(0, starts)
        g0 = pos.index_select(0, starts)
        local = starts - plan.offsets[:-1].index_select(0, owner)
        first = torch.searchsorted(owner, torch.arange(plan.world + 1))
        return Pieces(local, lengths, g0, self.doc_start.index_select(0, g0)), first

    @functools.cached_property
    def longest_document(self) -> int:
        """Tokens in the longest document (0 when the row is all padding)."""
        lengths = torch.diff(self.run_start, append=torch.tensor([self.doc_ids.numel()]))
        real = self.doc_ids[self.run_start] != 0
        return int(lengths[real].max()) if bool(real.any()) else 0

    def needed_positions(self, rank: int, window: Optional[int] = None) -> torch.Tensor:
        """Sorted positions whose keys `rank`'s queries see (owned ones included), under `window`."""
        return self.needs(window).positions(rank)

    @functools.cached_property
    def gathered_row(self) -> torch.Tensor:
        """``[S_pad]``: each position's row in the rank-ordered concatenation of all shards, each shard
        padded to the longest (``max_local_len`` rows: what an all-gather of equal blocks delivers)."""
        return self.owner * self.plan.max_local_len + self.local_index

    @functools.cached_property
    def transfer(self) -> torch.Tensor:
        """``[W (dst), W (src)]`` int64: rows ``dst`` needs that ``src`` owns (0 on the diagonal)."""
        return self.transfer_under(None)

    def transfer_under(self, window: Optional[int]) -> torch.Tensor:
        """`transfer` under a sliding `window` (None: full causal)."""
        return self.needs(window).transfer(self.plan)

    def transfer_of(self, rank: int, window: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows rank needs from each rank [W], rows each rank needs from rank [W])`` under `window`."""
        return self.needs(window).transfer_of(self.plan, rank)

    def documents_cross_ranks(self, window: Optional[int] = None) -> bool:
        """Whether any rank needs keys another rank owns (`transfer_under(window).any()`, from the plan alone):
        some document has positions on two ranks, and its queries see more than themselves."""
        if window == 1:
            return False
        owner = self.owner
        same_run = self.run[1:] == self.run[:-1]
        real = self.doc_ids[1:] != 0
        return bool((same_run & real & (owner[1:] != owner[:-1])).any())


def _merge_ranges(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Disjoint sorted ranges covering the union of ``[lo, hi)`` (given with `lo` ascending)."""
    if lo.numel() == 0:
        return lo, hi
    reach = torch.cummax(hi, dim=0).values
    new = torch.ones_like(lo, dtype=torch.bool)
    new[1:] = lo[1:] > reach[:-1]
    group = torch.cumsum(new.long(), dim=0) - 1
    merged_hi = torch.zeros(int(group[-1]) + 1, dtype=hi.dtype).scatter_reduce_(0, group, hi, reduce="amax")
    return lo[new], merged_hi


def _last_query_by_run(plan: ShardPlan, ids: torch.Tensor, run: torch.Tensor, runs: int) -> torch.Tensor:
    """``[W, runs]``: the last position of each run holding a real query of rank j (-1: none).

    Each rank's positions ascend, so its last position in a run is where the run (or the rank) changes.
    """
    flat, rank = plan.positions, plan.rank_of_row
    run_flat = run.index_select(0, flat)
    last_in_run = torch.ones_like(run_flat, dtype=torch.bool)
    last_in_run[:-1] = (run_flat[1:] != run_flat[:-1]) | (rank[1:] != rank[:-1])
    keep = last_in_run & (ids.index_select(0, flat) != 0)
    last = torch.full((plan.world, runs), -1, dtype=torch.long)
    last[rank[keep], run_flat[keep]] = flat[keep]
    return last
