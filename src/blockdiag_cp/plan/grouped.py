"""The grouped layout: each document on the fewest nearby ranks its work needs, modeled time balanced.

Note [Grouped planner]
----------------------
The balanced layout spreads every document over every rank of the group: exact balance,
but at a world of 1024 a 200-token document is cut into pieces on ranks of many nodes and
every layer exchanges its keys. The grouped planner plans a whole global batch (every dp
replica's rows concatenated) over all ranks from the *lengths* of its documents, with the
step's cost model (Note [The step's cost model] in step_costs.py):

1. Every document's work, whole: ``c = token_seconds l + pair_seconds pairs(l) + piece_seconds``
   (`StepCosts.document_seconds`); the target per rank is ``tau = sum c / W`` (the ideal step) and the token cap ``1.25 x`` the
   mean tokens per rank (`token_cap`, memory).
2. At a *grain* ``theta``, a document gets ``g = max(ceil(c / (theta tau)), ceil(l / cap))``
   ranks (at most ``min(W, l)``, and at most a node's when ``ceil(c / tau)`` ranks fit in one):
   short ones ``g = 1`` stay whole, long ones get a group sized to their work. Inside a group
   the document is cut as the balanced layout cuts one long document: ``2g`` chunks, member ``m`` holding chunks ``m`` and ``2g - 1 - m`` (head and
   tail), so every member has the same tokens and the same kernel work, rectangles
   included. Under a sliding window the cut is ``g`` contiguous chunks of equal work.
3. Groups are placed largest first on ``g`` consecutive ranks inside one node (``g`` <=
   `ranks_per_node`), else on whole nodes from a node's first rank: the window of ranks
   whose busiest member would be least loaded, under the token cap. Each member's K/V
   traffic (the rows its peers need, and back as gradients) counts at the intra- or
   inter-node speed, less what hides behind the attention over its own keys.
4. Whole documents go largest first to the least loaded rank with room under the cap
   (LPT), then single documents move from the busiest rank to the least busy while that
   shortens the step. Padding (it costs tokens, no attention, and may go anywhere) fills
   last, up to a common level of modeled time under the cap (water-filling).
5. Grains 1, 1/2 and 1/4 are tried; the plan with the shortest modeled step wins (ties: the
   coarser grain, fewer cuts). A finer grain cuts more documents and balances finer; a
   document under a quarter of a rank's work is never cut (unless it exceeds the token cap).

Everything runs on run lengths (numpy); positions are materialized once, at the end.
Deterministic: ties break by position and rank.

The parts: this module drafts and finishes plans (steps 1, 2's sizes, 5); groups.py cuts and
costs groups and their links (steps 2-3, `GroupCutter`); loads.py holds the ranks' loads and
the moves on them (steps 3-4, `Loads`); every cost is a `StepCosts` method (step_costs.py).

Note [Unequal shards]
---------------------
Equal tokens per rank is not a goal here: a rank holding a piece of a long document has
many pairs per token, one holding short documents few, so equal modeled time means
unequal tokens. The plan's ranks own different numbers of positions (`ShardPlan.local_lens`),
bounded by the token cap; every rank owns at least one (a padding position when the batch
has fewer tokens than ranks). The step runs such plans as they are: needed-only exchanges
move rows by count, the all-gather exchange pads each rank's rows to the longest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from .groups import GroupCutter
from .loads import Loads
from .options import PlanOptions
from .runs import run_starts
from .shard_plan import Segments, ShardPlan
from .step_costs import StepCosts

#: grains tried, coarse to fine (Note [Grouped planner], step 5)
GRAINS = (1.0, 0.5, 0.25)
#: stop trying finer grains once a draft's modeled step is this close to the ideal
GOOD_ENOUGH = 1.01
#: the best drafts that get their group cuts and documents settled (Note [Grouped planner], step 4): all three
POLISHED = 3


@dataclass(frozen=True)
class Placement:
    """Where every run of a row goes, and what each rank then costs (all numpy, ``[W]`` per rank).

    Attributes:
        start, length, rank: ``[P]`` int64: the pieces, a run of positions each, and their rank.
        tokens: positions per rank.
        compute: modeled seconds of compute per rank.
        exposed: link seconds per rank not hidden behind its own-key attention.
        intra_bytes, inter_bytes: K/V bytes each rank sends per step (forward + backward).
        ideal: ``sum of compute with every document whole / W``.
        grain: the grain of the chosen plan; split_documents: documents cut over several ranks.
    """

    start: np.ndarray
    length: np.ndarray
    rank: np.ndarray
    tokens: np.ndarray
    compute: np.ndarray
    exposed: np.ndarray
    intra_bytes: np.ndarray
    inter_bytes: np.ndarray
    ideal: float
    grain: float
    split_documents: int

    @property
    def seconds(self) -> np.ndarray:
        """``[W]`` modeled seconds per rank (compute + exposed links)."""
        return self.compute + self.exposed

    @property
    def step_seconds(self) -> float:
        return float(self.seconds.max())

    def shard_plan(self, seq_len: int) -> ShardPlan:
        """The `ShardPlan`: each rank's pieces in position order (padding positions beyond `seq_len`)."""
        runs = Segments.of(self.start, self.length, self.rank, self.tokens.size)
        return ShardPlan.of_runs("grouped", seq_len, runs, self.tokens.size)


