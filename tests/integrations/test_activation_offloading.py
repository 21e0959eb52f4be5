"""TRL's activation offloading (``SFTConfig(activation_offloading=True)``) under the mixin: its saved-tensor hooks
take the CP attention's saved tensors (queries, the gathered key/value buffers, outputs, log-sum-exps) like any
others, and the run equals the one without offloading and the run without CP.

TRL builds its `OffloadActivations` only on an accelerator (``torch.accelerator.current_accelerator()`` is None
on CPU and its constructor fails there, with or without CP). Here the same class runs with its device taken as
the CPU: every saved tensor of at least ``min_offload_size`` (0: all of them) is copied into a fresh tensor at
pack and rebuilt from the copy at unpack (its single-stream path; the streams path needs CUDA streams), and the
context is installed where SFTTrainer installs it (``maybe_activation_offload_context``, around forward and
backward in ``training_step``)."""

import tempfile
import warnings

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("trl")

import trainer_runs as tr  # noqa: E402


def offloading_on_cpu(model):
    """TRL's `get_act_offloading_ctx_manager(model)` with the CPU as its device (module docstring)."""
    import trl.models.activation_offloading as ao

    real = torch.accelerator.current_accelerator
    torch.accelerator.current_accelerator = lambda *args, **kwargs: torch.device("cpu")
    try:
        return ao.get_act_offloading_ctx_manager(model, use_pin_memory=False, use_streams=False, min_offload_size=0)
    finally:
        torch.accelerator.current_accelerator = real


def offloaded_run(rank: int, world: int, s: dict) -> dict:
    """`trainer_runs.pool_run` with TRL's offloading installed as SFTTrainer installs it; how many saved tensors
    it packed."""
    tr.launched_as(rank, world)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = tr.build(s, tmp)
        context = offloading_on_cpu(trainer.model)
        trainer.maybe_activation_offload_context = context
        trainer.train()
    steps = [e for e in trainer.state.log_history if "loss" in e and "train_loss" not in e]
    params = torch.cat([p.detach().double().reshape(-1) for p in tr.full_parameters(trainer)])
    return {"steps": steps, "params": params, "eval_loss": None, "packed": context.tensor_id,
            "tokens_seen": trainer.state.num_input_tokens_seen}


@pytest.mark.slow
def test_activation_offloading_under_cp_equals_the_run_without_it(rank_pools):
    s = tr.spec(cp=2, trainer="sft", evaluate=False, args={"max_grad_norm": 0.5})
    got = rank_pools(2).run(offloaded_run, s)[0]
    assert got["packed"] > 50, got["packed"]  # the step's saved tensors went through the hooks
    plain = rank_pools(2).run(tr.pool_run, s)[0]
    tr.assert_same(got, plain, tol=1e-12, param_tol=1e-12, label="offloaded against not, under CP")
    without_cp = rank_pools(1).run(tr.pool_run, tr.spec(cp=0, trainer="sft", evaluate=False, args={"max_grad_norm": 0.5}))[0]
    tr.assert_same(got, without_cp, tol=1e-6, param_tol=1e-6, label="offloaded under CP against no CP")
