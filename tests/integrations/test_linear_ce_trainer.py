"""The wiring `BlockDiagCPMixin` needs for a linear-CE option, as a subclass here (trainer.py is not changed):
its ``compute_loss`` in training calls `hf.linear_ce.linear_ce_loss` with the step's divisor and the
Trainer's label smoothing, then scales as ``Trainer.compute_loss`` scales. At cp 2 on gloo ranks, the logged
losses, grad norms and final parameters equal transformers' Trainer without CP and without the option
(tests/trainer_runs.py: float64 tiny Llama, padded rows with prompts, two steps of two accumulated batches),
also for a model with ``accepts_loss_kwargs=False`` (no token count: each micro-batch's mean)."""

import os
import tempfile
import warnings

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch  # noqa: E402
import trainer_runs as tr  # noqa: E402


def linear_ce_compute_loss(strategy, model, inputs, return_outputs, num_items_in_batch):
    """What `RowsStrategy.compute_loss` (hf/trainer_rows.py) would run first under ``linear_ce=True`` in training:
    the step's divisor, the Trainer's label smoothing, then the Trainer's ``num_processes`` factor as
    ``Trainer.compute_loss`` applies it."""
    from blockdiag_cp.hf.linear_ce import linear_ce_loss

    t = strategy.trainer
    step = strategy.rows_step()
    divisor = num_items_in_batch if step is None else step.replica_divisor(num_items_in_batch)
    loss = linear_ce_loss(model, inputs, num_items_in_batch=divisor, label_smoothing=t.args.label_smoothing_factor)
    if t.args.average_tokens_across_devices and t.model_accepts_loss_kwargs and num_items_in_batch is not None:
        loss = loss * (t.accelerator.num_processes // t.get_tp_size())
    return (loss, None) if return_outputs else loss


def linear_ce_trainer_class():
    import transformers

    from blockdiag_cp.hf.linear_ce import linear_head
    from blockdiag_cp.trainer import BlockDiagCPMixin

    class LinearCETrainer(BlockDiagCPMixin, transformers.Trainer):
        """What the mixin's ``linear_ce=True`` would do (see docs/memory.md, "Wiring")."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            linear_head(self.accelerator.unwrap_model(self.model))  # refuse a model by name before training

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if not model.training:  # evaluation keeps the plain path
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            self.linear_ce_calls = getattr(self, "linear_ce_calls", 0) + 1
            return linear_ce_compute_loss(self._strategy, model, inputs, return_outputs, num_items_in_batch)

    return LinearCETrainer


def linear_ce_run(rank: int, world: int, s: dict) -> dict:
    """`trainer_runs.pool_run` with the subclass above in place of the mixin's own trainer."""
    import transformers

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train = [{k: v for k, v in d.items() if k != "completion_mask"} for d in tr.documents(s["docs"], 0, s["prompt"])]
        model = tr.model(s["model"])
        if not s["accepts_loss_kwargs"]:  # no token count: the loss of a micro-batch is its mean
            model.accepts_loss_kwargs = False
        trainer = linear_ce_trainer_class()(
            model=model, args=transformers.TrainingArguments(**tr.common_args(s, tmp)),
            train_dataset=train, data_collator=tr.pad_collator, cp_size=s["cp"])
        trainer.train()
    steps = [e for e in trainer.state.log_history if "loss" in e and "train_loss" not in e]
    params = torch.cat([p.detach().double().reshape(-1) for p in trainer.model.parameters()])
    return {"steps": steps, "eval_loss": None, "params": params, "calls": getattr(trainer, "linear_ce_calls", 0)}


@pytest.mark.parametrize("smoothing, accepts_loss_kwargs", [(0.0, True), (0.1, True), (0.0, False)])
def test_the_linear_ce_wiring_trains_as_the_trainer_without_cp(smoothing, accepts_loss_kwargs, rank_pools):
    s = tr.spec(evaluate=False, accepts_loss_kwargs=accepts_loss_kwargs, args={"label_smoothing_factor": smoothing})
    got = rank_pools(2).run(linear_ce_run, {**s, "cp": 2})[0]
    want = tr.run(s)
    assert got["calls"] == s["steps"] * s["accum"]  # every micro-batch's loss came through linear_ce_loss
    tr.assert_same(got, want, label=f"linear CE, label smoothing {smoothing}, accepts_loss_kwargs {accepts_loss_kwargs}")
