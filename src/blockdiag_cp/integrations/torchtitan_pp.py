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
"""

from __future__ import annotations

import torch

from ..step.micro_batches import PipelineSteps

__all__ = ("REFUSED_WITH_PIPELINE", "PipelinedRows")

#: (the option, the value that keeps it off, why it is refused) with ``parallelism.pipeline_parallel_degree`` > 1
REFUSED_WITH_PIPELINE = (
    ("validator.enable", False,
     "with a pipeline, torchtitan 0.3.0's validator calls schedule.eval(arg_mbs=...), which torch 2.13's schedules "
     "do not take; validation through a pipeline under blockdiag-cp is not verified"),
    ("parallelism.tensor_parallel_degree", 1, "tensor x pipeline parallelism under blockdiag-cp is not verified"),
    ("compile.enable", False, "torchtitan's compiled pipeline stages under blockdiag-cp are not verified"),
    ("checkpoint.enable", False, "checkpoints of a pipeline under blockdiag-cp (saving, resuming) are not verified"),
)


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