def plan_grouped(doc_ids_S: torch.Tensor, world: int, options: Optional[PlanOptions] = None) -> ShardPlan:
    """The grouped plan of a row ``[S]`` (Note [Grouped planner]); an empty rank gets one padding position."""
    options = PlanOptions() if options is None else options
    starts, lengths, real = row_runs(doc_ids_S)
    return place_runs(starts, lengths, real, world, options).shard_plan(doc_ids_S.numel())


def row_runs(doc_ids_S: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(start, length, real)`` of each run of the row (a document, or a run of padding), in order."""
    ids = doc_ids_S.reshape(-1).cpu()
    starts = torch.nonzero(run_starts(ids)).flatten()
    lengths = torch.diff(starts, append=torch.tensor([ids.numel()]))
    return starts.numpy(), lengths.numpy(), (ids[starts] != 0).numpy()


def place_runs(starts: np.ndarray, lengths: np.ndarray, real: np.ndarray, world: int,
               options: PlanOptions) -> Placement:
    """Place runs (documents where `real`, padding elsewhere) on `world` ranks (Note [Grouped planner])."""
    if world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    problem = _Problem.of(np.asarray(starts, np.int64), np.asarray(lengths, np.int64), np.asarray(real, bool),
                          world, options)
    drafts = []
    for grain in GRAINS:
        drafts.append(problem.draft(grain))
        if drafts[-1].step <= GOOD_ENOUGH * problem.ideal or drafts[-1].split == problem.documents:
            break
    drafts.sort(key=lambda d: d.step)  # stable: the coarser grain first among equals
    best = None
    for draft in drafts[:POLISHED]:
        finished = problem.finish(draft)
        if best is None or finished.step_seconds < best.step_seconds:
            best = finished
        if best.step_seconds <= GOOD_ENOUGH * problem.ideal:
            break
    return best


@dataclass(frozen=True)
class _Problem:
    """One row's runs, their whole costs and the knobs: what every grain's placement starts from."""

    start: np.ndarray
    length: np.ndarray
    real: np.ndarray
    whole: np.ndarray  # [R] seconds of each run kept whole
    world: int
    cap: int
    costs: StepCosts
    cutter: GroupCutter

    @staticmethod
    def of(start, length, real, world: int, options: PlanOptions) -> "_Problem":
        costs = options.costs or StepCosts()
        whole = costs.document_seconds(length, options.window, real)
        cap = max(1, math.ceil(options.token_cap * float(length.sum()) / world))
        rpn = min(world, options.ranks_per_node or world)
        return _Problem(start, length, real, whole, world, cap, costs, GroupCutter(length, costs, options.window, rpn))

    @property
    def rpn(self) -> int:
        return self.cutter.ranks_per_node

    @property
    def documents(self) -> int:
        return int(self.real.sum())

    @property
    def ideal(self) -> float:
        return float(self.whole.sum()) / self.world

    def draft(self, grain: float) -> Loads:
        """Groups placed, whole documents dealt and moved (Note [Grouped planner], steps 2-4)."""
        W = self.world
        g = np.maximum(np.ceil(self.whole / (grain * self.ideal)) if self.ideal > 0 else 1,
                       np.ceil(self.length / self.cap)).astype(np.int64)
        fits_a_node = np.ceil(self.whole / self.ideal) <= self.rpn if self.ideal > 0 else np.ones_like(self.real)
        g = np.where(fits_a_node, np.minimum(g, self.rpn), g)  # a group crosses nodes only when its work needs it
        g = np.where(self.real, np.clip(g, 1, np.minimum(W, self.length)), 1)
        state = Loads(W, self.cap)
        groups = [self.cutter.cut(int(r), int(g[r])) for r in np.flatnonzero(g > 1)]
        groups.sort(key=lambda grp: (-grp.size, -float(grp.compute.max()), grp.run))
        for group in groups:
            state.place_group(self.cutter.place(group, state.best_window(group, self.rpn)))
        whole = (g == 1) & self.real
        items = (self.start[whole], self.length[whole])
        state.place_items(items, self.whole_item_seconds(items))
        state.refine(self.whole_item_seconds)
        state.grain = grain
        return state

    def finish(self, state: Loads) -> Placement:
        """A draft's group cuts and whole documents settled, padding filled: the placement."""
        for _ in range(3):  # whole documents and group cuts settle each other
            if not state.rebalance_groups(self.cutter, sweeps=2):
                break
            state.refine(self.whole_item_seconds)
        state.fill_padding(self.start[~self.real], self.length[~self.real], self.costs.token_seconds)
        end = int(self.start[-1] + self.length[-1]) if self.start.size else 0
        starts, lengths, ranks = state.pieces(self.start, end, self.costs.token_seconds)
        return Placement(starts, lengths, ranks, state.tokens.copy(), state.compute.copy(), state.exposed.copy(),
                         state.intra.copy(), state.inter.copy(), self.ideal, state.grain, len(state.groups))

    def whole_item_seconds(self, items: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        """Seconds of whole documents ``(start, length)``."""
        return self.costs.document_seconds(items[1], self.cutter.window)
