"""`plan_rank_state` (Note [A rank's step without a process group]) builds, in one process, the very step state
a rank of a real whole-batch step builds: compared field by field with gloo ranks on random batches."""

import numpy as np
import pytest
import torch

from blockdiag_cp import CPConfig
from blockdiag_cp.plan import PlanOptions
from blockdiag_cp.step.world_plan import plan_rank_state, plan_world_step


def random_rows(seed: int, dp: int) -> tuple[tuple[int, ...], ...]:
    """``dp`` replica rows of random documents (1-40 tokens) with padding runs inside and at the tail."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(dp):
        runs = [int(n) if rng.random() > 0.15 else -int(n) for n in rng.integers(1, 40, rng.integers(1, 7))]
        rows.append(tuple(runs) if any(n > 0 for n in runs) else (5, *runs))
    return tuple(rows)


def summary(state, replica_of_row) -> dict:
    """What a rank's state decides: its plan, geometry, pieces, exchange (with its traffic) and kernel."""
    g = state.geometry
    pieces = g.pieces(state.rank)
    return dict(positions=state.positions.tolist(), offsets=state.plan.offsets.tolist(), doc_ids=g.doc_ids.tolist(),
                last_by_run=g.last_by_run.tolist(), pieces=[t.tolist() for t in (pieces.local_start, pieces.length,
                                                                                  pieces.global_start, pieces.doc_start)],
                exchange=state.exchange.name, reason=state.exchange_reason, traffic=state.traffic,
                kernel=state.kernel.name, replica_of_row=replica_of_row.tolist())


def config_of(exchange: str) -> CPConfig:
    return CPConfig(layout="grouped", kv_exchange=exchange, kernel="sdpa", plan=PlanOptions(ranks_per_node=2))


def real_step_worker(rank, world, cases):
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp import make_cp_world_batch_and_ctx
    from blockdiag_cp.testing import doc_ids_from_lengths

    out = []
    for rows, dp, exchange in cases:
        mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "cp"))
        ids = doc_ids_from_lengths(rows[mesh.get_local_rank("dp")])
        batch = {"input_ids": torch.arange(ids.numel())[None], "_packed_seq_ids": ids[None]}
        ctx, _ = make_cp_world_batch_and_ctx(mesh, batch, config=config_of(exchange))
        out.append(summary(ctx.state, ctx.replica_of_row))
    return out


CASES = [(random_rows(seed, dp), dp, exchange) for seed, (dp, exchange) in
         enumerate([(2, "auto"), (4, "auto"), (1, "auto"), (2, "a2a"), (2, "allgather"), (4, "p2p"), (2, "ring")])]


