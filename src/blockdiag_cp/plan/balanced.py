"""The balanced layout: equal tokens *and* equal causal attention work on every rank.

Note [Balanced planner: fold a work-sorted chunk order]
-------------------------------------------------------
The work of a query is the number of keys it sees, ``w = offset in document + 1``;
padding has ``w = 0``. Contiguous shards are equal in tokens but not in work (the
rank holding a long document's tail does most of it). Zigzag fixes one document by
pairing a light head chunk with a heavy tail chunk, but needs every document
padded to a multiple of ``2 * cp``. This planner needs no per-document padding:

1. Cut every document into chunks of ``c`` tokens and order all chunks by their
   index inside their document, then by the document's length, then by position:
   all first chunks (shortest documents first), then all second chunks, ...
   Padding comes first. Along this order ``w`` is non-decreasing up to the band
   ``c``, the mean ``w`` of whole short documents grows with their length, and
   chunks of one document that stay neighbours in this order are neighbours in the
   row.

       row:    [A0 A1 A2 A3][B0 B1][C0]      (Xk = chunk k of document X)
       order:   pad  C0 B0 A0  B1 A1  A2  A3
                light ----------------> heavy

2. Fold the order like zigzag: rank r takes ``x_r`` tokens from the front of what
   is left and ``L - x_r`` from the back, with ``x_r`` chosen so its work is the
   remaining work divided by the remaining ranks. Because the order is (nearly)
   sorted, the front is lighter and the back heavier than that target, so such an
   ``x_r`` exists; among near-equal choices the planner prefers cuts at document
   or chunk edges (fewer, longer pieces).

       order:  [r0 | r1 | r2 | ...  middle  ... | r2 | r1 | r0]

3. If some rank is off the mean by more than the tolerance, halve ``c`` (a finer,
   more exactly sorted order) and fold again. ``c`` starts at ``L``, so one long
   document gets the classic two pieces per rank.

4. Count what the fused kernels pay, not only pairs (Note [Kernel-aware work]).

Only the total is padded, to the next multiple of ``world``. Deterministic: no
randomness, ties broken by position. Cost ``O(S log S)`` per attempt (numpy).

Note [Kernel-aware work]
------------------------
Equal pairs are not equal time. A rank's queries whose document began on another
rank see those earlier keys as a rectangle (no mask: every pair is used), the rest as
causal squares, whose diagonal tiles the fused kernels compute whole and then mask.
Measured with torch's fused CPU kernel (``python benchmarks/pair_cost.py``, 8 heads of
64, fp32, forward + backward), a pair of a rectangle of 768-2048 queries cost 0.56-0.93
of a pair in a causal square of the same length (1.00 at 4096 x 4096): the planner
uses 0.88 (`RECTANGLE_PAIR_COST`). Shorter pieces run in smaller query blocks, whose
cost per pair swings with their length; they count as pairs (`RECTANGLE_MIN_QUERIES`).
On the 300-document power-law row (shape 1.3, cp = 2) the pair-balanced plan gave one
rank a long document's tail (13.5M rectangle pairs) and the other the squares of the
long documents: equal pairs, and the second rank's kernels ran 6-11% longer.

So after the pair-balanced fold the planner folds the same chunk order again, each
query weighted by what it costs inside its piece of the current plan (``(t - s + 1) +
rho * s`` for a query at offset ``t`` of a piece of >= 768 queries starting at document
offset ``s``), and keeps the plan whose kernel work is the most even: two more folds at
most, never a plan less even in kernel work than the pair-balanced one. Rows whose
documents are all whole on their ranks have no rectangles: their plan is the
pair-balanced one. Per-row costs (the kernels' fixed work per query row) are the same
on every rank (``L`` rows each) and cancel. The model is the CPU kernel's; on CUDA the
tiles differ, and it is not measured there yet (no device lent).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from .runs import run_starts
from .options import PlanOptions
from .shard_plan import ShardPlan, pad_doc_ids, query_work
from .step_costs import RECTANGLE_MIN_QUERIES, RECTANGLE_PAIR_COST

#: Target: every rank's work within this fraction of the mean.
BALANCE_TOLERANCE = 0.05
#: Among fold points whose work is this close to the target, prefer clean cuts.
_NEAR_TARGET = 0.005
#: Folds with kernel-aware weights after the pair-balanced one.
_KERNEL_FOLDS = 2


def plan_balanced(doc_ids_S: torch.Tensor, world: int, options: Optional[PlanOptions] = None,
                  kernel_folds: int = _KERNEL_FOLDS) -> ShardPlan:
    """Plan equal-token, equal-work shards (Note [Balanced planner]); work under ``options.window`` if given.
    `kernel_folds`: folds with kernel-aware weights after the pair-balanced one (0: pairs only)."""
    window = None if options is None else options.window
    S = doc_ids_S.numel()
    L = -(-S // world)
    ids = pad_doc_ids(doc_ids_S, L * world)
    offset = query_work(ids).numpy() - 1  # position inside the document (-1 for padding)
    work = query_work(ids, window).numpy()
    length = _document_lengths(ids)
    best, best_spread, best_order = None, float("inf"), None
    chunk = max(1, L)
    while True:
        order = _chunk_order(offset, length, chunk)
        assignment = _fold(order, work, world, L)
        spread = _spread(assignment, work)
        if spread < best_spread:
            best, best_spread, best_order = assignment, spread, order
        if best_spread <= BALANCE_TOLERANCE or chunk == 1:
            break
        chunk //= 2
    if window is None and kernel_folds > 0:
        best = _kernel_aware(best, best_order, offset, world, L, kernel_folds)
    positions = torch.from_numpy(np.sort(best, axis=1))
    return ShardPlan.from_rows("balanced", S, positions)


def _kernel_aware(assignment: np.ndarray, order: np.ndarray, offset: np.ndarray, world: int, L: int,
                  folds: int) -> np.ndarray:
    """Fold the pair-balanced plan's chunk `order` again with each query weighted by its kernel cost in the
    current plan's pieces; return the plan whose kernel work is the most even (Note [Kernel-aware work])."""
    best, best_spread = assignment, _spread(assignment, kernel_work(assignment, offset))
    for _ in range(folds):
        if best_spread <= 0.0:
            break
        candidate = _fold(order, kernel_work(best, offset), world, L)
        spread = _spread(candidate, kernel_work(candidate, offset))
        if spread >= best_spread:
            break
        best, best_spread = candidate, spread
    return best


