"""The wiring `BlockDiagCPMixin` needs for a linear-CE option, as a subclass here (trainer.py is not changed):
its ``compute_loss`` in training calls `hf.linear_ce.linear_ce_loss` with the step's divisor and the
Trainer's label smoothing, then scales as ``Trainer.compute_loss`` scales. At cp 2 on gloo ranks, the logged
losses, grad norms and final parameters equal transformers' Trainer without CP and without the option
(tests/trainer_runs.py: float64 tiny Llama, padded rows with prompts, two steps of two accumulated batches)."""

import os
import tempfile
import warnings

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch  # noqa: E402
import trainer_runs as tr  # noqa: E402


def linear_ce_trainer_class():
    import transformers

    from blockdiag_cp.hf.linear_ce import linear_ce_loss, linear_head
    from blockdiag_cp.trainer import BlockDiagCPMixin

    class LinearCETrainer(BlockDiagCPMixin, transformers.Trainer):
        """What the mixin's ``linear_ce=True`` would do (see docs/memory.md, "Wiring")."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            linear_head(self.accelerator.unwrap_model(self.model))  # refuse a model by name before training

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if not model.training or self.compute_loss_func is not None:
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            self.linear_ce_calls = getattr(self, "linear_ce_calls", 0) + 1
            step = self._rows_step()
            divisor = num_items_in_batch if step is None else step.replica_divisor(num_items_in_batch)
            loss = linear_ce_loss(model, inputs, num_items_in_batch=divisor,
                                  label_smoothing=self.args.label_smoothing_factor)
            if self.args.average_tokens_across_devices and self.model_accepts_loss_kwargs and \
                    num_items_in_batch is not None:  # as Trainer.compute_loss scales (num_processes = dp x cp)
                loss = loss * (self.accelerator.num_processes // self.get_tp_size())
            return (loss, None) if return_outputs else loss

    return LinearCETrainer


def linear_ce_run(rank: int, world: int, s: dict) -> dict:
    """`trainer_runs.pool_run` with the subclass above in place of the mixin's own trainer."""
    import transformers

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train = [{k: v for k, v in d.items() if k != "completion_mask"} for d in tr.documents(s["docs"], 0, s["prompt"])]
        trainer = linear_ce_trainer_class()(
            model=tr.model(s["model"]), args=transformers.TrainingArguments(**tr.common_args(s, tmp)),
            train_dataset=train, data_collator=tr.pad_collator, cp_size=s["cp"])
        trainer.train()
    steps = [e for e in trainer.state.log_history if "loss" in e and "train_loss" not in e]
    params = torch.cat([p.detach().double().reshape(-1) for p in trainer.model.parameters()])
    return {"steps": steps, "eval_loss": None, "params": params, "calls": getattr(trainer, "linear_ce_calls", 0)}


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_the_linear_ce_wiring_trains_as_the_trainer_without_cp(smoothing, rank_pools):
    s = tr.spec(evaluate=False, args={"label_smoothing_factor": smoothing})
    got = rank_pools(2).run(linear_ce_run, {**s, "cp": 2})[0]
    want = tr.run(s)
    assert got["calls"] == s["steps"] * s["accum"]  # every micro-batch's loss came through linear_ce_loss
    tr.assert_same(got, want, label=f"linear CE, label smoothing {smoothing}")
