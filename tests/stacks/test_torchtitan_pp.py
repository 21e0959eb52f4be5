"""torchtitan's pipeline under blockdiag-cp (issue #54, docs/pipeline.md#torchtitan, docs/torchtitan.md).

Five launches of torchtitan's own training on CPU gloo ranks (tests/stacks/torchtitan_run.py with the config module,
assets and tiny models of test_torchtitan.py), float32, full activation checkpointing, 2 AdamW steps. Each pipeline
run at ``pipeline_parallel_degree`` 2 x ``blockdiag_cp.cp_degree`` 2 (4 ranks, FSDP over the CP ranks) is compared
with one rank without either, reading the same rows per step by accumulation:

* llama3, torchtitan's 1F1B, 4 micro-batches of 2 rows each (``pipeline_parallel_microbatch_size`` 2: the rows of
  a micro-batch laid end to end, one step each), torchtitan's chunked loss;
* deepseek_v3 (MLA; a dense layer, then a MoE layer balancing its experts' load), torchtitan's
  InterleavedZeroBubble (4 virtual stages over 2 ranks, each backward split into its input and weight parts), 4
  micro-batches of a row of 199 tokens, which only the CP run pads (to 200: the padding's routes are taken out of
  the experts' load counts in the turn of its own micro-batch), torchtitan's cross-entropy on the whole shard (its
  chunked loss is refused under a split backward: the final norm would get no gradient, with or without CP), also
  against the same config at cp 1 (the experts' loads: under this schedule torchtitan counts each token once per
  forward and per recompute, 16 times at pp 2 against 2 on one rank).

Compared: per-step losses, the logged gradient norms (1e-6; each within 1e-6 of the gradients' own float64 norm,
summed over the pipeline's stages), n_tokens_seen, every stage's final parameters, and the MoE layer's expert loads
and final expert biases. The fast tests: the options refused with a pipeline, by name, before anything is built, and
torchtitan's chunked loss under a split backward without blockdiag-cp (tests/stacks/torchtitan_split_backward.py).
"""
import json
import pathlib
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("torchtitan")
pytest.importorskip("triton")  # torchtitan 0.3.0 imports it unconditionally (its MoE kernels)

from torchtitan.components.loss import ChunkedLossWrapper  # noqa: E402
from torchtitan.models.llama3.config_registry import llama3_debugmodel  # noqa: E402

from torchtitan_assets import assert_trains_alike, write_assets  # noqa: E402
from torchtitan_assets import launch as launch_torchtitan  # noqa: E402

from blockdiag_cp.integrations.torchtitan import BlockDiagCPTrainer, blockdiag_config, check_options  # noqa: E402
from blockdiag_cp.integrations.torchtitan_pp import REFUSED_WITH_PIPELINE  # noqa: E402

SEQ_LEN, STEPS = 96, 2
CP2 = ("--blockdiag_cp.cp_degree", "2")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("torchtitan_pp")
    write_assets(root)
    return root


def launch(root: pathlib.Path, name: str, world: int, config_fn: str, *overrides: str) -> dict:
    return launch_torchtitan(root, name, world, config_fn, *overrides, seq_len=SEQ_LEN, steps=STEPS, probe=False)


@pytest.fixture(scope="module")
def llama_runs(assets):
    """llama3: one rank (4 micro-batches of 2 rows, accumulated), and 1F1B at pp 2 x cp 2."""
    return {"ref": launch(assets, "llama_ref", 1, "tiny_llama3_accumulated"),
            "pp2cp2": launch(assets, "llama_1f1b", 4, "tiny_llama3_1f1b", *CP2)}


@pytest.fixture(scope="module")
def moe_runs(assets):
    """deepseek_v3, rows of 199 (cp 2 pads each to 200): one rank (4 rows, accumulated), and InterleavedZeroBubble
    at pp 2 x cp 1 and pp 2 x cp 2."""
    rows = ("--training.seq_len", "199")
    return {"ref": launch(assets, "moe_ref", 1, "tiny_deepseek_v3_accumulated", *rows),
            "pp2cp1": launch(assets, "moe_zero_bubble_cp1", 2, "tiny_deepseek_v3_zero_bubble", *rows),
            "pp2cp2": launch(assets, "moe_zero_bubble", 4, "tiny_deepseek_v3_zero_bubble", *rows, *CP2)}


@pytest.mark.slow
def test_1f1b_at_pp2_x_cp2_trains_as_one_rank(llama_runs):
    ref, ours = llama_runs["ref"], llama_runs["pp2cp2"]
    assert ours["mesh"] == {"batch": 2, "fsdp": 2, "tp": 1, "pp": 2} and ref["mesh"]["pp"] == 1
    assert ours["cp_degree"] == 2 and ours["world"] == 4
    assert_trains_alike(ours, ref, STEPS)


