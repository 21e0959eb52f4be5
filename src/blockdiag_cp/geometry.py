"""Step geometry: what every rank's queries see, derived once from replicated doc ids.

Every rank holds the same document ids and plan, so every rank derives the same
geometry (and therefore the same exchange routing) without a collective.

Note [Who needs which keys]
---------------------------
Position ``g`` of document ``d`` is needed by rank ``j`` iff ``j`` owns a real query
of ``d`` at a position ``>= g``. With ``last[j, d]`` = the last position of ``d``
that ``j`` owns, ``need[j, g] = g <= last[j, doc(g)]``: one scatter-max and one
gather, vectorized over all ranks and positions.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .doc_ids import doc_starts, run_starts
from .layout.plan import ShardPlan, pad_doc_ids


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
        need_WS: ``[W, S_pad]`` bool, Note [Who needs which keys].
    """

    plan: ShardPlan
    doc_ids: torch.Tensor
    doc_start: torch.Tensor
    owner: torch.Tensor
    local_index: torch.Tensor
    need_WS: torch.Tensor

    @staticmethod
    def build(plan: ShardPlan, doc_ids_S: torch.Tensor) -> "StepGeometry":
        ids = pad_doc_ids(doc_ids_S.reshape(-1).cpu().long(), plan.padded_len)
        owner = plan.owner()
        return StepGeometry(plan, ids, doc_starts(ids), owner, plan.local_index(), _need(ids, owner, plan.world))

    @property
    def world(self) -> int:
        return self.plan.world

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
        starts = torch.nonzero(run_starts(self.doc_ids)).flatten()
        lengths = torch.diff(starts, append=torch.tensor([self.doc_ids.numel()]))
        real = self.doc_ids[starts] != 0
        return int(lengths[real].max()) if bool(real.any()) else 0

    def needed_positions(self, rank: int) -> torch.Tensor:
        """Sorted positions whose keys `rank`'s queries see (owned ones included)."""
        return torch.nonzero(self.need_WS[rank]).flatten()

    @functools.cached_property
    def gathered_row(self) -> torch.Tensor:
        """``[S_pad]``: each position's row in the rank-ordered concatenation of all shards."""
        return self.owner * self.plan.local_len + self.local_index

    @functools.cached_property
    def transfer(self) -> torch.Tensor:
        """``[W (dst), W (src)]`` int64: rows ``dst`` needs that ``src`` owns (0 on the diagonal)."""
        W = self.world
        flat = self.owner.unsqueeze(0) + W * torch.arange(W).unsqueeze(1)
        counts = torch.bincount(flat[self.need_WS], minlength=W * W).reshape(W, W)
        return counts.fill_diagonal_(0)


def _need(ids: torch.Tensor, owner: torch.Tensor, world: int) -> torch.Tensor:
    """``[W, S_pad]`` bool need matrix (Note [Who needs which keys])."""
    run = torch.cumsum(run_starts(ids).long(), dim=0) - 1
    n_runs = int(run[-1]) + 1
    pos = torch.arange(ids.numel())
    last = torch.full((world * n_runs,), -1, dtype=torch.long)
    real = ids != 0
    slot = owner * n_runs + run
    last.scatter_reduce_(0, slot[real], pos[real], reduce="amax")
    last_by_run = last.reshape(world, n_runs)  # [W, runs of the row]
    return (pos.unsqueeze(0) <= last_by_run[:, run]) & real.unsqueeze(0)
