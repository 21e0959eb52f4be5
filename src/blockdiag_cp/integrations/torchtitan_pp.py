"""torchtitan's pipeline (``parallelism.pipeline_parallel_degree``) under block-diagonal CP (issue #54).

Note [torchtitan's pipeline under CP]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torchtitan's trainer runs a pipeline step as ``pp_forward_backward_step``: each micro-batch (one packed row:
``parallelism.pipeline_parallel_microbatch_size`` 1) through ``post_dataloading_process``, then one call of its
schedule (built by torchtitan's ``pipeline_llm``: its stages, its split of the layers, its schedule class).
`PipelinedRows` is that method for `BlockDiagCPTrainer`: ``post_dataloading_process`` shards each micro-batch's
row by this library's plan (its own step), and the schedule runs inside ``PipelineSteps(...)(schedule)``, so
every stage action of micro-batch k, on every stage, attends with micro-batch k's documents (Note [Binding a
schedule's stages to their micro-batches' steps] in step/micro_batches.py). The loss is torchtitan's (the
shard's token sum over the global valid-token count, divided as `BlockDiagCPTrainer` divides it).

torchtitan 0.3.0 calls ``schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)``, which torch 2.13's
schedules do not take (they split whole-batch inputs: torchtitan's own pipeline fails there with "Expecting 4
arg_mbs but got 1", with or without this library). So the micro-batches' shards are stacked (one row per
micro-batch, dimension 0) and given to ``schedule.step`` as torch 2.13 takes them: the token ids to the first
stage, ``positions`` to every stage, the labels to the last; the schedule splits them back, in order.
"""

from __future__ import annotations

from typing import Any

import torch

from ..step.micro_batches import PipelineSteps

__all__ = ("PipelinedRows", "check_rows_per_micro_batch")


def check_rows_per_micro_batch(config: Any) -> None:
    """One packed row per micro-batch: ``training.local_batch_size`` 1 without a pipeline (more rows: accumulation
    through ``training.global_batch_size``), ``parallelism.pipeline_parallel_microbatch_size`` 1 with one (then
    ``local_batch_size`` is the number of micro-batches). `ValueError` naming the option otherwise."""
    if config.parallelism.pipeline_parallel_degree == 1:
        if config.training.local_batch_size != 1:
            raise ValueError(
                f"training.local_batch_size={config.training.local_batch_size!r} is refused by BlockDiagCPTrainer "
                "(blockdiag-cp shards one packed row per step; use training.global_batch_size for more rows "
                "(accumulation)); set training.local_batch_size=1")
    elif config.parallelism.pipeline_parallel_microbatch_size != 1:
        raise ValueError(
            f"parallelism.pipeline_parallel_microbatch_size={config.parallelism.pipeline_parallel_microbatch_size!r} "
            "is refused by BlockDiagCPTrainer (each pipeline micro-batch is one packed row, sharded by its own plan; "
            "training.local_batch_size is the number of micro-batches); set "
            "parallelism.pipeline_parallel_microbatch_size=1")


class PipelinedRows:
    """`BlockDiagCPTrainer`'s pipeline step (Note [torchtitan's pipeline under CP]); mixed in before torchtitan's
    ``Trainer``, whose ``post_dataloading_process`` (this library's sharding, which sets ``cp_step``),
    ``pp_schedule``, ``pp_has_first_stage`` / ``pp_has_last_stage``, ``train_context`` and ``device`` it uses."""

    def pp_forward_backward_step(self, *, input_dict_mbs: list[dict[str, torch.Tensor]],
                                 label_mbs: list[torch.Tensor], global_valid_tokens: torch.Tensor) -> torch.Tensor:
        ctxs, inputs, labels, positions = [], [], [], []
        for input_dict, row_labels in zip(input_dict_mbs, label_mbs, strict=True):
            shard, shard_labels, extra = self.post_dataloading_process(input_dict, row_labels)
            ctxs.append(self.cp_step)
            self.cp_step = None
            inputs.append(shard)
            labels.append(shard_labels)
            positions.append(extra["positions"])
        losses: list = []
        first = (torch.cat(inputs),) if self.pp_has_first_stage else ()
        last = dict(target=torch.cat(labels), losses=losses) if self.pp_has_last_stage else {}
        with self.train_context(), PipelineSteps(tuple(ctxs))(self.pp_schedule):
            self.pp_schedule.step(*first, positions=torch.cat(positions), return_outputs=False,
                                  loss_kwargs={"global_valid_tokens": global_valid_tokens}, **last)
        if self.pp_has_last_stage:
            return torch.sum(torch.stack(losses)).to(self.device)
        return torch.tensor([-1.0], device=self.device)
