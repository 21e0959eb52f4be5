"""Losses the Trainer and TRL compute outside the model's own forward, under CP.

Note [Losses outside the model under CP]
----------------------------------------
Under `BlockDiagCPMixin` the model's own loss gets ``shift_labels`` (the next-token targets
of the unsharded rows, sharded) and the Trainer's global token count (Note [The loss under
CP equals the loss without CP] in trainer.py). The other loss paths would shift each shard's
``labels`` on their own (a target lost at every shard boundary) or divide by the shard's
own count. Under a CP step of rows (`RowsStep`) the mixin gives each of them the unsharded
rows' targets and count:

- Label smoothing (``label_smoothing_factor``; transformers' ``LabelSmoother``, also in
  ``SFTTrainer``): `ShardLabelSmoother` sums the same per-token terms over this rank's logits
  against the step's ``shift_labels`` and divides by the count the Trainer passes, as
  ``LabelSmoother`` does; without one, by the replica's (per-micro-batch means, below).
- ``compute_loss_func`` (any function of ``(outputs, labels, num_items_in_batch)``): nothing
  says it is a sum over tokens, so `UnshardedLossFunction` gives it the unsharded outputs
  (every ``[1, L, ...]`` tensor gathered into the collator's ``[B, S, ...]`` rows,
  differentiably; padding positions hold -100) and the collator's ``labels``: every CP rank
  computes its replica's loss. The gather's backward sums every rank's gradients, so the
  ``cp`` ranks' gradients add up to ``cp`` times the replica's; DDP's average over
  ``dp x cp`` ranks divides them back, as without CP it averages over ``dp``. Where the
  Trainer multiplies the loss by ``num_processes`` (``dp x cp`` here, ``dp`` without CP),
  the function's loss is divided by ``cp``. Cost: the unsharded logits ``[S, V]`` on every
  CP rank (the model's own loss and label smoothing never build them).
- Per-micro-batch means: without a token count (models with ``accepts_loss_kwargs=False``,
  whose loss the Trainer leaves as the micro-batch's mean), the run without CP averages the
  replicas' means. Under CP a rank's share of its replica's mean is
  ``cp * (its token sum) / (the replica's count)``: the ``cp`` shares average (DDP) to the
  replica's mean. The replica's count (`RowsStep.targets`) is counted on the unsharded rows
  before sharding, so no collective. transformers' ``ForCausalLMLoss`` gets it as
  ``num_items_in_batch = targets / cp``; TRL's fused loss divides by the shard's own count,
  so its mean is rescaled (`rescale_shard_mean`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..loss import IGNORE_INDEX
from ..step.pipeline import TrainCtx
from ..step.gather import gather_sequence


@dataclass(frozen=True)
class RowsStep:
    """The CP step of one batch of rows, and what losses and outputs need of the rows as the collator made them.

    Attributes:
        ctx: the step (``ctx.state`` plans it).
        rows: ``(B, S)`` of the batch before `flatten_rows` made it one row ``[1, B * S]``.
        padding_mask: this rank's ``[1, L]`` mask of the step (True = padding).
        shift_labels: this rank's ``[1, L]`` next-token targets of the unsharded rows (None without labels).
        targets: 0-d: how many next-token targets the unsharded batch has (this replica's micro-batch).
        labels: the collator's ``labels`` ``[B, S]`` (None without).
        world_scaled: whether the Trainer multiplies the loss in flight by ``num_processes``.
    """

    ctx: TrainCtx
    rows: tuple[int, int]
    padding_mask: torch.Tensor
    shift_labels: Optional[torch.Tensor] = None
    targets: Optional[torch.Tensor] = None
    labels: Optional[torch.Tensor] = None
    world_scaled: bool = False

    @property
    def cp(self) -> int:
        return self.ctx.state.world

    def replica_divisor(self, num_items_in_batch: Any) -> Any:
        """What a token sum is divided by: the Trainer's count, else the replica's count over ``cp`` (Note)."""
        if num_items_in_batch is not None:
            return num_items_in_batch
        if self.targets is None:
            raise ValueError("a loss without a token count under CP needs the batch's labels")
        return self.targets / self.cp


def unshard_rows(outputs: Any, step: RowsStep, *, differentiable: bool = False) -> Any:
    """Each ``[1, L, ...]`` tensor of `outputs` (nested) -> the unsharded ``[B, S, ...]`` of the collator's rows.

    Padding positions of the rows (``attention_mask`` 0) attend to nothing under CP, so they
    hold -100, the Trainer's own fill for predictions (without CP they hold the output of a
    pad token attending across its row, which no loss or metric should read either).
    """
    from accelerate.utils import recursively_apply

    B, S = step.rows
    state = step.ctx.state
    padding_S = (state.geometry.doc_ids[: state.plan.seq_len] == 0).to(state.device)

    def unshard(t: torch.Tensor) -> torch.Tensor:
        if t.dim() < 2 or t.shape[0] != 1 or t.shape[1] != state.local_len:
            return t
        full = gather_sequence(t, 1, state=state)
        return full.masked_fill(padding_S.view(1, -1, *[1] * (t.dim() - 2)), -100).reshape(B, S, *t.shape[2:])

    if differentiable:
        return recursively_apply(unshard, outputs)
    with torch.no_grad():
        return recursively_apply(unshard, outputs)


class ShardLabelSmoother:
    """transformers' ``LabelSmoother`` on this rank's shard against the unsharded rows' targets (Note).

    Args:
        epsilon: ``label_smoothing_factor``.
        step_of: the `RowsStep` in flight, or None outside a CP step (then it is ``LabelSmoother``).

    Called as the Trainer calls ``LabelSmoother``: ``(model_output, labels, shift_labels=...,
    num_items_in_batch=...)``; inside a step `labels` and `shift_labels` are not read (the
    step's targets are already shifted, on the unsharded rows).
    """

    def __init__(self, epsilon: float, step_of: Callable[[], Optional[RowsStep]]) -> None:
        from transformers.trainer_pt_utils import LabelSmoother

        self.epsilon, self.step_of = float(epsilon), step_of
        self.unsharded = LabelSmoother(epsilon=self.epsilon)

    def __call__(self, model_output, labels, shift_labels: bool = False, num_items_in_batch=None):
        step = self.step_of()
        if step is None:
            return self.unsharded(model_output, labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch)
        if step.shift_labels is None:
            raise ValueError("label smoothing under CP needs the batch's labels")
        logits = model_output["logits"] if isinstance(model_output, dict) else model_output[0]
        divisor = step.replica_divisor(num_items_in_batch)
        nll, smoothed = smoothing_sums(logits, step.shift_labels)
        if torch.is_tensor(divisor):
            divisor = divisor.to(nll.device)
        return (1 - self.epsilon) * (nll / divisor) + self.epsilon * (smoothed / (divisor * logits.shape[-1]))


def smoothing_sums(logits_1LV: torch.Tensor, targets_1L: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of -log p(target), sum over the vocabulary of -log p)`` over the tokens with a target,
    computed as transformers' ``LabelSmoother`` computes them (the second in float32)."""
    neg_log_probs = -torch.nn.functional.log_softmax(logits_1LV, dim=-1)
    targets = targets_1L.to(neg_log_probs.device).unsqueeze(-1)
    ignored = targets.eq(IGNORE_INDEX)
    nll = neg_log_probs.gather(dim=-1, index=targets.clamp(min=0)).masked_fill(ignored, 0.0)
    smoothed = neg_log_probs.sum(dim=-1, keepdim=True, dtype=torch.float32).masked_fill(ignored, 0.0)
    return nll.sum(), smoothed.sum()


class UnshardedLossFunction:
    """A ``compute_loss_func`` run on the unsharded rows of each CP step (Note).

    Args:
        fn: the user's ``fn(outputs, labels, num_items_in_batch=...)``.
        step_of: the `RowsStep` in flight, or None outside a CP step (then `fn` runs as it is).
    """

    def __init__(self, fn: Callable, step_of: Callable[[], Optional[RowsStep]]) -> None:
        self.fn, self.step_of = fn, step_of

    def __call__(self, outputs, labels, num_items_in_batch=None, **kwargs):
        step = self.step_of()
        if step is None:
            return self.fn(outputs, labels, num_items_in_batch=num_items_in_batch, **kwargs)
        full = unshard_rows(outputs, step, differentiable=True)
        loss = self.fn(full, step.labels, num_items_in_batch=num_items_in_batch, **kwargs)
        return loss / step.cp if step.world_scaled else loss


def rescale_shard_mean(loss: torch.Tensor, step: RowsStep, kept: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A loss that is this shard's token mean (plus `kept`, left as it is) -> this rank's share of the
    replica's mean: ``cp * (shard sum) / (replica count)`` (Note, per-micro-batch means).

    The shard's mean divides by its own count clamped to 1 (TRL's fused loss), so a shard
    without targets holds 0 and stays 0.
    """
    if step.shift_labels is None or step.targets is None:
        raise ValueError("a per-micro-batch mean under CP needs the batch's labels")
    own = (step.shift_labels != IGNORE_INDEX).sum().to(loss.device, torch.float64)
    factor = (step.cp * own / step.targets.to(loss.device, torch.float64).clamp(min=1)).to(loss.dtype)
    if kept is None:
        return loss * factor
    return (loss - kept) * factor + kept
