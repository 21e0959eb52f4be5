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
exactly as the model's loss would (`blockdiag_cp.step.rows.shifted_labels`), computed
before sharding, so a shard's last token still predicts the next shard's first.
Forward *and* backward (with gradient-checkpointing recompute) run inside the CP step:
the Trainer's own ``_prepare_context_parallel_inputs`` hook returns our step context,
and ``training_step`` / ``prediction_step`` run the model and ``backward`` inside it.

Note [Every dp replica sees the batches it would see without CP]
----------------------------------------------------------------
accelerate prepares each dataloader for ``world = dp x cp`` processes; the ``cp`` ranks
of a replica must instead read what that replica reads in the run without CP, where
accelerate shards over ``dp`` processes only. `_shard_over_dp` re-points accelerate's
shards (as transformers itself does for its rank-aware sampler): ``num_processes = dp``,
``process_index = dp rank``. With one replica, the run without CP does not shard at all,
so the shards pass batches through (no completion of a short last batch by samples from
the start, which ``even_batches`` does for several processes) and hand each epoch to the
batch sampler, as accelerate does for an unwrapped one (axolotl's multipack sampler packs
again per epoch). ``even_batches=False``
with several replicas and a short last batch would leave replicas with fewer batches
waiting in the gradient all-reduce (plain DDP hangs the same way): refused.

Evaluation gathers per-batch losses (and logits, labels) over the world with
``gather_for_metrics``, which trims the last batch to the dataset's remainder. Under CP,
`prediction_step` first makes each CP rank hold its replica's value (the mean of the
CP ranks' losses, the unsharded logits in the collator's ``[B, S, ...]`` rows), and the
gather keeps one CP rank per replica before trimming, so the gathered tensors are those
of the run without CP.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
import transformers

from . import hf  # noqa: F401  (registers attn_implementation="blockdiag_cp")
from .config import ENTRY_LAYOUT, CPConfig
from .plan.options import PlanOptions
from .errors import CPTypeError
from .hf.model_checks import refuse_virtual_tokens
from .hf.options import refuse_unverified_options
from .hf.parallelism import read_parallelism_config
from .hf.replica import first_cp_rank_rows, gather_over_replicas, share_from_cp_rank0
from .hf.trainer_kinds import TrainerStrategy, strategy_for
from .mixers import prepare_model
from .parallel.failures import inherit_world_timeout, naming_collective_failures
from .step.inputs import check_seq_dims

logger = logging.getLogger(__name__)

if not all(hasattr(transformers.Trainer, hook) for hook in ("get_cp_size", "_prepare_context_parallel_inputs")):
    raise ImportError(
        f"blockdiag_cp.trainer needs transformers >= 5.0 (its Trainer's context-parallel hooks); found "
        f"{transformers.__version__}: pip install -U 'transformers>=5.0'"
    )


