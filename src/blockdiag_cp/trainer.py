"""Packed-sequence CP inside transformers' `Trainer` (and every subclass: TRL's `SFTTrainer`, ...).

    from blockdiag_cp.trainer import BlockDiagCPMixin, BlockDiagCPTrainer

    trainer = BlockDiagCPTrainer(model=model, args=args, train_dataset=ds, data_collator=collator, cp_size=2)

    class CPSFTTrainer(BlockDiagCPMixin, trl.SFTTrainer):
        pass

Launch with ``torchrun --nproc-per-node N``: the world is ``dp x cp`` ranks on a
``(dp, cp)`` DeviceMesh (consecutive ranks form a CP group). transformers and
accelerate are optional extras (``pip install blockdiag-cp[hf]``); this module is the
only one that needs the Trainer.

Note [The loss under CP equals the loss without CP]
---------------------------------------------------
The Trainer (transformers 5.x) computes, per optimizer step and rank ``r``:

    N      = number of target tokens, counted on the *unsharded* batches of the step,
             all-gathered over the world, divided by `get_cp_size()`
    loss_r = world * (sum of this rank's token losses) / N      (average_tokens_across_devices)
    grads  = DDP / FSDP average over the world of grad(loss_r)

Without CP (world = dp): every token lives on one rank, so the average of
``dp * sum_r / N`` is ``sum_all / N``: the global token mean. With CP (world = dp x cp),
all ``cp`` ranks of a replica see the same batches (the dataloader is sharded over dp
only), so the gathered count is ``cp * N``; `get_cp_size()` returns ``cp`` and the
Trainer divides it back to ``N``. Each CP rank then holds a disjoint shard of its
replica's targets, so ``sum_r`` over all ``dp x cp`` ranks is again ``sum_all``, and the
world average of ``world * sum_r / N`` is ``sum_all / N``: the same mean, the same
gradients (hence the same ``grad_norm``), and the same logged ``loss`` (the Trainer
logs the world mean of ``loss_r / world``-scaled values, i.e. ``sum_all / N``).

The targets are the next tokens of the *unsharded* rows, each row shifted on its own
exactly as the model's loss would (`blockdiag_cp.rows.shifted_labels`), computed
before sharding, so a shard's last token still predicts the next shard's first.
Forward *and* backward (with gradient-checkpointing recompute) run inside the CP step:
the Trainer's own ``_prepare_context_parallel_inputs`` hook returns our step context,
and ``training_step`` / ``prediction_step`` run the model and ``backward`` inside it.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.distributed as dist
import transformers

from . import hf  # noqa: F401  (registers attn_implementation="blockdiag_cp")
from .batch import make_cp_blockdiag_batch_and_ctx
from .config import CPConfig
from .errors import CPTypeError
from .rows import flatten_rows

logger = logging.getLogger(__name__)

if not all(hasattr(transformers.Trainer, hook) for hook in ("get_cp_size", "_prepare_context_parallel_inputs")):
    raise ImportError(
        f"blockdiag_cp.trainer needs transformers >= 5.0 (its Trainer's context-parallel hooks); found "
        f"{transformers.__version__}: pip install -U 'transformers>=5.0'"
    )

#: keys the step adds for its own bookkeeping; the model never sees them
STEP_ONLY_KEYS = ("_packed_seq_ids", "padding_mask")


class BlockDiagCPMixin:
    """Block-diagonal context parallelism for any `transformers.Trainer` subclass.

    Args:
        cp_size: ranks per CP group (must divide the world size); 1 = data parallel
            only, still with per-document attention on packed rows.
        cp_config: `CPConfig` for every step (exchange, kernel, layout).
        *args, **kwargs: passed to the Trainer unchanged.

    Every CP rank of a dp replica gets the same batches in the same order; each batch
    is flattened to one packed row (`flatten_rows`) and sharded with
    `make_cp_blockdiag_batch_and_ctx`; the loss, the logged loss and the gradients are
    those of the run without CP (Note [The loss under CP equals the loss without CP]).
    """

    def __init__(self, *args: Any, cp_size: int = 1, cp_config: Optional[CPConfig] = None, **kwargs: Any) -> None:
        if isinstance(cp_size, bool) or not isinstance(cp_size, int):
            raise CPTypeError(f"cp_size must be an int, got {type(cp_size).__name__}")
        if cp_size < 1:
            raise ValueError(f"cp_size must be >= 1, got {cp_size}")
        if cp_config is not None and not isinstance(cp_config, CPConfig):
            raise CPTypeError(f"cp_config must be a CPConfig, got {type(cp_config).__name__}")
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        _refuse_accelerate_cp(getattr(training_args, "parallelism_config", None))
        _no_batch_dispatch(training_args)
        super().__init__(*args, **kwargs)
        _refuse_accelerate_cp(getattr(self.accelerator, "parallelism_config", None))  # e.g. from an accelerate YAML
        world = self.args.world_size
        if world % cp_size:
            raise ValueError(f"cp_size={cp_size} must divide the world size {world} (world = dp x cp)")
        self.cp_size, self.cp_config = cp_size, CPConfig() if cp_config is None else cp_config
        self.dp_size = world // cp_size
        self.cp_mesh, self.dp_rank = _cp_mesh(self.dp_size, cp_size, self.args.device)
        _use_blockdiag_attention(self.model)

    # -- the Trainer's hooks ------------------------------------------------------------

    def get_cp_size(self) -> int:
        """Ranks sharing one batch: the Trainer divides its token count by this (see the Note)."""
        return self.cp_size

    def get_train_dataloader(self):
        return _shard_over_dp(super().get_train_dataloader(), self.dp_size, self.dp_rank)

    def get_eval_dataloader(self, *args: Any, **kwargs: Any):
        return _shard_over_dp(super().get_eval_dataloader(*args, **kwargs), self.dp_size, self.dp_rank)

    def _prepare_context_parallel_inputs(self, model, inputs):
        """The Trainer's CP hook: flatten, shard and return ``(train_ctx, inputs)``; forward and
        backward of `training_step` (and the loss of `prediction_step`) run inside ``train_ctx()``."""
        batch = {k: v.to(self.args.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        batch = flatten_rows(batch)
        train_ctx, batch = make_cp_blockdiag_batch_and_ctx(self.cp_mesh, None, batch, config=self.cp_config)
        for key in STEP_ONLY_KEYS:
            batch.pop(key, None)
        return train_ctx, batch

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        if self.compute_metrics is not None and not prediction_loss_only:
            raise ValueError(
                "under block-diagonal CP each rank holds a shard of the logits, so compute_metrics cannot see whole "
                "rows; evaluate the loss only (compute_metrics=None or prediction_loss_only=True)"
            )
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)


class BlockDiagCPTrainer(BlockDiagCPMixin, transformers.Trainer):
    """`transformers.Trainer` with block-diagonal CP (see `BlockDiagCPMixin`)."""


def _refuse_accelerate_cp(config) -> None:
    """`ValueError` if accelerate's own context/sequence parallelism is configured too."""
    if config is not None and (getattr(config, "cp_enabled", False) or getattr(config, "sp_enabled", False)):
        raise ValueError(
            "accelerate's ParallelismConfig(cp_size > 1 or sp_size > 1) is set together with BlockDiagCPMixin; use "
            "one: the mixin's cp_size (per-document attention on packed rows) or accelerate's context parallelism "
            "(no packing), not both"
        )


