"""The grouped layout (Note [Grouped planner]): every position once, short documents whole, groups inside a
node when they fit, the token cap, modeled time near the ideal, and each rank's modeled compute and K/V bytes
recomputed here from the materialized plan (not from the planner's own bookkeeping)."""

import math

import numpy as np
import pytest
import torch

from blockdiag_cp.plan import PlanOptions, StepCosts, plan_shards
from blockdiag_cp.plan.geometry import StepGeometry
from blockdiag_cp.plan.grouped import place_runs, plan_grouped
from blockdiag_cp.plan.step_costs import pairs_before
from blockdiag_cp.plan.whole_batch import micro_batches, pack_rows, project
from blockdiag_cp.testing import doc_ids_from_lengths
from scenarios import pieces_by_rank

COSTS = StepCosts()  # a 1B-class Llama: a token costs about 16k pairs


def lognormal_rows(dp, row=32768, seed=0, mu=7.0, sigma=1.0):
    """`dp` rows of lognormal document lengths, each row filled up to `row` tokens (the last one cut)."""
    rng = np.random.default_rng(seed)
    lengths = []
    for _ in range(dp):
        left = row
        while left > 0:
            n = int(min(left, max(1, rng.lognormal(mu, sigma))))
            lengths.append(n)
            left -= n
    return np.array(lengths, dtype=np.int64)


def place(lengths, world, **knobs):
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    return place_runs(starts, lengths, np.ones(lengths.size, bool), world, PlanOptions(**knobs))


def test_every_position_once_ranks_ascending_and_none_empty():
    ids = doc_ids_from_lengths((37, 1, 90, 5, 61, -7, 3))
    for world in (1, 2, 3, 5, 8):
        plan = plan_shards(ids, world, "grouped", options=PlanOptions(costs=StepCosts(token_seconds=4.0, pair_seconds=1.0)))
        assert plan.layout == "grouped" and plan.world == world and min(plan.local_lens) >= 1
        assert torch.equal(plan.positions.sort().values, torch.arange(plan.padded_len))
        for r in range(world):
            pos = plan.rank_positions(r)
            assert bool((pos[1:] > pos[:-1]).all())
    tiny = plan_shards(doc_ids_from_lengths((1, 1)), 4, "grouped")  # fewer tokens than ranks
    assert tiny.local_lens == (1, 1, 1, 1) and tiny.padded_len == 4 and tiny.seq_len == 2


