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
the start, which ``even_batches`` does for several processes). ``even_batches=False``
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

import contextlib
import dataclasses
import functools
import logging
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
import transformers

from . import hf  # noqa: F401  (registers attn_implementation="blockdiag_cp")
from .step.batch import check_seq_dims, make_cp_blockdiag_batch_and_ctx
from .step.world import make_cp_world_batch_and_ctx
from .config import ENTRY_LAYOUT, CPConfig
from .errors import CPTypeError
from .hf.metrics import FusedOutputs, kept_replicas, kept_totals, logged_metrics, token_fields
from .hf.losses import RowsStep, ShardLabelSmoother, UnshardedLossFunction, rescale_shard_mean, unshard_rows
from .hf.model_checks import check_loss_inputs, refuse_virtual_tokens
from .hf.moe import BalanceStep, RouterBalance, aux_loss_enabled
from .hf.neftune import NeftuneUnderCP, NoiseRows
from .hf.options import refuse_unverified_options
from .hf.scoring import STEP_ONLY_KEYS, ScoringSession
from .hf.whole_batch import refuse_per_replica_losses
from .hf.replica import ReplicaAccelerator, first_cp_rank_rows, share_from_cp_rank0
from .loss import IGNORE_INDEX
from .mixers import prepare_model
from .step.slot import current_step
from .step.rows import flatten_rows

logger = logging.getLogger(__name__)

if not all(hasattr(transformers.Trainer, hook) for hook in ("get_cp_size", "_prepare_context_parallel_inputs")):
    raise ImportError(
        f"blockdiag_cp.trainer needs transformers >= 5.0 (its Trainer's context-parallel hooks); found "
        f"{transformers.__version__}: pip install -U 'transformers>=5.0'"
    )

