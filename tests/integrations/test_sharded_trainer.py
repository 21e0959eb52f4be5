"""The Trainer and TRL's SFTTrainer on sharded training stacks (DeepSpeed ZeRO, FSDP2) under the mixin, each
against the same stack without CP: the same world of dp replicas, the same data.

In-process runs (tests/trainer_runs.py) on fresh gloo rank pools of their own (``own_pools`` in conftest.py),
closed at the end of each test: the CP run on
``dp x cp`` ranks, the run without CP on ``dp`` ranks. Float64 tiny Llama (its losses in float32, as
transformers computes them); DeepSpeed trains over gloo on CPU (its CPU accelerator; design.md section 5).
"""

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import trainer_runs as tr  # noqa: E402
from trainer_runs import fsdp2, zero  # noqa: E402

SFT = {"trainer": "sft"}
#: DeepSpeed's ZeRO-3 partitions float32, bfloat16 and float16 parameters only (its zero.Init asserts so on CPU too)
F32 = {"dtype": "float32"}


def compare(pools, dp: int, label: str, changes: dict, wrapper: str, tol=1e-6, param_tol=1e-6, grad_tol=None):
    """The CP run of `changes` (dp x cp 2 ranks) against the same stack without CP (dp ranks): every logged step's
    loss and grad norm, the eval loss and the final parameters; both runs trained by `wrapper`."""
    got = pools(2 * dp).run(tr.pool_run, tr.spec(cp=2, **changes))[0]
    want = pools(dp).run(tr.pool_run, tr.spec(cp=0, **changes))[0]
    assert got["wrapper"] == want["wrapper"] == wrapper, (label, got["wrapper"], want["wrapper"])
    tr.assert_same(got, want, keys=("loss",), tol=tol, param_tol=param_tol, label=label)
    tr.assert_same(got, want, keys=("grad_norm",), tol=grad_tol or tol, param_tol=param_tol, label=label)


@pytest.mark.slow
def test_deepspeed_zero_equals_the_same_stage_without_cp(own_pools, tmp_path):
    """DeepSpeed ZeRO 1, 2 and 3 through the Trainer and SFTTrainer (``deepspeed=`` a dict or a JSON file), dp 1 x
    cp 2 against the stage on 1 process and dp 2 x cp 2 against it on 2: gradient accumulation (2 micro-batches),
    clipping (max_grad_norm 0.5, below the grad norms), DeepSpeed's AdamW. DeepSpeed averages the gradients over its
    data-parallel group, every dp x cp rank, as DDP does: the Trainer's loss scaling (Note [The loss under CP equals
    the loss without CP]) holds as it is, and so do the per-micro-batch means (average_tokens_across_devices=False,
    accepts_loss_kwargs=False). bf16: DeepSpeed's bf16 weights, within their rounding."""
    pytest.importorskip("deepspeed")
    clip = {"max_grad_norm": 0.5}
    path = tmp_path / "zero3.json"
    path.write_text(json.dumps(zero(3)))
    compare(own_pools, 1, "ZeRO-2, Trainer", {"args": {"deepspeed": zero(2), **clip}}, "DeepSpeedEngine ZeRO-2")
    compare(own_pools, 1, "ZeRO-3 (a JSON file), SFT", {**SFT, **F32, "args": {"deepspeed": str(path), **clip}},
            "DeepSpeedEngine ZeRO-3", param_tol=1e-5)
    compare(own_pools, 1, "ZeRO-1, Trainer, average_tokens_across_devices=False",
            {"args": {"deepspeed": zero(1), "average_tokens_across_devices": False, **clip}}, "DeepSpeedEngine ZeRO-1")
    compare(own_pools, 1, "ZeRO-3, SFT, bf16", {**SFT, **F32, "args": {"deepspeed": zero(3, bf16={"enabled": "auto"}),
                                                               "bf16": True, **clip}},
            "DeepSpeedEngine ZeRO-3", tol=2e-4, grad_tol=5e-3, param_tol=1e-2)  # observed 3e-5, 1.3e-3, 5.9e-3
    compare(own_pools, 2, "dp2 ZeRO-3, Trainer", {**F32, "args": {"deepspeed": zero(3), **clip}}, "DeepSpeedEngine ZeRO-3",
            tol=1e-5, param_tol=2e-3)  # float32: eval loss 2e-6; Adam at lr 1e-2 amplifies rounding (4.9e-4 seen)
    compare(own_pools, 2, "dp2 ZeRO-2, Trainer, accepts_loss_kwargs=False",
            {"accepts_loss_kwargs": False, "args": {"deepspeed": zero(2), **clip}}, "DeepSpeedEngine ZeRO-2",
            param_tol=5e-6)  # observed 1.1e-6


@pytest.mark.slow
def test_accelerate_fsdp2_equals_fsdp2_without_cp(own_pools):
    """accelerate's FSDP2 through the Trainer and SFTTrainer (``fsdp="full_shard"``, ``fsdp_config={"fsdp_version":
    2}``, and accelerate's ``ParallelismConfig`` read as the mixin's mesh: Note [accelerate's ParallelismConfig under
    the mixin]), against FSDP2 without CP on the dp replicas: gradient accumulation, clipping (DTensor grad norms).
    On CPU, accelerate drops the FSDP plugin; `trainer_runs.CPUStandInForAccelerateFSDP2` puts it back where the
    GPU path keeps it, so what runs is accelerate's own FSDP2 preparation (``fully_shard`` per decoder layer and at
    the root, DTensor parameters), the code it runs on GPUs (benchmarks/gpu_session.sh runs the GPU case)."""
    from accelerate import ParallelismConfig

    clip = {"max_grad_norm": 0.5}
    wrapped = "FSDPLlamaForCausalLM"
    compare(own_pools, 1, "FSDP2, Trainer", {"args": {**fsdp2(), **clip}}, wrapped)
    compare(own_pools, 2, "dp2 FSDP2 (no reshard after forward), SFT",
            {**SFT, "args": {**fsdp2(reshard_after_forward=False), **clip}}, wrapped)
    # ParallelismConfig: the CP run's config against the run without CP's (the same, less cp)
    for dp, label, changes, cp_config, config in (
            (1, "ParallelismConfig(cp_size=2), Trainer", {}, ParallelismConfig(cp_size=2), None),
            (2, "ParallelismConfig(dp_shard_size=2, cp_size=2), SFT", SFT,
             ParallelismConfig(dp_shard_size=2, cp_size=2), ParallelismConfig(dp_shard_size=2))):
        # (accelerate refuses dp_replicate_size > 1 with cp_size > 1 and dp_shard_size 1; HSDP x CP needs 8 ranks)
        got = own_pools(2 * dp).run(tr.pool_run, tr.spec(cp=1, **changes, args={
            **fsdp2(), **clip, "parallelism_config": cp_config}))[0]
        want = own_pools(dp).run(tr.pool_run, tr.spec(cp=0, **changes, args={
            **fsdp2(), **clip, "parallelism_config": config}))[0]
        assert got["wrapper"] == want["wrapper"] == wrapped, (label, got["wrapper"], want["wrapper"])
        assert got["cp_size"] == 2 and got["dp_size"] == dp, (label, got["cp_size"], got["dp_size"])
        tr.assert_same(got, want, tol=1e-6, param_tol=1e-6, label=label)
