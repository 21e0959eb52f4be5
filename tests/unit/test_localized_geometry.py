"""The step's geometry on runs (Note [Localized geometry]): range intersections, plans given by their runs, rows
given by their lengths, each against the per-position tables; and a rank's whole-batch state built without any
table over the global row (what keeps its host work O(own share) at a thousand ranks)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from blockdiag_cp import CPConfig
from blockdiag_cp.plan import PlanOptions, StepCosts, plan_shards
from blockdiag_cp.plan.geometry import Runs, StepGeometry
from blockdiag_cp.plan.ranges import intersect_ranges
from blockdiag_cp.mixers.conv import conv_plan
from blockdiag_cp.mixers.temperature import document_positions
from blockdiag_cp.plan.shard_plan import Segments, ShardPlan
from blockdiag_cp.step.world_plan import plan_world_step
from blockdiag_cp.testing import doc_ids_from_lengths

ranges_lists = st.lists(st.tuples(st.integers(0, 40), st.integers(0, 12)), max_size=8)
rows = st.lists(st.one_of(st.integers(1, 15), st.integers(-5, -1)), min_size=1, max_size=10).filter(
    lambda s: any(n > 0 for n in s))
GROUPED_COSTS = StepCosts(token_seconds=4.0, pair_seconds=1.0)


@settings(max_examples=200, deadline=None)
@given(queries=ranges_lists, cuts=st.lists(st.integers(1, 50), max_size=8, unique=True))
def test_intersect_ranges_matches_brute_force(queries, cuts):
    bounds = [0] + sorted(cuts)
    start, end = torch.tensor(bounds[:-1], dtype=torch.long), torch.tensor(bounds[1:], dtype=torch.long)
    lo = torch.tensor([a for a, _ in queries], dtype=torch.long)
    hi = torch.tensor([a + n for a, n in queries], dtype=torch.long)
    got = list(zip(*(t.tolist() for t in intersect_ranges(lo, hi, start, end))))
    want = [(i, j, max(a, s), min(b, e)) for i, (a, b) in enumerate(zip(lo.tolist(), hi.tolist()))
            for j, (s, e) in enumerate(zip(start.tolist(), end.tolist())) if min(b, e) > max(a, s)]
    assert got == want


@settings(max_examples=80, deadline=None)
@given(segs=rows, world=st.integers(1, 5), layout=st.sampled_from(["contiguous", "balanced", "grouped"]))
def test_a_plan_given_by_its_runs_is_the_plan_given_by_its_positions(segs, world, layout):
    ids = doc_ids_from_lengths(segs)
    plan = plan_shards(ids, world, layout, options=PlanOptions(costs=GROUPED_COSTS if layout == "grouped" else None))
    positions = ShardPlan(plan.layout, plan.seq_len, plan.padded_len, plan.positions, plan.local_lens)
    segments = positions.segments
    by_runs = ShardPlan.of_runs(plan.layout, plan.seq_len, segments, world)
    assert by_runs.local_lens == plan.local_lens
    for r in range(world):
        assert by_runs.rank_positions(r).tolist() == plan.rank_positions(r).tolist()
    assert by_runs.positions.tolist() == plan.positions.tolist()
    everything = torch.arange(plan.padded_len)
    owner, local = segments.locate(everything)
    assert owner.tolist() == plan.owner().tolist() and local.tolist() == plan.local_index().tolist()
    assert (segments.start[1:] == segments.end[:-1]).all() and int(segments.start[0]) == 0
    # shuffled runs sort alike
    order = torch.randperm(segments.start.numel(), generator=torch.Generator().manual_seed(len(segs)))
    again = Segments.of(segments.start[order], segments.length[order], segments.rank[order], world)
    assert all(torch.equal(a, b) for a, b in zip(vars(again).values(), vars(segments).values()))


@settings(max_examples=60, deadline=None)
@given(segs=rows, world=st.integers(1, 5), window=st.one_of(st.none(), st.integers(1, 12)))
def test_a_geometry_from_lengths_equals_the_one_from_ids(segs, world, window):
    """The whole-batch step's geometry (documents back to back, padding after) from `Runs.of_lengths` alone."""
    lengths = [n for n in segs if n > 0]
    ids = doc_ids_from_lengths(lengths)
    plan = plan_shards(ids, world, "grouped", options=PlanOptions(costs=GROUPED_COSTS))
    from_ids = StepGeometry.build(plan, ids)
    from_runs = StepGeometry.build(plan, None, Runs.of_lengths(np.array(lengths)))
    assert from_runs.doc_ids.tolist() == from_ids.doc_ids.tolist()
    for r in range(world):
        assert [t.tolist() for t in vars(from_runs.pieces(r)).values()] == \
               [t.tolist() for t in vars(from_ids.pieces(r)).values()]
        assert from_runs.needed_positions(r, window).tolist() == from_ids.needed_positions(r, window).tolist()
    assert torch.equal(from_runs.transfer_under(window), from_ids.transfer_under(window))
    assert from_runs.longest_document == from_ids.longest_document == max(lengths)