#: (module, class) of the transformers / TRL trainers whose batches are language-model rows
#: (token ids with per-token labels): the mixin flattens and shards each batch
ROW_TRAINERS = frozenset({
    ("transformers.trainer", "Trainer"),
    ("trl.trainer.base_trainer", "_BaseTrainer"),
    ("trl.trainer.sft_trainer", "SFTTrainer"),
})
#: TRL trainers that score padded rows with the fused LM head: each scoring forward runs as a
#: packed row under CP (Note [Scoring forwards under CP] in hf/scoring.py), the trainer's own
#: code per replica (Note [Trainer code runs per replica, the model per CP rank] in hf/replica.py)
SCORING_TRAINERS = frozenset({("trl.trainer.dpo_trainer", "DPOTrainer")})
#: scoring trainers that also generate their rows (completions shared by the CP ranks of a replica)
GENERATING_TRAINERS = frozenset({("trl.trainer.grpo_trainer", "GRPOTrainer")})


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
    """

    def __init__(
        self, *args: Any, cp_size: int = 1, cp_config: Optional[CPConfig] = None,
        seq_dims: Optional[Mapping[str, int]] = None, whole_batch: bool = False, **kwargs: Any,
    ) -> None:
        if isinstance(cp_size, bool) or not isinstance(cp_size, int):
            raise CPTypeError(f"cp_size must be an int, got {type(cp_size).__name__}")
        if cp_size < 1:
            raise ValueError(f"cp_size must be >= 1, got {cp_size}")
        if cp_config is not None and not isinstance(cp_config, CPConfig):
            raise CPTypeError(f"cp_config must be a CPConfig, got {type(cp_config).__name__}")
        if not isinstance(whole_batch, bool):
            raise CPTypeError(f"whole_batch must be a bool, got {type(whole_batch).__name__}")
        self.whole_batch = whole_batch
        self.seq_dims = check_seq_dims(seq_dims)
        self._kind = _trainer_kind(type(self))
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        _refuse_accelerate_cp(getattr(training_args, "parallelism_config", None))
        _refuse_rank_aware_sampler(training_args, cp_size)
        refuse_unverified_options(training_args, self._kind, type(self).__name__)
        _no_batch_dispatch(training_args)
        if self._kind == "generating":
            _generation_batch_per_replica(training_args, cp_size)
        super().__init__(*args, **kwargs)
        _refuse_accelerate_cp(getattr(self.accelerator, "parallelism_config", None))  # e.g. from an accelerate YAML
        world = self.args.world_size
        if world % cp_size:
            raise ValueError(f"cp_size={cp_size} must divide the world size {world} (world = dp x cp)")
        default = _whole_batch_config(self.model) if whole_batch else CPConfig(layout=ENTRY_LAYOUT)
        self.cp_size, self.cp_config = cp_size, default if cp_config is None else cp_config
        self.dp_size = world // cp_size
        _refuse_uneven_replicas(self.accelerator.even_batches, self.args.dataloader_drop_last, self.dp_size)
        self.world_mesh, self.cp_mesh, self.dp_rank, self._dp_group = _cp_mesh(self.dp_size, cp_size, self.args.device)
        self._cp_step: Optional[RowsStep] = None
        self._scoring = ScoringSession(self.cp_mesh, self.cp_config)
        where = f"in {type(self).__name__} (packed rows{' under CP' if cp_size > 1 else ''})"
        for model in self._scored_models():
            refuse_virtual_tokens(model, where)
            prepare_model(model, where)  # supported hybrid mixers run per document; a model not verified is refused
            _use_blockdiag_attention(model)
            if self._kind != "rows":
                self._scoring.install(model)
        if self._kind != "rows" and cp_size > 1 and getattr(self, "aux_loss_enabled", False):
            raise ValueError("the MoE load-balancing loss (output_router_logits) is not additive over CP shards of a "
                             "scored row; turn it off or train without CP")
        self._router_balance: Optional[RouterBalance] = None
        if whole_batch:
            model = self.accelerator.unwrap_model(self.model)
            refuse_per_replica_losses(self._kind, self.args, self.compute_loss_func, self.model_accepts_loss_kwargs,
                                      aux_loss_enabled(model))
        if self._kind == "rows":
            self._adopt_loss_paths(where)
        if self._kind == "generating" and cp_size > 1:
            from accelerate.utils import set_seed

            set_seed(self.args.seed + self.dp_rank)  # as the replica's process is seeded without CP (seed + its index)

    def _adopt_loss_paths(self, where: str) -> None:
        """Give every loss path of a trainer of rows the unsharded rows' targets and count (Note [Losses outside
        the model under CP] in hf/losses.py; the router loss: Note in hf/moe.py), or refuse the model by name."""
        model = self.accelerator.unwrap_model(self.model)
        self._sft = any(cls.__module__ == "trl.trainer.sft_trainer" for cls in type(self).__mro__)
        own_loss = self.compute_loss_func is None and self.label_smoother is None and not self._sft
        check_loss_inputs(model, self.model_accepts_loss_kwargs, own_loss, where)
        if self.label_smoother is not None:
            from transformers.trainer_pt_utils import LabelSmoother

            if type(self.label_smoother) is not LabelSmoother:
                raise ValueError(f"{type(self.label_smoother).__name__} as label_smoother is not verified under the "
                                 "mixin: use label_smoothing_factor (transformers' LabelSmoother)")
            self.label_smoother = ShardLabelSmoother(self.label_smoother.epsilon, self._rows_step)
        if self.compute_loss_func is not None:
            self.compute_loss_func = UnshardedLossFunction(self.compute_loss_func, self._rows_step)
        if aux_loss_enabled(model):
            self._router_balance = RouterBalance(model, self._balance_step, where)
            self._router_balance.install()
        self._fused = FusedOutputs.install(model) if self._sft else FusedOutputs()

    def _rows_step(self) -> Optional[RowsStep]:
        """The CP step of rows in flight (its context entered), or None."""
        step = self._cp_step
        active = current_step()
        return step if step is not None and active is not None and step.ctx.state is active else None

    def _balance_step(self) -> Optional[BalanceStep]:
        step = self._rows_step()
        if step is None:
            return None
        share = 1.0 / step.cp if step.world_scaled else 1.0
        return BalanceStep((~step.padding_mask).reshape(-1), step.ctx.state.group, share)

    def _noise_rows(self) -> Optional[NoiseRows]:
        step = self._rows_step()
        if step is None:
            return None
        state = step.ctx.state
        return NoiseRows(step.rows, state.positions, state.plan.padded_len)

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
        if self._kind != "rows":
            return self._scoring, inputs
        batch = {k: v.to(self.args.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        primary = batch.get("input_ids", batch.get("inputs_embeds"))
        rows = tuple(primary.shape[:2]) if isinstance(primary, torch.Tensor) and primary.dim() >= 2 else (1, 0)
        labels = batch.get("labels")
        batch = flatten_rows(batch)
        shifted = batch.get("shift_labels")
        targets = (shifted != IGNORE_INDEX).sum() if isinstance(shifted, torch.Tensor) else None  # before sharding
        if self.whole_batch and model.training and self.world_mesh is not None:  # every replica's rows over all
            # ranks (hf/whole_batch.py)
            train_ctx, batch = make_cp_world_batch_and_ctx(self.world_mesh, batch, config=self.cp_config,
                                                           seq_dims=self.seq_dims)
        else:
            train_ctx, batch = make_cp_blockdiag_batch_and_ctx(self.cp_mesh, None, batch, config=self.cp_config,
                                                               seq_dims=self.seq_dims)
        self._cp_step = RowsStep(train_ctx, rows, batch["padding_mask"], batch.get("shift_labels"), targets,
                                 labels if isinstance(labels, torch.Tensor) else None)
        for key in STEP_ONLY_KEYS:
            batch.pop(key, None)
        return train_ctx, batch

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch: Any = None):
        """The Trainer's (or TRL's) loss, every path of it normalized as without CP (Note [Losses outside the
        model under CP] in hf/losses.py); TRL's logged ``num_tokens`` then counts the real tokens of the step,
        not the padding the CP row adds. A scoring trainer's loss and metrics are computed per replica
        (Note [Trainer code runs per replica, the model per CP rank])."""
        if self._kind != "rows":
            with self._scoring(), self._per_replica():
                return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                            num_items_in_batch=num_items_in_batch)
        step = self._rows_step()
        if step is not None:
            scaled = bool(self.args.average_tokens_across_devices and num_items_in_batch is not None
                          and (self.model_accepts_loss_kwargs or self.compute_loss_func is not None))
            self._cp_step = step = dataclasses.replace(step, world_scaled=scaled)
            if step.targets is not None and self._model_mean_loss(num_items_in_batch):
                inputs = {**inputs, "num_items_in_batch": step.replica_divisor(None)}
        counted = getattr(self, "_total_train_tokens", None)
        self._fused.outputs = None
        result = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if self._sft and step is not None and self.args.world_size > 1 and self._fused.outputs is not None:
            self._log_replica_metrics(self._fused.outputs, step, "train" if model.training else "eval")
        if step is not None and self._fused_mean_loss(num_items_in_batch):
            result = self._rescaled(result, step)
        if counted is not None and model.training and step is not None and self._total_train_tokens != counted:
            real = (~step.padding_mask).reshape(1, -1).double()
            self._total_train_tokens = counted + int(self._kept_totals(real, step)[0])
            self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
        return result

    def _log_replica_metrics(self, outputs: Any, step: RowsStep, mode: str) -> None:
        """TRL's last logged entropy and token accuracy, as the replicas log them (Note in hf/metrics.py)."""
        fields = token_fields(outputs)
        logged = self._metrics[mode]
        if fields is None or not logged.get("entropy") or not logged.get("mean_token_accuracy"):
            return
        logged["entropy"][-1], logged["mean_token_accuracy"][-1] = logged_metrics(self._kept_totals(fields, step))

    def _kept_totals(self, rows_XL: torch.Tensor, step: RowsStep) -> torch.Tensor:
        """Per-token values of this rank's rows summed as accelerate's gather over the replicas keeps them."""
        replica = step.ctx.replica_of_row
        if replica is None:  # a step of one replica's row: every row is this rank's replica's
            replica = torch.full((rows_XL.shape[1],), self.dp_rank, dtype=torch.long, device=rows_XL.device)
        return kept_totals(rows_XL, replica.to(rows_XL.device), self.dp_size, self.accelerator.gradient_state)

    def _model_mean_loss(self, num_items_in_batch: Any) -> bool:
        """Whether the model's own loss is a per-micro-batch mean in flight (no token count for it)."""
        return (not self._sft and not self.model_accepts_loss_kwargs and num_items_in_batch is None
                and self.label_smoother is None and self.compute_loss_func is None)

    def _fused_mean_loss(self, num_items_in_batch: Any) -> bool:
        """Whether TRL's fused loss in flight divides by the shard's own count (no token count for it)."""
        smoothing = self.label_smoother is not None and getattr(self.args, "loss_type", "nll") == "nll"
        return self._sft and num_items_in_batch is None and self.compute_loss_func is None and not smoothing

    def _rescaled(self, result: Any, step: RowsStep) -> Any:
        """TRL's fused shard mean -> this rank's share of the replica's mean; the router loss it added stays."""
        loss = result[0] if isinstance(result, tuple) else result
        kept = None
        if self._router_balance is not None and self._router_balance.last_aux is not None:
            kept = getattr(self, "router_aux_loss_coef", 0.0) * self._router_balance.last_aux
        loss = rescale_shard_mean(loss, step, kept)
        return (loss, *result[1:]) if isinstance(result, tuple) else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The Trainer's prediction step; under CP, each CP rank then holds its replica's loss (the
        CP ranks' mean) and the unsharded logits, shaped as the collator's rows. A scoring
        trainer's step runs per replica, its forwards under CP."""
        if self._kind != "rows":
            with self._scoring(), self._per_replica():
                return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        self._cp_step = None
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        step, self._cp_step = self._cp_step, None
        if step is None or step.ctx.state.world == 1:  # the model ran unsharded (e.g. TRL's SFT prediction step)
            return loss, logits, labels
        if loss is not None:
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=step.ctx.state.group)
            loss = loss / step.ctx.state.world
        if logits is not None:
            logits = unshard_rows(logits, step)
        return loss, logits, labels

    def evaluation_loop(self, *args: Any, **kwargs: Any):
        """The Trainer's loop, gathering one CP rank per replica (Note [Every dp replica sees ...])."""
        if self.cp_size > 1:
            use_objects = getattr(self.args, "eval_use_gather_object", False)
            self.gather_function = functools.partial(self._gather_over_replicas, use_gather_object=use_objects)
        return super().evaluation_loop(*args, **kwargs)

    def train(self, *args: Any, **kwargs: Any):
        """The Trainer's training; with ``neftune_noise_alpha``, NEFTune's noise is the run without CP's
        (Note [NEFTune under CP] in hf/neftune.py) in place of the Trainer's hook, which sizes it by the shard."""
        alpha = self.neftune_noise_alpha
        if alpha is None or self._kind != "rows":
            return super().train(*args, **kwargs)
        embeddings = self.accelerator.unwrap_model(self.model).get_input_embeddings()
        handle = embeddings.register_forward_hook(NeftuneUnderCP(alpha, self._noise_rows))
        self.neftune_noise_alpha = None
        try:
            return super().train(*args, **kwargs)
        finally:
            handle.remove()
            self.neftune_noise_alpha = alpha

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
        if self._kind != "generating":
            return super()._prepare_inputs(inputs)
        with self._per_replica():
            return super()._prepare_inputs(inputs)

    def _generate(self, prompts):
        """TRL's generation on every CP rank, then CP rank 0's completions (and RNG state) on all of them."""
        return share_from_cp_rank0(super()._generate(prompts), self._cp_group())

    def _calculate_rewards(self, *args: Any, **kwargs: Any):
        """TRL's rewards, gathered over the world, kept once per replica (CP rank 0's rows)."""
        rewards = super()._calculate_rewards(*args, **kwargs)
        return rewards if self.cp_size == 1 else first_cp_rank_rows(rewards, self.dp_size, self.cp_size)

    def _scored_models(self) -> list[torch.nn.Module]:
        """The policy and, for scoring trainers, the reference model (unwrapped)."""
        models = [self.model]
        ref = getattr(self, "ref_model", None) if self._kind != "rows" else None
        if isinstance(ref, torch.nn.Module):
            models.append(self.accelerator.unwrap_model(ref))
        return models

    def _cp_group(self):
        return None if self.cp_mesh is None else self.cp_mesh.get_group()

    @contextlib.contextmanager
    def _per_replica(self):
        """`self.accelerator` as this rank's dp replica sees it, for the block (Note in hf/replica.py)."""
        real = self.accelerator
        if self.cp_size == 1 or isinstance(real, ReplicaAccelerator):
            yield
            return
        self.accelerator = ReplicaAccelerator(real, self._dp_group, self.dp_size, self.dp_rank)
        try:
            yield
        finally:
            self.accelerator = real

    def _gather_over_replicas(self, data, use_gather_object: bool = False):
        """``gather_for_metrics`` over the dp replicas: the world's gather, one CP rank per replica,
        then the last batch trimmed to the dataset's remainder."""
        from accelerate.utils import recursively_apply

        if use_gather_object:
            data = _gather_objects_over_replicas(data, self.args.world_size, self.cp_size)
        else:
            keep = functools.partial(first_cp_rank_rows, dp=self.dp_size, cp=self.cp_size)
            data = recursively_apply(keep, self.accelerator.gather(data))
        kept = kept_replicas(self.accelerator.gradient_state)
        if kept is None:
            return data
        return data[:kept] if use_gather_object else recursively_apply(lambda t: t[:kept], data)


