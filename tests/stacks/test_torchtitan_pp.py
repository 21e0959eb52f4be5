"""torchtitan's pipeline under blockdiag-cp (issue #54, docs/pipeline.md#torchtitan).

Three launches of torchtitan's own training on CPU gloo ranks (tests/stacks/torchtitan_pp_run.py), the tiny llama3
and local assets of tests/stacks/test_torchtitan.py, 4 packed rows per optimizer step:

* no pipeline, no CP, one rank, the 4 rows by accumulation (``training.global_batch_size 4``): the reference;
* ``pipeline_parallel_degree 2`` at ``cp_degree 1`` (two ranks) and at ``cp_degree 2`` (four ranks), torchtitan's
  ``pipeline_llm`` split and schedule, 4 micro-batches of one row each (``local_batch_size 4``, micro-batch size 1):
  per-step losses, grad norms and final parameters equal the reference (float32 training: 1e-5).

torchtitan 0.3.0's own pipeline does not run on torch 2.13 (its ``schedule.step(arg_mbs=...)`` is a newer torch's
signature); `BlockDiagCPTrainer`'s pipeline step calls torch 2.13's (Note [torchtitan's pipeline under CP]).
"""

import os
import pathlib
import subprocess
import sys

import pytest
import torch

pytest.importorskip("torchtitan")
pytest.importorskip("triton")  # torchtitan 0.3.0 imports it unconditionally (its MoE kernels)

from torchtitan.models.llama3.config_registry import llama3_debugmodel  # noqa: E402

from torchtitan_assets import CONFIG_MODULE, write_assets  # noqa: E402

from blockdiag_cp.integrations.torchtitan import blockdiag_config, check_options  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
SEQ_LEN, STEPS, MICRO_BATCHES = 96, 2, 4
PIPELINE = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B",
            "--training.local_batch_size", str(MICRO_BATCHES), "--parallelism.pipeline_parallel_microbatch_size", "1",
            "--training.disable_cuda_graphs")


def launch(root: pathlib.Path, name: str, world: int, *overrides: str) -> dict:
    """One torchtitan run under torchrun; returns what torchtitan_pp_run.py recorded."""
    cfg_dir = root / f"cfg_{name}"
    cfg_dir.mkdir()
    (cfg_dir / "tt_tiny_config.py").write_text(CONFIG_MODULE.format(
        tok=str(root / "tok"), data=str(root / "data"), seq_len=SEQ_LEN, steps=STEPS, dump=str(root / f"out_{name}")))
    out = root / f"{name}.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(cfg_dir), str(HERE), *sys.path]), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(root / "hf_cache")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           str(HERE / "torchtitan_pp_run.py"), str(out), "--module", "tt_tiny_config", "--config", "tiny_llama3",
           *overrides]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-8000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("torchtitan_pp")
    write_assets(root)
    return {"ref": launch(root, "ref", 1, "--training.global_batch_size", str(MICRO_BATCHES)),
            "pp2": launch(root, "pp2", 2, *PIPELINE),
            "pp2_cp2": launch(root, "pp2_cp2", 4, *PIPELINE, "--blockdiag_cp.cp_degree", "2")}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pp2", "pp2_cp2"])
def test_the_pipeline_trains_as_one_rank_without_it(runs, name):
    ref, got = runs["ref"], runs[name]
    assert len(got["losses"]) == len(ref["losses"]) == STEPS
    for key, tolerance in (("losses", 1e-5), ("grad_norms", 1e-5)):
        for a, b in zip(got[key], ref[key], strict=True):
            assert abs(a - b) <= tolerance * abs(b), (key, got[key], ref[key])
    assert set(got["params"]) == set(ref["params"])  # every stage's parameters came back, under torchtitan's names
    for n, want in ref["params"].items():
        err = float((got["params"][n] - want).norm() / want.norm())
        assert err < 1e-5, (n, err)


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
