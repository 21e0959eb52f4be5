"""Step geometry against a position-by-position brute force: who needs which keys, and how many move."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from blockdiag_cp.plan.geometry import StepGeometry
from blockdiag_cp.plan import plan_shards
from blockdiag_cp.testing import doc_ids_from_lengths


def brute_need(ids, owner, world, window=None):
    """need[j][g]: rank j owns a real query of g's document at a position q >= g (and q < g + window)."""
    S = len(ids)
    end = lambda g: S if window is None else min(S, g + window)
    return [[bool(ids[g]) and any(owner[q] == j and ids[q] == ids[g] for q in range(g, end(g))) for g in range(S)]
            for j in range(world)]


segments = st.lists(st.one_of(st.integers(1, 15), st.integers(-5, -1)), min_size=1, max_size=10).filter(
    lambda s: any(n > 0 for n in s))


@settings(max_examples=80, deadline=None)
@given(segs=segments, world=st.integers(1, 5), layout=st.sampled_from(["contiguous", "balanced"]),
       window=st.one_of(st.none(), st.integers(1, 12)))
def test_geometry_matches_brute_force(segs, world, layout, window):
    ids = doc_ids_from_lengths(segs)
    plan = plan_shards(ids, world, layout)
    geometry = StepGeometry.build(plan, ids)
    padded = geometry.doc_ids.tolist()
    owner = geometry.owner.tolist()
    need = brute_need(padded, owner, world, window)
    everything = torch.arange(len(padded))
    assert geometry.need_at(everything, window).tolist() == need
    if window is None:
        assert geometry.need_WS.tolist() == need
    for r in range(world):
        assert geometry.needed_positions(r, window).tolist() == [g for g in range(len(padded)) if need[r][g]]
    transfer = [[sum(need[d][g] for g in range(len(padded)) if owner[g] == s) if d != s else 0
                 for s in range(world)] for d in range(world)]
    assert geometry.transfer_under(window).tolist() == transfer
    real_lengths = [n for n in segs if n > 0]
    assert geometry.longest_document == max(real_lengths)


def test_need_at_a_subset_equals_the_full_matrix():
    ids = doc_ids_from_lengths((7, -2, 30, 4, 1, -3, 12))
    geometry = StepGeometry.build(plan_shards(ids, 3, "balanced"), ids)
    positions = torch.tensor([0, 5, 9, 10, 38, 40, 58])
    assert torch.equal(geometry.need_at(positions), geometry.need_WS[:, positions])