def _no_batch_dispatch(training_args) -> None:
    """Ask accelerate to shard batches per process (not dispatch them from rank 0), so the
    dataloader can be re-sharded over dp only."""
    config = getattr(training_args, "accelerator_config", None)
    if config is not None and getattr(config, "dispatch_batches", None):
        logger.warning("blockdiag-cp: accelerator_config.dispatch_batches=True is turned off (CP shards batches over dp)")
    if config is not None:
        config.dispatch_batches = False


def _cp_mesh(dp: int, cp: int, device: torch.device):
    """``(cp sub-mesh or None, dp rank)`` of a ``(dp, cp)`` DeviceMesh over the world."""
    if not (dist.is_available() and dist.is_initialized()):
        if dp * cp != 1:
            raise ValueError("cp_size > 1 needs torch.distributed: launch with torchrun")
        return None, 0
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dp, cp), mesh_dim_names=("dp", "cp"))
    return mesh["cp"], mesh.get_local_rank("dp")


def _use_blockdiag_attention(model) -> None:
    """Switch the model to ``attn_implementation="blockdiag_cp"`` (it attends per document)."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "_attn_implementation", None) != hf.ATTN_IMPLEMENTATION:
        logger.info("blockdiag-cp: model attention %r -> %r", config._attn_implementation, hf.ATTN_IMPLEMENTATION)
        model.set_attn_implementation(hf.ATTN_IMPLEMENTATION)


def _shard_over_dp(dataloader, dp: int, dp_rank: int):
    """Make accelerate's prepared dataloader shard over the dp replicas only.

    accelerate shards over every process; with CP, the ``cp`` ranks of a replica must
    read the same batches. Its shards keep ``num_processes`` / ``process_index`` as
    attributes (transformers itself resets them for its rebalancing sampler).
    """
    from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard

    shards = [getattr(dataloader, "batch_sampler", None), getattr(dataloader, "dataset", None)]
    found = False
    for shard in shards:
        if isinstance(shard, (BatchSamplerShard, IterableDatasetShard)):
            shard.num_processes, shard.process_index = dp, dp_rank
            found = True
    if not found and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            f"blockdiag-cp cannot shard this dataloader ({type(dataloader).__name__}) over the dp replicas only; "
            "use a map-style or iterable dataset with accelerate's default sharding (dispatch_batches=False)"
        )
    return dataloader
