"""Forward and backward parity with the dense float64 oracle on real gloo collectives.

One rank-pool run per world computes the whole matrix (scenario x exchange x kernel x layout, plus
activation checkpointing); each test then asserts one exchange's slice of it.
"""

import itertools

import pytest

from blockdiag_cp.plan import plan_shards
from blockdiag_cp.testing import ParityCase, parity_worker, spawn
from scenarios import EXCHANGES, KERNELS, LAYOUTS, SCENARIOS, matrix_cases

TOL = 1e-10


@pytest.fixture(scope="module")
def results_for(rank_pools):
    """``results_for(world)``: every rank's results for the whole matrix of that world, run once."""
    cache = {}

    def get(world: int):
        if world not in cache:
            cache[world] = rank_pools(world).run(parity_worker, matrix_cases(world))
        return cache[world]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("exchange", EXCHANGES)
def test_matches_float64_oracle(world, exchange, results_for):
    per_rank = results_for(world)
    checked, bad = 0, []
    for rank, results in enumerate(per_rank):
        for r in results:
            if r.case.kv_exchange != exchange:
                continue
            checked += 1
            if not (r.out_err < TOL and r.grad_err < TOL):
                c = r.case
                bad.append(f"rank {rank} {c.segments} kernel={c.kernel} layout={c.layout} ckpt={c.checkpoint} "
                           f"ran={r.exchange}: out {r.out_err:.2e} grad {r.grad_err:.2e}")
    assert checked == world * sum(c.kv_exchange == exchange for c in matrix_cases(world))
    assert not bad, "\n".join(bad)


def expected_routing(case, world):
    """What `halo` and `auto` must run, derived here from first principles (not the library's geometry).

    Rank r needs the keys of its documents up to its last query in each; halo serves
    iff every key a rank needs from another rank lies on its left neighbour.
    """
    ids = case.doc_ids.tolist()
    owners = plan_shards(case.doc_ids, world, case.layout).owner().tolist()
    foreign = set()  # (needing rank, owning rank)
    for r in range(world):
        last = {}
        for g, (doc, owner) in enumerate(zip(ids, owners)):
            if doc and owner == r:
                last[doc] = g
        foreign |= {(r, owners[g]) for g, doc in enumerate(ids) if doc in last and g <= last[doc] and owners[g] != r}
    halo_serves = all(src == dst - 1 for dst, src in foreign)
    return {"halo": "halo" if halo_serves else "a2a",
            "auto": "a2a" if not foreign else ("halo" if halo_serves else "a2a")}


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_every_exchange_routes_as_it_should(world, results_for):
    """allgather, a2a and ring run as named; halo and auto run exactly what the geometry calls for."""
    checked = 0
    for results in results_for(world):
        for r in results:
            requested = r.case.kv_exchange
            want = requested if requested in ("allgather", "a2a", "ring") else expected_routing(r.case, world)[requested]
            assert r.exchange == want, (r.case, r.exchange, want)
            checked += 1
    assert checked == world * len(matrix_cases(world))
    ran = {(r.case.kv_exchange, r.exchange) for results in results_for(world) for r in results}
    assert ("auto", "halo") in ran and ("halo", "halo") in ran  # both branches are exercised


@pytest.mark.slow  # the world-4 parity grid (4 ranks on 2 cores): the full suite runs it
def test_halo_with_document_over_three_ranks_falls_back_exactly(results_for):
    per_rank = results_for(4)
    spanning = [r for results in per_rank for r in results
                if r.case.kv_exchange == "halo" and r.case.segments == (37,) and r.case.layout == "contiguous"]
    assert spanning and all(r.exchange == "a2a" for r in spanning)
    assert all(r.out_err < TOL and r.grad_err < TOL for r in spanning)


