"""Checkpoints under the mixin: a Trainer run saved after step k and resumed from that checkpoint by a fresh trainer
(``train(resume_from_checkpoint=...)``) ends as the run that was never interrupted, on DDP, DeepSpeed ZeRO-2/3 and
accelerate's FSDP2 (sharded and full state dicts), and across a change of world where the stack can reshard.

The uninterrupted run saves ``checkpoint-k`` on its way (what a run stopped after step k leaves on disk: the
checkpoint is written before step k + 1 starts); the resumed run loads it (model, optimizer, scheduler, every rank's
RNG state, the trainer state), skips the micro-batches the Trainer already trained in the epoch (accelerate's
``skip_first_batches`` over the mixin's dataloader, re-sharded over the dp replicas only: Note [Every dp replica sees
the batches it would see without CP] in trainer.py) and trains to the end. Compared: every logged step after k (loss,
grad norm) and the final parameters. Float64 tiny Llama (tests/trainer_runs.py), AdamW; in-process gloo rank pools.
The killed-rank test (a rank SIGKILLed under torchrun) is in tests/integrations/test_killed_rank.py.
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import trainer_runs as tr  # noqa: E402
from trainer_runs import fsdp2, zero  # noqa: E402

CLIP = {"max_grad_norm": 0.5}


def saving_every(k: int, **args) -> dict:
    """``TrainingArguments`` options: `args`, gradient clipping, and a checkpoint every `k` optimizer steps."""
    return {**CLIP, **args, "save_strategy": "steps", "save_steps": k}


def resume_equals_uninterrupted(pools, tmp_path, label: str, *, k: int, steps: int, world: int, changes: dict,
                                then_world: int = 0, then_changes: dict | None = None, convert=None,
                                tol: float = 1e-6, param_tol: float = 1e-9) -> dict:
    """Train `changes` (a `tr.spec` at cp 2 on `world` ranks) for `steps` steps, saving every `k`; then a fresh
    trainer (`then_changes`, default the same, on `then_world` ranks, default `world`) resumes from
    ``checkpoint-k`` (after ``convert(checkpoint)`` if given) and trains to `steps`. Every logged step after `k` and
    the final parameters must agree (`tol`, `param_tol` relative); returns the resumed run."""
    assert steps - k >= 2, "assert_same compares at least 2 logged steps"
    first, then = tmp_path / "uninterrupted", tmp_path / "resumed"
    full = pools(world).run(tr.pool_run, tr.spec(cp=2, steps=steps, evaluate=False, output_dir=str(first), **changes))[0]
    checkpoint = first / f"checkpoint-{k}"
    assert checkpoint.is_dir(), (label, sorted(os.listdir(first)))
    if convert is not None:
        convert(checkpoint)
    resumed = pools(then_world or world).run(tr.pool_run, tr.spec(
        cp=2, steps=steps, evaluate=False, output_dir=str(then), resume=str(checkpoint),
        **(changes if then_changes is None else then_changes)))[0]
    assert resumed["wrapper"] == full["wrapper"], (label, resumed["wrapper"], full["wrapper"])
    after = [{**run, "steps": [e for e in run["steps"] if e["step"] > k]} for run in (resumed, full)]
    assert [e["step"] for e in after[0]["steps"]] == list(range(k + 1, steps + 1)), (label, resumed["steps"])
    tr.assert_same(*after, tol=tol, param_tol=param_tol, label=label)
    return resumed


def test_resume_under_cp_equals_the_uninterrupted_run(rank_pools, tmp_path):
    """DDP under the mixin at dp 1 x cp 2, resumed mid-epoch (step 2 of the epoch's 4: the Trainer skips 4
    micro-batches of the mixin's dataloader), bit for bit. (DDP runs leave no process-wide state: the session's
    ranks.)"""
    resume_equals_uninterrupted(rank_pools, tmp_path, "DDP dp1 x cp2", k=2, steps=4, world=2,
                                changes={"args": saving_every(2)}, tol=0.0, param_tol=0.0)


@pytest.mark.slow
def test_resume_in_the_whole_batch_mode_at_dp2(rank_pools, tmp_path):
    """``whole_batch=True`` at dp 2 x cp 2 (its planner and prefetcher hold no state across steps: a fresh trainer
    plans the remaining micro-batches as the uninterrupted one does), resumed after step 1 of an epoch of 2, then
    across the epoch boundary (the sampler's reshuffle)."""
    resume_equals_uninterrupted(rank_pools, tmp_path, "whole_batch dp2 x cp2", k=1, steps=3, world=4,
                                changes={"args": saving_every(1), "whole_batch": True}, tol=0.0, param_tol=0.0)


def to_universal(checkpoint) -> None:
    """DeepSpeed's universal checkpoint of `checkpoint` (a Trainer checkpoint folder), as its docs have users make
    it: ``ds_to_universal`` (``--inject_missing_state``: the Trainer's engine does not write Megatron's
    ``universal_checkpoint_info``) into ``<tag>_universal``, named by ``latest_universal``."""
    tag = (checkpoint / "latest").read_text().strip()
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                    str(checkpoint / tag), "--output_folder", str(checkpoint / f"{tag}_universal"),
                    "--inject_missing_state"], check=True, capture_output=True)
    (checkpoint / "latest_universal").write_text(f"{tag}_universal")


