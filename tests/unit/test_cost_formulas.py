"""The step's cost formulas (Note [The step's cost model]), each against numbers worked out here: the `StepCosts`
methods the grouped planner, the whole-batch projection and `blockdiag-cp plan` cost work with."""

import numpy as np
import pytest

from blockdiag_cp.plan import PlanOptions, StepCosts
from blockdiag_cp.plan.step_costs import pair_flops, pairs_before, transformer_flops
from blockdiag_cp.plan.whole_batch import project

#: small integers, so that every expected number below is exact
COSTS = StepCosts(token_seconds=3.0, pair_seconds=2.0, carry_seconds=5.0, piece_seconds=7.0, intra_gbps=2.0,
                  inter_gbps=0.5)


def brute_pairs(n, window):
    """Query q (0-based) of a document sees keys max(0, q - window + 1) .. q."""
    return sum(q + 1 if window is None else min(q + 1, window) for q in range(n))


@pytest.mark.parametrize("window", [None, 1, 3, 7, 50])
def test_pairs_before_counts_each_querys_keys(window):
    n = np.arange(41)
    assert pairs_before(n, window).tolist() == [brute_pairs(int(k), window) for k in n]


def test_seconds_is_tokens_pairs_carried_tokens_and_pieces():
    assert COSTS.seconds(10, 100) == 3 * 10 + 2 * 100 + 7
    assert COSTS.seconds(10, 100, pieces=3, carried=4) == 3 * 10 + 2 * 100 + 5 * 4 + 7 * 3
    assert COSTS.seconds(np.array([1, 2]), np.array([0, 5]), pieces=0).tolist() == [3, 16]


@pytest.mark.parametrize("window", [None, 4])
def test_document_and_row_seconds(window):
    lengths = np.array([10, 5, 1, 9])
    real = np.array([True, False, True, True])
    whole = [3 * n + 2 * brute_pairs(n, window) + 7 for n in lengths.tolist()]
    assert COSTS.document_seconds(lengths, window).tolist() == whole
    # a run of padding costs its tokens: no pairs, no piece
    assert COSTS.document_seconds(lengths, window, real).tolist() == [whole[0], 3 * 5, whole[2], whole[3]]
    assert COSTS.row_seconds(lengths, window) == sum(whole)  # a row: its documents whole, one piece each


def test_span_pairs_count_the_rectangle_at_its_factor_from_its_threshold_on():
    costs = StepCosts(rectangle_factor=0.5, rectangle_min_queries=768)
    lo = np.array([0, 100, 100, 100])
    hi = np.array([768, 868, 867, 101])
    n = (hi - lo).astype(float)
    rate = np.array([0.5, 0.5, 1.0, 1.0])  # 768 queries: at the factor; 767: as pairs
    assert costs.span_pairs(lo, hi).tolist() == (n * (n + 1) / 2 + rate * n * lo).tolist()
    # under a window: exactly the span's pairs, the keys before it counted only within the window
    assert costs.span_pairs(np.array([0, 6, 30]), np.array([6, 10, 31]), 4).tolist() == [
        brute_pairs(6, 4), brute_pairs(10, 4) - brute_pairs(6, 4), 4]


def test_span_seconds_carry_only_a_span_that_continues_its_document():
    costs = StepCosts(token_seconds=3.0, pair_seconds=2.0, carry_seconds=5.0, piece_seconds=7.0,
                      rectangle_min_queries=10**9)
    lo, hi = np.array([0, 4]), np.array([4, 6])
    assert costs.span_seconds(lo, hi).tolist() == [3 * 4 + 2 * 10 + 7, 3 * 2 + 2 * (3 + 2 * 4) + 5 * 2 + 7]


def test_link_and_exposed_seconds():
    assert COSTS.link_seconds(4e9, 1e9) == 4 / 2 + 1 / 0.5
    exposed = COSTS.exposed_seconds(np.array([4e9, 4e9, 0.0]), np.array([1e9, 0.0, 0.0]), np.array([1.0, 3.0, 1.0]))
    assert exposed.tolist() == [3.0, 0.0, 0.0]  # what hides behind the own-key attention is not added


def test_pair_flops_and_the_attention_costs_blockdiag_cp_plan_predicts_with():
    assert pair_flops(heads=2, head_dim=3, v_head_dim=5, layers=4) == 7 * 2 * (3 + 5) * 4
    per_pair = transformer_flops(hidden=64, layers=4, heads=2, kv_heads=1, head_dim=3, v_head_dim=5, intermediate=8,
                                 vocab=10, attention_layers=3)[1]
    assert per_pair == pair_flops(heads=2, head_dim=3, v_head_dim=5, layers=3)
    layer = StepCosts.for_attention(head_dim=192, v_head_dim=128, tflops=2.0, intra_gbps=3.0, inter_gbps=4.0)
    assert layer.pair_seconds == pytest.approx(7 * (192 + 128) / 2e12, rel=1e-15) and layer.token_seconds == 0
    assert (layer.intra_gbps, layer.inter_gbps) == (3.0, 4.0)
    assert StepCosts.for_attention(head_dim=64).pair_seconds == pytest.approx(7 * 128 / 400e12, rel=1e-15)


@pytest.mark.parametrize("window", [None, 300])
def test_fixed_rows_are_the_heaviest_row_over_its_cp_ranks(window):
    costs = StepCosts(token_seconds=3.0, pair_seconds=2.0, piece_seconds=1e4)
    batch = [np.array([1000, 20, 20]), np.array([900, 200]), np.array([30] * 40)]
    work = [sum(3 * n + 2 * brute_pairs(n, window) + 1e4 for n in row.tolist()) for row in batch]
    projection = project(batch, 2, PlanOptions(costs=costs, window=window))
    assert projection.fixed_seconds == max(work) / 2
    assert projection.grouped.ideal == pytest.approx(sum(work) / 6, rel=1e-12)
