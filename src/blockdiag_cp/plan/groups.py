"""Groups of the grouped layout: a document cut over ``g`` consecutive ranks, each member's cost, its links.

A `Group` is one document cut for ``g`` members (Note [Grouped planner] in grouped.py, step 2):
head and tail chunks, member ``m`` holding chunks ``m`` and ``2g - 1 - m`` (contiguous chunks of
equal work under a sliding window). `GroupCutter` cuts and costs groups of one row's documents
with the step's cost model (`StepCosts.span_seconds`, Note [The step's cost model]), cuts a
group again to even out its members' ranks (step 4), and costs its K/V links once it has a place
(`Placed`, step 3): a member's traffic at the intra- or inter-node speed, less what hides behind
the attention over its own keys (`StepCosts.exposed_seconds`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .step_costs import StepCosts, pairs_before


@dataclass(frozen=True)
class Group:
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
class Placed:
    """A group where it was placed: its first rank, and each member's exposed link seconds and bytes."""

    group: Group
    first: int
    exposed: np.ndarray
    intra: np.ndarray
    inter: np.ndarray

    @property
    def ranks(self) -> np.ndarray:
        return self.first + np.arange(self.group.size)


@dataclass(frozen=True)
class GroupCutter:
    """Cuts one row's runs (``length [R]``) into groups and costs them: the cost model, the window, and the
    ranks a node holds (links between ranks of one node are intra-node)."""

    length: np.ndarray
    costs: StepCosts
    window: Optional[int]
    ranks_per_node: int

    def cut(self, run: int, g: int, tokens: Optional[np.ndarray] = None, traffic: bool = True) -> Group:
        """Cut run `run` over `g` members holding `tokens[m]` tokens each (default: equal work), as head and tail
        chunks (Note [Grouped planner], step 2; contiguous chunks under a window), and cost each member."""
        length = int(self.length[run])
        if tokens is None:
            tokens = np.diff(self.equal_work_cuts(length, g)) if self.window is not None else even(length, g)
        if self.window is None and bool((tokens >= 2).all()):
            heads = tokens // 2
            sizes = np.concatenate([heads, (tokens - heads)[::-1]])
            chunk_member = np.concatenate([np.arange(g), np.arange(g)[::-1]])
        else:
            sizes, chunk_member = tokens, np.arange(g)
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        lo, hi, member = merge_adjacent(bounds[:-1], bounds[1:], chunk_member)
        return self._cost(run, g, lo, hi, member, traffic)

    def _cost(self, run: int, g: int, lo: np.ndarray, hi: np.ndarray, member: np.ndarray,
              traffic: bool = True) -> Group:
        """Each member's compute, tokens and own-key attention, and (`traffic`) the rows members send each other."""
        seconds = self.costs.span_seconds(lo, hi, self.window)
        own = pairs_before(hi - lo, self.window)  # the pairs over the piece's own keys
        per_member = lambda x: np.bincount(member, weights=x, minlength=g)  # noqa: E731
        rows = group_traffic(lo, hi, member, g, self.window) if traffic else np.zeros((g, g))
        return Group(run, per_member(seconds), per_member((hi - lo).astype(np.float64)).astype(np.int64),
                     self.costs.pair_seconds * per_member(own), rows, member, lo, hi)

    def recut(self, group: Group, other: np.ndarray, iterations: int = 3) -> Optional[Group]:
        """`group` cut again so that ``other + member compute`` is as even as its work allows (`other`: ``[g]``
        the members' ranks' seconds without it), or None when the even cut is already right. Token counts
        follow the target work by fixed-point steps (a member's work grows about linearly with its tokens)."""
        total = float(group.compute.sum())
        target = np.maximum(water_level(other, total) - other, 0.0)
        if np.abs(target - group.compute).max() <= 1e-3 * total / group.size:
            return None
        length, g = int(self.length[group.run]), group.size
        least = 2 if self.window is None and length >= 2 * g else 1
        tokens = group.tokens.astype(np.float64)
        recut = group
        for _ in range(iterations):
            tokens = tokens * np.where(recut.compute > 0, target / np.maximum(recut.compute, 1e-300), 1.0)
            counts = round_to(np.maximum(tokens, least), length, least)
            recut = self.cut(group.run, g, counts, traffic=False)
            tokens = counts.astype(np.float64)
        return self.cut(group.run, g, counts)

    def equal_work_cuts(self, length: int, g: int) -> np.ndarray:
        """``[g + 1]`` offsets cutting a document into `g` contiguous chunks of equal work (each >= 1 token)."""
        offsets = np.arange(length + 1)
        work = self.costs.seconds(offsets, pairs_before(offsets, self.window), pieces=0)  # of the first n tokens
        targets = work[-1] * np.arange(1, g) / g
        inner = np.searchsorted(work, targets)
        inner = np.clip(inner, np.arange(1, g), length - g + np.arange(1, g))  # every chunk keeps a token
        inner = np.maximum.accumulate(np.maximum(inner, np.arange(1, g)))
        return np.concatenate([[0], inner, [length]])

    def place(self, group: Group, first: int) -> Placed:
        """`group` on ranks ``first ..``: each member's exposed link seconds and its intra- and inter-node bytes
        (Note [Grouped planner], step 3)."""
        node = (first + np.arange(group.size)) // self.ranks_per_node
        both = (group.traffic + group.traffic.T) * self.costs.kv_bytes_per_token  # forward and gradients back
        across = node[:, None] != node[None, :]
        inter = (both * across).sum(axis=1)
        intra = both.sum(axis=1) - inter
        return Placed(group, first, self.costs.exposed_seconds(intra, inter, group.hide), intra, inter)


