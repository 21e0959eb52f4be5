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
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .doc_ids import doc_starts, run_starts
from .layout.plan import ShardPlan, pad_doc_ids
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

    @staticmethod
    def build(plan: ShardPlan, doc_ids_S: torch.Tensor) -> "StepGeometry":
        ids = pad_doc_ids(doc_ids_S.reshape(-1).cpu().long(), plan.padded_len)
        starts = run_starts(ids)
        run = torch.cumsum(starts.long(), dim=0) - 1
        run_start = torch.nonzero(starts).flatten()
        last = _last_query_by_run(plan.positions_WL, ids, run, run_start.numel())
        return StepGeometry(plan, ids, doc_starts(ids), plan.owner(), plan.local_index(), run, run_start, last)

    @property
    def world(self) -> int:
        return self.plan.world

    def need_at(self, positions: torch.Tensor) -> torch.Tensor:
        """``[W, n]`` bool: which ranks' queries see the keys at `positions` ``[n]``."""
        last = self.last_by_run.index_select(1, self.run.index_select(0, positions))
        return (positions.unsqueeze(0) <= last) & (self.doc_ids.index_select(0, positions) != 0).unsqueeze(0)

    @functools.cached_property
    def need_WS(self) -> torch.Tensor:
        """``[W, S_pad]`` bool, the whole need matrix (for tools and tests; planning uses `need_at`)."""
        return self.need_at(torch.arange(self.plan.padded_len))

    def pieces(self, rank: int) -> Pieces:
        """The query pieces of `rank`, in local order."""
        pos = self.plan.rank_positions(rank)
        ids = self.doc_ids[pos]
        new = torch.ones_like(ids, dtype=torch.bool)
        new[1:] = (ids[1:] != ids[:-1]) | (pos[1:] != pos[:-1] + 1)
        starts = torch.nonzero(new).flatten()
        lengths = torch.diff(starts, append=torch.tensor([pos.numel()]))
        real = ids[starts] != 0
        starts, lengths = starts[real], lengths[real]
        g0 = pos[starts]
        return Pieces(starts, lengths, g0, self.doc_start[g0])

    @functools.cached_property
    def longest_document(self) -> int:
        """Tokens in the longest document (0 when the row is all padding)."""
        lengths = torch.diff(self.run_start, append=torch.tensor([self.doc_ids.numel()]))
        real = self.doc_ids[self.run_start] != 0
        return int(lengths[real].max()) if bool(real.any()) else 0

    def needed_positions(self, rank: int) -> torch.Tensor:
        """Sorted positions whose keys `rank`'s queries see (owned ones included)."""
        last = self.last_by_run[rank]
        seen = last >= 0
        return concat_ranges(self.run_start[seen], last[seen] - self.run_start[seen] + 1)

    @functools.cached_property
    def gathered_row(self) -> torch.Tensor:
        """``[S_pad]``: each position's row in the rank-ordered concatenation of all shards."""
        return self.owner * self.plan.local_len + self.local_index

    @functools.cached_property
    def transfer(self) -> torch.Tensor:
        """``[W (dst), W (src)]`` int64: rows ``dst`` needs that ``src`` owns (0 on the diagonal).

        Counted from the ranges: src's sorted positions inside ``[start(d), last[dst, d]]``.
        """
        seen = self.last_by_run >= 0  # [W, runs]
        lo = self.run_start.expand_as(self.last_by_run)[seen]
        hi = self.last_by_run[seen] + 1
        dst = torch.arange(self.world).unsqueeze(1).expand_as(self.last_by_run)[seen]
        counts = []
        for positions in self.plan.positions_WL:
            inside = torch.searchsorted(positions, hi) - torch.searchsorted(positions, lo)
            counts.append(torch.zeros(self.world, dtype=torch.long).index_add_(0, dst, inside))
        return torch.stack(counts, dim=1).fill_diagonal_(0)


def _last_query_by_run(positions_WL: torch.Tensor, ids: torch.Tensor, run: torch.Tensor, runs: int) -> torch.Tensor:
    """``[W, runs]``: the last position of each run holding a real query of rank j (-1: none).

    Each rank's positions ascend, so its last position in a run is where the run changes.
    """
    flat = positions_WL.reshape(-1)
    run_WL = run.index_select(0, flat).reshape(positions_WL.shape)
    last_in_run = torch.ones_like(run_WL, dtype=torch.bool)
    last_in_run[:, :-1] = run_WL[:, 1:] != run_WL[:, :-1]
    keep = last_in_run & (ids.index_select(0, flat) != 0).reshape(positions_WL.shape)
    rank = torch.arange(positions_WL.shape[0]).unsqueeze(1).expand_as(positions_WL)
    last = torch.full((positions_WL.shape[0], runs), -1, dtype=torch.long)
    last[rank[keep], run_WL[keep]] = positions_WL[keep]
    return last
