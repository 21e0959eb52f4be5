"""The layout each entry plans when it is given no config (the rule: `CPConfig.layout`), read from the
plans the steps ran with on gloo ranks (cp 2), not from a config attribute.

The library's own entries plan balanced shards: the Trainer mixin's rows, TRL's DPO scoring forwards
under the mixin, `make_cp_vlm_batch_and_ctx`. The seed's entry with ``config=None`` keeps the seed's
contiguous shards, and a config a caller passes is respected.
"""

import os
import tempfile
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from blockdiag_cp import CPConfig, plan_shards  # noqa: E402

WORLD = 2


def record_plans(*models) -> list:
    """Before the first decoder layer of every forward of `models` inside a CP step: ``(layout, the row's
    document ids [S], this rank's positions)`` of the step's plan, appended to the list returned."""
    from blockdiag_cp.step.slot import current_step

    seen = []

    def record(module, args):
        state = current_step()
        if state is not None:
            plan = state.plan
            seen.append((plan.layout, state.geometry.doc_ids[: plan.seq_len].clone(), state.positions.clone()))

    for model in models:
        model.model.layers[0].register_forward_pre_hook(record)
    return seen


def assert_planned(per_rank: list, layout: str) -> None:
    """Every recorded step ran `layout`'s plan of its row (`plan_shards`), on every rank, and the rows are
    ones where balanced and contiguous shards differ (else the check could not tell them apart)."""
    for rank, seen in enumerate(per_rank):
        assert seen, f"rank {rank}: no forward ran inside a CP step"
        for planned, doc_ids, positions in seen:
            assert planned == layout, (rank, planned, layout)
            assert torch.equal(positions, plan_shards(doc_ids, WORLD, layout).rank_positions(rank)), (rank, layout)
    rows = [doc_ids for _, doc_ids, _ in per_rank[0]]
    assert any(not torch.equal(plan_shards(d, WORLD, "balanced").positions, plan_shards(d, WORLD, "contiguous").positions)
               for d in rows), "balanced and contiguous shards coincide on every row"


def trainer_worker(rank, world, layout=None):
    """One training step of transformers' Trainer under the mixin (tests/trainer_runs.py), ``cp_config`` None
    or ``CPConfig(layout=layout)``."""
    import trainer_runs as tr

    tr.launched_as(rank, world)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = tr.build(tr.spec(cp=world, steps=1, accum=1, evaluate=False, layout=layout), tmp)
        seen = record_plans(trainer.model)
        trainer.train()
    return seen


def dpo_worker(rank, world):
    """One step of TRL's DPOTrainer under the mixin (examples/train_dpo.py), ``cp_config`` None: the
    policy's and the reference model's scoring forwards."""
    import trainer_runs as tr
    from examples_module import example

    dpo = example("train_dpo")
    tr.launched_as(rank, world)
    args = dpo.parse_args(["--cp", str(world), "--steps", "1", "--float64"])
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = dpo.build_trainer(args, tmp)
        seen = record_plans(trainer.model, trainer.ref_model)
        trainer.train()
    return seen


def entries_worker(rank, world):
    """The plans of the seed's entry and of the VLM entry, given no config and given one."""
    from torch.distributed.device_mesh import init_device_mesh
    from test_vlm import packed_row, tiny_vlm

    from blockdiag_cp import make_cp_blockdiag_batch_and_ctx
    from blockdiag_cp.hf import make_cp_vlm_batch_and_ctx

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"]
    model = tiny_vlm("qwen2_vl", "blockdiag_cp")
    out = {}
    for name, config in (("seed", None), ("vlm", None), ("vlm contiguous", CPConfig(layout="contiguous"))):
        row = packed_row("qwen2_vl")
        if name == "seed":
            ctx, _ = make_cp_blockdiag_batch_and_ctx(mesh, None, {k: row[k] for k in ("input_ids", "_packed_seq_ids")},
                                                     config=config)
        else:
            ctx, _ = make_cp_vlm_batch_and_ctx(mesh, model, row, config=config)
        plan = ctx.state.plan
        out[name] = [(plan.layout, ctx.state.geometry.doc_ids[: plan.seq_len].clone(), ctx.state.positions.clone())]
    return out


def test_a_trainer_built_with_no_cp_config_plans_balanced_shards(rank_pools):
    pool = rank_pools(WORLD)
    assert_planned(pool.run(trainer_worker), "balanced")
    assert_planned(pool.run(trainer_worker, "contiguous"), "contiguous")  # a cp_config passed is respected


def test_dpo_scoring_forwards_under_the_mixin_plan_balanced_shards(rank_pools):
    pytest.importorskip("trl")
    assert_planned(rank_pools(WORLD).run(dpo_worker), "balanced")


def test_the_seed_entry_keeps_contiguous_shards_and_the_vlm_entry_plans_balanced_ones(rank_pools):
    per_rank = rank_pools(WORLD).run(entries_worker)
    assert CPConfig().layout == "contiguous"
    for name, layout in (("seed", "contiguous"), ("vlm", "balanced"), ("vlm contiguous", "contiguous")):
        assert_planned([r[name] for r in per_rank], layout)
