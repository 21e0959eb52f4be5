"""accelerate's ``ParallelismConfig`` read as the mixin's ``(dp, cp)`` mesh.

Note [accelerate's ParallelismConfig under the mixin]
-----------------------------------------------------
People ask for context parallelism in this ecosystem with
``TrainingArguments(parallelism_config=ParallelismConfig(dp_replicate_size=R, dp_shard_size=S, cp_size=C))``
together with FSDP2. accelerate's own CP (``torch.distributed.tensor.experimental.context_parallel``) drops
the attention mask and attends causally over the whole row, which is wrong on packed rows; the mixin's CP
attends per document. So the mixin reads the config as its mesh and keeps the sharding accelerate derives
from it:

- ``cp = C`` (the mixin's ``cp_size``; passing both, different, is an error) and ``dp = R x S`` replicas;
- accelerate lays its mesh out as ``(dp_replicate, dp_shard, cp)`` (row-major: consecutive ranks form a CP
  group) and shards the model with FSDP2 over its flattened ``dp_shard x cp`` dimension (HSDP: replicated
  over ``dp_replicate``). The mixin's ``(dp, cp)`` mesh has the same rank layout, so accelerate is given
  ``ParallelismConfig(dp_replicate_size=R, dp_shard_size=S x C, cp_size=1)``: the same FSDP2 mesh and
  sharding, and no CP of its own (no ``context_parallel`` buffers, no mask-dropping hooks);
- gradients are averaged over all ``R x S x C`` ranks, as in the run without CP over ``R x S``
  (Note [The loss under CP equals the loss without CP] in trainer.py).

Tensor parallelism and sequence parallelism (``tp_size``, ``sp_size`` > 1) are not verified with the
mixin and are refused by name.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ("full_parameters", "read_parallelism_config")


def read_parallelism_config(training_args: Any, cp_size: int) -> int:
    """The CP size the mixin runs with: `cp_size`, or ``parallelism_config.cp_size`` of `training_args`
    (Note [accelerate's ParallelismConfig under the mixin]); rewrites ``training_args.parallelism_config``
    for accelerate (its CP dimension folded into ``dp_shard``). `ValueError` for what is not verified."""
    config = getattr(training_args, "parallelism_config", None)
    if config is None:
        return cp_size
    for name in ("tp_size", "sp_size"):
        if getattr(config, name, 1) > 1:
            raise ValueError(f"ParallelismConfig({name}={getattr(config, name)}) is not verified with BlockDiagCPMixin: "
                             "use dp_replicate_size, dp_shard_size and cp_size (read as the mixin's mesh)")
    if config.cp_size > 1 and cp_size > 1 and config.cp_size != cp_size:
        raise ValueError(f"ParallelismConfig(cp_size={config.cp_size}) and the mixin's cp_size={cp_size} differ: set "
                         "one (the mixin reads the ParallelismConfig's cp_size as its own)")
    if config.cp_size == 1:
        return cp_size
    training_args.parallelism_config = dataclasses.replace(
        config, dp_shard_size=config.dp_shard_size * config.cp_size, cp_size=1, cp_handler=None)
    return config.cp_size


def full_parameters(trainer: Any) -> list:
    """A Trainer's model parameters, whole: gathered where DeepSpeed ZeRO-3 partitions them, the full tensors of
    FSDP2's DTensors (a collective on every rank: call it on all of them), as they are otherwise."""
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    if getattr(trainer, "is_deepspeed_enabled", False):
        import deepspeed

        params = list(model.parameters())
        with deepspeed.zero.GatheredParameters(params):
            return [p.detach().clone() for p in params]
    return [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