def kernel_work(assignment: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """``[S_pad]`` float: each query's kernel cost in pair units under `assignment` ``[W, L]``: its keys
    inside its piece at 1, the keys before its piece (a rectangle) at `RECTANGLE_PAIR_COST` when the piece
    has at least `RECTANGLE_MIN_QUERIES` queries (at 1 otherwise); 0 for padding."""
    start, length = pieces_of(assignment, offset)
    rate = np.where(length >= RECTANGLE_MIN_QUERIES, RECTANGLE_PAIR_COST, 1.0)
    cost = (offset - start + 1) + rate * start
    return np.where(offset < 0, 0.0, cost)


def pieces_of(assignment: np.ndarray, offset: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``([S_pad], [S_pad])``: for each position, the document offset of the first query of its piece
    (the run of consecutive positions of one document on one rank that holds it) and the piece's length."""
    positions = np.sort(assignment, axis=1)
    off = offset[positions]  # [W, L]
    starts = np.ones_like(off, dtype=bool)
    starts[:, 1:] = (positions[:, 1:] != positions[:, :-1] + 1) | (off[:, 1:] != off[:, :-1] + 1) | (off[:, 1:] == 0)
    index = np.arange(off.shape[1])
    run_first = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    ends = np.ones_like(starts)  # the last row of each run
    ends[:, :-1] = starts[:, 1:]
    run_last = np.minimum.accumulate(np.where(ends, index, off.shape[1])[:, ::-1], axis=1)[:, ::-1]
    start, length = np.empty_like(offset), np.empty_like(offset)
    start[positions] = np.take_along_axis(off, run_first, axis=1)
    length[positions] = run_last - run_first + 1
    return start, length


def _document_lengths(ids: torch.Tensor) -> np.ndarray:
    """``[S_pad]``: the length of each position's document (or padding run)."""
    run = torch.cumsum(run_starts(ids).long(), dim=0) - 1
    return torch.bincount(run)[run].numpy()


def _chunk_order(offset: np.ndarray, length: np.ndarray, chunk: int) -> np.ndarray:
    """Positions ordered by (chunk index inside the document, document length, position); padding first."""
    chunk_index = np.where(offset < 0, -1, offset // chunk)
    return np.lexsort((np.arange(offset.size), length, chunk_index))


def _clean_cuts(order: np.ndarray) -> np.ndarray:
    """``[S_pad + 1]`` bool: cutting the order before index i splits no run of the row."""
    clean = np.ones(order.size + 1, dtype=bool)
    clean[1:-1] = order[1:] != order[:-1] + 1
    return clean


def _fold(order: np.ndarray, work: np.ndarray, world: int, L: int) -> np.ndarray:
    """``[world, L]`` positions: rank r takes x_r from the front and L - x_r from the back."""
    prefix = np.concatenate([[0], np.cumsum(work[order], dtype=np.int64)])
    clean = _clean_cuts(order)
    lo, hi = 0, order.size
    ranks = np.empty((world, L), dtype=np.int64)
    for r in range(world):
        x = _choose_split(prefix, clean, lo, hi, L, world - r)
        ranks[r] = np.concatenate([order[lo : lo + x], order[hi - (L - x) : hi]])
        lo, hi = lo + x, hi - (L - x)
    return ranks


def _choose_split(prefix: np.ndarray, clean: np.ndarray, lo: int, hi: int, L: int, ranks_left: int) -> int:
    """Front size x in [0, L] whose work is closest to the remaining average.

    Among x within `_NEAR_TARGET` of the best, prefer cuts that split no run, then
    a single piece (x == 0 or x == L), then the smallest x.
    """
    target = (prefix[hi] - prefix[lo]) / ranks_left
    x = np.arange(L + 1)
    got = (prefix[lo + x] - prefix[lo]) + (prefix[hi] - prefix[hi - L + x])
    miss = np.abs(got - target)
    near = miss <= miss.min() + _NEAR_TARGET * max(target, 1.0)
    dirty = (~clean[lo + x]).astype(np.int64) + (~clean[hi - L + x]).astype(np.int64)
    dirty[0] = int(not clean[hi - L])
    dirty[L] = int(not clean[lo + L])
    cost = np.where(near, dirty * 4 + np.where((x == 0) | (x == L), 0, 1), np.iinfo(np.int64).max)
    return int(np.argmin(cost))


def _spread(assignment: np.ndarray, work: np.ndarray) -> float:
    """Largest relative deviation of a rank's work from the mean (0 for no work)."""
    per_rank = work[assignment].sum(axis=1)
    mean = per_rank.mean()
    return 0.0 if mean == 0 else float(np.abs(per_rank - mean).max() / mean)
