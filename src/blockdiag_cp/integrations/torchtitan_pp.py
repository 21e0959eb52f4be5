"""torchtitan's pipeline (``parallelism.pipeline_parallel_degree``) under block-diagonal CP (issue #54).

Note [torchtitan's pipeline under CP]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torchtitan's trainer runs a pipeline step as ``pp_forward_backward_step``: each micro-batch (``parallelism.
pipeline_parallel_microbatch_size`` rows; ``training.local_batch_size`` rows in all) through
``post_dataloading_process``, then one call of its schedule (built by torchtitan's ``pipeline_llm``: its stages,
its split of the layers, its schedule class). `PipelinedRows` is that method for `BlockDiagCPTrainer`:
``post_dataloading_process`` lays each micro-batch's rows end to end as one packed row and shards it by this
library's plan, its own step (Note [Several rows per micro-batch] in torchtitan_rows.py), and the schedule runs
inside ``PipelineSteps(...)(schedule)``, so every stage action of micro-batch k, on every stage (those that get
hidden states too), attends with micro-batch k's documents, whatever order the schedule runs them in (Note
[Binding a schedule's stages to their micro-batches' steps] in step/micro_batches.py). The loss is torchtitan's
(each shard's token sum over the global valid-token count, divided as `BlockDiagCPTrainer` divides it), the
gradient norm torchtitan's sum over the pipeline ranks (on CPU each stage's part accumulated in float64, Note
[Gradient norms on CPU]), and a MoE router's padding hook finds its micro-batch's step in the turn it runs in.

torchtitan 0.3.0 calls ``schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)``, which torch 2.13's
schedules do not take (they split whole-batch inputs: torchtitan's own pipeline fails there with "Expecting 4
arg_mbs but got 1", with or without this library). So the micro-batches' shards are stacked (one packed row per
micro-batch, dimension 0) and given to ``schedule.step`` as torch 2.13 takes them: the token ids to the first
stage, ``positions`` to every stage, the labels to the last; the schedule splits them back, in order.

Note [torchtitan's chunked loss under a split backward]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Under a schedule that splits each backward into its input and weight parts (InterleavedZeroBubble,
ZBVZeroBubble, DualPipeV), torchtitan 0.3.0's `ChunkedLossWrapper` (its configs' default loss) leaves the final
norm's weight without a gradient, at every step, with or without CP: measured through this trainer at cp 1 (the
logged grad norm 3.6e-5 off, ``norm.weight`` 1.3e-3 apart after 2 AdamW steps, every other gradient equal at
step 1) and with torch's pipelining, torchtitan's loss and FSDP alone (no blockdiag-cp). torchtitan shards the
norm and the head as one FSDP unit, which the wrapper reshards at the end of its forward (its backward runs inside
the loss); torch's split backward then looks up the stage's parameters, the sharded ones, which the norm's graph
does not hold. Without FSDP, or under a schedule with a full backward (GPipe, 1F1B, Interleaved1F1B, LoopedBFS),
the norm gets its gradient. So `refuse_chunked_loss_under_split_backward` refuses the pair by name; the loss
itself (``config.loss = config.loss.loss_fn``: torchtitan's cross-entropy on the whole shard) trains exactly.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.pipelining.schedules import (
    ScheduleDualPipeV,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
    get_schedule_class,
)
from torchtitan.components.loss import ChunkedLossWrapper

from ..step.micro_batches import PipelineSteps

__all__ = ("REFUSED_WITH_PIPELINE", "PipelinedRows", "refuse_chunked_loss_under_split_backward")

#: (the option, the value that keeps it off, why it is refused) with ``parallelism.pipeline_parallel_degree`` > 1
REFUSED_WITH_PIPELINE = (
    ("validator.enable", False,
     "with a pipeline, torchtitan 0.3.0's validator calls schedule.eval(arg_mbs=...), which torch 2.13's schedules "
     "do not take; validation through a pipeline under blockdiag-cp is not verified"),
    ("parallelism.tensor_parallel_degree", 1, "tensor x pipeline parallelism under blockdiag-cp is not verified"),
    ("compile.enable", False, "torchtitan's compiled pipeline stages under blockdiag-cp are not verified"),
    ("checkpoint.enable", False, "checkpoints of a pipeline under blockdiag-cp (saving, resuming) are not verified"),
)

#: torch 2.13's schedules that split each backward into its input and weight parts
SPLIT_BACKWARD_SCHEDULES = (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV)


def refuse_chunked_loss_under_split_backward(config: Any) -> None:
    """Refuse torchtitan's `ChunkedLossWrapper` under a pipeline schedule that splits its backward, or one read
    from a CSV file (it may): the final norm's weight would get no gradient (Note [torchtitan's chunked loss under
    a split backward]).

    Raises:
        ValueError: naming the loss, the schedule and what to use instead.
    """
    parallelism = config.parallelism
    if parallelism.pipeline_parallel_degree <= 1 or not isinstance(config.loss, ChunkedLossWrapper.Config):
        return
    if parallelism.pipeline_parallel_schedule_csv:
        schedule = f"parallelism.pipeline_parallel_schedule_csv={parallelism.pipeline_parallel_schedule_csv!r}"
    elif issubclass(get_schedule_class(parallelism.pipeline_parallel_schedule), SPLIT_BACKWARD_SCHEDULES):
        schedule = f"parallelism.pipeline_parallel_schedule={parallelism.pipeline_parallel_schedule!r}"
    else:
        return
    raise ValueError(
        f"loss=ChunkedLossWrapper with {schedule} is refused by BlockDiagCPTrainer: under a schedule that splits "
        f"each backward into its input and weight parts (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV; a CSV "
        f"schedule may), torchtitan's chunked loss leaves the final norm's weight without a gradient, with or "
        f"without CP (Note [torchtitan's chunked loss under a split backward]). Set config.loss = "
        f"config.loss.loss_fn (the cross-entropy on the whole shard), or a schedule with a full backward (GPipe, "
        f"1F1B, Interleaved1F1B, LoopedBFS)")


class PipelinedRows:
    """`BlockDiagCPTrainer`'s pipeline step (Note [torchtitan's pipeline under CP]); mixed in before torchtitan's
    ``Trainer``, whose ``post_dataloading_process`` (this library's sharding, which sets ``cp_step``),
    ``pp_schedule``, ``pp_has_first_stage`` / ``pp_has_last_stage``, ``train_context`` and ``device`` it uses."""

    def pp_forward_backward_step(self, *, input_dict_mbs: list[dict[str, torch.Tensor]],
                                 label_mbs: list[torch.Tensor], global_valid_tokens: torch.Tensor) -> torch.Tensor:
        """One schedule step over the micro-batches ``[B, S]`` each; returns the loss (the last stage's sum over
        its micro-batches; -1 on the other stages, as torchtitan)."""
        steps, inputs, labels, extras = [], [], [], []
        for input_dict, row_labels in zip(input_dict_mbs, label_mbs, strict=True):
            shard, shard_labels, extra = self.post_dataloading_process(input_dict, row_labels)  # [1, L] each
            steps.append(self.cp_step)
            self.cp_step = None
            inputs.append(shard)
            labels.append(shard_labels)
            extras.append(extra)
        kwargs = {key: torch.cat([extra[key] for extra in extras]) for key in extras[0]}  # positions [M, L]
        losses: list[torch.Tensor] = []
        first = (torch.cat(inputs),) if self.pp_has_first_stage else ()  # [M, L]
        last = dict(target=torch.cat(labels), losses=losses) if self.pp_has_last_stage else {}
        with self.train_context(), PipelineSteps(tuple(steps))(self.pp_schedule):
            self.pp_schedule.step(*first, return_outputs=False, loss_kwargs={"global_valid_tokens": global_valid_tokens},
                                  **kwargs, **last)
        if self.pp_has_last_stage:
            return torch.sum(torch.stack(losses)).to(self.device)
        return torch.tensor([-1.0], device=self.device)
