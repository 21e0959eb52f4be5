"""The ranks' loads while the grouped planner builds a placement (Note [Grouped planner] in grouped.py, steps 3-4).

`Loads` keeps each rank's modeled seconds (compute and exposed links), tokens and link bytes,
and the groups and whole documents placed so far; its methods are the planner's moves: a group
to the window of ranks it fits best, whole documents largest first to the least loaded rank
under the token cap (LPT), single documents moved or swapped off the busiest rank, groups cut
again to even out their members' ranks, and padding water-filled up to a common level.
"""

from __future__ import annotations

import heapq
from typing import Callable, Optional

import numpy as np

from .groups import Group, GroupCutter, Placed


class Loads:
    """The ranks' loads while a placement is built: seconds, tokens, link bytes, the groups and whole documents."""

    def __init__(self, world: int, cap: int) -> None:
        self.cap = cap
        self.seconds = np.zeros(world)
        self.compute = np.zeros(world)
        self.exposed = np.zeros(world)
        self.tokens = np.zeros(world, dtype=np.int64)
        self.intra = np.zeros(world)
        self.inter = np.zeros(world)
        self.groups: list[Placed] = []
        self.items: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]] = None  # whole documents: start, length, rank
        self.padding: tuple[np.ndarray, np.ndarray, np.ndarray] = (np.zeros(0, np.int64),) * 3
        self.grain = 1.0

    @property
    def step(self) -> float:
        return float(self.seconds.max())

    @property
    def split(self) -> int:
        return len(self.groups)

    def place_group(self, placed: Placed) -> None:
        self.groups.append(placed)
        self._add(placed, 1)

    def _add(self, placed: Placed, sign: int) -> None:
        ranks, group = placed.ranks, placed.group
        self.compute[ranks] += sign * group.compute
        self.exposed[ranks] += sign * placed.exposed
        self.seconds[ranks] += sign * (group.compute + placed.exposed)
        self.tokens[ranks] += sign * group.tokens
        self.intra[ranks] += sign * placed.intra
        self.inter[ranks] += sign * placed.inter

    def rebalance_groups(self, cutter: GroupCutter, sweeps: int = 3) -> bool:
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
                recut = cutter.recut(placed.group, other)
                if recut is not None:
                    candidate = cutter.place(recut, placed.first)
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
        """Largest first, each to the least busy rank with room under the cap (else the one with the fewest
        tokens). The loop runs over Python lists (a numpy scalar read or write costs about ten times a list's);
        the sums are the same float64 additions in the same order."""
        starts, lengths = items
        order = np.lexsort((starts, -seconds))
        rank_of = np.empty(starts.size, dtype=np.int64)
        busy, compute, tokens = self.seconds.tolist(), self.compute.tolist(), self.tokens.tolist()
        item_seconds, item_tokens = seconds.tolist(), lengths.tolist()
        queue = RoomQueue(busy, tokens, self.cap)
        for i in order.tolist():
            chosen = queue.take(item_tokens[i])
            rank_of[i] = chosen
            busy[chosen] += item_seconds[i]
            compute[chosen] += item_seconds[i]
            tokens[chosen] += item_tokens[i]
            queue.changed(chosen)
        self.seconds[:], self.compute[:], self.tokens[:] = busy, compute, tokens
        self.items = (starts, lengths, rank_of)

    def refine(self, item_seconds: Callable[[tuple[np.ndarray, np.ndarray]], np.ndarray], rounds: Optional[int] = None, partners: int = 8) -> None:
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
        amounts = water_fill(level / rate, room, total)
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

    def best_window(self, group: Group, ranks_per_node: int) -> int:
        """The first rank of the `group.size` consecutive ranks the group goes to (Note [Grouped planner], 3):
        inside one node when it fits one (else whole nodes from a node's first rank), the window whose busiest
        member would be least loaded, under the token cap."""
        g, W, rpn = group.size, self.seconds.size, ranks_per_node
        s = np.arange(W - g + 1)
        starts = s[(s // rpn) == ((s + g - 1) // rpn)] if g <= rpn else s[s % rpn == 0]
        if starts.size == 0:
            starts = np.array([W - g])
        seconds_SG = np.lib.stride_tricks.sliding_window_view(self.seconds, g)[starts]  # [candidates, members]
        tokens_SG = np.lib.stride_tricks.sliding_window_view(self.tokens, g)[starts]
        busiest = (seconds_SG + group.compute).max(axis=1)
        over = np.maximum(tokens_SG + group.tokens - self.cap, 0).sum(axis=1)
        load = np.zeros(starts.size)
        for m in range(g):  # member by member, as a rank's seconds are summed everywhere else (ties read it)
            load += seconds_SG[:, m]
        order = np.lexsort((starts, load, busiest, over))
        return int(starts[order[0]])

    def pieces(self, run_start: np.ndarray, end: int, token_seconds: float) -> tuple[np.ndarray, ...]:
        """``(start, length, rank)`` of every piece placed (groups' pieces, whole documents, padding), the runs
        starting at `run_start`; a rank with nothing to do is given one padding position from `end` on (and
        its token and seconds counted)."""
        pieces = [(run_start[p.group.run] + p.group.lo, p.group.hi - p.group.lo, p.first + p.group.member)
                  for p in self.groups]
        starts, lengths, ranks = (np.concatenate(parts) for parts in zip(*pieces, self.items, self.padding))
        empty = np.flatnonzero(np.bincount(ranks, minlength=self.tokens.size) == 0)
        if empty.size:  # a rank with nothing to do still holds one (padding) position
            starts = np.concatenate([starts, end + np.arange(empty.size)])
            lengths = np.concatenate([lengths, np.ones(empty.size, dtype=np.int64)])
            ranks = np.concatenate([ranks, empty])
            self.tokens[empty] += 1
            self.seconds[empty] += token_seconds
            self.compute[empty] += token_seconds
        return starts, lengths, ranks


def water_fill(level: np.ndarray, room: np.ndarray, total: int) -> np.ndarray:
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
    for r in order[::-1]:  # levels so large that a token does not show (a share jumps whole): the excess back,
        if short >= 0:  # from the highest ranks down
            break
        back = min(-short, int(amounts[r]))
        amounts[r] -= back
        short += back
    return amounts


class RoomQueue:
    """The ranks in the order whole documents go to them: the least busy one (the lowest rank among equals) that
    has room for an item's tokens under the cap; when none has, the one with the fewest tokens (the lowest rank
    among equals).

    Note [Ranks parked for room]: ranks wait in one of two heaps. Open ranks by ``(seconds, rank)``; a rank popped
    from there without room for the item at hand is parked by ``(tokens, rank)``, and parked ranks open again
    once an item is small enough for them (items come largest first, so a rank is parked and opened a few times
    at most, not scanned for every item). Entries carry the rank's version; a rank that takes an item gets a new
    version and one new open entry, and its older entries are dropped when they surface. Each take is
    O(log W) amortized, where scanning every rank without room was O(W).

    `busy` and `tokens` are the caller's lists, read as it changes them (`changed` after each change).
    """

    def __init__(self, busy: list[float], tokens: list[int], cap: int) -> None:
        self.busy, self.tokens, self.cap = busy, tokens, cap
        self.version = [0] * len(busy)
        self.open = [(t, r, 0) for r, t in enumerate(busy)]
        self.parked: list[tuple[int, int, int]] = []
        heapq.heapify(self.open)

    def take(self, n: int) -> int:
        """The rank an item of `n` tokens goes to."""
        open_, parked, version, tokens, room = self.open, self.parked, self.version, self.tokens, self.cap - n
        while parked and (parked[0][0] <= room or parked[0][2] != version[parked[0][1]]):
            _, r, v = heapq.heappop(parked)
            if v == version[r]:
                heapq.heappush(open_, (self.busy[r], r, v))
        while open_:
            _, r, v = open_[0]
            if v == version[r] and tokens[r] <= room:
                return r
            heapq.heappop(open_)
            if v == version[r]:
                heapq.heappush(parked, (tokens[r], r, v))
        while parked[0][2] != version[parked[0][1]]:
            heapq.heappop(parked)
        return parked[0][1]

    def changed(self, rank: int) -> None:
        """`rank`'s seconds and tokens changed: a new version, open again."""
        self.version[rank] += 1
        heapq.heappush(self.open, (self.busy[rank], rank, self.version[rank]))