class BlockDiagCPTrainer(BlockDiagCPMixin, transformers.Trainer):
    """`transformers.Trainer` with block-diagonal CP (see `BlockDiagCPMixin`)."""


def _trainer_kind(cls: type) -> str:
    """``"rows"``, ``"scoring"`` or ``"generating"`` (the most specific of `cls`'s transformers / TRL
    bases); a `ValueError` if one of them is none of these."""
    kinds = {**dict.fromkeys(ROW_TRAINERS, "rows"), **dict.fromkeys(SCORING_TRAINERS, "scoring"),
             **dict.fromkeys(GENERATING_TRAINERS, "generating")}
    found = []
    for base in cls.__mro__:
        if base.__module__.split(".")[0] not in ("transformers", "trl"):
            continue
        kind = kinds.get((base.__module__, base.__qualname__))
        if kind is None:
            raise ValueError(
                f"BlockDiagCPMixin does not support {base.__qualname__} ({base.__module__}): it is neither a trainer of "
                "language-model rows (token ids with per-token labels) nor one of the scoring trainers whose forwards "
                "the mixin shards, so sharding its batches would be wrong or crash inside the trainer. Supported: "
                "transformers.Trainer, trl.SFTTrainer, trl.DPOTrainer and trl.GRPOTrainer (and your own subclasses "
                "of them); train this one without the mixin."
            )
        found.append(kind)
    return found[0] if found else "rows"