@pytest.mark.slow
def test_a_moe_model_under_zero_bubble_at_pp2_x_cp2_trains_as_one_rank_and_as_cp1(moe_runs):
    ref, cp1, ours = moe_runs["ref"], moe_runs["pp2cp1"], moe_runs["pp2cp2"]
    assert ours["mesh"] == {"batch": 2, "fsdp": 2, "tp": 1, "pp": 2} and ref["world"] == 1
    assert cp1["mesh"] == {"batch": 1, "fsdp": 1, "tp": 1, "pp": 2} and cp1["cp_degree"] == 1
    assert_trains_alike(ours, ref, STEPS)
    assert_trains_alike(ours, cp1, STEPS)
    assert len(cp1["expert_loads"]) == len(ours["expert_loads"]) == STEPS
    # torchtitan counts a token's routes at each forward of its layer: under InterleavedZeroBubble with full
    # checkpointing, the forward and a recompute per weight group of the split backward; at the first step torch's
    # metadata inference also runs each stage once on torch.empty inputs (whatever the memory held), so step 1's
    # counts are compared in total (the number of routes counted), the later steps' per expert
    assert ours["expert_loads"][0].sum() == cp1["expert_loads"][0].sum() > 0
    for got, want in zip(ours["expert_loads"][1:], cp1["expert_loads"][1:]):
        assert torch.equal(got, want), (got, want)  # the real tokens' routes, the padding's taken out
    assert ref["expert_biases"].keys() == ours["expert_biases"].keys() == cp1["expert_biases"].keys()
    for name, bias in ref["expert_biases"].items():
        assert bias.abs().max() > 0 and torch.equal(ours["expert_biases"][name], bias), name
        assert torch.equal(cp1["expert_biases"][name], bias), name


def pipelined_config():
    config = blockdiag_config(llama3_debugmodel(), cp_degree=2)
    config.parallelism.pipeline_parallel_degree = 2
    config.training.local_batch_size = 4
    config.checkpoint.enable = False
    return config


@pytest.mark.parametrize("path, value", [(path, {False: True, 1: 2}[keep]) for path, keep, _ in REFUSED_WITH_PIPELINE])
def test_what_is_not_verified_with_a_pipeline_is_refused_by_name(path, value):
    config = pipelined_config()
    check_options(config)  # a pipeline, several micro-batches and rows: accepted
    config.parallelism.pipeline_parallel_microbatch_size = 2
    check_options(config)
    section, name = path.split(".")
    setattr(getattr(config, section), name, value)
    with pytest.raises(ValueError, match=re.escape(f"{path}={value!r} is refused by BlockDiagCPTrainer")) as raised:
        check_options(config)
    assert "pipeline" in str(raised.value)
    config.parallelism.pipeline_parallel_degree = 1
    check_options(config)  # checkpoints, the validator, TP and compile are verified without a pipeline


def test_a_refusal_comes_before_torchtitan_builds_anything():
    config = pipelined_config()
    config.validator.enable = True
    with pytest.raises(ValueError, match=r"validator\.enable=True is refused .*schedule\.eval\(arg_mbs=\.\.\.\)"):
        BlockDiagCPTrainer(config)
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("schedule", ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV", "csv"])
def test_torchtitans_chunked_loss_under_a_split_backward_is_refused_by_name(schedule, tmp_path):
    config = pipelined_config()
    assert isinstance(config.loss, ChunkedLossWrapper.Config)  # llama3_debugmodel's own loss
    for full_backward in ("1F1B", "Interleaved1F1B", "GPipe", "LoopedBFS"):
        config.parallelism.pipeline_parallel_schedule = full_backward
        check_options(config)
    if schedule == "csv":
        config.parallelism.pipeline_parallel_schedule = "PipelineScheduleMulti"
        config.parallelism.pipeline_parallel_schedule_csv = str(tmp_path / "schedule.csv")
        named = re.escape(f"pipeline_parallel_schedule_csv={config.parallelism.pipeline_parallel_schedule_csv!r}")
    else:
        config.parallelism.pipeline_parallel_schedule = schedule
        named = re.escape(f"pipeline_parallel_schedule={schedule!r}")
    with pytest.raises(ValueError, match=rf"loss=ChunkedLossWrapper with parallelism\.{named} is refused .*"
                                         r"final norm's weight without a gradient"):
        check_options(config)
    config.loss = config.loss.loss_fn  # the cross-entropy on the whole shard: accepted
    check_options(config)
    config.parallelism.pipeline_parallel_degree = 1
    config.loss = ChunkedLossWrapper.Config()
    check_options(config)  # no pipeline: the chunked loss is verified (test_torchtitan.py)


def test_torchtitans_chunked_loss_leaves_the_norm_without_gradient_under_a_split_backward(tmp_path):
    """Why the pair is refused, without blockdiag-cp: torch's pipelining, torchtitan's loss and FSDP alone."""
    out = tmp_path / "grads.json"
    subprocess.run([sys.executable, str(pathlib.Path(__file__).parent / "torchtitan_split_backward.py"), str(out)],
                   check=True, capture_output=True, timeout=300)
    runs = json.loads(out.read_text())
    want = runs["Interleaved1F1B/plain"]
    assert want["3.norm.weight"] > 0 and all(norm is not None for norm in want.values())
    assert runs["Interleaved1F1B/chunked"] == pytest.approx(want, rel=1e-6)
    assert runs["InterleavedZeroBubble/plain"] == pytest.approx(want, rel=1e-6)
    split_chunked = runs["InterleavedZeroBubble/chunked"]
    assert split_chunked.pop("3.norm.weight") is None  # the norm's weight: no gradient
    assert split_chunked == pytest.approx({k: v for k, v in want.items() if k != "3.norm.weight"}, rel=1e-6)
