"""torchtitan's pipeline under blockdiag-cp (issue #54, docs/pipeline.md#torchtitan, docs/torchtitan.md).

Four launches of torchtitan's own training on CPU gloo ranks (tests/stacks/torchtitan_run.py with the config module,
assets and tiny models of test_torchtitan.py), float32, full activation checkpointing, 2 AdamW steps. Each pipeline
run, ``pipeline_parallel_degree`` 2 x ``blockdiag_cp.cp_degree`` 2 (4 ranks, FSDP over the CP ranks), is compared
with one rank without either, reading the same rows per step by accumulation:

* llama3, torchtitan's 1F1B, 4 micro-batches of 2 rows each (``pipeline_parallel_microbatch_size`` 2: the rows of
  a micro-batch laid end to end, one step each);
* deepseek_v3 (MLA; a dense layer, then a MoE layer balancing its experts' load), torchtitan's
  InterleavedZeroBubble (4 virtual stages over 2 ranks, each backward split into its input and weight parts), 4
  micro-batches of a row of 200 tokens, which only the CP run pads (each shard of 100 to 104: the padding's routes
  are taken out of the experts' load counts in the turn of its own micro-batch).

Compared: per-step losses, the logged gradient norms (1e-6; each within 1e-6 of the gradients' own float64 norm,
summed over the pipeline's stages), n_tokens_seen, every stage's final parameters, and the MoE layer's expert loads
at every step and its final expert biases (equal). The fast tests: the options refused with a pipeline, by name,
before anything is built.
"""

import pathlib
import re

import pytest
import torch

pytest.importorskip("torchtitan")
pytest.importorskip("triton")  # torchtitan 0.3.0 imports it unconditionally (its MoE kernels)

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
    """deepseek_v3, rows of 200: one rank (4 rows, accumulated), and InterleavedZeroBubble at pp 2 x cp 2."""
    rows = ("--training.seq_len", "200")
    return {"ref": launch(assets, "moe_ref", 1, "tiny_deepseek_v3_accumulated", *rows),
            "pp2cp2": launch(assets, "moe_zero_bubble", 4, "tiny_deepseek_v3_zero_bubble", *rows, *CP2)}


@pytest.mark.slow
def test_1f1b_at_pp2_x_cp2_trains_as_one_rank(llama_runs):
    ref, ours = llama_runs["ref"], llama_runs["pp2cp2"]
    assert ours["mesh"] == {"batch": 2, "fsdp": 2, "tp": 1, "pp": 2} and ref["mesh"]["pp"] == 1
    assert ours["cp_degree"] == 2 and ours["world"] == 4
    assert_trains_alike(ours, ref, STEPS)


@pytest.mark.slow
def test_a_moe_model_under_zero_bubble_at_pp2_x_cp2_trains_as_one_rank(moe_runs):
    ref, ours = moe_runs["ref"], moe_runs["pp2cp2"]
    assert ours["mesh"] == {"batch": 2, "fsdp": 2, "tp": 1, "pp": 2} and ref["world"] == 1
    assert_trains_alike(ours, ref, STEPS)
    assert len(ref["expert_loads"]) == len(ours["expert_loads"]) == STEPS
    for got, want in zip(ours["expert_loads"], ref["expert_loads"]):
        assert torch.equal(got, want), (got, want)  # the real tokens' routes, the padding's taken out
    assert ref["expert_biases"].keys() == ours["expert_biases"].keys() and ref["expert_biases"]
    for name, bias in ref["expert_biases"].items():
        assert bias.abs().max() > 0 and torch.equal(ours["expert_biases"][name], bias), name


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
