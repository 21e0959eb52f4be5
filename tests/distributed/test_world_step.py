"""The whole-batch step (`make_cp_world_batch_and_ctx`) on real gloo ranks: every replica's row planned over
all dp x cp ranks (unequal shards), attention forward and backward against each replica row's float64 oracle,
on every exchange and CPU kernel, GQA, windows, sinks, checkpointing, worlds 2-6; bad input raises on every rank."""

import pytest

from blockdiag_cp.testing import spawn
from blockdiag_cp.testing.world_parity import WorldCase, world_parity_worker

TOL = 1e-10

#: replica rows: one long document beside short ones, padding inside and at the tail, a 1-token document
ROWS = {
    "long_and_short": ((5, 9, -2, 13, 1, 2, 3, -3, 7), (37,)),
    "padding_rows": ((2, 17, 1, 1, 9, 3), (6, -31)),
    "many_short": ((1, 2, 3, 1, 1, 2, 3, 2, 1, 3, 2, 1), (4, -3, 6, -2, 5, -4, 3, -1), (60,)),
    "five_replicas": ((30, 2), (1, 1, 1), (17, -4, 9), (44,), (3, 5, 8, 13)),
}


#: worlds that run every exchange with both CPU kernels; the others run auto and a2a with sdpa (and the rest)
FULL_WORLDS = (2, 4)


def matrix(world):
    """The cases of one world: dp x cp = world with the rows' replicas (dp = the rows' count)."""
    cases = []
    full = world in FULL_WORLDS
    for i, (name, rows) in enumerate(ROWS.items()):
        if world % len(rows):
            continue
        cp = world // len(rows)
        heads, kv = [(4, 2), (8, 2), (4, 4)][i % 3]
        for exchange in ("auto", "p2p", "a2a", "allgather", "ring", "halo") if full else ("auto", "a2a"):
            for kernel in ("dense", "sdpa") if full else ("sdpa",):
                cases.append(WorldCase(rows, cp, heads=heads, kv_heads=kv, kv_exchange=exchange, kernel=kernel, seed=i))
        cases.append(WorldCase(rows, cp, window=4, seed=i))
        cases.append(WorldCase(rows, cp, kernel="sdpa", sinks=True, checkpoint="non_reentrant", seed=i))
        cases.append(WorldCase(rows, cp, checkpoint="reentrant", ranks_per_node=2, seed=i))
    return cases


def check(per_rank, world):
    bad, checked = [], 0
    for rank, results in enumerate(per_rank):
        for r in results:
            checked += 1
            if not (r.out_err < TOL and r.grad_err < TOL):
                c = r.case
                bad.append(f"rank {rank} {c.rows} {c.kv_exchange}/{c.kernel} window={c.window} ckpt={c.checkpoint} "
                           f"ran={r.exchange}: out {r.out_err:.1e} grad {r.grad_err:.1e}")
    assert checked == world * len(matrix(world))
    assert not bad, "\n".join(bad)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4, 5, 6])
def test_the_whole_batch_step_matches_each_rows_oracle(world, rank_pools):
    per_rank = rank_pools(world).run(world_parity_worker, matrix(world))
    check(per_rank, world)
    auto = [r for results in per_rank for r in results if r.case.kv_exchange == "auto" and r.case.window is None]
    assert {r.exchange for r in auto} <= {"p2p", "halo", "a2a"}


def test_unequal_shards_on_every_exchange_at_world_four(rank_pools):
    """The fast loop's share of the matrix: one row pair, unequal shards, each exchange once (auto: p2p)."""
    cases = [WorldCase(ROWS["long_and_short"], 2, kernel="sdpa", kv_exchange=e, checkpoint=c)
             for e, c in (("auto", None), ("allgather", None), ("a2a", None), ("ring", "non_reentrant"))]
    per_rank = rank_pools(4).run(world_parity_worker, cases)
    for i, case in enumerate(cases):
        ran = [results[i] for results in per_rank]
        assert all(r.out_err < TOL and r.grad_err < TOL for r in ran), (case.kv_exchange, ran)
        assert len({r.local_len for r in ran}) > 1  # ranks own different numbers of positions
        assert {r.exchange for r in ran} == {"p2p" if case.kv_exchange == "auto" else case.kv_exchange}
        assert sum(r.tokens for r in ran) == sum(n for row in case.rows for n in row if n > 0)  # padding left out


