"""The Trainer mixin's strategy for trainers of language-model rows: transformers' ``Trainer``, TRL's ``SFTTrainer``.

Each batch of token ids with per-token labels is flattened to one packed row (`flatten_rows`)
and sharded (`make_cp_blockdiag_batch_and_ctx`, or `make_cp_world_batch_and_ctx` in the
whole-batch mode); the step (`RowsStep`) keeps what the loss paths need of the rows as the
collator made them. The model's own loss is exact by the Trainer's normalization (Note [The
loss under CP equals the loss without CP] in trainer.py); every other loss path gets the
unsharded rows' targets and count (Note [Losses outside the model under CP] in hf/losses.py),
an MoE router's load-balancing loss its replica's statistics (hf/moe.py), NEFTune the noise of
the run without CP (hf/neftune.py), and TRL's logged token metrics the replicas' values
(hf/metrics.py). `SFTRowsStrategy` adds what TRL's fused LM head computes on its own: its loss,
``entropy``, ``mean_token_accuracy`` and ``num_tokens``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Optional

import torch
import torch.distributed as dist

from ..loss import IGNORE_INDEX
from ..step.batch import make_cp_blockdiag_batch_and_ctx
from ..step.rows import flatten_rows
from ..step.slot import current_step
from ..step.prefetch import WorldStepPrefetcher
from ..step.world import make_cp_world_batch_and_ctx
from .linear_ce import linear_ce_loss, linear_head
from .losses import RowsStep, ShardLabelSmoother, UnshardedLossFunction, rescale_shard_mean, unshard_rows
from .metrics import FusedOutputs, kept_totals, logged_metrics, token_fields
from .model_checks import check_loss_inputs
from .moe import BalanceStep, RouterBalance, aux_loss_enabled
from .neftune import NeftuneUnderCP, NoiseRows
from .scoring import STEP_ONLY_KEYS
from .whole_batch import refuse_per_replica_losses


@dataclasses.dataclass(frozen=True)
class _FlatRows:
    """A collator's batch as the step takes it: one packed row (`flatten_rows`), with what the loss paths
    keep of the rows before sharding.

    Attributes:
        batch: the packed row's tensors on the device; rows: ``(B, S)`` of the collator's rows;
        targets: the row's target count (None without ``shift_labels``); labels: the collator's labels.
    """

    batch: dict[str, Any]
    rows: tuple[int, int]
    targets: Optional[torch.Tensor]
    labels: Optional[torch.Tensor]

    @staticmethod
    def of(inputs: dict[str, Any], device: Any) -> "_FlatRows":
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        primary = batch.get("input_ids", batch.get("inputs_embeds"))
        rows = tuple(primary.shape[:2]) if isinstance(primary, torch.Tensor) and primary.dim() >= 2 else (1, 0)
        labels = batch.get("labels")
        batch = flatten_rows(batch)
        shifted = batch.get("shift_labels")
        targets = (shifted != IGNORE_INDEX).sum() if isinstance(shifted, torch.Tensor) else None  # before sharding
        return _FlatRows(batch, rows, targets, labels if isinstance(labels, torch.Tensor) else None)


class RowsStrategy:
    """transformers' ``Trainer`` (and TRL's base trainer) under the mixin: the model computes the loss.

    Args:
        trainer: the mixed-in trainer (`BlockDiagCPMixin`), built: its meshes, ``cp_config``, ``seq_dims``
            and ``whole_batch`` set.

    `step` is the CP step of the batch in flight (set by `step_inputs`, the Trainer's
    ``_prepare_context_parallel_inputs``); `rows_step` is it while its context is entered.
    """

    #: the kind's name in the options tables (hf/options.py)
    kind: ClassVar[str] = "rows"

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.step: Optional[RowsStep] = None
        self.router_balance: Optional[RouterBalance] = None
        self.prefetcher: Optional[WorldStepPrefetcher] = None
        self.prefetched: dict[int, tuple[dict[str, Any], _FlatRows, Any]] = {}

    @staticmethod
    def prepare_args(training_args: Any, cp_size: int) -> None:
        """Nothing to change in the arguments before the Trainer is built."""

    def scored_models(self) -> list[torch.nn.Module]:
        """The model the mixin prepares: the trainer's own."""
        return [self.trainer.model]

    def adopt(self, models: list[torch.nn.Module], where: str) -> None:
        """Give every loss path of a trainer of rows the unsharded rows' targets and count (Note [Losses outside
        the model under CP] in hf/losses.py; the router loss: Note in hf/moe.py), or refuse the model by name;
        in the whole-batch mode, refuse first every loss that is per replica (hf/whole_batch.py)."""
        t = self.trainer
        model = t.accelerator.unwrap_model(t.model)
        if t.whole_batch:
            refuse_per_replica_losses(t.args, t.compute_loss_func, t.model_accepts_loss_kwargs, aux_loss_enabled(model))
        check_loss_inputs(model, t.model_accepts_loss_kwargs, self._model_owns_loss(), where)
        if t.label_smoother is not None:
            from transformers.trainer_pt_utils import LabelSmoother

            if type(t.label_smoother) is not LabelSmoother:
                raise ValueError(f"{type(t.label_smoother).__name__} as label_smoother is not verified under the "
                                 "mixin: use label_smoothing_factor (transformers' LabelSmoother)")
            t.label_smoother = ShardLabelSmoother(t.label_smoother.epsilon, self.rows_step)
        if t.compute_loss_func is not None:
            t.compute_loss_func = UnshardedLossFunction(t.compute_loss_func, self.rows_step)
        if aux_loss_enabled(model):
            self.router_balance = RouterBalance(model, self.balance_step, where)
            self.router_balance.install()
        if t.linear_ce:
            self._adopt_linear_ce(model)

    def _adopt_linear_ce(self, model: torch.nn.Module) -> None:
        """``linear_ce=True``: refuse by name what the linear cross-entropy loss does not compute exactly
        (docs/memory.md), before any step."""
        t = self.trainer
        for what, why in ((t.whole_batch, "whole_batch=True (the loss of rows from several replicas)"),
                          (t.compute_loss_func is not None, "a compute_loss_func (it takes the logits)"),
                          (self.router_balance is not None, "the MoE router loss (output_router_logits)")):
            if what:
                raise ValueError(f"linear_ce=True is not verified with {why}: turn one of them off")
        linear_head(model)  # a head the loss cannot read is refused by name

    # -- the step in flight --------------------------------------------------------------

    def rows_step(self) -> Optional[RowsStep]:
        """The CP step of rows in flight (its context entered), or None."""
        step = self.step
        active = current_step()
        return step if step is not None and active is not None and step.ctx.state is active else None

    def balance_step(self) -> Optional[BalanceStep]:
        step = self.rows_step()
        if step is None:
            return None
        share = 1.0 / step.cp if step.world_scaled else 1.0
        return BalanceStep((~step.padding_mask).reshape(-1), step.ctx.state.group, share)

    def noise_rows(self) -> Optional[NoiseRows]:
        step = self.rows_step()
        if step is None:
            return None
        state = step.ctx.state
        return NoiseRows(step.rows, state.positions, state.plan.padded_len)

    # -- the Trainer's hooks -------------------------------------------------------------

    def step_inputs(self, model: torch.nn.Module, inputs: dict[str, Any]) -> tuple[Callable, dict[str, Any]]:
        """Flatten, shard and return ``(train_ctx, inputs)`` (the Trainer's ``_prepare_context_parallel_inputs``);
        in the whole-batch mode a micro-batch `prefetch` submitted takes its prefetched plan."""
        t = self.trainer
        ticket = self.prefetched.pop(id(inputs), None)
        world = t.whole_batch and model.training and t.world_mesh is not None
        if ticket is not None and ticket[0] is inputs and world:
            flat = ticket[1]
            step = self.prefetcher.step(ticket[2])
            train_ctx, batch = step.train_ctx, step.batch
        else:
            flat = _FlatRows.of(inputs, t.args.device)
            if world:  # every replica's rows over all ranks (hf/whole_batch.py)
                train_ctx, batch = make_cp_world_batch_and_ctx(t.world_mesh, flat.batch, config=t.cp_config,
                                                               seq_dims=t.seq_dims)
            else:
                train_ctx, batch = make_cp_blockdiag_batch_and_ctx(t.cp_mesh, None, flat.batch, config=t.cp_config,
                                                                   seq_dims=t.seq_dims)
        self.step = RowsStep(train_ctx, flat.rows, batch["padding_mask"], batch.get("shift_labels"), flat.targets,
                             flat.labels)
        for key in STEP_ONLY_KEYS:
            batch.pop(key, None)
        return train_ctx, batch

    def prefetch(self, samples: list[dict[str, Any]]) -> None:
        """The whole-batch mode: the micro-batches of an optimizer step (the Trainer's ``get_batch_samples``),
        flattened and submitted in order, so that each one's agreement and plan run on the planning thread
        while the ones before it train (Note [Planning off the critical path]); `step_inputs` takes them."""
        t = self.trainer
        if not t.whole_batch or t.world_mesh is None:
            return
        if self.prefetcher is None:
            self.prefetcher = WorldStepPrefetcher(t.world_mesh, config=t.cp_config, seq_dims=t.seq_dims)
        self.prefetched.clear()  # tickets an evaluation left unused: their plans are dropped alike on every rank
        for inputs in samples:
            flat = _FlatRows.of(inputs, t.args.device)
            self.prefetched[id(inputs)] = (inputs, flat, self.prefetcher.submit(flat.batch))

    def compute_loss(self, parent: Callable, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool,
                     num_items_in_batch: Any) -> Any:
        """`parent` (the Trainer's loss), told whether it is world-scaled; a per-micro-batch mean of the model's
        own loss gets the replica's count (Note [Losses outside the model under CP] in hf/losses.py)."""
        t = self.trainer
        if t.linear_ce and model.training:  # evaluation keeps the plain path (its metrics may want the logits)
            return self._linear_ce_loss(model, inputs, return_outputs, num_items_in_batch)
        step = self.rows_step()
        if step is not None:
            scaled = bool(t.args.average_tokens_across_devices and num_items_in_batch is not None
                          and (t.model_accepts_loss_kwargs or t.compute_loss_func is not None))
            self.step = step = dataclasses.replace(step, world_scaled=scaled)
            if step.targets is not None and self._model_mean_loss(num_items_in_batch):
                inputs = {**inputs, "num_items_in_batch": step.replica_divisor(None)}
        return parent(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    def _linear_ce_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool,
                        num_items_in_batch: Any) -> Any:
        """The loss of ``linear_ce=True`` (`hf.linear_ce.linear_ce_loss`: the shard's cross-entropy from the final
        hidden states, never the logits) divided as the model's own loss is (the replica's count, or its mean),
        then scaled as ``Trainer.compute_loss`` scales a loss that got the token count."""
        t = self.trainer
        step = self.rows_step()
        divisor = num_items_in_batch if step is None else step.replica_divisor(num_items_in_batch)
        loss = linear_ce_loss(model, inputs, num_items_in_batch=divisor, label_smoothing=t.args.label_smoothing_factor)
        if t.args.average_tokens_across_devices and t.model_accepts_loss_kwargs and num_items_in_batch is not None:
            loss = loss * (t.accelerator.num_processes // t.get_tp_size())
        return (loss, None) if return_outputs else loss

    def prediction_step(self, parent: Callable, model: torch.nn.Module, inputs: dict[str, Any],
                        prediction_loss_only: bool, ignore_keys: Optional[list[str]]) -> Any:
        """`parent` (the Trainer's prediction step); under CP, each CP rank then holds its replica's loss (the
        CP ranks' mean) and the unsharded logits, shaped as the collator's rows."""
        self.step = None
        loss, logits, labels = parent(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        step, self.step = self.step, None
        if step is None or step.ctx.state.world == 1:  # the model ran unsharded (e.g. TRL's SFT prediction step)
            return loss, logits, labels
        if loss is not None:
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=step.ctx.state.group)
            loss = loss / step.ctx.state.world
        if logits is not None:
            logits = unshard_rows(logits, step)
        return loss, logits, labels

    def train(self, parent: Callable, *args: Any, **kwargs: Any) -> Any:
        """`parent` (the Trainer's training); with ``neftune_noise_alpha``, NEFTune's noise is the run without CP's
        (Note [NEFTune under CP] in hf/neftune.py) in place of the Trainer's hook, which sizes it by the shard. The
        whole-batch mode's planning thread and group end with it (waited for when training ends, abandoned when
        it raises: a peer may be gone)."""
        try:
            result = self._train(parent, *args, **kwargs)
        except BaseException:
            self._close_prefetcher(wait=False)
            raise
        self._close_prefetcher(wait=True)
        return result

    def _close_prefetcher(self, wait: bool) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close(wait=wait)
        self.prefetcher = None
        self.prefetched.clear()

    def _train(self, parent: Callable, *args: Any, **kwargs: Any) -> Any:
        t = self.trainer
        alpha = t.neftune_noise_alpha
        if alpha is None:
            return parent(*args, **kwargs)
        embeddings = t.accelerator.unwrap_model(t.model).get_input_embeddings()
        handle = embeddings.register_forward_hook(NeftuneUnderCP(alpha, self.noise_rows))
        t.neftune_noise_alpha = None
        try:
            return parent(*args, **kwargs)
        finally:
            handle.remove()
            t.neftune_noise_alpha = alpha

    def prepare_inputs(self, parent: Callable, inputs: Any) -> Any:
        """`parent` (the Trainer's input preparation), as it is."""
        return parent(inputs)

    # -- the loss paths ------------------------------------------------------------------

    def _model_owns_loss(self) -> bool:
        """Whether the model's own forward computes the loss (no label smoothing, no ``compute_loss_func``)."""
        t = self.trainer
        return t.compute_loss_func is None and t.label_smoother is None

    def _model_mean_loss(self, num_items_in_batch: Any) -> bool:
        """Whether the model's own loss is a per-micro-batch mean in flight (no token count for it)."""
        t = self.trainer
        return (not t.model_accepts_loss_kwargs and num_items_in_batch is None
                and t.label_smoother is None and t.compute_loss_func is None)


class SFTRowsStrategy(RowsStrategy):
    """TRL's ``SFTTrainer`` under the mixin: TRL's fused LM head computes the loss and the token metrics.

    The fused head scores each shard against the unsharded rows' ``shift_labels``; where it
    divides by the shard's own count (no token count for it), its mean is rescaled to the
    replica's (`rescale_shard_mean`); its logged ``entropy``, ``mean_token_accuracy`` and
    ``num_tokens`` are recomputed as the replicas log them (Note [TRL's token metrics under CP]
    in hf/metrics.py), from the head's outputs kept by `FusedOutputs`.
    """

    def __init__(self, trainer: Any) -> None:
        super().__init__(trainer)
        self.fused = FusedOutputs()

    def adopt(self, models: list[torch.nn.Module], where: str) -> None:
        if self.trainer.linear_ce:
            raise ValueError("linear_ce=True is for the Trainer's own loss: SFTTrainer's loss (TRL's fused LM head) "
                             "already never holds the logits; leave linear_ce off")
        super().adopt(models, where)
        self.fused = FusedOutputs.install(self.trainer.accelerator.unwrap_model(self.trainer.model))

    def compute_loss(self, parent: Callable, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool,
                     num_items_in_batch: Any) -> Any:
        """TRL's loss, every path of it normalized as without CP; TRL's logged ``num_tokens`` then counts the
        real tokens of the step, not the padding the CP row adds."""
        t = self.trainer
        counted = getattr(t, "_total_train_tokens", None)
        self.fused.outputs = None
        result = super().compute_loss(parent, model, inputs, return_outputs, num_items_in_batch)
        step = self.rows_step()
        if step is None:
            return result
        if t.args.world_size > 1 and self.fused.outputs is not None:
            self._log_replica_metrics(self.fused.outputs, step, "train" if model.training else "eval")
        if self._fused_mean_loss(num_items_in_batch):
            result = self._rescaled(result, step)
        if counted is not None and model.training and t._total_train_tokens != counted:
            real = (~step.padding_mask).reshape(1, -1).double()
            t._total_train_tokens = counted + int(self._kept_totals(real, step)[0])
            t._metrics["train"]["num_tokens"] = [t._total_train_tokens]
        return result

    def _model_owns_loss(self) -> bool:
        return False  # TRL's fused head computes it

    def _model_mean_loss(self, num_items_in_batch: Any) -> bool:
        return False  # TRL's fused loss is rescaled instead (`_fused_mean_loss`)

    def _fused_mean_loss(self, num_items_in_batch: Any) -> bool:
        """Whether TRL's fused loss in flight divides by the shard's own count (no token count for it)."""
        t = self.trainer
        smoothing = t.label_smoother is not None and getattr(t.args, "loss_type", "nll") == "nll"
        return num_items_in_batch is None and t.compute_loss_func is None and not smoothing

    def _rescaled(self, result: Any, step: RowsStep) -> Any:
        """TRL's fused shard mean -> this rank's share of the replica's mean; the router loss it added stays."""
        loss = result[0] if isinstance(result, tuple) else result
        kept = None
        if self.router_balance is not None and self.router_balance.last_aux is not None:
            kept = getattr(self.trainer, "router_aux_loss_coef", 0.0) * self.router_balance.last_aux
        loss = rescale_shard_mean(loss, step, kept)
        return (loss, *result[1:]) if isinstance(result, tuple) else loss

    def _log_replica_metrics(self, outputs: Any, step: RowsStep, mode: str) -> None:
        """TRL's last logged entropy and token accuracy, as the replicas log them (Note in hf/metrics.py)."""
        fields = token_fields(outputs)
        logged = self.trainer._metrics[mode]
        if fields is None or not logged.get("entropy") or not logged.get("mean_token_accuracy"):
            return
        logged["entropy"][-1], logged["mean_token_accuracy"][-1] = logged_metrics(self._kept_totals(fields, step))

    def _kept_totals(self, rows_XL: torch.Tensor, step: RowsStep) -> torch.Tensor:
        """Per-token values of this rank's rows summed as accelerate's gather over the replicas keeps them."""
        t = self.trainer
        replica = step.ctx.replica_of_row
        if replica is None:  # a step of one replica's row: every row is this rank's replica's
            replica = torch.full((rows_XL.shape[1],), t.dp_rank, dtype=torch.long, device=rows_XL.device)
        return kept_totals(rows_XL, replica.to(rows_XL.device), t.dp_size, t.accelerator.gradient_state)
