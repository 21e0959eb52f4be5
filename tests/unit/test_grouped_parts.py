"""The grouped planner's parts (Note [Grouped planner]): a group's cuts (groups.py), the moves on the ranks' loads
(loads.py), and the placement's modeled compute and bytes recomputed from the materialized plan under a sliding
window and with padding runs (the full-causal, padding-free case: test_grouped_layout.py)."""

import numpy as np
import pytest
import torch

from blockdiag_cp.plan import PlanOptions, StepCosts, plan_shards
from blockdiag_cp.plan.geometry import StepGeometry
from blockdiag_cp.plan.grouped import place_runs, row_runs
from blockdiag_cp.plan.groups import GroupCutter, union_per_member, water_level
from blockdiag_cp.plan.loads import Loads, RoomQueue, water_fill
from blockdiag_cp.plan.step_costs import pairs_before
from blockdiag_cp.testing import doc_ids_from_lengths
from scenarios import pieces_by_rank


def placed(lengths, world, **knobs):
    ids = doc_ids_from_lengths(tuple(lengths))
    placement = place_runs(*row_runs(ids.reshape(-1)), world, PlanOptions(**knobs))
    return ids.reshape(-1), placement, placement.shard_plan(ids.numel())


@pytest.mark.parametrize("g", [2, 3, 5])
def test_equal_work_cuts_give_contiguous_chunks_of_equal_work(g):
    costs = StepCosts(token_seconds=16.0, pair_seconds=1.0)
    cutter = GroupCutter(np.array([6000]), costs, 256, 8)
    cuts = cutter.equal_work_cuts(6000, g)
    assert cuts[0] == 0 and cuts[-1] == 6000 and bool((np.diff(cuts) > 0).all())
    work = 16.0 * np.diff(cuts) + np.diff(pairs_before(cuts, 256))
    assert work.max() / work.min() < 1.001


def test_union_per_member_merges_ranges_that_overlap_or_touch():
    """(Under a window the planner gives each member one piece; a member of several pieces needs their ranges'
    union.)"""
    lo, hi, member = union_per_member(np.array([20, 4, 3, 0, 2]), np.array([25, 9, 6, 4, 8]), np.array([0, 0, 1, 0, 1]))
    assert (lo.tolist(), hi.tolist(), member.tolist()) == ([0, 20, 2], [9, 25, 8], [0, 0, 1])


def test_water_level_fills_the_lowest_first():
    assert water_level(np.array([1.0, 3.0, 6.0]), 4.0) == 4.0  # 3 + 1 + 0
    assert water_level(np.array([1.0, 3.0, 6.0]), 12.0) == 22.0 / 3  # everyone under water
    assert water_level(np.array([5.0]), 2.0) == 7.0


def test_a_recut_levels_its_members_ranks():
    cutter = GroupCutter(np.array([8000]), StepCosts(), None, 4)
    group = cutter.cut(0, 4)
    other = np.array([0.0, 0.1, 0.2, 0.3]) * float(group.compute.sum())
    recut = cutter.recut(group, other)
    assert recut is not None and int(recut.tokens.sum()) == 8000
    spread = lambda g: float(np.ptp(other + g.compute))  # noqa: E731
    assert spread(recut) < 0.1 * spread(group)
    assert bool((np.diff(recut.tokens) < 0).all())  # a member on a busier rank holds fewer tokens


def test_a_group_window_keeps_under_the_token_cap():
    """Nodes of 2 ranks: the least loaded window (ranks 0-1) has no room for the group's tokens once rank 0 holds
    500 of its 600: the group goes to ranks 2-3."""
    cutter = GroupCutter(np.array([1000]), StepCosts(), None, 2)
    group = cutter.cut(0, 2)
    state = Loads(4, cap=600)
    state.seconds[:] = [0.0, 0.0, 1.0, 1.0]
    assert state.best_window(group, 2) == 0
    state.tokens[:] = [500, 0, 0, 0]
    assert state.best_window(group, 2) == 2


def test_refine_moves_whole_documents_off_the_busiest_rank():
    state = Loads(2, cap=10**6)
    starts, lengths = np.arange(6) * 100, np.array([100, 90, 80, 70, 60, 50])
    seconds = lengths.astype(np.float64)
    state.items = (starts, lengths, np.zeros(6, dtype=np.int64))  # everything on rank 0
    state.seconds[0] = state.compute[0] = seconds.sum()
    state.tokens[0] = lengths.sum()
    state.refine(lambda items: items[1].astype(np.float64))
    assert state.step <= 230.0  # 450 over two ranks: moves and swaps of single documents get within 5 of even
    on = [lengths[state.items[2] == r].sum() for r in range(2)]
    assert on == state.tokens.tolist() == state.seconds.tolist()


@pytest.mark.parametrize("window", [None, 300])
def test_each_ranks_modeled_compute_with_padding_and_a_window(window):
    """Every rank's compute from its pieces (a piece at offset o of n tokens: its tokens, its pairs under the window,
    the rectangle rule, a piece, the carry of a continuing piece); a padding token costs a token, nothing more."""
    lengths = [9000, -50, 3000, 700, 40, -7, 2, 5000, 1, 300, 12000, -300, 64]
    costs = StepCosts(token_seconds=StepCosts().token_seconds, pair_seconds=StepCosts().pair_seconds,
                      carry_seconds=3e-6, piece_seconds=2e-4, kv_bytes_per_token=1e3)
    ids, placement, plan = placed(lengths, 6, ranks_per_node=3, costs=costs, window=window)
    for rank, pieces in enumerate(pieces_by_rank(plan, ids)):
        seconds, padding = 0.0, 0
        for doc, offset, n in pieces:
            if doc == 0:
                padding += n
                continue
            if window is None:
                rate = costs.rectangle_factor if n >= costs.rectangle_min_queries else 1.0
                pairs = n * (n + 1) / 2 + rate * n * offset
            else:
                pairs = float(pairs_before(np.array([offset + n]), window)[0] - pairs_before(np.array([offset]), window)[0])
            seconds += costs.token_seconds * n + costs.pair_seconds * pairs
            seconds += costs.piece_seconds + (costs.carry_seconds * n if offset > 0 else 0.0)
        seconds += costs.token_seconds * (padding + plan.local_lens[rank] - sum(n for _, _, n in pieces))
        assert seconds == pytest.approx(placement.compute[rank], rel=1e-9), rank
    real = np.array([n for n in lengths if n > 0])
    whole = costs.token_seconds * real + costs.pair_seconds * pairs_before(real, window) + costs.piece_seconds
    padding = -sum(n for n in lengths if n < 0)
    assert placement.ideal == pytest.approx((whole.sum() + costs.token_seconds * padding) / 6, rel=1e-12)


