"""torchtitan's pipeline under blockdiag-cp (issue #54, docs/pipeline.md#torchtitan).

Four launches of torchtitan's own training on CPU gloo ranks (tests/stacks/torchtitan_pp_run.py), the tiny llama3
and local assets of tests/stacks/test_torchtitan.py, 4 packed rows per optimizer step, every decoder layer under
torchtitan's full activation checkpointing (its default, selective, cannot run a zero-bubble schedule: "Trying to
backward an extra time", with or without CP):

* no pipeline, no CP, one rank, the 4 rows by accumulation (``training.global_batch_size 4``): the reference;
* ``pipeline_parallel_degree 2`` x ``cp_degree 2`` (four ranks), 1F1B, 4 micro-batches of one row each
  (``local_batch_size 4``, micro-batch size 1): losses, grad norms and final parameters equal the reference;
* InterleavedZeroBubble (4 virtual stages, torchtitan's own split) at ``cp_degree 2`` equals the same config at
  ``cp_degree 1`` (float32 training: 1e-5). (torchtitan's zero-bubble run differs from its run without a pipeline
  by about 2e-5 in the grad norm at cp 1 already: torchtitan's, not CP's.)

torchtitan 0.3.0's own pipeline does not run on torch 2.13 (its ``schedule.step(arg_mbs=...)`` is a newer torch's
signature); `BlockDiagCPTrainer`'s pipeline step calls torch 2.13's (Note [torchtitan's pipeline under CP]).
"""

import pathlib

import pytest
import torch

pytest.importorskip("torchtitan")
pytest.importorskip("triton")  # torchtitan 0.3.0 imports it unconditionally (its MoE kernels)

from torchtitan.models.llama3.config_registry import llama3_debugmodel  # noqa: E402

from torchtitan_assets import launch as launch_torchtitan  # noqa: E402
from torchtitan_assets import write_assets  # noqa: E402

from blockdiag_cp.integrations.torchtitan import blockdiag_config, check_options  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
SEQ_LEN, STEPS, MICRO_BATCHES = 96, 2, 4
PIPELINE = ("--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", str(MICRO_BATCHES),
            "--parallelism.pipeline_parallel_microbatch_size", "1", "--training.disable_cuda_graphs")
FULL_AC = "activation-checkpoint:full"  # torchtitan's CLI subcommand (it comes last)


def launch(root: pathlib.Path, name: str, world: int, *overrides: str) -> dict:
    """One torchtitan run under torchrun; returns what torchtitan_pp_run.py recorded."""
    return torch.load(launch_torchtitan(root, name, world, HERE / "torchtitan_pp_run.py", (), overrides, SEQ_LEN,
                                        STEPS), weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("torchtitan_pp")
    write_assets(root)
    zero_bubble = ("--parallelism.pipeline_parallel_schedule", "InterleavedZeroBubble")
    return {"ref": launch(root, "ref", 1, "--training.global_batch_size", str(MICRO_BATCHES), FULL_AC),
            "1f1b_cp2": launch(root, "1f1b_cp2", 4, *PIPELINE, "--parallelism.pipeline_parallel_schedule", "1F1B",
                               "--blockdiag_cp.cp_degree", "2", FULL_AC),
            "zb_cp1": launch(root, "zb_cp1", 2, *PIPELINE, *zero_bubble, FULL_AC),
            "zb_cp2": launch(root, "zb_cp2", 4, *PIPELINE, *zero_bubble, "--blockdiag_cp.cp_degree", "2", FULL_AC)}


def assert_trains_alike(got, ref, tolerance=1e-5):
    assert len(got["losses"]) == len(ref["losses"]) == STEPS
    for key in ("losses", "grad_norms"):
        for a, b in zip(got[key], ref[key], strict=True):
            assert abs(a - b) <= tolerance * abs(b), (key, got[key], ref[key])
    assert set(got["params"]) == set(ref["params"])  # every stage's parameters came back, under torchtitan's names
    for n, want in ref["params"].items():
        err = float((got["params"][n] - want).norm() / want.norm())
        assert err < tolerance, (n, err)


@pytest.mark.slow
@pytest.mark.parametrize("name, reference", [("1f1b_cp2", "ref"), ("zb_cp2", "zb_cp1")])
def test_the_pipeline_at_cp2_trains_as_without_cp(runs, name, reference):
    assert_trains_alike(runs[name], runs[reference])


def test_one_row_per_micro_batch_is_refused_by_name_otherwise():
    config = blockdiag_config(llama3_debugmodel(), cp_degree=2)
    config.parallelism.spmd_backend = "partial_dtensor"
    config.checkpoint.enable = False
    config.parallelism.pipeline_parallel_degree = 2
    config.training.local_batch_size = 4  # four micro-batches of one row: accepted
    check_options(config)
    config.parallelism.pipeline_parallel_microbatch_size = 2
    with pytest.raises(ValueError, match=r"parallelism\.pipeline_parallel_microbatch_size=2 is refused"):
        check_options(config)
    config.parallelism.pipeline_parallel_degree = 1
    with pytest.raises(ValueError, match=r"training\.local_batch_size=4 is refused"):
        check_options(config)
