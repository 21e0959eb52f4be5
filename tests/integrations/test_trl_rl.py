"""TRL's DPOTrainer and GRPOTrainer mixed into `BlockDiagCPMixin`, against the same trainers without CP.

The CP runs are `torchrun` launches of the examples on gloo (float64 tiny Llama). The runs
without CP: in this process for one replica (and for DPO's dp 2, one process taking both
replicas' pairs); for GRPO at dp 2, plain DDP over 2 processes (each process seeds its own
sampling, so one process cannot stand in for two). TRL's fused LM head computes log-probs in
float32, so the logged values agree to about 1e-7, not float64's 1e-12.
"""

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("accelerate")

from examples_module import example  # noqa: E402
from test_trainer import torchrun  # noqa: E402

DPO_KEYS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
            "logps/rejected", "entropy", "num_tokens")
GRPO_KEYS = ("loss", "grad_norm", "kl", "reward", "reward_std", "entropy", "completions/mean_length", "num_tokens")


def assert_same_steps(got, want, keys, tol=1e-6):
    """Every logged step's `keys` within `tol` relative (absolute below 1: losses and rewards near 0)."""
    assert len(got) == len(want) >= 2, (got, want)
    for step, (a, b) in enumerate(zip(got, want), 1):
        for key in keys:
            assert a[key] is not None and b[key] is not None, (step, key)
            assert abs(a[key] - b[key]) <= tol * max(1.0, abs(b[key])), (step, key, a[key], b[key])


def cp_run(tmp_path, nproc, script, *args):
    lines = torchrun(nproc, script, "--float64", "--save", str(tmp_path / "p.pt"), *args)
    return [{k: v for k, v in e.items() if k != "step"} for e in lines if "step" in e], torch.load(tmp_path / "p.pt")


def assert_same_params(got, want, tol=1e-6):
    relative = float((got - want).norm() / want.norm())
    assert relative <= tol, relative


@pytest.mark.slow
def test_grpo_under_cp_equals_grpo_without_cp(tmp_path):
    """cp 2, 2 accumulated micro-batches per generation: generation, rewards, KL to the reference
    model, the DAPO loss; the final parameters."""
    grpo = example("train_grpo")
    steps, params = cp_run(tmp_path, 2, "train_grpo.py", "--cp", "2", "--accum", "2")
    reference = grpo.run(grpo.parse_args(["--cp", "0", "--float64", "--accum", "2"]))
    assert_same_steps(steps, reference["steps"], GRPO_KEYS)
    assert_same_params(params, reference["params"])


@pytest.mark.slow
def test_dpo_and_grpo_at_dp2_cp2_equal_the_runs_without_cp(tmp_path):
    """dp 2 x cp 2 (each replica is a cp 2 run: DPO at cp 2 alone is not run again). DPO: gradient
    checkpointing (its default) and a reference model. GRPO: prompt groups span both replicas (2
    completions per replica, 4 per prompt), so the rewards are normalized over the replicas once
    each, not once per CP rank."""
    dpo = example("train_dpo")
    steps, params = cp_run(tmp_path, 4, "train_dpo.py", "--cp", "2", "--steps", "2")
    reference = dpo.run(dpo.parse_args(["--cp", "0", "--dp", "2", "--float64", "--steps", "2"]))
    assert_same_steps(steps, reference["steps"], DPO_KEYS)
    assert_same_params(params, reference["params"])
    grpo_args = ("--batch", "2", "--steps", "2")
    steps, params = cp_run(tmp_path, 4, "train_grpo.py", "--cp", "2", *grpo_args)
    ddp_steps, ddp_params = cp_run(tmp_path, 2, "train_grpo.py", "--cp", "0", *grpo_args)
    assert_same_steps(steps, ddp_steps, GRPO_KEYS)
    assert_same_params(params, ddp_params)


def test_the_scoring_forwards_of_dpo_run_as_packed_rows(tmp_path):
    """The mixin's DPO strategy hooks the policy and the reference model (Note [Scoring forwards under CP] in
    hf/scoring.py): at cp 1 each scoring forward already runs as one packed row ``[1, B * T]``. Without the hooks
    the rows stay ``[B, T]`` and the logged values still equal the run without CP, so the runs above cannot tell."""
    dpo = example("train_dpo")
    trainer = dpo.build_trainer(dpo.parse_args(["--cp", "1", "--steps", "1", "--float64"]), str(tmp_path))
    seen = {"policy": [], "reference": []}
    for name, model in (("policy", trainer.model), ("reference", trainer.ref_model)):
        model.get_input_embeddings().register_forward_hook(
            lambda module, args, output, name=name: seen[name].append(tuple(args[0].shape)))
    trainer.train()
    assert seen["policy"] and seen["reference"], seen
    assert all(shape[0] == 1 for shapes in seen.values() for shape in shapes), seen