class BlockDiagCPMixin:
    """Block-diagonal context parallelism for any `transformers.Trainer` subclass.

    Args:
        cp_size: ranks per CP group (must divide the world size); 1 = data parallel
            only, still with per-document attention on packed rows.
        cp_config: `CPConfig` for every step (exchange, kernel, layout); None (default):
            ``CPConfig(layout="balanced")``, equal attention work per rank (the rule:
            `CPConfig.layout`), for the rows of a step and every DPO / GRPO scoring forward.
        seq_dims: extra sequence-aligned batch keys and their sequence dimension,
            passed to `make_cp_blockdiag_batch_and_ctx` (e.g. ``{"per_layer_inputs": 1}``).
        whole_batch: train each global micro-batch on all dp x cp ranks: every replica's
            documents planned together (`make_cp_world_batch_and_ctx`; ``cp_config`` defaults
            to ``CPConfig(layout="grouped")`` with ``StepCosts.from_config(model.config)``), so no
            step waits for the heaviest replica. Loss,
            gradients, logs and evaluation as without it; per-replica losses are refused
            (Note [The whole-batch mode of the mixin] in hf/whole_batch.py).
        linear_ce: the training loss from the final hidden states and the LM head with torch's chunked
            ``linear_cross_entropy`` (`hf.linear_ce.linear_ce_loss`): a shard's ``[L, V]`` logits are never held;
            the same loss, label smoothing and token count as the model's own (docs/memory.md). The Trainer's
            loss only (SFT's, DPO's and GRPO's already never hold the logits); evaluation keeps the plain path;
            a model whose head the loss cannot read (softcapping, a non-linear head) is refused by name. Under
            DeepSpeed ZeRO-2 and ZeRO-3 and FSDP2 as well (Note [A loss outside the modules under ZeRO-3]).
        *args, **kwargs: passed to the Trainer unchanged.

    Every CP rank of a dp replica gets the batches that replica gets without CP, in the
    same order (Note [Every dp replica sees the batches it would see without CP]); each
    batch is flattened to one packed row (`flatten_rows`) and sharded with
    `make_cp_blockdiag_batch_and_ctx`; the loss, the logged loss, the gradients and the
    evaluation results are those of the run without CP (Note [The loss under CP equals
    the loss without CP]); so are the loss paths outside the model's own forward (label
    smoothing, ``compute_loss_func``, TRL's losses, models with ``accepts_loss_kwargs=False``:
    Note [Losses outside the model under CP] in hf/losses.py), an MoE router's load-balancing
    loss (hf/moe.py) and NEFTune's noise (hf/neftune.py). Refused at construction, by name:
    trainers that are neither trainers of rows nor TRL's DPO / GRPO, models with token mixers
    outside attention, PEFT adapters that add virtual tokens, and every option of the
    Trainer's or TRL's config the mixin has not verified (Note [Options the mixin has not
    verified are refused] in hf/options.py).

    What differs per trainer kind (rows: the Trainer, SFT; scoring: DPO, GRPO) is a strategy
    object (`TrainerStrategy`, hf/trainer_kinds.py), chosen once from the trainer's class; the
    hooks below hand it the Trainer's own method.
    """

    def __init__(
        self, *args: Any, cp_size: int = 1, cp_config: Optional[CPConfig] = None,
        seq_dims: Optional[Mapping[str, int]] = None, whole_batch: bool = False, linear_ce: bool = False,
        **kwargs: Any,
    ) -> None:
        if isinstance(cp_size, bool) or not isinstance(cp_size, int):
            raise CPTypeError(f"cp_size must be an int, got {type(cp_size).__name__}")
        if cp_size < 1:
            raise ValueError(f"cp_size must be >= 1, got {cp_size}")
        if cp_config is not None and not isinstance(cp_config, CPConfig):
            raise CPTypeError(f"cp_config must be a CPConfig, got {type(cp_config).__name__}")
        for name, flag in (("whole_batch", whole_batch), ("linear_ce", linear_ce)):
            if not isinstance(flag, bool):
                raise CPTypeError(f"{name} must be a bool, got {type(flag).__name__}")
        self.whole_batch, self.linear_ce = whole_batch, linear_ce
        self.seq_dims = check_seq_dims(seq_dims)
        strategy = strategy_for(type(self))  # the trainer's kind, looked at here only
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        cp_size = read_parallelism_config(training_args, cp_size)  # accelerate's cp_size is the mixin's
        _refuse_rank_aware_sampler(training_args, cp_size)
        refuse_unverified_options(training_args, strategy.kind, type(self).__name__)
        _no_batch_dispatch(training_args)
        strategy.prepare_args(training_args, cp_size)
        super().__init__(*args, **kwargs)
        _refuse_accelerate_cp(getattr(self.accelerator, "parallelism_config", None))  # e.g. from an accelerate YAML:
        # one given to the Trainer was read above
        world = self.args.world_size
        if world % cp_size:
            raise ValueError(f"cp_size={cp_size} must divide the world size {world} (world = dp x cp)")
        default = _whole_batch_config(self.model) if whole_batch else CPConfig(layout=ENTRY_LAYOUT)
        self.cp_size, self.cp_config = cp_size, default if cp_config is None else cp_config
        self.dp_size = world // cp_size
        _refuse_uneven_replicas(self.accelerator.even_batches, self.args.dataloader_drop_last, self.dp_size)
        self.world_mesh, self.cp_mesh, self.dp_rank, self.dp_group = _cp_mesh(self.dp_size, cp_size, self.args.device)
        self._strategy: TrainerStrategy = strategy(self)
        where = f"in {type(self).__name__} (packed rows{' under CP' if cp_size > 1 else ''})"
        models = self._strategy.scored_models()
        for model in models:
            refuse_virtual_tokens(model, where)
            prepare_model(model, where)  # supported hybrid mixers run per document; a model not verified is refused
            _use_blockdiag_attention(model)
        self._strategy.adopt(models, where)

    # -- the Trainer's hooks ------------------------------------------------------------

    def get_cp_size(self) -> int:
        """Ranks sharing one batch: the Trainer divides its token count by this (see the Note)."""
        return self.cp_size

    def get_train_dataloader(self):
        return _shard_over_dp(super().get_train_dataloader(), self.dp_size, self.dp_rank, self.cp_size)

    def get_eval_dataloader(self, *args: Any, **kwargs: Any):
        return _shard_over_dp(super().get_eval_dataloader(*args, **kwargs), self.dp_size, self.dp_rank, self.cp_size)

    def get_test_dataloader(self, *args: Any, **kwargs: Any):
        return _shard_over_dp(super().get_test_dataloader(*args, **kwargs), self.dp_size, self.dp_rank, self.cp_size)

    def _prepare_context_parallel_inputs(self, model, inputs):
        """The Trainer's CP hook: flatten, shard and return ``(train_ctx, inputs)``; forward and
        backward of `training_step` (and the loss of `prediction_step`) run inside ``train_ctx()``.
        A scoring trainer's inputs pass unchanged: its forwards are sharded as they come
        (Note [Scoring forwards under CP] in hf/scoring.py)."""
        return self._strategy.step_inputs(model, inputs)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The Trainer's micro-batches of one optimizer step; in the whole-batch mode each is agreed and
        planned on a background thread while the ones before it train (Note [Planning off the critical path])."""
        samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._strategy.prefetch(samples)
        return samples, num_items

    def training_step(self, *args: Any, **kwargs: Any):
        """The Trainer's step (forward and backward, the CP exchanges and the gradient all-reduce in it); a collective
        that fails in it (a peer died, or did not answer within the process group's timeout) raises a
        `CollectiveFailure` naming it, the step and this rank (Note [A peer that dies mid-step] in
        parallel/failures.py)."""
        with naming_collective_failures(self._where):
            return super().training_step(*args, **kwargs)

    def _where(self) -> str:
        """This rank's place, for errors: the optimizer step, the rank in the world and in the (dp, cp) mesh."""
        cp_rank = 0 if self.cp_mesh is None else self.cp_mesh.get_local_rank()
        return (f"optimizer step {self.state.global_step + 1} on rank {self.args.process_index} of "
                f"{self.args.world_size} (dp replica {self.dp_rank} of {self.dp_size}, CP rank {cp_rank} of "
                f"{self.cp_size})")

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch: Any = None):
        """The Trainer's (or TRL's) loss, every path of it normalized as without CP (Note [Losses outside the
        model under CP] in hf/losses.py); TRL's logged ``num_tokens`` then counts the real tokens of the step,
        not the padding the CP row adds. A scoring trainer's loss and metrics are computed per replica
        (Note [Trainer code runs per replica, the model per CP rank])."""
        return self._strategy.compute_loss(super().compute_loss, model, inputs, return_outputs, num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The Trainer's prediction step; under CP, each CP rank then holds its replica's loss (the
        CP ranks' mean) and the unsharded logits, shaped as the collator's rows. A scoring
        trainer's step runs per replica, its forwards under CP."""
        return self._strategy.prediction_step(super().prediction_step, model, inputs, prediction_loss_only,
                                              ignore_keys)

    def evaluation_loop(self, *args: Any, **kwargs: Any):
        """The Trainer's loop, gathering one CP rank per replica (Note [Every dp replica sees ...]); where the
        trainer gathers with accelerate's plain ``gather`` (Seq2SeqTrainer's ``evaluate``), the last batch is kept
        whole, as that gather keeps it."""
        if self.cp_size > 1:
            use_objects = getattr(self.args, "eval_use_gather_object", False)
            trim = getattr(self.gather_function, "__func__", None) is not getattr(type(self.accelerator), "gather", None)
            self.gather_function = functools.partial(gather_over_replicas, accelerator=self.accelerator, dp=self.dp_size,
                                                     cp=self.cp_size, use_gather_object=use_objects, trim=trim)
        return super().evaluation_loop(*args, **kwargs)

    def train(self, *args: Any, **kwargs: Any):
        """The Trainer's training; with ``neftune_noise_alpha``, NEFTune's noise is the run without CP's
        (Note [NEFTune under CP] in hf/neftune.py) in place of the Trainer's hook, which sizes it by the shard."""
        return self._strategy.train(super().train, *args, **kwargs)

    def floating_point_ops(self, inputs) -> int:
        """This rank's share of the batch's FLOPs: the ``cp`` ranks of a replica split it."""
        return super().floating_point_ops(inputs) // self.cp_size

    def _track_num_input_tokens(self, inputs) -> None:
        """``num_input_tokens_seen`` counts each replica's batch once, not once per CP rank."""
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        seen = self.state.num_input_tokens_seen - before
        self.state.num_input_tokens_seen = before + seen // self.cp_size

    def _prepare_inputs(self, inputs):
        """The trainer's input preparation; a generating trainer's (generation, rewards, the old and
        reference log-probs) runs per replica, its scoring forwards under CP."""
        return self._strategy.prepare_inputs(super()._prepare_inputs, inputs)

    def _generate(self, prompts):
        """TRL's generation on every CP rank, then CP rank 0's completions (and RNG state) on all of them
        (a generating trainer's hook: GRPO)."""
        return share_from_cp_rank0(super()._generate(prompts), self._cp_group())

    def _calculate_rewards(self, *args: Any, **kwargs: Any):
        """TRL's rewards, gathered over the world, kept once per replica (CP rank 0's rows; GRPO's hook)."""
        rewards = super()._calculate_rewards(*args, **kwargs)
        return rewards if self.cp_size == 1 else first_cp_rank_rows(rewards, self.dp_size, self.cp_size)

    def _cp_group(self):
        return None if self.cp_mesh is None else self.cp_mesh.get_group()


class BlockDiagCPTrainer(BlockDiagCPMixin, transformers.Trainer):
    """`transformers.Trainer` with block-diagonal CP (see `BlockDiagCPMixin`)."""


def _whole_batch_config(model) -> CPConfig:
    """``CPConfig(layout="grouped")`` with the model's own cost model (`StepCosts.from_config`), or the default
    one where its config lacks the sizes."""
    from .plan import StepCosts

    try:
        costs = StepCosts.from_config(model.config)
    except (AttributeError, TypeError, ValueError) as exc:
        logger.info("blockdiag-cp: whole_batch plans with the default StepCosts (%s)", exc)
        costs = None
    return CPConfig(layout="grouped", plan=PlanOptions(costs=costs))


def _refuse_uneven_replicas(even_batches: bool, drop_last: bool, dp: int) -> None:
    """`ValueError` where dp replicas could run different numbers of batches (a hang in the all-reduce)."""
    if dp > 1 and not even_batches and not drop_last:
        raise ValueError(
            f"accelerate's even_batches=False with dataloader_drop_last=False over {dp} dp replicas gives replicas "
            "different numbers of batches when the data does not divide evenly, and the ones with fewer wait forever "
            "in the gradient all-reduce (plain DDP hangs the same way). Keep even_batches=True (the default) or set "
            "dataloader_drop_last=True."
        )


def _refuse_rank_aware_sampler(training_args, cp_size: int) -> None:
    """`ValueError` for samplers that pick each process's batches themselves (they cannot see the CP groups)."""
    if cp_size > 1 and getattr(training_args, "train_sampling_strategy", None) == "batch_rebalance":
        raise ValueError(
            "train_sampling_strategy='batch_rebalance' gives every process its own batches, so the ranks of one CP "
            "group would hold different rows; use 'random', 'sequential' or 'group_by_length' with cp_size > 1"
        )


def _refuse_accelerate_cp(config) -> None:
    """`ValueError` if accelerate's own context/sequence parallelism is configured too."""
    if config is not None and (getattr(config, "cp_enabled", False) or getattr(config, "sp_enabled", False)):
        raise ValueError(
            "accelerate's ParallelismConfig(cp_size > 1 or sp_size > 1) is set outside the Trainer's arguments (an "
            "accelerate config?) together with BlockDiagCPMixin: pass it as TrainingArguments(parallelism_config=...), "
            "where the mixin reads its cp_size as its own (per-document attention on packed rows), or leave it out"
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
    """``(the (dp, cp) DeviceMesh, its cp sub-mesh, dp rank, dp process group)`` over the world (the dp group
    joins the ranks of this rank's CP index, one per replica), its groups with the world group's timeout; Nones
    and 0 without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        if dp * cp != 1:
            raise ValueError("cp_size > 1 needs torch.distributed: launch with torchrun")
        return None, None, 0, None
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dp, cp), mesh_dim_names=("dp", "cp"))
    inherit_world_timeout(mesh)  # a hung peer fails the CP exchange when the world's timeout says so
    return mesh, mesh["cp"], mesh.get_local_rank("dp"), mesh["dp"].get_group()


def _use_blockdiag_attention(model) -> None:
    """Switch the model to ``attn_implementation="blockdiag_cp"`` (it attends per document)."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "_attn_implementation", None) != hf.ATTN_IMPLEMENTATION:
        logger.info("blockdiag-cp: model attention %r -> %r", config._attn_implementation, hf.ATTN_IMPLEMENTATION)
        model.set_attn_implementation(hf.ATTN_IMPLEMENTATION)


def _shard_over_dp(dataloader, dp: int, dp_rank: int, cp: int):
    """Make accelerate's prepared dataloader shard over the dp replicas only (Note [Every dp replica ...]).

    accelerate shards over every process; with CP, the ``cp`` ranks of a replica must
    read the same batches. Its shards keep ``num_processes`` / ``process_index`` as
    attributes (transformers itself resets them for its rank-aware sampler, which is
    left as it is).
    """
    from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard
    from transformers import trainer_pt_utils

    # transformers' rank-aware sampler (5.2x; older ones, e.g. the 5.16 axolotl pins, have none: nothing to leave)
    rank_aware = getattr(trainer_pt_utils, "BatchRebalanceSampler", ())

    if cp == 1 or dataloader is None:
        return dataloader  # accelerate already shards over the dp replicas
    found = False
    for shard in (getattr(dataloader, "batch_sampler", None), getattr(dataloader, "dataset", None)):
        if isinstance(shard, BatchSamplerShard) and not isinstance(shard.batch_sampler, rank_aware):
            shard.num_processes, shard.process_index = dp, dp_rank
            shard.even_batches = shard.even_batches and dp > 1  # one replica: every batch as it comes
            if dp == 1 and hasattr(shard.batch_sampler, "set_epoch"):  # and each epoch reaches the batch sampler, as
                shard.set_epoch = shard.batch_sampler.set_epoch  # unsharded (axolotl's multipack re-packs per epoch)
            found = True
        elif isinstance(shard, IterableDatasetShard):
            shard.num_processes, shard.process_index = dp, dp_rank
            if dp == 1:
                shard.batch_size = 1  # yields each sample as it comes: the DataLoader batches them, a short last one too
            found = True
    if not found and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            f"blockdiag-cp cannot shard this dataloader ({type(dataloader).__name__}) over the dp replicas only; "
            "use a map-style or iterable dataset with accelerate's default sharding (dispatch_batches=False)"
        )
    return dataloader
