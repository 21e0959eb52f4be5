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

Note [Localized geometry]
-------------------------
A rank's step must not cost O(global tokens): the whole-batch step's row holds every replica's
documents (8.4M tokens at a world of 1024), and a rank owns 8k of them. So the geometry works
on *runs*, never on positions: the row's runs (`Runs`: documents and padding runs) and the
plan's `Segments` (runs of consecutive positions of one rank). Cutting the segments at the
run starts gives every rank's pieces (`every_rank_pieces`) and, per (rank, document), the
range of keys it needs (`Needs`): all ``O(documents + segments)``, a small constant each.
What one rank routes is an intersection of ranges: the needs of every rank with its own
segments (the rows it sends, `send_rows_of`), its needs with the plan's segments (the rows
it receives and where they come from, `sources_of`), then ``O(own rows + needed rows)``
index work. The per-position tables (`doc_ids`, `owner`, `local_index`, `need_WS`, ...) are
built on first use, for tools, tests and the paths that read a whole row (`gather_sequence`,
mixers' halos).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from .runs import doc_starts, run_starts
from .shard_plan import ShardPlan, pad_doc_ids
from .ranges import concat_ranges, intersect_ranges


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

    def narrow(self, lo: int, hi: int) -> "Pieces":
        return Pieces(*(t[lo:hi] for t in (self.local_start, self.length, self.global_start, self.doc_start)))


@dataclass(frozen=True)
class Runs:
    """The padded row's runs in position order: documents and padding runs (``[R]`` int64 ``start``,
    ``length``; ``[R]`` bool ``real``: a document)."""

    start: torch.Tensor
    length: torch.Tensor
    real: torch.Tensor

    @staticmethod
    def of_ids(doc_ids_S: torch.Tensor) -> "Runs":
        """The runs of document ids ``[S]`` (0: padding)."""
        ids = doc_ids_S.reshape(-1).cpu().long()
        start = torch.nonzero(run_starts(ids)).flatten() if ids.numel() else ids.new_zeros(0)
        return Runs(start, torch.diff(start, append=torch.tensor([ids.numel()])), ids.index_select(0, start) != 0)

    @staticmethod
    def of_lengths(lengths: np.ndarray) -> "Runs":
        """Documents of `lengths` ``[n]`` back to back from position 0."""
        length = torch.from_numpy(np.asarray(lengths, dtype=np.int64))
        return Runs(torch.cumsum(length, 0) - length, length, torch.ones_like(length, dtype=torch.bool))

    @property
    def end(self) -> int:
        return int(self.start[-1] + self.length[-1]) if self.count else 0

    def padded_to(self, padded_len: int) -> "Runs":
        """These runs, then padding up to `padded_len` (the trailing padding run grows)."""
        end = self.end
        if padded_len <= end:
            return self
        if self.count and not bool(self.real[-1]):
            return Runs(self.start, torch.cat([self.length[:-1], self.length[-1:] + padded_len - end]), self.real)
        return Runs(torch.cat([self.start, torch.tensor([end])]), torch.cat([self.length, torch.tensor([padded_len - end])]),
                    torch.cat([self.real, torch.tensor([False])]))

    @property
    def count(self) -> int:
        return self.start.numel()


@dataclass(frozen=True)
class Needs:
    """The keys each rank's queries see under one window: sorted, disjoint ranges per rank.

    ``rank``, ``lo``, ``hi``: ``[n]`` int64, rank-major (ascending positions within a rank): rank
    ``rank[i]`` needs the positions of ``[lo[i], hi[i])``; ``first``: ``[W + 1]`` where each rank's begin.
    """

    window: Optional[int]
    rank: torch.Tensor
    lo_all: torch.Tensor
    hi_all: torch.Tensor
    first: torch.Tensor

    @property
    def world(self) -> int:
        return self.first.numel() - 1

    def ranges(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``([n_r], [n_r])``: the ranges `rank` needs."""
        a, b = int(self.first[rank]), int(self.first[rank + 1])
        return self.lo_all[a:b], self.hi_all[a:b]

    def positions(self, rank: int) -> torch.Tensor:
        """Sorted positions rank `rank` needs (its own included)."""
        lo, hi = self.ranges(rank)
        return concat_ranges(lo, hi - lo)

    def at(self, positions: torch.Tensor) -> torch.Tensor:
        """``[W, n]`` bool: which ranks need the keys at `positions` ``[n]`` (tools and tests: ``O(W n)``)."""
        rows = []
        for rank in range(self.world):
            lo, hi = self.ranges(rank)
            index = torch.searchsorted(lo, positions, right=True) - 1
            inside = index >= 0
            rows.append(inside & (positions < hi.index_select(0, index.clamp(min=0))) if lo.numel() else inside)
        return torch.stack(rows) if rows else torch.zeros(0, positions.numel(), dtype=torch.bool)

    def owned_by(self, segments) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """What every rank needs of `segments` (a plan's, or one rank's): ``(needing rank [k], segment [k],
        first position [k], end [k])``, rank-major, ascending positions within a rank."""
        i, j, a, b = intersect_ranges(self.lo_all, self.hi_all, segments.start, segments.end)
        return self.rank.index_select(0, i), j, a, b

    def transfer(self, plan: ShardPlan) -> torch.Tensor:
        """``[W (dst), W (src)]``: rows ``dst`` needs that ``src`` owns (0 on the diagonal)."""
        segments, W = plan.segments, plan.world
        dst, j, a, b = self.owned_by(segments)
        src = segments.rank.index_select(0, j)
        counts = torch.zeros(W * W, dtype=torch.long).index_add_(0, dst * W + src, b - a).reshape(W, W)
        return counts.fill_diagonal_(0)

    def transfer_of(self, plan: ShardPlan, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``([W], [W])``: the rows `rank` needs from each rank, and the rows each rank needs from `rank`
        (row `rank` and column `rank` of `transfer`)."""
        _, owner, _ = self.sources(plan, rank)
        recv = torch.bincount(owner, minlength=plan.world)
        recv[rank] = 0
        return recv, self.sent(plan, rank)[1]

    def sent(self, plan: ShardPlan, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``([T] local rows, [W] counts)``: the rows of `rank` other ranks need, grouped by the rank that
        needs them (ascending), ascending within one; and how many each needs."""
        mine = plan.segments.of_rank(rank)
        dst, j, a, b = self.owned_by(mine)
        other = dst != rank
        dst, j, a, b = dst[other], j[other], a[other], b[other]
        rows = concat_ranges(mine.local.index_select(0, j) + a - mine.start.index_select(0, j), b - a)
        return rows, torch.zeros(plan.world, dtype=torch.long).index_add_(0, dst, b - a)

    def sources(self, plan: ShardPlan, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``([N] positions, [N] owner, [N] owner's local row)``: what `rank` needs, ascending, and where it is."""
        lo, hi = self.ranges(rank)
        segments = plan.segments
        _, j, a, b = intersect_ranges(lo, hi, segments.start, segments.end)
        lengths = b - a
        positions = concat_ranges(a, lengths)
        piece = torch.repeat_interleave(torch.arange(j.numel()), lengths, output_size=positions.numel())
        seg = j.index_select(0, piece)
        local = segments.local.index_select(0, seg) + positions - segments.start.index_select(0, seg)
        return positions, segments.rank.index_select(0, seg), local


@dataclass(frozen=True)
class StepGeometry:
    """Replicated per-step facts, on runs (Note [Localized geometry]). All tensors are CPU int64/bool.

    Attributes:
        plan: the shard plan.
        source_ids: ``[S]`` the document ids it was built from (0 = padding), unpadded; None when built from
            its runs alone.
        runs: the padded row's `Runs`.
        every_rank_pieces: every rank's `Pieces`, rank after rank, and ``[W + 1]`` where each rank's
            begin; ``piece_run``: ``[P]`` each piece's run.
        crosses: some document has positions on two ranks.
    """

    plan: ShardPlan
    source_ids: Optional[torch.Tensor]
    runs: Runs
    every_rank_pieces: tuple[Pieces, torch.Tensor]
    piece_run: torch.Tensor
    crosses: bool
    _needs: dict = field(default_factory=dict, compare=False, repr=False)
    _lock: Any = field(default_factory=threading.Lock, compare=False, repr=False)

    @staticmethod
    def build(plan: ShardPlan, doc_ids_S: Optional[torch.Tensor], runs: Optional[Runs] = None) -> "StepGeometry":
        """The geometry of `plan` over the row of `doc_ids_S` ``[S]``; `runs`: its `Runs` when the caller has
        them (the whole-batch step knows its documents' lengths): then the ids are not read."""
        runs = (Runs.of_ids(doc_ids_S) if runs is None else runs).padded_to(plan.padded_len)
        pieces, first, piece_run, crosses = _every_rank_pieces(plan, runs)
        return StepGeometry(plan, doc_ids_S, runs, (pieces, first), piece_run, crosses)

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
        """Rank j needs ``[start(d), last[j, d]]`` of each document d it holds queries of: one range per
        (rank, document), from its pieces (rank-major, ascending)."""
        pieces, _ = self.every_rank_pieces
        rank = self.piece_rank
        last = torch.ones_like(rank, dtype=torch.bool)
        last[:-1] = (rank[1:] != rank[:-1]) | (self.piece_run[1:] != self.piece_run[:-1])
        ends = (pieces.global_start + pieces.length)[last]
        return self._needs_of(None, rank[last], pieces.doc_start[last], ends)

    def _windowed_needs(self, window: int) -> Needs:
        """The union, per rank, of ``[max(start(d), g0 - w + 1), g1)`` over its pieces."""
        pieces, _ = self.every_rank_pieces
        first = torch.maximum(pieces.doc_start, pieces.global_start - window + 1)
        span = self.plan.padded_len + 1  # ranks apart: ranges of two ranks never merge
        lo, hi = _merge_ranges(self.piece_rank * span + first, self.piece_rank * span + pieces.global_start + pieces.length)
        rank = torch.div(lo, span, rounding_mode="floor")
        return self._needs_of(window, rank, lo - rank * span, hi - rank * span)

    def _needs_of(self, window: Optional[int], rank: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> Needs:
        """`Needs` of rank-major ranges ``[n]``."""
        return Needs(window, rank, lo, hi, torch.searchsorted(rank, torch.arange(self.world + 1)))

    @functools.cached_property
    def piece_rank(self) -> torch.Tensor:
        """``[P]`` the rank of each piece of `every_rank_pieces`."""
        _, first = self.every_rank_pieces
        return torch.repeat_interleave(torch.arange(self.world), torch.diff(first))

    def pieces(self, rank: int) -> Pieces:
        """The query pieces of `rank`, in local order."""
        every, first = self.every_rank_pieces
        return every.narrow(int(first[rank]), int(first[rank + 1]))

    @functools.cached_property
    def longest_document(self) -> int:
        """Tokens in the longest document (0 when the row is all padding)."""
        lengths = self.runs.length[self.runs.real]
        return int(lengths.max()) if lengths.numel() else 0

    def needed_positions(self, rank: int, window: Optional[int] = None) -> torch.Tensor:
        """Sorted positions whose keys `rank`'s queries see (owned ones included), under `window`."""
        return self.needs(window).positions(rank)

    def sources_of(self, rank: int, window: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``([N] positions, [N] owner, [N] owner's local row)`` of the keys `rank` needs under `window`."""
        return self.needs(window).sources(self.plan, rank)

    def send_rows_of(self, rank: int, window: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``([T] local rows, [W] counts)``: `rank`'s rows other ranks need under `window`, grouped by the
        rank that needs them (ascending), ascending within one."""
        return self.needs(window).sent(self.plan, rank)

    def transfer_under(self, window: Optional[int]) -> torch.Tensor:
        """``[W (dst), W (src)]`` int64 under a sliding `window` (None: full causal)."""
        return self.needs(window).transfer(self.plan)

    @functools.cached_property
    def transfer(self) -> torch.Tensor:
        """``[W (dst), W (src)]`` int64: rows ``dst`` needs that ``src`` owns (0 on the diagonal)."""
        return self.transfer_under(None)

    def transfer_of(self, rank: int, window: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows rank needs from each rank [W], rows each rank needs from rank [W])`` under `window`."""
        return self.needs(window).transfer_of(self.plan, rank)

    def documents_cross_ranks(self, window: Optional[int] = None) -> bool:
        """Whether any rank needs keys another rank owns (`transfer_under(window).any()`, from the plan alone):
        some document has positions on two ranks, and its queries see more than themselves."""
        return window != 1 and self.crosses

    def gathered_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """``[n]``: each position's row in the rank-ordered concatenation of all shards, each shard padded to
        the longest (``max_local_len`` rows: what an all-gather of equal blocks delivers)."""
        owner, local = self.plan.segments.locate(positions)
        return owner * self.plan.max_local_len + local

    def doc_start_of(self, positions: torch.Tensor) -> torch.Tensor:
        """``[n]`` the first position of each position's run (its document's, or its padding run's)."""
        return self.runs.start.index_select(0, torch.searchsorted(self.runs.start, positions, right=True) - 1)

    def need_at(self, positions: torch.Tensor, window: Optional[int] = None) -> torch.Tensor:
        """``[W, n]`` bool: which ranks' queries see the keys at `positions` ``[n]`` (under `window`)."""
        return self.needs(window).at(positions)

    # per-position tables, built on first use (Note [Localized geometry])

    @functools.cached_property
    def doc_ids(self) -> torch.Tensor:
        """``[S_pad]`` padded document ids (0 = padding; from the runs, numbered 1, 2, ... when built from them)."""
        if self.source_ids is None:
            real = self.runs.real.long()
            return torch.repeat_interleave(torch.cumsum(real, 0) * real, self.runs.length)
        return pad_doc_ids(self.source_ids.reshape(-1).cpu().long(), self.plan.padded_len)

    @functools.cached_property
    def doc_start(self) -> torch.Tensor:
        """``[S_pad]`` first position of each position's document."""
        return doc_starts(self.doc_ids)

    @functools.cached_property
    def owner(self) -> torch.Tensor:
        """``[S_pad]`` owning rank."""
        return self.plan.owner()

    @functools.cached_property
    def local_index(self) -> torch.Tensor:
        """``[S_pad]`` row in the owner's local order."""
        return self.plan.local_index()

    @property
    def run_start(self) -> torch.Tensor:
        """``[runs]`` first position of each run (a document or a padding run)."""
        return self.runs.start

    @functools.cached_property
    def run(self) -> torch.Tensor:
        """``[S_pad]`` index of each position's run."""
        return torch.repeat_interleave(torch.arange(self.runs.count), self.runs.length)

    @functools.cached_property
    def last_by_run(self) -> torch.Tensor:
        """``[W, runs]`` the last position of each run where rank ``j`` owns a real query, -1 where none."""
        needs = self.needs(None)
        last = torch.full((self.world, self.runs.count), -1, dtype=torch.long)
        run = torch.searchsorted(self.runs.start, needs.lo_all, right=True) - 1
        last[needs.rank, run] = needs.hi_all - 1
        return last

    @functools.cached_property
    def need_WS(self) -> torch.Tensor:
        """``[W, S_pad]`` bool, the whole need matrix (for tools and tests; planning uses `need_at`)."""
        return self.need_at(torch.arange(self.plan.padded_len))

    @functools.cached_property
    def gathered_row(self) -> torch.Tensor:
        """``[S_pad]``: `gathered_rows` of every position."""
        return self.owner * self.plan.max_local_len + self.local_index


def _every_rank_pieces(plan: ShardPlan, runs: Runs) -> tuple[Pieces, torch.Tensor, torch.Tensor, bool]:
    """Every rank's pieces (the plan's segments cut at the run starts, real runs only, merged where one rank
    holds consecutive positions of one run), rank after rank; ``[W + 1]`` where each rank's begin; ``[P]``
    each piece's run; whether a document has positions on two ranks."""
    segments = plan.segments
    cuts = torch.unique(torch.cat([segments.start, runs.start]))
    seg = torch.searchsorted(segments.start, cuts, right=True) - 1
    run = torch.searchsorted(runs.start, cuts, right=True) - 1
    rank = segments.rank.index_select(0, seg)
    new = torch.ones_like(cuts, dtype=torch.bool)
    new[1:] = (run[1:] != run[:-1]) | (rank[1:] != rank[:-1])
    first_cut = torch.nonzero(new).flatten()
    start, run, rank, seg = (t.index_select(0, first_cut) for t in (cuts, run, rank, seg))
    length = torch.diff(start, append=torch.tensor([plan.padded_len]))
    real = runs.real.index_select(0, run)
    crosses = bool((real[1:] & (run[1:] == run[:-1])).any())  # after merging: the same run on another rank
    order = torch.nonzero(real).flatten()
    order = order.index_select(0, torch.argsort(rank.index_select(0, order), stable=True))
    start, run, rank, seg, length = (t.index_select(0, order) for t in (start, run, rank, seg, length))
    local = segments.local.index_select(0, seg) + start - segments.start.index_select(0, seg)
    first = torch.searchsorted(rank, torch.arange(plan.world + 1))
    return Pieces(local, length, start, runs.start.index_select(0, run)), first, run, crosses


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