def bad_input_worker(rank, world, what):
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp import CPConfig, PlanOptions, make_cp_world_batch_and_ctx
    from blockdiag_cp.testing import doc_ids_from_lengths

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "cp"))
    segments = (3, 4) if mesh.get_local_rank("dp") == 0 else (5, 1)
    if what == "replica_disagrees" and rank == 1:
        segments = (2, 5)  # rank 1 is replica 0's second cp rank: it must hold replica 0's row
    ids = doc_ids_from_lengths(segments)
    batch = {"input_ids": torch.ones(1, ids.numel(), dtype=torch.long), "_packed_seq_ids": ids[None]}
    if what == "bad_batch" and rank == 2:
        batch["input_ids"] = torch.ones(2, ids.numel(), dtype=torch.long)
    config = CPConfig(layout="grouped", plan=PlanOptions(token_cap=1.5 if (what == "config_disagrees" and rank == 3) else 1.25))
    try:
        make_cp_world_batch_and_ctx(mesh, batch, config=config)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("what, message", [
    ("replica_disagrees", "replica 0 hold different rows"),
    ("bad_batch", "rejected their batch"),
    ("config_disagrees", "disagree on the CPConfig"),
])
def test_bad_input_raises_on_every_rank(what, message, rank_pools):
    errors = rank_pools(4).run(bad_input_worker, what)
    assert all(e is not None for e in errors), errors
    if what == "bad_batch":
        assert "batch size must be 1" in errors[2]
        errors = errors[:2] + errors[3:]
    assert all(message in e for e in errors), errors


#: each replica's row for the sequence-key checks (segments: n > 0 a document, -n padding)
KEY_ROWS = {"documents": ((3, -2, 5), (1, 1, 1, 1)), "single tokens": ((1, 1, 1, -2, 1, 1, 1, 1, 1), (1, 1, 1, 1))}


def shard_worker(rank, world, rows, transposed=False):
    """This rank's shard of two replica rows with every sequence key, and where its positions came from.
    `transposed`: the (dp, cp) mesh's ranks column-major (replica 0 = ranks 0 and 2), so the ranks sending a
    rank its tokens are not in position order."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    from blockdiag_cp import make_cp_world_batch_and_ctx
    from blockdiag_cp.loss import add_shift_labels
    from blockdiag_cp.testing import doc_ids_from_lengths

    if transposed:
        mesh = DeviceMesh("cpu", torch.arange(world).reshape(2, world // 2).t().reshape(2, world // 2),
                          mesh_dim_names=("dp", "cp"))
    else:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "cp"))
    d = mesh.get_local_rank("dp")
    ids = doc_ids_from_lengths(rows[d])
    S = ids.numel()
    batch = add_shift_labels({"input_ids": 100 * (d + 1) + torch.arange(S)[None], "_packed_seq_ids": ids[None],
                              "position_ids": torch.stack([torch.arange(S)[None] + 1000 * d] * 3),
                              "labels": 100 * (d + 1) + torch.arange(S)[None]})
    ctx, shard = make_cp_world_batch_and_ctx(mesh, batch, padding_token_id=7)
    return {k: v for k, v in shard.items() if isinstance(v, torch.Tensor)}, ctx.replica_of_row, ctx.state.positions


@pytest.mark.parametrize("world, transposed, rows", [(2, False, "documents"), (4, True, "single tokens")])
def test_every_sequence_key_moves_with_its_token_and_padding_positions_fill_as_the_seed_fills(world, transposed,
                                                                                               rows, rank_pools):
    """The global row is each replica's real tokens in dp order (padding left out); each key of each shard row
    is the replica's value at that token (mRoPE positions and next-token targets included), a padding position
    holds the seed's fill, and `replica_of_row` names each row's replica; also with a column-major mesh."""
    from blockdiag_cp.testing import doc_ids_from_lengths

    origin = []  # global row -> (replica, position in its row, document id there)
    for d, segments in enumerate(KEY_ROWS[rows]):
        ids = doc_ids_from_lengths(segments).tolist()
        origin += [(d, p, doc) for p, doc in enumerate(ids) if doc]
    for ids_of, replica_of_row, positions in rank_pools(world).run(shard_worker, KEY_ROWS[rows], transposed):
        for row, g in enumerate(positions.tolist()):
            if g >= len(origin):
                assert int(ids_of["input_ids"][0, row]) == 7 and int(ids_of["labels"][0, row]) == -100
                assert bool(ids_of["padding_mask"][0, row]) and int(replica_of_row[row]) == -1
                continue
            d, p, doc = origin[g]
            assert int(ids_of["input_ids"][0, row]) == 100 * (d + 1) + p, (g, row)
            assert int(ids_of["labels"][0, row]) == 100 * (d + 1) + p
            assert int(ids_of["position_ids"][1, 0, row]) == 1000 * d + p
            assert int(replica_of_row[row]) == d and not bool(ids_of["padding_mask"][0, row])
            assert int(ids_of["_packed_seq_ids"][0, row]) > 0
            follows = g + 1 < len(origin) and origin[g + 1][:1] == (d,) and origin[g + 1][1:] == (p + 1, doc)
            target = 100 * (d + 1) + p + 1 if follows else -100  # the next token of its own document
            assert int(ids_of["shift_labels"][0, row]) == target, (g, row)


def test_a_mesh_that_is_not_a_device_mesh_is_refused():
    from blockdiag_cp import make_cp_world_batch_and_ctx

    with pytest.raises(ValueError, match="DeviceMesh"):
        make_cp_world_batch_and_ctx(None, {})


def one_d_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp.testing.world_parity import run_world_case

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    return run_world_case(WorldCase(((5, 9, -2, 13, 1, 2, 3, -3, 7),), world), mesh)


def test_a_one_dimensional_mesh_is_one_replica_over_all_its_ranks(rank_pools):
    for r in rank_pools(3).run(one_d_worker):
        assert r.out_err < TOL and r.grad_err < TOL


@pytest.mark.slow
def test_spawned_ranks_run_it_too():
    """A fresh spawn (not the pool): the step's subgroup-free path on a new process group."""
    per_rank = spawn(world_parity_worker, 2, [WorldCase(((6, 20), (3, 3, 3)), 1)])
    assert all(r.out_err < TOL and r.grad_err < TOL for results in per_rank for r in results)