def many_documents(seed: int = 0, docs: int = 300) -> tuple[int, ...]:
    """Hundreds of documents per row: mostly 1-8 tokens, 1-token documents between long ones, some padding."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(docs):
        if i % 37 == 5:
            out += [rng.randint(60, 180), 1]  # a long document, then a 1-token one
        elif i % 53 == 7:
            out.append(-rng.randint(1, 4))
        else:
            out.append(rng.choice([1, 1, 2, 3, 5, 8]))
    return tuple(out)


def many_docs_cases():
    segments = many_documents()
    return [ParityCase(segments, heads=4, kv_heads=2, head_dim=8, kv_exchange=ex, kernel=k, layout=lay, seed=7)
            for ex in ("auto", "ring") for k in ("sdpa", "dense") for lay in ("contiguous", "balanced")
            if not (k == "dense" and ex != "auto")]


@pytest.mark.slow
@pytest.mark.parametrize("world", [3])
def test_hundreds_of_documents_per_rank_match_the_oracle(world, rank_pools):
    """The batching of tiny pieces (padded buckets, equal shapes) is exact, forward and backward."""
    cases = many_docs_cases()
    assert sum(n > 0 for n in cases[0].segments) >= 300
    per_rank = rank_pools(world).run(parity_worker, cases)
    for results in per_rank:
        assert len(results) == len(cases)
        for r in results:
            assert r.out_err < TOL and r.grad_err < TOL, (r.case.kv_exchange, r.case.kernel, r.case.layout,
                                                          r.out_err, r.grad_err)


def layer_feature_cases():
    """Sliding windows shorter than the documents, with softcapping and sinks, on every exchange."""
    segments = (5, 9, -2, 13, 1, 2, 3, -3, 27)
    features = [dict(window=4), dict(window=1), dict(window=6, softcap=30.0, sinks=True), dict(softcap=5.0, sinks=True)]
    return [ParityCase(segments, heads=4, kv_heads=2, kv_exchange=ex, kernel=k, layout=lay, seed=3, **f)
            for ex in EXCHANGES for k in ("sdpa", "dense") for lay in ("contiguous", "balanced") for f in features]


@pytest.mark.slow
def test_windows_softcap_and_sinks_match_the_oracle():
    cases = layer_feature_cases()
    for results in spawn(parity_worker, 3, cases, timeout=600):
        assert len(results) == len(cases)
        bad = [(r.case.kv_exchange, r.case.kernel, r.case.layout, r.case.window, r.case.softcap, r.case.sinks,
                r.out_err, r.grad_err) for r in results if not (r.out_err < TOL and r.grad_err < TOL)]
        assert not bad, bad
        windowed_ring = [r for r in results if r.case.kv_exchange == "ring" and r.case.window is not None]
        assert windowed_ring and all(r.exchange == "a2a" for r in windowed_ring)  # ring serves windows via a2a


def mla_cases(world: int) -> list[ParityCase]:
    """Multi-head latent attention (values of another head dim than queries and keys: 5 or 12 against 8) on
    every exchange x CPU kernel x layout, with GQA 8:2, 4:4 and 4:1, windows, softcap with sinks, rows that
    straddle, span every rank or leave ranks of only padding; activation checkpointing; head parallelism."""
    rows = [SCENARIOS[n] for n in ("straddle", "one_doc_all_ranks", "padding_ranks", "tiny_docs", "mixed")]
    features = [{}, {"window": 4}, {"softcap": 5.0, "sinks": True}]
    heads = [(8, 2), (4, 4), (4, 1)]
    cases = []
    for i, (exchange, kernel, layout) in enumerate(itertools.product(EXCHANGES, KERNELS, LAYOUTS)):
        h, hk = heads[(i // 2) % 3]
        cases.append(ParityCase(rows[i % 5], heads=h, kv_heads=hk, v_head_dim=(5, 12)[(i + i // 4) % 2],
                                kv_exchange=exchange, kernel=kernel, layout=layout, seed=i, **features[i % 3]))
    for mode, exchange in (("reentrant", "a2a"), ("non_reentrant", "ring")):
        cases.append(ParityCase(SCENARIOS["straddle"], heads=8, kv_heads=2, v_head_dim=5, kv_exchange=exchange,
                                kernel="sdpa", checkpoint=mode, seed=98))
    degree, h = (3, 6) if world == 3 else (2, 4)
    for exchange, hk, extra in (("a2a", degree, {}), ("ring", degree, {"sinks": True}),
                                ("allgather", degree, {"window": 4}), ("auto", 1, {})):  # 1 K/V head: repeated
        cases.append(ParityCase(SCENARIOS["mixed"], heads=h, kv_heads=hk, v_head_dim=5, kv_exchange=exchange,
                                layout="balanced", ulysses_degree=degree, seed=97, **extra))
    return cases


#: a few of them on the fast loop (world 2)
MLA_FAST = [ParityCase(SCENARIOS["straddle"], heads=8, kv_heads=2, v_head_dim=5, kv_exchange="a2a"),
            ParityCase(SCENARIOS["mixed"], heads=4, kv_heads=4, v_head_dim=12, kv_exchange="ring", sinks=True),
            ParityCase(SCENARIOS["straddle"], heads=4, kv_heads=1, v_head_dim=5, kv_exchange="allgather",
                       kernel="dense", layout="balanced", window=4),
            ParityCase(SCENARIOS["one_doc_all_ranks"], heads=4, kv_heads=2, v_head_dim=5, kv_exchange="halo",
                       checkpoint="non_reentrant"),
            ParityCase(SCENARIOS["mixed"], heads=4, kv_heads=2, v_head_dim=5, ulysses_degree=2, layout="balanced")]


def assert_mla_exact(per_rank, cases):
    for results in per_rank:
        assert [r.case for r in results] == cases
        bad = [(r.case, r.exchange, r.out_err, r.grad_err) for r in results if not (r.out_err < TOL and r.grad_err < TOL)]
        assert not bad, bad
        assert all(r.output.shape[-1] == r.case.value_dim for r in results)


def test_mla_value_head_dim_is_exact_on_the_fast_loop(rank_pools):
    assert_mla_exact(rank_pools(2).run(parity_worker, MLA_FAST), MLA_FAST)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_mla_value_head_dim_matches_the_oracle_everywhere(world, rank_pools):
    cases = mla_cases(world)
    assert_mla_exact(rank_pools(world).run(parity_worker, cases), cases)
