"""Whole batches from document lengths: rows packed as trainers pack them, fixed rows against the grouped plan.

Note [Projecting a whole-batch step]
------------------------------------
A trainer packs documents into rows of ``row_len`` tokens (TRL's best-fit decreasing: longest
first, each into the row with the least room that fits it; a document longer than a row is
cut into rows), shuffles the rows, and gives each of the ``dp`` replicas one row per micro-batch.
With *fixed rows* each replica's row runs on its own CP group of ``cp`` ranks, and the step
lasts as long as the heaviest row: ``max over rows of work(row) / cp`` -- credited here with a
perfect balance inside each row and free links, the best any layout can do with fixed rows, so
the gain measured against it is a lower bound. The *grouped* plan places the micro-batch's
documents over all ``dp x cp`` ranks (Note [Grouped planner]); its step is its slowest rank's
modeled seconds, links included. The *ideal* is the micro-batch's work divided by the ranks.
Work follows `StepCosts` (Note [The step's cost model]): a fixed row's is `StepCosts.row_seconds`.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .grouped import Placement, place_runs
from .options import PlanOptions
from .step_costs import StepCosts


def pack_rows(lengths: Sequence[int], row_len: int) -> list[np.ndarray]:
    """Best-fit decreasing: documents (longest first) into the row with the least room that fits; a document
    longer than `row_len` is cut into `row_len` pieces first. Rows in the order they were opened."""
    pieces: list[int] = []
    for n in (int(v) for v in lengths):
        if n < 1:
            raise ValueError(f"document lengths must be positive, got {n}")
        pieces += [row_len] * (n // row_len) + ([n % row_len] if n % row_len else [])
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (room left, row) ascending
    for n in sorted(pieces, reverse=True):
        at = bisect.bisect_left(room, (n, -1))
        if at == len(room):
            rows.append([n])
            left = (row_len - n, len(rows) - 1)
        else:
            left_room, row = room.pop(at)
            rows[row].append(n)
            left = (left_room - n, row)
        if left[0] > 0:
            bisect.insort(room, left)
    return [np.array(r, dtype=np.int64) for r in rows]


def micro_batches(rows: list[np.ndarray], dp: int, seed: int = 0) -> list[list[np.ndarray]]:
    """The rows shuffled (as a sampler does) and dealt `dp` to a micro-batch (an incomplete last one dropped)."""
    order = np.random.default_rng(seed).permutation(len(rows))
    shuffled = [rows[i] for i in order]
    return [shuffled[i : i + dp] for i in range(0, len(shuffled) - dp + 1, dp)]


@dataclass(frozen=True)
class Projection:
    """One micro-batch's modeled step under fixed rows and under the grouped plan (Note [Projecting ...]).

    Attributes:
        fixed_seconds: the heaviest row's work over its cp ranks.
        grouped: the grouped plan's placement (per-rank seconds, tokens, bytes).
        plan_seconds: how long planning took (wall clock, this process).
    """

    fixed_seconds: float
    grouped: Placement
    plan_seconds: float

    @property
    def speedup(self) -> float:
        return self.fixed_seconds / self.grouped.step_seconds

    @property
    def of_ideal(self) -> float:
        return self.grouped.step_seconds / self.grouped.ideal


def project(batch: list[np.ndarray], cp: int, options: PlanOptions) -> Projection:
    """Fixed rows against the grouped plan of one micro-batch (`batch`: each replica's row of lengths)."""
    costs = options.costs or StepCosts()
    fixed = max(costs.row_seconds(row, options.window) for row in batch) / cp
    lengths = np.concatenate(batch)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    t0 = time.perf_counter()
    placement = place_runs(starts, lengths, np.ones(lengths.size, bool), len(batch) * cp, options)
    return Projection(fixed, placement, time.perf_counter() - t0)