def _whole_batch_config(model) -> CPConfig:
    """``CPConfig(layout="grouped")`` with the model's own cost model (`StepCosts.from_config`), or the default
    one where its config lacks the sizes."""
    from .plan import StepCosts

    try:
        costs = StepCosts.from_config(model.config)
    except (AttributeError, TypeError, ValueError) as exc:
        logger.info("blockdiag-cp: whole_batch plans with the default StepCosts (%s)", exc)
        costs = None
    return CPConfig(layout="grouped", step_costs=costs)


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
    """``(the (dp, cp) DeviceMesh, its cp sub-mesh, dp rank, dp process group)`` over the world (the dp group
    joins the ranks of this rank's CP index, one per replica); Nones and 0 without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        if dp * cp != 1:
            raise ValueError("cp_size > 1 needs torch.distributed: launch with torchrun")
        return None, None, 0, None
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dp, cp), mesh_dim_names=("dp", "cp"))
    return mesh, mesh["cp"], mesh.get_local_rank("dp"), mesh["dp"].get_group()


def _generation_batch_per_replica(training_args, cp: int) -> None:
    """TRL sized the generation batch for every process (``per_device x world x steps_per_generation``);
    under CP the ``cp`` ranks of a replica share one batch, so it is ``per_device x dp x steps``, as
    without CP (``steps_per_generation`` is kept: set that one, not ``generation_batch_size``)."""
    steps = getattr(training_args, "steps_per_generation", None)
    if cp == 1 or training_args is None or not steps:
        return
    dp = training_args.world_size // cp
    size = training_args.per_device_train_batch_size * dp * steps
    generations = getattr(training_args, "num_generations", 1) or 1
    if size % generations:
        raise ValueError(f"the generation batch of a replica step, per_device_train_batch_size x dp x "
                         f"steps_per_generation = {size}, must be divisible by num_generations={generations}")
    if training_args.generation_batch_size != size:
        logger.warning("blockdiag-cp: generation_batch_size %s -> %d (per_device_train_batch_size x dp=%d x "
                       "steps_per_generation=%d: the CP ranks of a replica share its batch)",
                       training_args.generation_batch_size, size, dp, steps)
    training_args.generation_batch_size = size


def _use_blockdiag_attention(model) -> None:
    """Switch the model to ``attn_implementation="blockdiag_cp"`` (it attends per document)."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "_attn_implementation", None) != hf.ATTN_IMPLEMENTATION:
        logger.info("blockdiag-cp: model attention %r -> %r", config._attn_implementation, hf.ATTN_IMPLEMENTATION)
        model.set_attn_implementation(hf.ATTN_IMPLEMENTATION)