def test_a_realistic_batch_short_documents_whole_groups_in_a_node_tokens_capped():
    lengths = lognormal_rows(8)  # dp 8 rows of 32k tokens, over dp 8 x cp 4
    world, rpn = 32, 4
    ids = doc_ids_from_lengths(tuple(lengths.tolist()))
    plan = plan_shards(ids, world, "grouped", options=PlanOptions(ranks_per_node=rpn))
    work = COSTS.token_seconds * lengths + COSTS.pair_seconds * lengths * (lengths + 1) / 2
    tau = work.sum() / world
    ranks_of = {}
    for rank, pieces in enumerate(pieces_by_rank(plan, ids)):
        for doc, _, _ in pieces:
            ranks_of.setdefault(doc, set()).add(rank)
    short = np.flatnonzero(work <= tau / 4) + 1
    assert all(len(ranks_of[d]) == 1 for d in short)  # short documents are never cut
    fits = [d for d in ranks_of if math.ceil(work[d - 1] / tau) <= rpn]  # work that fits in a node
    assert sum(len(ranks_of[d]) > 1 for d in fits) >= 5  # cut documents among them (the rule is exercised)
    for d in fits:
        assert len({r // rpn for r in ranks_of[d]}) == 1, (d, sorted(ranks_of[d]))
    tokens = np.array(plan.local_lens)
    assert tokens.max() <= math.ceil(1.25 * lengths.sum() / world)
    assert len(set(plan.local_lens)) > 1  # unequal shards serve the modeled time


def sft_micro_batches(dp, batches, seed=0, mu=7.0, sigma=1.2, row=32768):
    """Lognormal document lengths (median 1.1k tokens) packed into rows best-fit decreasing, shuffled, dealt."""
    rng = np.random.default_rng(seed)
    lengths = np.maximum(1, rng.lognormal(mu, sigma, size=dp * batches * row // 1500)).astype(np.int64)
    return micro_batches(pack_rows(lengths, row), dp, seed)[:batches]


def test_a_group_takes_the_least_loaded_window_inside_a_node():
    """Two nodes of 4 ranks; ranks 3 and 4 (either side of the node boundary) are the least loaded, so the
    best window of 2 would cross it: the planner takes the best window inside a node instead."""
    from blockdiag_cp.plan.grouped import _Problem
    from blockdiag_cp.plan.loads import Loads

    lengths = np.array([1000, 10, 10])
    problem = _Problem.of(np.array([0, 1000, 1010]), lengths, np.ones(3, bool), 8, PlanOptions(ranks_per_node=4))
    state = Loads(8, cap=10**9)
    state.seconds[:] = [5.0, 5.0, 4.0, 1.0, 1.0, 3.0, 5.0, 5.0]
    # ranks 3-4 (loads 1, 1) would cross the node boundary; inside a node 4-5 (1, 3) beats 2-3 (4, 1)
    assert state.best_window(problem.cutter.cut(0, 2), problem.rpn) == 4
    state.seconds[:] = [5.0, 5.0, 5.0, 1.0, 1.0, 5.0, 5.0, 5.0]
    assert state.best_window(problem.cutter.cut(0, 2), problem.rpn) in (2, 4)


@pytest.mark.parametrize("grain", [1.0, 0.5, 0.25])
def test_at_every_grain_a_document_whose_work_fits_a_node_gets_a_group_inside_one(grain):
    """The grain cuts finer (up to 4 x a document's ranks), but never past a node for work that fits one."""
    from blockdiag_cp.plan.grouped import _Problem

    lengths = lognormal_rows(2, row=8192, seed=5)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    problem = _Problem.of(starts, lengths, np.ones(lengths.size, bool), 16, PlanOptions(ranks_per_node=4))
    draft = problem.draft(grain)
    sizes = {p.group.run: p.group.size for p in draft.groups}
    fits = {r for r in sizes if math.ceil(problem.whole[r] / problem.ideal) <= 4}
    assert fits and all(sizes[r] <= 4 and p.first // 4 == (p.first + p.group.size - 1) // 4
                        for p in draft.groups for r in [p.group.run] if r in fits)
    if grain < 1:
        assert any(math.ceil(problem.whole[r] / (grain * problem.ideal)) > 4 for r in fits)  # the clamp mattered


def test_the_token_cap_binds_where_time_alone_would_not_keep_it():
    """Pairs cost everything, tokens nothing: time alone would pile the short documents onto the ranks beside
    the long one's group; the cap keeps every rank within 1.25x the mean tokens."""
    lengths = np.array([6000] + [40] * 150)
    costs = StepCosts(token_seconds=1e-12, pair_seconds=1.0)
    placement = place(lengths, 4, costs=costs)
    assert placement.tokens.max() <= math.ceil(1.25 * lengths.sum() / 4)
    free = place(lengths, 4, costs=costs, token_cap=100.0)
    assert free.tokens.max() > math.ceil(1.25 * lengths.sum() / 4)  # without the cap it would not hold


@pytest.mark.parametrize("dp, seed", [(8, 0), (8, 1), (32, 2)])
def test_modeled_step_near_the_ideal_and_well_over_fixed_rows(dp, seed):
    projections = [project(batch, 4, PlanOptions(ranks_per_node=8)) for batch in sft_micro_batches(dp, 6, seed)]
    fixed = sum(p.fixed_seconds for p in projections)
    grouped = sum(p.grouped.step_seconds for p in projections)
    ideal = sum(p.grouped.ideal for p in projections)
    assert grouped <= 1.05 * ideal and max(p.of_ideal for p in projections) <= 1.08
    assert fixed / grouped >= 1.3
    for p in projections:
        assert p.grouped.tokens.max() <= math.ceil(1.25 * p.grouped.tokens.mean())


def test_each_ranks_modeled_compute_from_the_materialized_plan():
    """Recompute every rank's compute from its pieces (rectangles of >= 768 queries at 0.88, a cost per piece,
    the extra of a piece that continues its document): independent of how the planner cut and costed groups."""
    lengths = np.array([9000, 3000, 700, 40, 2, 5000, 1, 300, 12000, 64])
    ids = doc_ids_from_lengths(tuple(lengths.tolist()))
    costs = StepCosts(token_seconds=COSTS.token_seconds, pair_seconds=COSTS.pair_seconds, carry_seconds=3e-6,
                      piece_seconds=2e-4)
    placement = place(lengths, 6, ranks_per_node=3, costs=costs)
    plan = placement.shard_plan(ids.numel())
    for rank, pieces in enumerate(pieces_by_rank(plan, ids)):
        seconds = 0.0
        for _, offset, n in pieces:
            rate = costs.rectangle_factor if n >= costs.rectangle_min_queries else 1.0
            seconds += costs.token_seconds * n + costs.pair_seconds * (n * (n + 1) / 2 + rate * n * offset)
            seconds += costs.piece_seconds + (costs.carry_seconds * n if offset > 0 else 0.0)
        assert seconds == pytest.approx(placement.compute[rank], rel=1e-9), rank
        assert plan.local_lens[rank] == placement.tokens[rank]
    whole = costs.token_seconds * lengths + costs.pair_seconds * lengths * (lengths + 1) / 2 + costs.piece_seconds
    assert placement.ideal == pytest.approx(whole.sum() / 6, rel=1e-12)  # every document whole, a piece each


def test_each_ranks_modeled_bytes_are_what_the_needed_only_exchange_moves():
    lengths = np.array([4000, 100, 2500, 7, 9000, 30, 1, 600])
    ids = doc_ids_from_lengths(tuple(lengths.tolist()))
    costs = StepCosts(kv_bytes_per_token=10.0)
    placement = place(lengths, 5, ranks_per_node=2, costs=costs)
    transfer = StepGeometry.build(placement.shard_plan(ids.numel()), ids).transfer  # [dst, src] rows
    for rank in range(5):
        rows = int(transfer[:, rank].sum() + transfer[rank, :].sum())  # sent forward + gradients sent back
        assert placement.intra_bytes[rank] + placement.inter_bytes[rank] == pytest.approx(10.0 * rows), rank
    assert placement.inter_bytes.sum() > 0  # the 9000-token document needs more than a node here


def test_group_members_hold_equal_kernel_work():
    """Head and tail chunks; the middle member's two chunks touch (one piece, whose inner rectangle counts as
    square), so the cut gives it a few tokens less: equal kernel work, near-equal tokens."""
    ids = doc_ids_from_lengths((8000,))
    plan = plan_shards(ids, 4, "grouped")
    assert max(plan.local_lens) / min(plan.local_lens) < 1.005
    work = []
    for pieces in pieces_by_rank(plan, ids):
        assert len(pieces) in (1, 2)
        work.append(sum(COSTS.token_seconds * n + COSTS.pair_seconds * (
            n * (n + 1) / 2 + (0.88 if n >= 768 else 1.0) * n * off) for _, off, n in pieces))
    assert max(work) / min(work) < 1.002


def test_a_window_cuts_contiguous_chunks_of_equal_work():
    ids = doc_ids_from_lengths((6000, 50))
    costs = StepCosts(token_seconds=16.0, pair_seconds=1.0)
    plan = plan_shards(ids, 3, "grouped", options=PlanOptions(window=256, costs=costs))
    pieces = pieces_by_rank(plan, ids)
    long_doc = [p for rank in pieces for p in rank if p[0] == 1]
    assert len(long_doc) == 3  # one contiguous piece per member
    work = [16.0 * n + pairs_before(np.array([o + n]), 256)[0] - pairs_before(np.array([o]), 256)[0]
            for _, o, n in long_doc]
    assert max(work) / min(work) < 1.01
    assert long_doc[0][2] > long_doc[1][2]  # the first chunk has fewer pairs per token: more tokens


def test_deterministic_and_the_row_level_entry_equals_the_lengths_entry():
    lengths = lognormal_rows(2, row=8192, seed=3)
    ids = doc_ids_from_lengths(tuple(lengths.tolist()))
    a, b = plan_grouped(ids, 7), plan_grouped(ids, 7)
    assert torch.equal(a.positions, b.positions) and a.local_lens == b.local_lens
    c = place(lengths, 7).shard_plan(ids.numel())
    assert torch.equal(a.positions, c.positions)


def test_padding_runs_are_placed_as_tokens_and_a_token_cap_of_one_is_equal_shards_where_it_can_be():
    ids = doc_ids_from_lengths((300, -120, 80, 80, -40, 220))
    plan = plan_shards(ids, 4, "grouped", options=PlanOptions(token_cap=1.0))
    assert plan.padded_len == ids.numel() and max(plan.local_lens) <= ids.numel() // 4 + 1


@pytest.mark.parametrize("segments", [(300, -120, 80, 80, -40, 220), (3000, -1200, 800, 800, -400, 2200),
                                      (5000, -2000, 300, 300, 300), (4096, 1500, -700, 600, 500, -900, 1200)])
def test_padding_runs_go_to_the_least_busy_ranks_where_the_cap_leaves_room(segments):
    """Padding costs only its tokens' time: with room under the default cap it fills the ranks whose modeled
    time is lowest, so the step stays at the ideal (spread evenly it would cost 6-11% here)."""
    lengths = np.abs(np.array(segments, dtype=np.int64))
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    placement = place_runs(starts, lengths, np.array(segments) > 0, 4, PlanOptions())
    assert placement.step_seconds <= 1.01 * placement.ideal, placement.seconds / placement.ideal
    assert int(placement.tokens.sum()) == int(lengths.sum())


@pytest.mark.parametrize("token_cap", [1.0, 1.1, 1.25])
def test_padding_respects_the_token_cap_where_the_least_busy_ranks_have_little_room(token_cap):
    """A long document keeps some ranks busy with few tokens: padding, cheap in time, would pile onto the others
    past the memory cap; the cap holds (every rank at most ceil(token_cap x the mean) positions)."""
    costs = StepCosts(token_seconds=1.0, pair_seconds=1.0)
    for segments in [(3000,) + (20,) * 50 + (-1500,), (4000, -800) + (10,) * 100 + (-700,),
                     (2500,) + (30,) * 40 + (-900, 600, -600)]:
        ids = doc_ids_from_lengths(segments)
        plan = plan_shards(ids, 4, "grouped", options=PlanOptions(token_cap=token_cap, costs=costs))
        assert max(plan.local_lens) <= math.ceil(token_cap * ids.numel() / 4), (segments, plan.local_lens)


@pytest.mark.parametrize("knob, value, message", [
    ("token_cap", 0.9, "token_cap"), ("token_cap", float("inf"), "token_cap"), ("ranks_per_node", 0, "ranks_per_node"),
    ("costs", "fast", "StepCosts"), ("window", 0, "window")])
def test_bad_knobs_are_value_errors(knob, value, message):
    with pytest.raises(ValueError, match=message):
        plan_shards(doc_ids_from_lengths((5, 5)), 2, "grouped", options=PlanOptions(**{knob: value}))


def test_step_costs_from_a_config_and_bad_numbers():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                                      num_key_value_heads=8, intermediate_size=8192, vocab_size=128256)
    assert StepCosts.from_config(config) == StepCosts()
    mla = transformers.DeepseekV3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, qk_nope_head_dim=16,
                                        qk_rope_head_dim=8, v_head_dim=12, kv_lora_rank=16, q_lora_rank=None,
                                        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    costs = StepCosts.from_config(mla)
    assert costs.kv_bytes_per_token == mla.num_key_value_heads * (24 + 12) * 2 * 2
    hybrid = transformers.Qwen3_5TextConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=16,
                                            layer_types=["linear_attention"] * 3 + ["full_attention"])
    assert StepCosts.from_config(hybrid).pair_seconds == pytest.approx(StepCosts.from_config(
        transformers.Qwen3_5TextConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=16,
                                       layer_types=["full_attention"] * 4)).pair_seconds / 4)
    for bad in (dict(token_seconds=-1.0), dict(pair_seconds=float("inf")), dict(intra_gbps=0),
                dict(token_seconds=0.0, pair_seconds=0.0)):
        with pytest.raises(ValueError):
            StepCosts(**bad)


def test_step_costs_of_mla_count_a_pair_at_query_key_plus_value_width():
    """A query-key pair costs ``7 H (D_qk + D_v)`` FLOPs per attention layer (Note [The step's cost model]); MLA's
    widths differ (24 and 12 here), so counting either one twice is visible."""
    transformers = pytest.importorskip("transformers")
    mla = transformers.DeepseekV3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, qk_nope_head_dim=16,
                                        qk_rope_head_dim=8, v_head_dim=12, kv_lora_rank=16, q_lora_rank=None,
                                        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    costs = StepCosts.from_config(mla, tflops=1e-12)  # seconds == FLOPs
    assert costs.pair_seconds == pytest.approx(7 * 4 * (24 + 12) * 2)


def test_step_costs_of_moe_count_the_active_experts_not_all_of_them():
    """Per token, an MoE layer runs its `num_experts_per_tok` experts of `moe_intermediate_size`; the total expert
    count changes the parameters, not a token's work."""
    transformers = pytest.importorskip("transformers")

    def qwen3_moe(**experts):
        return transformers.Qwen3MoeConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                           num_key_value_heads=2, head_dim=16, intermediate_size=128,
                                           moe_intermediate_size=32, vocab_size=100, **experts)

    costs = StepCosts.from_config(qwen3_moe(num_experts=64, num_experts_per_tok=2), tflops=1e-12)
    projections = 64 * (4 * 32 + 2 * 32)  # q, o at 4 heads and k, v at 2, each 16 wide
    assert costs.token_seconds == pytest.approx(6 * (2 * (projections + 3 * 64 * 32 * 2) + 64 * 100))
    assert StepCosts.from_config(qwen3_moe(num_experts=8, num_experts_per_tok=2), tflops=1e-12) == costs
    more_active = StepCosts.from_config(qwen3_moe(num_experts=64, num_experts_per_tok=4), tflops=1e-12)
    assert more_active.token_seconds - costs.token_seconds == pytest.approx(6 * 2 * 3 * 64 * 32 * 2)


def test_rows_packed_best_fit_decreasing():
    rows = pack_rows([5, 9, 3, 7, 2, 20, 1], 10)
    assert sorted(int(r.sum()) for r in rows) == [7, 10, 10, 10, 10]  # 20 -> 10 + 10; 9 + 1; 7 + 3; 5 + 2
    assert sorted(np.concatenate(rows).tolist()) == sorted([5, 9, 3, 7, 2, 10, 10, 1])
    best_fit = pack_rows([6, 5, 4, 3], 10)  # 6 opens a row, 5 another; 4 fits both: best fit is the 6-row (room 4)
    assert [r.tolist() for r in best_fit] == [[6, 4], [5, 3]]
    with pytest.raises(ValueError):
        pack_rows([3, 0], 10)
