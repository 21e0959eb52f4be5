"""The mixin's ``linear_ce=True``: its training loss comes from `hf.linear_ce.linear_ce_loss` with the step's
divisor and the Trainer's label smoothing, scaled as ``Trainer.compute_loss`` scales. At cp 2 on gloo ranks, the
logged losses, grad norms and final parameters equal transformers' Trainer without CP and without the option
(tests/trainer_runs.py: float64 tiny Llama, padded rows with prompts, two steps of two accumulated batches),
also for a model with ``accepts_loss_kwargs=False`` (no token count: each micro-batch's mean). What it does not
compute exactly is refused by name at construction."""

import os
import tempfile
import warnings

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch  # noqa: E402
import trainer_runs as tr  # noqa: E402


def linear_ce_run(rank: int, world: int, s: dict) -> dict:
    """`trainer_runs.pool_run` with ``linear_ce=True``; counts the training forwards whose head got no position
    (the loss was taken from its input, never as logits)."""
    import transformers

    from blockdiag_cp.trainer import BlockDiagCPTrainer

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train = [{k: v for k, v in d.items() if k != "completion_mask"} for d in tr.documents(s["docs"], 0, s["prompt"])]
        model = tr.model(s["model"])
        if not s["accepts_loss_kwargs"]:  # no token count: the loss of a micro-batch is its mean
            model.accepts_loss_kwargs = False
        headless = []
        model.get_output_embeddings().register_forward_hook(
            lambda module, args, out: headless.append(module.training and out.shape[1] == 0))
        trainer = BlockDiagCPTrainer(
            model=model, args=transformers.TrainingArguments(**tr.common_args(s, tmp)),
            train_dataset=train, data_collator=tr.pad_collator, cp_size=s["cp"], linear_ce=True)
        trainer.train()
    steps = [e for e in trainer.state.log_history if "loss" in e and "train_loss" not in e]
    params = torch.cat([p.detach().double().reshape(-1) for p in trainer.model.parameters()])
    return {"steps": steps, "eval_loss": None, "params": params, "calls": sum(headless),
            "tokens_seen": trainer.state.num_input_tokens_seen}


@pytest.mark.parametrize("smoothing, accepts_loss_kwargs", [(0.0, True), (0.1, True), (0.0, False)])
def test_the_linear_ce_wiring_trains_as_the_trainer_without_cp(smoothing, accepts_loss_kwargs, rank_pools):
    s = tr.spec(evaluate=False, accepts_loss_kwargs=accepts_loss_kwargs, args={"label_smoothing_factor": smoothing})
    got = rank_pools(2).run(linear_ce_run, {**s, "cp": 2})[0]
    want = tr.run(s)
    assert got["calls"] == s["steps"] * s["accum"]  # every micro-batch's loss came from the head's input
    tr.assert_same(got, want, label=f"linear CE, label smoothing {smoothing}, accepts_loss_kwargs {accepts_loss_kwargs}")