def _gather_objects_over_replicas(data: Any, world: int, cp: int) -> Any:
    """accelerate's ``gather_object`` as the dp replicas' processes run it without CP: one replica (one
    process, nothing distributed) gets its object back; several get every replica's items, flattened."""
    objects: list[Any] = [None] * world
    dist.all_gather_object(objects, data)
    replicas = objects[::cp]
    return replicas[0] if len(replicas) == 1 else [item for obj in replicas for item in obj]


def _shard_over_dp(dataloader, dp: int, dp_rank: int, cp: int):
    """Make accelerate's prepared dataloader shard over the dp replicas only (Note [Every dp replica ...]).

    accelerate shards over every process; with CP, the ``cp`` ranks of a replica must
    read the same batches. Its shards keep ``num_processes`` / ``process_index`` as
    attributes (transformers itself resets them for its rank-aware sampler, which is
    left as it is).
    """
    from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard
    from transformers.trainer_pt_utils import BatchRebalanceSampler

    if cp == 1 or dataloader is None:
        return dataloader  # accelerate already shards over the dp replicas
    found = False
    for shard in (getattr(dataloader, "batch_sampler", None), getattr(dataloader, "dataset", None)):
        if isinstance(shard, BatchSamplerShard) and not isinstance(shard.batch_sampler, BatchRebalanceSampler):
            shard.num_processes, shard.process_index = dp, dp_rank
            shard.even_batches = shard.even_batches and dp > 1  # one replica: every batch as it comes
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