def merge_adjacent(lo: np.ndarray, hi: np.ndarray, member: np.ndarray):
    """Chunks ``[lo, hi)`` (ascending) -> pieces: a member's chunks that touch are one piece."""
    keep = np.ones(lo.size, dtype=bool)
    keep[1:] = (member[1:] != member[:-1]) | (lo[1:] != hi[:-1])
    group = np.cumsum(keep) - 1
    new_hi = np.zeros(int(group[-1]) + 1, dtype=np.int64)
    np.maximum.at(new_hi, group, hi)
    return lo[keep], new_hi, member[keep]


def group_traffic(lo: np.ndarray, hi: np.ndarray, member: np.ndarray, g: int, window: Optional[int]) -> np.ndarray:
    """``[g, g]``: rows member i owns that member j's queries see (forward), 0 on the diagonal.

    Member j sees its document's keys ``[0, b)`` up to its last piece's end ``b`` (under a window,
    ``[a - w + 1, b)`` for each of its pieces ``[a, b)``, merged): the overlaps of those ranges with
    the owners' pieces."""
    if window is None:
        need_hi = np.zeros(g, dtype=np.int64)
        np.maximum.at(need_hi, member, hi)
        need_lo, need_member = np.zeros(g, dtype=np.int64), np.arange(g)
    else:
        need_lo, need_hi, need_member = union_per_member(np.maximum(lo - window + 1, 0), hi, member)
    overlap = np.minimum(hi[:, None], need_hi[None, :]) - np.maximum(lo[:, None], need_lo[None, :])
    rows = np.maximum(overlap, 0).astype(np.float64)  # [own pieces, needed ranges]
    pair = (member[:, None] * g + need_member[None, :]).ravel()  # (owner, seeker) of each overlap
    traffic = np.bincount(pair, weights=rows.ravel(), minlength=g * g).reshape(g, g)
    np.fill_diagonal(traffic, 0.0)
    return traffic


def union_per_member(lo: np.ndarray, hi: np.ndarray, member: np.ndarray):
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


def water_level(other: np.ndarray, total: float) -> float:
    """The common level ``L`` with ``sum(max(L - other, 0)) == total`` (water-filling over `other`)."""
    order = np.sort(other)
    for k in range(order.size, 0, -1):
        level = (total + order[:k].sum()) / k
        if level >= order[k - 1]:
            return float(level)
    return float(order[0] + total)


def round_to(values: np.ndarray, total: int, least: int) -> np.ndarray:
    """`values` as integers >= `least` summing to `total`: the part above `least` scaled to fit, floored, and
    the tokens left over given to the largest remainders."""
    free = total - least * values.size
    above = np.maximum(values - least, 0.0)
    share = above * free / above.sum() if above.sum() > 0 else np.full(values.size, free / values.size)
    base = np.floor(share).astype(np.int64)
    order = np.argsort(-(share - base), kind="stable")
    base[order[: free - int(base.sum())]] += 1
    return base + least


def even(length: int, g: int) -> np.ndarray:
    """``[g]`` token counts as equal as integers allow, summing to `length`."""
    return np.diff((np.arange(g + 1) * length) // g)
