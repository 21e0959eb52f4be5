"""The grouped layout: each document on the fewest nearby ranks its work needs, modeled time balanced.

Note [Grouped planner]
----------------------
The balanced layout spreads every document over every rank of the group: exact balance,
but at a world of 1024 a 200-token document is cut into pieces on ranks of many nodes and
every layer exchanges its keys. The grouped planner plans a whole global batch (every dp
replica's rows concatenated) over all ranks from the *lengths* of its documents, with the
step's cost model (Note [The step's cost model] in step_costs.py):

1. Every document's work, whole: ``c = token_seconds l + pair_seconds pairs(l)``; the
   target per rank is ``tau = sum c / W`` (the ideal step) and the token cap ``1.25 x`` the
   mean tokens per rank (`token_cap`, memory).
2. At a *grain* ``theta``, a document gets ``g = max(ceil(c / (theta tau)), ceil(l / cap))``
   ranks (at most ``min(W, l)``, and at most a node's when ``ceil(c / tau)`` ranks fit in one):
   short ones ``g = 1`` stay whole, long ones get a group sized to their work. Inside a group the document is cut as the balanced layout cuts one long
   document: ``2g`` chunks, member ``m`` holding chunks ``m`` and ``2g - 1 - m`` (head and
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

import heapq
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from .ranges import concat_ranges
from .runs import run_starts
from .shard_plan import ShardPlan
from .options import PlanOptions
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
        order = np.lexsort((self.start, self.rank))
        positions = concat_ranges(torch.from_numpy(self.start[order]), torch.from_numpy(self.length[order]))
        lens = np.bincount(self.rank, weights=self.length, minlength=self.tokens.size).astype(np.int64)
        return ShardPlan("grouped", seq_len, int(lens.sum()), positions, tuple(int(n) for n in lens))


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


def pairs_before(offset: np.ndarray, window: Optional[int]) -> np.ndarray:
    """``F(n)``: query-key pairs of a document's first `n` queries (each sees its earlier keys and
    itself, at most `window`)."""
    n = offset.astype(np.float64)
    if window is None:
        return n * (n + 1) / 2
    w = float(window)
    return np.where(n <= w, n * (n + 1) / 2, w * (w + 1) / 2 + (n - w) * w)


@dataclass(frozen=True)
class _Group:
    """A document cut over ``g`` consecutive ranks: per member (``[g]``) its compute, tokens and own-key
    attention; ``traffic [g, g]`` the rows member i sends member j forward; its pieces (``member``,
    document offsets ``lo``, ``hi``)."""

    run: int
    compute: np.ndarray
    tokens: np.ndarray
    hide: np.ndarray
    traffic: np.ndarray
    member: np.ndarray
    lo: np.ndarray
    hi: np.ndarray

    @property
    def size(self) -> int:
        return self.compute.size


@dataclass(frozen=True)
class _Problem:
    """One row's runs, their whole costs and the knobs: what every grain's placement starts from."""

    start: np.ndarray
    length: np.ndarray
    real: np.ndarray
    whole: np.ndarray  # [R] seconds of each run kept whole
    world: int
    rpn: int
    cap: int
    costs: StepCosts
    window: Optional[int]

    @staticmethod
    def of(start, length, real, world: int, options: PlanOptions) -> "_Problem":
        costs = options.costs or StepCosts()
        pairs = np.where(real, pairs_before(length, options.window), 0.0)
        whole = costs.token_seconds * length + costs.pair_seconds * pairs + costs.piece_seconds * real
        cap = max(1, math.ceil(options.token_cap * float(length.sum()) / world))
        rpn = min(world, options.ranks_per_node or world)
        return _Problem(start, length, real, whole, world, rpn, cap, costs, options.window)

    @property
    def documents(self) -> int:
        return int(self.real.sum())

    @property
    def ideal(self) -> float:
        return float(self.whole.sum()) / self.world

    def draft(self, grain: float) -> "_Loads":
        """Groups placed, whole documents dealt and moved (Note [Grouped planner], steps 2-4)."""
        W = self.world
        g = np.maximum(np.ceil(self.whole / (grain * self.ideal)) if self.ideal > 0 else 1,
                       np.ceil(self.length / self.cap)).astype(np.int64)
        fits_a_node = np.ceil(self.whole / self.ideal) <= self.rpn if self.ideal > 0 else np.ones_like(self.real)
        g = np.where(fits_a_node, np.minimum(g, self.rpn), g)  # a group crosses nodes only when its work needs it
        g = np.where(self.real, np.clip(g, 1, np.minimum(W, self.length)), 1)
        state = _Loads(W, self.cap)
        groups = [self._group(int(r), int(g[r])) for r in np.flatnonzero(g > 1)]
        groups.sort(key=lambda grp: (-grp.size, -float(grp.compute.max()), grp.run))
        for group in groups:
            state.place_group(group, self._best_window(state, group), self)
        whole = (g == 1) & self.real
        items = (self.start[whole], self.length[whole])
        state.place_items(items, self.whole_item_seconds(items))
        state.refine(self.whole_item_seconds)
        state.grain = grain
        return state

    def finish(self, state: "_Loads") -> Placement:
        """A draft's group cuts and whole documents settled, padding filled: the placement."""
        for _ in range(3):  # whole documents and group cuts settle each other
            if not state.rebalance_groups(self, sweeps=2):
                break
            state.refine(self.whole_item_seconds)
        state.fill_padding(self.start[~self.real], self.length[~self.real], self.costs.token_seconds)
        return state.placement(self, state.grain, len(state.groups))

    def whole_item_seconds(self, items: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        """Seconds of whole documents ``(start, length)``."""
        lengths = items[1]
        return (self.costs.token_seconds * lengths + self.costs.pair_seconds * pairs_before(lengths, self.window)
                + self.costs.piece_seconds)

    def _group(self, run: int, g: int, tokens: Optional[np.ndarray] = None, traffic: bool = True) -> _Group:
        """Cut run `run` over `g` members holding `tokens[m]` tokens each (default: equal work), as head and tail
        chunks (Note [Grouped planner], step 2; contiguous chunks under a window), and cost each member."""
        length = int(self.length[run])
        if tokens is None:
            tokens = np.diff(self._equal_work_cuts(length, g)) if self.window is not None else _even(length, g)
        if self.window is None and bool((tokens >= 2).all()):
            heads = tokens // 2
            sizes = np.concatenate([heads, (tokens - heads)[::-1]])
            chunk_member = np.concatenate([np.arange(g), np.arange(g)[::-1]])
        else:
            sizes, chunk_member = tokens, np.arange(g)
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        lo, hi, member = _merge_adjacent(bounds[:-1], bounds[1:], chunk_member)
        return self._cost_group(run, g, lo, hi, member, traffic)

    def _cost_group(self, run: int, g: int, lo: np.ndarray, hi: np.ndarray, member: np.ndarray,
                    traffic: bool = True) -> _Group:
        """Each member's compute, tokens and own-key attention, and (`traffic`) the rows members send each other."""
        costs = self.costs
        n = (hi - lo).astype(np.float64)
        if self.window is None:
            rate = np.where(n >= costs.rectangle_min_queries, costs.rectangle_factor, 1.0)
            pairs = n * (n + 1) / 2 + rate * n * lo
            own = n * (n + 1) / 2
        else:
            pairs = pairs_before(hi, self.window) - pairs_before(lo, self.window)
            own = pairs_before(n, self.window)
        seconds = (costs.token_seconds * n + costs.pair_seconds * pairs + costs.carry_seconds * n * (lo > 0)
                   + costs.piece_seconds)
        per_member = lambda x: np.bincount(member, weights=x, minlength=g)  # noqa: E731
        rows = _group_traffic(lo, hi, member, g, self.window) if traffic else np.zeros((g, g))
        return _Group(run, per_member(seconds), per_member(n).astype(np.int64), costs.pair_seconds * per_member(own),
                      rows, member, lo, hi)

    def recut(self, group: _Group, other: np.ndarray, iterations: int = 3) -> Optional[_Group]:
        """`group` cut again so that ``other + member compute`` is as even as its work allows (`other`: ``[g]``
        the members' ranks' seconds without it), or None when the even cut is already right. Token counts
        follow the target work by fixed-point steps (a member's work grows about linearly with its tokens)."""
        total = float(group.compute.sum())
        level = _level(other, total)
        target = np.maximum(level - other, 0.0)
        if np.abs(target - group.compute).max() <= 1e-3 * total / group.size:
            return None
        length, g = int(self.length[group.run]), group.size
        least = 2 if self.window is None and length >= 2 * g else 1
        tokens = group.tokens.astype(np.float64)
        recut = group
        for _ in range(iterations):
            tokens = tokens * np.where(recut.compute > 0, target / np.maximum(recut.compute, 1e-300), 1.0)
            counts = _round_to(np.maximum(tokens, least), length, least)
            recut = self._group(group.run, g, counts, traffic=False)
            tokens = counts.astype(np.float64)
        return self._group(group.run, g, counts)

    def _equal_work_cuts(self, length: int, g: int) -> np.ndarray:
        """``[g + 1]`` offsets cutting a document into `g` contiguous chunks of equal work (each >= 1 token)."""
        work = self.costs.token_seconds * np.arange(length + 1) + self.costs.pair_seconds * pairs_before(
            np.arange(length + 1), self.window)
        targets = work[-1] * np.arange(1, g) / g
        inner = np.searchsorted(work, targets)
        inner = np.clip(inner, np.arange(1, g), length - g + np.arange(1, g))  # every chunk keeps a token
        inner = np.maximum.accumulate(np.maximum(inner, np.arange(1, g)))
        return np.concatenate([[0], inner, [length]])

    def _best_window(self, state: "_Loads", group: _Group) -> int:
        """The first rank of the `group.size` consecutive ranks the group goes to (Note [Grouped planner], 3)."""
        g, W, rpn = group.size, self.world, self.rpn
        s = np.arange(W - g + 1)
        starts = s[(s // rpn) == ((s + g - 1) // rpn)] if g <= rpn else s[s % rpn == 0]
        if starts.size == 0:
            starts = np.array([W - g])
        busiest = np.full(starts.size, -np.inf)
        load = np.zeros(starts.size)
        over = np.zeros(starts.size, dtype=np.int64)
        for m in range(g):  # one pass per member over every candidate window (g small, W large)
            at = starts + m
            busiest = np.maximum(busiest, state.seconds[at] + group.compute[m])
            load += state.seconds[at]
            over += np.maximum(state.tokens[at] + group.tokens[m] - self.cap, 0)
        order = np.lexsort((starts, load, busiest, over))
        return int(starts[order[0]])

    def link_seconds(self, group: _Group, first: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``[g]`` each member's exposed link seconds and its intra- and inter-node bytes at ranks from `first`."""
        node = (first + np.arange(group.size)) // self.rpn
        both = (group.traffic + group.traffic.T) * self.costs.kv_bytes_per_token  # forward and gradients back
        across = node[:, None] != node[None, :]
        inter = (both * across).sum(axis=1)
        intra = both.sum(axis=1) - inter
        link = intra / (self.costs.intra_gbps * 1e9) + inter / (self.costs.inter_gbps * 1e9)
        return np.maximum(link - group.hide, 0.0), intra, inter


@dataclass
class _Placed:
    """A group where it was placed: its first rank, and each member's exposed link seconds and bytes."""

    group: _Group
    first: int
    exposed: np.ndarray
    intra: np.ndarray
    inter: np.ndarray

    @property
    def ranks(self) -> np.ndarray:
        return self.first + np.arange(self.group.size)


class _Loads:
    """The ranks' loads while a placement is built: seconds, tokens, link bytes, the groups and whole documents."""

    def __init__(self, world: int, cap: int) -> None:
        self.cap = cap
        self.seconds = np.zeros(world)
        self.compute = np.zeros(world)
        self.exposed = np.zeros(world)
        self.tokens = np.zeros(world, dtype=np.int64)
        self.intra = np.zeros(world)
        self.inter = np.zeros(world)
        self.groups: list[_Placed] = []
        self.items: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]] = None  # whole documents: start, length, rank
        self.padding: tuple[np.ndarray, np.ndarray, np.ndarray] = (np.zeros(0, np.int64),) * 3
        self.grain = 1.0

    @property
    def step(self) -> float:
        return float(self.seconds.max())

    @property
    def split(self) -> int:
        return len(self.groups)

    def place_group(self, group: _Group, first: int, problem: "_Problem") -> None:
        placed = _Placed(group, first, *problem.link_seconds(group, first))
        self.groups.append(placed)
        self._add(placed, 1)

    def _add(self, placed: _Placed, sign: int) -> None:
        ranks, group = placed.ranks, placed.group
        self.compute[ranks] += sign * group.compute
        self.exposed[ranks] += sign * placed.exposed
        self.seconds[ranks] += sign * (group.compute + placed.exposed)
        self.tokens[ranks] += sign * group.tokens
        self.intra[ranks] += sign * placed.intra
        self.inter[ranks] += sign * placed.inter

    def rebalance_groups(self, problem: "_Problem", sweeps: int = 3) -> None:
        """Re-cut each group so that its members' ranks end as even as its work allows (Note [Grouped planner],
        step 4): a member on a busier rank holds fewer tokens. Kept only where the busiest member gets faster.
        Returns whether any group was cut again."""
        changed = False
        for _ in range(sweeps):
            moved = False
            mean, peak = float(self.seconds.mean()), float(self.seconds.max())
            hot = mean + 0.25 * (peak - mean)  # only groups with a member on a rank near the busiest
            for index in sorted(range(len(self.groups)), key=lambda i: -float(self.groups[i].group.compute.sum())):
                placed = self.groups[index]
                if self.seconds[placed.ranks].max() <= hot:
                    continue
                self._add(placed, -1)
                other = self.seconds[placed.ranks]
                recut = problem.recut(placed.group, other)
                if recut is not None:
                    candidate = _Placed(recut, placed.first, *problem.link_seconds(recut, placed.first))
                    before = (other + placed.group.compute + placed.exposed).max()
                    tokens = self.tokens[placed.ranks] + recut.tokens  # (the group is out of the loads here)
                    capped = bool((tokens <= max(self.cap, int((tokens - recut.tokens + placed.group.tokens).max()))).all())
                    if capped and (other + recut.compute + candidate.exposed).max() < before * (1 - 1e-6):
                        placed = self.groups[index] = candidate
                        moved = changed = True
                self._add(placed, 1)
            if not moved:
                break
        return changed

    def place_items(self, items: tuple[np.ndarray, np.ndarray], seconds: np.ndarray) -> None:
        """Largest first, each to the least loaded rank with room under the cap (else the most room)."""
        starts, lengths = items
        order = np.lexsort((starts, -seconds))
        rank_of = np.empty(starts.size, dtype=np.int64)
        heap = [(float(t), r) for r, t in enumerate(self.seconds)]
        heapq.heapify(heap)
        tokens = self.tokens
        for i in order.tolist():
            n, skipped, chosen = int(lengths[i]), [], None
            while heap and len(skipped) < 64:
                t, r = heapq.heappop(heap)
                if tokens[r] + n <= self.cap:
                    chosen = r
                    break
                skipped.append((t, r))
            if chosen is None:
                chosen = int(np.argmin(tokens)) if tokens.min() + n > self.cap else int(np.flatnonzero(
                    tokens + n <= self.cap)[np.argmin(self.seconds[tokens + n <= self.cap])])
                skipped = [(t, r) for t, r in skipped if r != chosen]
                heap = [(t, r) for t, r in heap if r != chosen]
                heapq.heapify(heap)
            for entry in skipped:
                heapq.heappush(heap, entry)
            rank_of[i] = chosen
            self.seconds[chosen] += seconds[i]
            self.compute[chosen] += seconds[i]
            tokens[chosen] += n
            heapq.heappush(heap, (float(self.seconds[chosen]), chosen))
        self.items = (starts, lengths, rank_of)

    def refine(self, item_seconds, rounds: Optional[int] = None, partners: int = 8) -> None:
        """While the step shortens: move one whole document from the busiest rank to a less busy one, or swap
        one of its documents with a smaller one of the `partners` least busy ranks."""
        starts, lengths, rank_of = self.items
        seconds = item_seconds((starts, lengths))
        by_rank: list[list[int]] = [[] for _ in range(self.seconds.size)]
        for i, r in enumerate(rank_of.tolist()):
            by_rank[r].append(i)
        for _ in range(4 * self.seconds.size if rounds is None else rounds):
            hi = int(np.argmax(self.seconds))
            mine = np.array(by_rank[hi], dtype=np.int64)
            move = None if mine.size == 0 else self._best_move(hi, mine, by_rank, seconds, lengths, partners)
            if move is None:
                return
            i, j, lo = move  # item i from hi to lo, and item j (or -1) back
            for item, src, dst in ((i, hi, lo), (j, lo, hi)):
                if item < 0:
                    continue
                by_rank[src].remove(item)
                by_rank[dst].append(item)
                rank_of[item] = dst
                for r, sign in ((src, -1), (dst, 1)):
                    self.seconds[r] += sign * seconds[item]
                    self.compute[r] += sign * seconds[item]
                    self.tokens[r] += sign * lengths[item]

    def _best_move(self, hi: int, mine: np.ndarray, by_rank, seconds, lengths, partners: int):
        """``(item from hi, item back or -1, partner rank)`` that lowers the pair's busier side most, or None."""
        best, best_peak = None, self.seconds[hi] * (1 - 1e-12)
        for lo in np.argsort(self.seconds, kind="stable")[:partners].tolist():
            gap = self.seconds[hi] - self.seconds[lo]
            if lo == hi or gap <= 0:
                continue
            theirs = np.array([-1] + by_rank[lo], dtype=np.int64)
            back_s = np.where(theirs >= 0, seconds[theirs], 0.0)
            back_n = np.where(theirs >= 0, lengths[theirs], 0)
            delta = seconds[mine][:, None] - back_s[None, :]  # [mine, theirs]: what leaves hi
            room = (self.tokens[lo] + lengths[mine][:, None] - back_n[None, :] <= self.cap) & (
                self.tokens[hi] - lengths[mine][:, None] + back_n[None, :] <= self.cap)
            peak = np.maximum(self.seconds[hi] - delta, self.seconds[lo] + delta)
            peak = np.where((delta > 0) & room, peak, np.inf)
            a, b = np.unravel_index(int(np.argmin(peak)), peak.shape)
            if peak[a, b] < best_peak:
                best, best_peak = (int(mine[a]), int(theirs[b]), lo), float(peak[a, b])
        return best

    def fill_padding(self, starts: np.ndarray, lengths: np.ndarray, token_seconds: float) -> None:
        """Give the padding runs' tokens to the ranks up to one level of modeled time, under the cap (above it
        evenly when the cap has no room left), cutting the runs in order."""
        total = int(lengths.sum())
        if total == 0:
            return
        room = np.maximum(self.cap - self.tokens, 0)
        if room.sum() < total:
            room = room + -(-(total - int(room.sum())) // room.size)
        level = self.seconds if token_seconds > 0 else self.tokens.astype(np.float64)
        rate = token_seconds if token_seconds > 0 else 1.0
        amounts = _water_fill(level / rate, room, total)
        bounds = np.concatenate([[0], np.cumsum(amounts)])
        runs_end = np.cumsum(lengths)
        cuts = np.unique(np.concatenate([bounds, runs_end, [0]]))
        lo, hi = cuts[:-1], cuts[1:]
        run = np.searchsorted(runs_end, lo, side="right")
        rank = np.searchsorted(bounds, lo, side="right") - 1
        first = starts[run] + lo - (runs_end[run] - lengths[run])
        self.padding = (first, hi - lo, rank)
        self.tokens += amounts
        self.seconds += amounts * token_seconds
        self.compute += amounts * token_seconds

    def placement(self, problem: _Problem, grain: float, split: int) -> Placement:
        pieces = [(problem.start[p.group.run] + p.group.lo, p.group.hi - p.group.lo, p.first + p.group.member)
                  for p in self.groups]
        starts, lengths, ranks = (np.concatenate(parts) for parts in zip(*pieces, self.items, self.padding))
        empty = np.flatnonzero(np.bincount(ranks, minlength=self.tokens.size) == 0)
        if empty.size:  # a rank with nothing to do still holds one (padding) position
            end = int(problem.start[-1] + problem.length[-1]) if problem.start.size else 0
            starts = np.concatenate([starts, end + np.arange(empty.size)])
            lengths = np.concatenate([lengths, np.ones(empty.size, dtype=np.int64)])
            ranks = np.concatenate([ranks, empty])
            self.tokens[empty] += 1
            self.seconds[empty] += problem.costs.token_seconds
            self.compute[empty] += problem.costs.token_seconds
        return Placement(starts, lengths, ranks, self.tokens.copy(), self.compute.copy(), self.exposed.copy(),
                         self.intra.copy(), self.inter.copy(), problem.ideal, grain, split)


def _merge_adjacent(lo: np.ndarray, hi: np.ndarray, member: np.ndarray):
    """Chunks ``[lo, hi)`` (ascending) -> pieces: a member's chunks that touch are one piece."""
    keep = np.ones(lo.size, dtype=bool)
    keep[1:] = (member[1:] != member[:-1]) | (lo[1:] != hi[:-1])
    group = np.cumsum(keep) - 1
    new_hi = np.zeros(int(group[-1]) + 1, dtype=np.int64)
    np.maximum.at(new_hi, group, hi)
    return lo[keep], new_hi, member[keep]


def _group_traffic(lo: np.ndarray, hi: np.ndarray, member: np.ndarray, g: int, window: Optional[int]) -> np.ndarray:
    """``[g, g]``: rows member i owns that member j's queries see (forward), 0 on the diagonal.

    Member j sees its document's keys ``[0, b)`` up to its last piece's end ``b`` (under a window,
    ``[a - w + 1, b)`` for each of its pieces ``[a, b)``, merged): the overlaps of those ranges with
    the owners' pieces."""
    if window is None:
        need_hi = np.zeros(g, dtype=np.int64)
        np.maximum.at(need_hi, member, hi)
        need_lo, need_member = np.zeros(g, dtype=np.int64), np.arange(g)
    else:
        need_lo, need_hi, need_member = _union_per_member(np.maximum(lo - window + 1, 0), hi, member)
    overlap = np.minimum(hi[:, None], need_hi[None, :]) - np.maximum(lo[:, None], need_lo[None, :])
    rows = np.maximum(overlap, 0).astype(np.float64)  # [own pieces, needed ranges]
    traffic = np.zeros((g, g))
    np.add.at(traffic, (np.broadcast_to(member[:, None], rows.shape), np.broadcast_to(need_member[None, :], rows.shape)),
              rows)
    np.fill_diagonal(traffic, 0.0)
    return traffic


def _union_per_member(lo: np.ndarray, hi: np.ndarray, member: np.ndarray):
    """Each member's ranges ``[lo, hi)`` merged where they overlap or touch (in member, then offset order)."""
    order = np.lexsort((lo, member))
    lo, hi, member = lo[order], hi[order], member[order]
    reach = hi.copy()
    for i in range(1, lo.size):  # a member's reach so far (ranges of one member are few)
        if member[i] == member[i - 1]:
            reach[i] = max(reach[i], reach[i - 1])
    new = np.ones(lo.size, dtype=bool)
    new[1:] = (member[1:] != member[:-1]) | (lo[1:] > reach[:-1])
    group = np.cumsum(new) - 1
    merged_hi = np.zeros(int(group[-1]) + 1, dtype=np.int64)
    np.maximum.at(merged_hi, group, hi)
    return lo[new], merged_hi, member[new]


def _level(other: np.ndarray, total: float) -> float:
    """The common level ``L`` with ``sum(max(L - other, 0)) == total`` (water-filling over `other`)."""
    order = np.sort(other)
    for k in range(order.size, 0, -1):
        level = (total + order[:k].sum()) / k
        if level >= order[k - 1]:
            return float(level)
    return float(order[0] + total)


def _round_to(values: np.ndarray, total: int, least: int) -> np.ndarray:
    """`values` as integers >= `least` summing to `total`: the part above `least` scaled to fit, floored, and
    the tokens left over given to the largest remainders."""
    free = total - least * values.size
    above = np.maximum(values - least, 0.0)
    share = above * free / above.sum() if above.sum() > 0 else np.full(values.size, free / values.size)
    base = np.floor(share).astype(np.int64)
    order = np.argsort(-(share - base), kind="stable")
    base[order[: free - int(base.sum())]] += 1
    return base + least


def _even(length: int, g: int) -> np.ndarray:
    """``[g]`` token counts as equal as integers allow, summing to `length`."""
    return np.diff((np.arange(g + 1) * length) // g)


def _water_fill(level: np.ndarray, room: np.ndarray, total: int) -> np.ndarray:
    """``[W]`` int64 amounts summing to `total`, each at most `room`, raising the lowest `level`s to a common
    one (``level + amount`` equal where an amount is neither 0 nor its room)."""
    lo, hi = float(level.min()), float((level + room).max())
    for _ in range(60):  # bisection on the common level
        mid = (lo + hi) / 2
        if np.clip(mid - level, 0, room).sum() < total:
            lo = mid
        else:
            hi = mid
    amounts = np.floor(np.clip(hi - level, 0, room)).astype(np.int64)
    short = total - int(amounts.sum())
    order = np.lexsort((np.arange(level.size), level + amounts))
    for r in order:  # the rounding left over: one token each to the lowest ranks with room
        if short <= 0:
            break
        if amounts[r] < room[r]:
            amounts[r] += 1
            short -= 1
    return amounts