@pytest.mark.slow
def test_deepspeed_zero_checkpoints_resume_under_cp(own_pools, tmp_path):
    """DeepSpeed ZeRO-3 checkpoints (the engine's own: partitioned parameters and optimizer states per rank) saved
    and resumed under the mixin at dp 1 x cp 2; then saved at dp 2 x cp 2 and resumed at dp 1 x cp 2 (the same
    global batch: 6 rows per replica) through DeepSpeed's universal checkpoint. The engine's plain checkpoint
    refuses a new data-parallel world (its ZeRORuntimeException), which the last case checks stays so. (ZeRO-2's
    checkpoints, the same engine code without partitioned parameters, were run here until 0.12; ZeRO-3 in float32:
    its zero.Init takes float32, bf16 and fp16 only.)"""
    pytest.importorskip("deepspeed")
    f32 = {"dtype": "float32"}
    resume_equals_uninterrupted(own_pools, tmp_path / "z3", "ZeRO-3 dp1 x cp2", k=2, steps=4,
                                world=2, changes={**f32, "args": saving_every(2, deepspeed=zero(3))})
    universal = saving_every(1, deepspeed=zero(3, checkpoint={"load_universal": True}))
    resume_equals_uninterrupted(  # observed 1.0e-8 (float64 weights); float32 through the universal checkpoint
        own_pools, tmp_path / "z3u", "ZeRO-3 dp2 x cp2 -> dp1 x cp2 (universal)", k=1, steps=3,
        world=4, changes={**f32, "args": saving_every(1, deepspeed=zero(3))}, then_world=2,
        then_changes={**f32, "batch": 6, "args": universal}, convert=to_universal, param_tol=1e-7)
    with pytest.raises(RuntimeError, match="used a DP world size of 4 but the current world size is 2"):
        own_pools(2).run(tr.pool_run, tr.spec(cp=2, steps=3, batch=6, evaluate=False, output_dir=str(tmp_path / "no"),
                                              dtype="float32",
                                              resume=str(tmp_path / "z3u" / "uninterrupted" / "checkpoint-2"),
                                              args=saving_every(1, deepspeed=zero(3))))


@pytest.mark.slow
def test_fsdp2_checkpoints_resume_under_cp(own_pools, tmp_path):
    """accelerate's FSDP2 (the CPU stand-in for its GPU preparation, tests/trainer_runs.py) under the mixin: sharded
    (torch.distributed.checkpoint, one shard per rank) and full state dicts saved and resumed at dp 1 x cp 2; then
    saved at dp 2 x cp 2 (FSDP2 shards over all 4 ranks) and resumed at dp 1 x cp 2 (the same global batch), which
    torch.distributed.checkpoint reshards (sharded) or rank 0 scatters (full)."""
    for kind in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
        args = fsdp2(state_dict_type=kind)
        if kind == "SHARDED_STATE_DICT":  # (the full state dict's same-world resume: run here until 0.12)
            resume_equals_uninterrupted(own_pools, tmp_path / kind, f"FSDP2 {kind} dp1 x cp2", k=2, steps=4, world=2,
                                        changes={"args": saving_every(2, **args)})
        resume_equals_uninterrupted(own_pools, tmp_path / f"{kind}-world", f"FSDP2 {kind} dp2 x cp2 -> dp1 x cp2",
                                    k=1, steps=3, world=4, changes={"args": saving_every(1, **args)}, then_world=2,
                                    then_changes={"batch": 6, "args": saving_every(1, **args)})