def tiny_worker(rank, world):
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp import make_cp_world_batch_and_ctx
    from blockdiag_cp.loss import add_shift_labels
    from blockdiag_cp.testing import doc_ids_from_lengths

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    ids = doc_ids_from_lengths(((1, -2), (1,))[mesh.get_local_rank("dp")])
    batch = add_shift_labels({"input_ids": torch.full((1, ids.numel()), 5), "_packed_seq_ids": ids[None]})
    ctx, shard = make_cp_world_batch_and_ctx(mesh, batch, padding_token_id=7)
    return shard["input_ids"].tolist(), shard["shift_labels"].tolist(), shard["padding_mask"].tolist(), \
        shard["position_ids"].tolist(), ctx.replica_of_row.tolist()


def test_ranks_beyond_the_tokens_hold_one_padding_position_each(rank_pools):
    """Two real tokens over 4 ranks: two ranks hold one padding position, filled as the seed fills padding."""
    out = rank_pools(4).run(tiny_worker)
    real = [o for o in out if o[0] == [[5]]]
    padding = [o for o in out if o[0] == [[7]]]
    assert len(real) == 2 and len(padding) == 2
    for ids, targets, mask, positions, replica in padding:
        assert targets == [[-100]] and mask == [[True]] and positions == [[0]] and replica == [-1]
    assert sorted(o[4] for o in real) == [[0], [1]] and all(o[2] == [[False]] for o in real)


def sliced_mesh_worker(rank, world):
    """The whole-batch step on the (dp, cp) slice of a larger mesh (pipeline stages around it): each slice's
    group ranks are not its global ranks, and in the second layout a slice's ranks are not even consecutive."""
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp.testing.world_parity import run_world_case

    stages = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "cp"))  # slices [0, 1], [2, 3]
    inner = run_world_case(WorldCase(((5, 9, -2, 13, 1, 2, 3),), 2, kernel="sdpa"), stages["dp", "cp"])
    strided = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("dp", "pp", "cp"))  # slices [0, 2], [1, 3]
    outer = run_world_case(WorldCase(((6, 20), (3, -2, 3, 3)), 1, kernel="sdpa"), strided["dp", "cp"])
    return inner, outer


def test_a_dp_cp_slice_of_a_larger_mesh_plans_over_its_own_ranks(rank_pools):
    for inner, outer in rank_pools(4).run(sliced_mesh_worker):
        for r in (inner, outer):
            assert r.out_err < TOL and r.grad_err < TOL, r


def named_dims_worker(rank, world):
    """The mesh read by its dimension names: ("cp", "dp") is the same step as ("dp", "cp"); names the step cannot
    read are refused, naming them (not blamed on the data)."""
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp import make_cp_world_batch_and_ctx
    from blockdiag_cp.testing.world_parity import run_world_case
    from blockdiag_cp.step.world import WorldView

    case = WorldCase(((5, 9, -2, 13), (3, 3, 3, -1, 8)), 2, kernel="sdpa")
    transposed = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "dp"))  # ranks 0, 2 are replica 0
    view = WorldView.of(transposed)
    result = run_world_case(case, transposed)
    errors = []
    for names in (("dp", "tp"), ("data", "context")):
        try:
            make_cp_world_batch_and_ctx(init_device_mesh("cpu", (2, 2), mesh_dim_names=names), {})
        except ValueError as exc:
            errors.append(str(exc))
    return (view.replica, view.cp_index), result, errors


def test_the_mesh_is_read_by_its_dimension_names(rank_pools):
    for rank, (place, result, errors) in enumerate(rank_pools(4).run(named_dims_worker)):
        assert place == (rank % 2, rank // 2)
        assert result.out_err < TOL and result.grad_err < TOL, result
        assert len(errors) == 2 and all("reads the mesh's dimensions by name" in e for e in errors), errors
        assert "('dp', 'tp')" in errors[0] and "('data', 'context')" in errors[1]