def test_each_ranks_modeled_bytes_under_a_window_are_what_it_needs():
    """Under a window a member needs only the last `window - 1` keys before each of its pieces: the rows each
    rank sends (forward) and receives back (gradients) are the geometry's windowed needs."""
    window = 500
    lengths = [4000, 100, 2500, 7, 9000, 30, 1, 600]
    ids, placement, plan = placed(lengths, 5, ranks_per_node=2, costs=StepCosts(kv_bytes_per_token=10.0),
                                  window=window)
    geometry = StepGeometry.build(plan, ids)
    owner = plan.owner()
    rows = torch.zeros(5, 5)  # [dst, src]
    for dst in range(5):
        needed = geometry.needed_positions(dst, window)
        needed = needed[needed < ids.numel()]
        rows[dst] = torch.bincount(owner[needed], minlength=5).float()
        rows[dst, dst] = 0
    assert placement.inter_bytes.sum() > 0 and rows.sum() < 4000 + 2500 + 9000  # the window keeps it small
    for rank in range(5):
        sent = float(rows[:, rank].sum() + rows[rank, :].sum())
        assert placement.intra_bytes[rank] + placement.inter_bytes[rank] == pytest.approx(10.0 * sent), rank


def test_padding_fills_where_the_levels_dwarf_a_token():
    """Pairs cost everything, a token 1e-12 of a pair: in token units the ranks' levels are ~1e19, where one token
    does not show, and the water level jumped a rank's whole room (the planner raised IndexError). The excess goes
    back from the highest rank: the lowest ranks fill to their room, the next takes what is left."""
    level = np.array([9.25e18, 9.55e18, 7.78e18, 8.04e18, 2.92e18])
    assert water_fill(level, np.array([14, 0, 13, 2, 3]), 19).tolist() == [1, 0, 13, 2, 3]
    lengths = (99, 5334, 4236, 698, 239, 1743, 3980, 400, 77, 3473, 52, 20, 247, -9, 81, 174, 405, -10, 1012, 1129)
    ids = doc_ids_from_lengths(lengths)
    plan = plan_shards(ids, 5, "grouped", options=PlanOptions(ranks_per_node=2, token_cap=1.0,
                                                              costs=StepCosts(token_seconds=1e-12, pair_seconds=1.0)))
    assert torch.equal(plan.positions.sort().values, torch.arange(plan.padded_len))


def least_busy_with_room(busy, tokens, cap, n):
    """The brute-force rule `RoomQueue` keeps: the least busy rank (lowest among equals) with room for `n` tokens
    under `cap`, else the rank with the fewest tokens (lowest among equals)."""
    fits = [r for r in range(len(busy)) if tokens[r] + n <= cap]
    if fits:
        return min(fits, key=lambda r: (busy[r], r))
    return min(range(len(busy)), key=lambda r: (tokens[r], r))


@pytest.mark.parametrize("seed", range(40))
def test_the_room_queue_takes_the_least_busy_rank_with_room_else_the_emptiest(seed):
    """Items of any size order (mostly largest first, as the planner sends them, some growing), ties in seconds
    and tokens, items that fill a rank exactly to the cap, and items no rank has room for."""
    rng = np.random.default_rng(seed)
    world, cap = int(rng.integers(1, 40)), int(rng.integers(20, 200))
    busy = [float(x) for x in rng.integers(0, 4, world)]  # few distinct values: ties
    tokens = [int(x) for x in rng.integers(0, cap // 2, world)]
    sizes = sorted((int(x) for x in rng.integers(1, cap // 3, 6 * world)), reverse=True)
    if seed % 3 == 0:  # some items grow: ranks parked for a smaller item must wait again
        rng.shuffle(sizes)
    queue = RoomQueue(busy, tokens, cap)
    for n in sizes + [cap, cap - min(tokens)]:
        want = least_busy_with_room(busy, tokens, cap, n)
        assert queue.take(n) == want
        busy[want] += float(rng.integers(0, 3))
        tokens[want] += n
        queue.changed(want)


def test_whole_documents_go_largest_first_to_the_least_busy_rank_with_room():
    """`Loads.place_items` against the same rule applied item by item."""
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 300, 400)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    seconds = lengths * 2.0 + (lengths % 7)
    loads = Loads(13, int(lengths.sum() * 1.05 / 13))
    loads.place_items((starts, lengths), seconds)
    busy, tokens = [0.0] * 13, [0] * 13
    for i in np.lexsort((starts, -seconds)):
        r = least_busy_with_room(busy, tokens, loads.cap, int(lengths[i]))
        assert loads.items[2][i] == r
        busy[r] += float(seconds[i])
        tokens[r] += int(lengths[i])
    assert loads.seconds.tolist() == busy == loads.compute.tolist() and loads.tokens.tolist() == tokens