def test_plan_rank_state_is_the_state_each_rank_of_a_real_step_builds(rank_pools):
    per_rank = rank_pools(4).run(real_step_worker, CASES)
    for i, (rows, dp, exchange) in enumerate(CASES):
        world_plan = plan_world_step(rows, dp, 4 // dp, config_of(exchange))
        for rank in range(4):
            step = world_plan.rank_step(rank)
            assert summary(step.state, step.replica_of_row) == per_rank[rank][i], (rows, dp, exchange, rank)
            assert step.state.group is None
        assert summary(plan_rank_state(rows, dp, 4 // dp, 3, config_of(exchange)), step.replica_of_row) == \
            per_rank[3][i]


@pytest.mark.parametrize("args, message", [
    (([(3, 4)], 2, 1), "dp=2 rows"), (([(3, 0)], 1, 2), "non-empty runs"), (([()], 1, 2), "non-empty runs"),
    (([(3,)], 0, 2), "dp must be"), (([(3,)], 1, 2.0), "cp must be"),
])
def test_bad_lengths_or_shapes_raise_at_entry(args, message):
    with pytest.raises(ValueError, match=message):
        plan_world_step(*args)


def test_a_rank_outside_the_mesh_is_refused():
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 4\)"):
        plan_rank_state([(3, 4), (5,)], 2, 2, 4)


def prefetch_worker(rank, world, batches_rows, dp, exchange):
    """Each micro-batch through `prefetched_world_steps` and through `make_cp_world_batch_and_ctx`: the shards,
    the states and an attention call's output and input gradient."""
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp import cp_blockdiag_sdpa, make_cp_world_batch_and_ctx
    from blockdiag_cp.step.prefetch import prefetched_world_steps
    from blockdiag_cp.testing import doc_ids_from_lengths

    mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "cp"))
    d = mesh.get_local_rank("dp")

    def batch_of(rows, seed):
        ids = doc_ids_from_lengths(rows[d])
        x = torch.randn(1, ids.numel(), 8, generator=torch.Generator().manual_seed(seed * 10 + d), dtype=torch.float64)
        return {"inputs_embeds": x.requires_grad_(), "labels": torch.arange(ids.numel())[None],
                "_packed_seq_ids": ids[None]}

    def attend(ctx, shard):
        x = shard["inputs_embeds"]
        q = x.reshape(1, -1, 2, 4).transpose(1, 2)
        with ctx():
            out = cp_blockdiag_sdpa(q, q * 0.5, q.flip(-1))
        return out

    def run(ctx, shard, leaf):
        out = attend(ctx, shard)
        out.pow(2).sum().backward()
        return dict(summary(ctx.state, ctx.replica_of_row), layout=ctx.state.config.layout, ids=shard["labels"].tolist(),
                    positions=shard["position_ids"].tolist(), out=out.detach(), grad=leaf.grad)

    config = None if exchange is None else config_of(exchange)  # None: each entry's own default (both grouped)
    plain = []
    for i, rows in enumerate(batches_rows):
        batch = batch_of(rows, i)
        leaf = batch["inputs_embeds"]
        ctx, shard = make_cp_world_batch_and_ctx(mesh, batch, config=config)
        plain.append(run(ctx, shard, leaf))
    leaves = []

    def fed():
        for i, rows in enumerate(batches_rows):
            batch = batch_of(rows, i)
            leaves.append(batch["inputs_embeds"])
            yield batch

    prefetched = [run(step.train_ctx, step.batch, leaves[i])
                  for i, step in enumerate(prefetched_world_steps(mesh, fed(), config=config))]
    return plain, prefetched


@pytest.mark.parametrize("dp, exchange", [(2, "auto"), (4, "a2a"), (2, None)])
def test_prefetched_steps_equal_the_steps_without_prefetch(dp, exchange, rank_pools):
    """Given a config, and given none: the prefetcher's default plan is the whole-batch entry's (``grouped``)."""
    batches = [random_rows(100 + i, dp) for i in range(3)]
    for plain, prefetched in rank_pools(4).run(prefetch_worker, batches, dp, exchange):
        assert len(plain) == len(prefetched) == 3
        assert {step["layout"] for step in plain + prefetched} == {"grouped"}
        for a, b in zip(plain, prefetched):
            assert {k: v for k, v in a.items() if k not in ("out", "grad")} == \
                {k: v for k, v in b.items() if k not in ("out", "grad")}
            assert torch.equal(a["out"], b["out"]) and torch.equal(a["grad"], b["grad"])
            assert a["grad"].abs().sum() > 0


def bad_second_batch_worker(rank, world):
    """The second micro-batch of replica 1 has no input tensor: every rank raises when it asks for that step."""
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp.step.prefetch import prefetched_world_steps
    from blockdiag_cp.testing import doc_ids_from_lengths

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "cp"))
    ids = doc_ids_from_lengths((3, 4, -1))[None]
    batches = [{"input_ids": torch.ones_like(ids), "_packed_seq_ids": ids}, {"_packed_seq_ids": ids.clone()}]
    if rank == 0:
        batches[1]["input_ids"] = torch.ones_like(ids)
    got = []
    try:
        for step in prefetched_world_steps(mesh, batches):
            got.append(step.batch["input_ids"].shape[1])
    except ValueError as exc:
        return got, str(exc)
    return got, None


def test_a_bad_batch_raises_on_every_rank_at_its_step(rank_pools):
    (got0, error0), (got1, error1) = rank_pools(2).run(bad_second_batch_worker)
    assert len(got0) == len(got1) == 1  # the first step ran on both ranks
    assert "rank(s) [1] of the mesh rejected their batch" in error0
    assert "'input_ids'" in error1