def test_runs_pad_their_tail_whatever_it_holds():
    assert [t.tolist() for t in vars(Runs.of_ids(torch.tensor([3, 3, 0, 5])).padded_to(7)).values()] == \
           [[0, 2, 3, 4], [2, 1, 1, 3], [True, False, True, False]]
    assert [t.tolist() for t in vars(Runs.of_ids(torch.tensor([3, 3, 0])).padded_to(5)).values()] == \
           [[0, 2], [2, 3], [True, False]]
    assert Runs.of_lengths(np.array([2, 4])).padded_to(6).length.tolist() == [2, 4]


def geometry_doc_start(world_plan, positions):
    """Each position's document start from the global row's lengths (padding: its padding run's)."""
    starts = np.concatenate([[0], np.cumsum(world_plan.row.lengths)])
    index = np.searchsorted(starts, positions.numpy(), side="right") - 1
    return torch.from_numpy(starts[np.minimum(index, starts.size - 1)])


#: the per-position tables of a geometry and a plan (Note [Localized geometry]): built only when read
POSITION_TABLES = ("doc_ids", "doc_start", "owner", "local_index", "run", "last_by_run", "need_WS", "gathered_row")


@pytest.mark.parametrize("exchange", ["auto", "a2a", "allgather"])
def test_a_whole_batch_rank_builds_its_state_without_a_table_over_the_global_row(exchange):
    """Host work O(own share): a rank's state (geometry, pieces, exchange routing, kernel tables, windowed layers,
    token route) reads the global row's runs and the plan's segments, never a per-position table of the row."""
    rng = np.random.default_rng(3)
    replicas = [[2500, *rng.integers(1, 300, 30).tolist()] for _ in range(4)]  # long documents are cut
    config = CPConfig(layout="grouped", kv_exchange=exchange, kernel="sdpa", plan=PlanOptions(ranks_per_node=4))
    world_plan = plan_world_step(replicas, 4, 4, config)
    moved, listed = [], set()
    for rank in (0, 9, 15):
        step = world_plan.rank_step(rank)
        step.state.exchange_for(window=64)
        conv_plan(step.state, 4)  # a hybrid model's conv halo, and Llama 4's positions in their documents
        positions = step.state.positions
        assert document_positions(step.state).tolist() == (positions - geometry_doc_start(world_plan, positions)).tolist()
        geometry = step.state.geometry
        assert not set(POSITION_TABLES) & set(vars(geometry)), (rank, set(POSITION_TABLES) & set(vars(geometry)))
        assert "doc_ids" not in vars(world_plan.row)
        assert world_plan.plan.given_positions is None and "positions" not in vars(world_plan.plan)
        moved.append(step.state.exchange.traffic.recv_fwd)
        exchange = step.state.exchange
        if hasattr(exchange, "recv_splits"):  # the positions listed: its own and its peers' (a conv halo's owners)
            peers = {r for r, n in enumerate(exchange.recv_splits) if n} | {rank}
            listed |= peers
            assert set(world_plan.plan._rank_positions) <= listed, (rank, world_plan.plan._rank_positions.keys())
    assert any(moved), "the sampled ranks route no rows: the case does not exercise the routing"
    # the tables, when a tool reads them, are the row's
    assert geometry.doc_ids[: world_plan.row.seq_len].tolist() == world_plan.row.doc_ids.tolist()


def test_the_global_row_reads_ids_and_real_tokens_from_its_runs():
    """`GlobalRow.ids_at` and `real_of` (what a rank's token route and moved ids read) against the dense row."""
    from blockdiag_cp.step.world_plan import _runs_of, _view
    from blockdiag_cp.step.world import GlobalRow

    replicas = [[3, -2, 5, 1, -4], [-1, 7, 2], [4]]
    row = GlobalRow.of(_runs_of(replicas, 3, 1), _view(3, 1, 0))
    everything = torch.arange(row.seq_len)
    assert row.ids_at(everything).tolist() == row.doc_ids.tolist() == [1] * 3 + [2] * 5 + [3] + [4] * 7 + [5] * 2 + [6] * 4
    assert [row.real_of(d).tolist() for d in range(3)] == [[0, 1, 2, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6, 7, 8, 9],
                                                           [0, 1, 2, 3]]


@settings(max_examples=60, deadline=None)
@given(segs=rows, world=st.integers(2, 5), width=st.integers(1, 6))
def test_halo_reads_are_the_keys_another_rank_owns(segs, world, width):
    """`HaloReads` (a conv of `width`'s halo, from the plan's segments) against the per-position tables: the
    ``width - 1`` positions of its document before each of a rank's pieces that another rank owns."""
    from blockdiag_cp.mixers.conv import HaloReads

    ids = doc_ids_from_lengths(segs)
    plan = plan_shards(ids, world, "grouped", options=PlanOptions(costs=GROUPED_COSTS))
    geometry = StepGeometry.build(plan, ids)
    reads = HaloReads.of(geometry, width)
    got = sorted(zip(reads.owner.tolist(), reads.row.tolist(), reads.reader.tolist()))
    owner, local, doc_start = geometry.owner.tolist(), geometry.local_index.tolist(), geometry.doc_start.tolist()
    want = []
    for reader in range(world):
        p = geometry.pieces(reader)
        for g0, d0 in zip(p.global_start.tolist(), p.doc_start.tolist()):
            want += [(owner[g], local[g], reader) for g in range(max(d0, g0 - width + 1), g0) if owner[g] != reader]
    assert got == sorted(want)
