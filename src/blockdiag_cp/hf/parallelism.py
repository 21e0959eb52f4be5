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

Note [A loss outside the modules under ZeRO-3]
----------------------------------------------
DeepSpeed ZeRO-3 gathers a module's parameters in hooks: before its forward, and in its backward
when the gradient reaches its outputs; it releases them after (and reduces each gradient into
its partition in a hook that runs when the gradient is accumulated, so the weight must still
be whole then). The linear-CE loss (hf/linear_ce.py) reads the LM head's weight in the head's
forward pre-hook, where it is gathered, but the loss is no output of the head: in its backward
the weight had been released (size 0). `forward_with_loss_out` makes the loss what DeepSpeed
knows how to serve, with its own API:

- the loss leaves the model as an output of the module DeepSpeed hooked at the top (the
  engine's ``.module``): a forward hook put before DeepSpeed's own returns ``(outputs,
  loss)``, so DeepSpeed's hook that fetches the module's parameters for its backward sits on
  the loss too, and the backward of the loss runs inside that module's backward;
- the head's parameters are registered as external parameters of that module
  (``deepspeed.zero.register_external_parameter``: parameters its forward uses outside the
  modules that own them), so DeepSpeed fetches them with that module's: for its forward, and
  for its backward from where the backward reaches the loss to where it ends, through the
  loss's backward (where the weight's gradient is accumulated whole and reduced into its
  partition by DeepSpeed's own hook). They stay registered (DeepSpeed's trace of what each
  module fetches, which it prefetches by, must not change from step to step), so the head's
  weight (``V x H``) is whole from the start of each forward of the model to the end of its
  backward (measured: on the plain path DeepSpeed's prefetch holds it through the forward
  too, but not through the backward), evaluation's forward included.

A tied head (the input embeddings' weight) is the same parameter: its gradients from the loss
and from the embeddings are accumulated once, whole, and reduced once, as on the plain path.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import torch

__all__ = ("forward_with_loss_out", "full_parameters", "read_parallelism_config")


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


class _LossOut(tuple):
    """``(outputs, loss)``: what the top module returns while `forward_with_loss_out` carries a loss out of it."""


def forward_with_loss_out(model: torch.nn.Module, kwargs: dict[str, Any], params: Sequence[torch.nn.Parameter],
                          loss_of: Callable[[], Optional[torch.Tensor]]) -> tuple[Any, Optional[torch.Tensor]]:
    """``(model(**kwargs), loss_of())`` where the forward computes the loss (any tensor) from `params` outside any
    module's outputs (a forward hook); ``loss_of()`` is read at the end of the forward (None: not computed).

    Where `params` are partitioned by DeepSpeed ZeRO-3, the loss is carried out as an output of the module
    DeepSpeed hooked at the top of `model` and `params` are its external parameters (Note [A loss outside the
    modules under ZeRO-3]), so its backward gets them whole; otherwise the forward runs as it is.
    """
    top = _zero3_top(model) if any(hasattr(p, "ds_id") for p in params) else None
    if top is None:
        return model(**kwargs), loss_of()
    import deepspeed

    for p in params:  # once per parameter (by id)
        deepspeed.zero.register_external_parameter(top, p)

    def carry_out(module, args, outputs):
        loss = loss_of()
        return None if loss is None else _LossOut((outputs, loss))

    handle = top.register_forward_hook(carry_out, prepend=True)  # before DeepSpeed's hooks see the outputs
    try:
        result = model(**kwargs)
    finally:
        handle.remove()
    if isinstance(result, _LossOut):
        return result[0], result[1]
    if loss_of() is not None:
        raise ValueError(f"DeepSpeed ZeRO-3: {type(top).__name__}'s outputs did not come back through its forward "
                         "hooks, so the loss's backward would not get the parameters it reads")
    return result, None


def _zero3_top(model: torch.nn.Module) -> torch.nn.Module:
    """The outermost module of `model`'s wrapper chain that DeepSpeed ZeRO-3 hooked (the engine's ``.module``)."""
    module = model
    while "ds_external_parameters" not in vars(module):  # set on each module DeepSpeed hooks (not the engine)
        inner = module._modules.get("module", module._modules.get("_orig_mod"))
        if not isinstance(inner, torch.nn.Module):
            raise ValueError(f"DeepSpeed ZeRO-3 partitions the parameters a loss reads, but {type(model).__name__} "
                             "is neither its engine nor a module it hooked: call the engine")
        module = inner
    return module
