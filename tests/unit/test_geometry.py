"""Step geometry against a position-by-position brute force: who needs which keys, and how many move."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from blockdiag_cp.plan.geometry import StepGeometry
from blockdiag_cp.plan import PlanOptions, StepCosts, plan_shards
from blockdiag_cp.testing import doc_ids_from_lengths


def brute_need(ids, owner, world, window=None):
    """need[j][g]: rank j owns a real query of g's document at a position q >= g (and q < g + window)."""
    S = len(ids)
    end = lambda g: S if window is None else min(S, g + window)
    return [[bool(ids[g]) and any(owner[q] == j and ids[q] == ids[g] for q in range(g, end(g))) for g in range(S)]
            for j in range(world)]


segments = st.lists(st.one_of(st.integers(1, 15), st.integers(-5, -1)), min_size=1, max_size=10).filter(
    lambda s: any(n > 0 for n in s))


def brute_pieces(ids, positions):
    """A rank's pieces from its positions: (local start, length, global start, document start) of each run of
    consecutive positions of one real document."""
    out, S = [], len(ids)
    for i, g in enumerate(positions):
        if g >= S or ids[g] == 0:
            continue
        if out and positions[i - 1] == g - 1 and ids[g - 1] == ids[g] and out[-1][0] + out[-1][1] == i:
            out[-1][1] += 1
            continue
        start = g
        while start > 0 and ids[start - 1] == ids[g]:
            start -= 1
        out.append([i, 1, g, start])
    return [tuple(p) for p in out]


#: tiny rows plan as real ones under the grouped layout with these costs (documents cut over groups)
GROUPED_COSTS = StepCosts(token_seconds=4.0, pair_seconds=1.0)


@settings(max_examples=80, deadline=None)
@given(segs=segments, world=st.integers(1, 5), layout=st.sampled_from(["contiguous", "balanced", "grouped"]),
       window=st.one_of(st.none(), st.integers(1, 12)))
def test_geometry_matches_brute_force(segs, world, layout, window):
    ids = doc_ids_from_lengths(segs)
    plan = plan_shards(ids, world, layout, options=PlanOptions(costs=GROUPED_COSTS if layout == "grouped" else None))
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
    assert geometry.documents_cross_ranks(window) == any(any(row) for row in transfer)
    for r in range(world):
        recv, send = geometry.transfer_of(r, window)
        assert recv.tolist() == transfer[r] and send.tolist() == [transfer[d][r] for d in range(world)]
        positions = plan.rank_positions(r).tolist()
        p = geometry.pieces(r)
        got = list(zip(*(t.tolist() for t in (p.local_start, p.length, p.global_start, p.doc_start))))
        assert got == brute_pieces(padded, positions), (r, positions)
        block = plan.max_local_len  # an all-gather of blocks padded to the longest shard
        assert [int(geometry.gathered_row[g]) for g in positions] == [r * block + i for i in range(len(positions))]
    real_lengths = [n for n in segs if n > 0]
    assert geometry.longest_document == max(real_lengths)


def test_need_at_a_subset_equals_the_full_matrix():
    ids = doc_ids_from_lengths((7, -2, 30, 4, 1, -3, 12))
    geometry = StepGeometry.build(plan_shards(ids, 3, "balanced"), ids)
    positions = torch.tensor([0, 5, 9, 10, 38, 40, 58])
    assert torch.equal(geometry.need_at(positions), geometry.need_WS[:, positions])


class _LoopbackA2A:
    """An `a2a` exchange of one rank whose transport hands over what the other ranks would send
    (their owned rows this rank needs, grouped by source, ascending), from the global K/V."""

    @staticmethod
    def build(geometry, rank, k_SHD, v_SHD):
        from blockdiag_cp.exchange.base import ExchangeSetup, fuse_rows
        from blockdiag_cp.exchange.needed import AllToAllExchange
        from blockdiag_cp.kernels import SdpaKernel

        needed = geometry.needed_positions(rank)
        owner = geometry.owner[needed]
        rows = torch.cat([needed[owner == src] for src in range(geometry.world) if src != rank])

        class Loopback(AllToAllExchange):
            def transport(self, rows_TX, send_splits, recv_splits):
                return fuse_rows(k_SHD[rows], v_SHD[rows])

        return Loopback(ExchangeSetup(geometry, rank, None, (SdpaKernel(),), torch.device("cpu")))


@pytest.mark.parametrize("v_dim", [4, 3])  # values as wide as keys, or narrower (MLA: Note [Fused K/V rows])
@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
@pytest.mark.parametrize("segments", [(40,), (9, 30, 1), tuple([3, 5, 2, 7] * 6), (60, 2, 3, 4, 5, 6, 7, 8, 9),
                                      (27, 5, 7, 27)])  # the last: balanced rank 0 has > 8 runs (slots)
def test_needed_only_buffer_holds_every_needed_row_head_major(layout, segments, v_dim):
    """Note [Head-major key buffer]: the buffer is K/V at the needed positions, in order, each head's
    rows contiguous (one strided copy per run, or per slot), local and received rows alike."""
    from blockdiag_cp.plan import make_plan

    ids = doc_ids_from_lengths(segments)
    world = 3
    plan = make_plan(ids, world, layout)
    geometry = StepGeometry.build(plan, ids)
    S = plan.positions_WL.numel()
    k_SHD, v_SHD = torch.randn(S, 2, 4, dtype=torch.float64), torch.randn(S, 2, v_dim, dtype=torch.float64)
    for rank in range(world):
        exchange = _LoopbackA2A.build(geometry, rank, k_SHD, v_SHD)
        mine = plan.positions_WL[rank]
        # the layer's token-major rows, as a model hands them over (a strided view)
        k_local, v_local = (t[mine].transpose(0, 1).contiguous().transpose(0, 1) for t in (k_SHD, v_SHD))
        k_buf, v_buf = exchange.gather_rows(k_local, v_local)
        needed = geometry.needed_positions(rank)
        assert torch.equal(k_buf, k_SHD[needed]) and torch.equal(v_buf, v_SHD[needed])
        if k_buf.data_ptr() != k_local.data_ptr():  # a fresh buffer (not the local rows' own view)
            assert k_buf.transpose(0, 1).is_contiguous() and v_buf.transpose(0, 1).is_contiguous()
