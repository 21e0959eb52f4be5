"""Sequence scoring under CP: TRL's fused-head forwards on padded rows run as one packed, sharded row.

Preference and RL trainers (TRL's DPO, GRPO, ...) score sequences, not tokens of a
language-model batch: they call ``model(input_ids [B, T], attention_mask, labels,
fused_lm_head=True)`` on padded rows (chosen then rejected, or a group's completions)
and read per-token fields of the result (``log_probs``, ``entropy``, ... of shape
``[B, T - 1]``), then sum, mask and compare them in their own code.

Note [Scoring forwards under CP]
--------------------------------
A `ScoringSession` is entered around one trainer step (forward *and* backward). While it
is, a forward pre-hook on the policy and reference models turns such a call into the
call of a CP step: the rows are flattened into one packed row (`flatten_rows`: each row
its own document, padding stays padding, next-token targets from each row's own
``labels``), sharded with `make_cp_blockdiag_batch_and_ctx`, and the model runs on this
rank's shard with those targets as ``shift_labels`` (TRL's fused head scores pre-shifted
labels without shifting). A forward hook then gathers the per-token fields, ``[1, L]``
per rank, into ``[B, T - 1]``: bytes O(tokens), never O(tokens x vocab), and the trainer's
own loss and metrics code runs unchanged on the result, the same on every CP rank.

Gradients: every CP rank computes the same loss from the gathered values; the gather's
backward sums every rank's gradient of each shard's values (`gather_sequence`), so each
rank's parameter gradient is ``cp`` times its share, and DDP/FSDP's average over
``dp x cp`` ranks is the average over the ``dp`` replicas: the gradient without CP.

A forward with gradients keeps its step active until the session ends (the backward, and
any checkpointed recompute, runs in it); a forward without (the reference model, old
log-probs) ends its step at once. A later forward on the same rows (DPO's reference after
the policy) reuses the step; one on other rows while a forward with gradients is pending
is a `ValueError` (two such steps cannot both be active).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from ..config import CPConfig
from ..step.batch import make_cp_blockdiag_batch_and_ctx
from ..step.pipeline import TrainCtx
from ..step.gather import gather_sequence
from ..step.rows import flatten_rows

#: per-token fields of TRL's ``FusedCausalLMOutput`` (``[B, T - 1]`` without CP)
PER_TOKEN_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")
#: keys the step adds for its own bookkeeping; the model never sees them
STEP_ONLY_KEYS = ("_packed_seq_ids", "padding_mask")
#: the row tensors a scoring forward may carry (text rows; images are not sharded on this path)
ROW_KEYS = ("input_ids", "attention_mask", "labels", "position_ids", "token_type_ids")


@dataclass(frozen=True)
class ScoringStep:
    """One planned scoring forward.

    Attributes:
        ctx: the CP step of the packed rows.
        rows: ``(B, T)`` of the padded rows as the trainer passed them.
        key: the rows' ``input_ids``, ``attention_mask`` and ``labels`` (to reuse the step for the same rows).
        model_kwargs: this rank's sharded inputs of the step (``shift_labels`` included).
        targets: how many next-token targets the rows have (the loss's default divisor).
    """

    ctx: TrainCtx
    rows: tuple[int, int]
    key: tuple[Optional[torch.Tensor], ...]
    model_kwargs: dict[str, Any]
    targets: int

    def same_rows(self, key: tuple[Optional[torch.Tensor], ...]) -> bool:
        return all(
            (a is None and b is None) or (a is not None and b is not None and a.shape == b.shape and torch.equal(a, b))
            for a, b in zip(self.key, key)
        )


class ScoringSession:
    """Runs the fused-head scoring forwards of one trainer step on packed rows under CP (see the Note).

    Args:
        cp_mesh: the CP sub-mesh (None: one process; documents are still masked per row).
        config: the `CPConfig` of every step.

    ``session()`` is the context manager of one trainer step; `install` adds the hooks to a model.
    """

    def __init__(self, cp_mesh, config: CPConfig) -> None:
        self.cp_mesh, self.config = cp_mesh, config
        self.active = False
        self._entered: Optional[contextlib.AbstractContextManager] = None  # the step's train_ctx(), entered
        self._step: Optional[ScoringStep] = None  # the step of the forward in flight
        self._divisor: Any = None  # its num_items_in_batch, if the caller passed one
        self._kept: Optional[ScoringStep] = None  # a step whose backward is still to run

    @contextlib.contextmanager
    def __call__(self) -> Iterator["ScoringSession"]:
        if self.active:  # re-entered (the trainer's step around its loss): one session
            yield self
            return
        self.active = True
        try:
            yield self
        finally:
            self.active, self._step, self._kept = False, None, None
            self._leave()

    def install(self, model: torch.nn.Module) -> None:
        """Add the pre-hook (rows -> this rank's shard) and the hook (shard fields -> rows) to `model`."""
        if getattr(model, "_blockdiag_cp_scoring", None) is self:
            return
        model.register_forward_pre_hook(self._pre_hook, with_kwargs=True)
        model.register_forward_hook(self._post_hook, with_kwargs=True)
        model._blockdiag_cp_scoring = self

    # -- hooks --------------------------------------------------------------------------

    def _pre_hook(self, module, args: tuple, kwargs: dict[str, Any]):
        if not self.active or not kwargs.get("fused_lm_head"):
            return None
        if args:
            raise ValueError("a scoring forward under CP takes its rows as keyword arguments (input_ids=..., labels=...)")
        step = self._plan(kwargs)
        self._step, self._divisor = step, kwargs.get("num_items_in_batch")
        # options (not tensors) pass as they came; the loss is recomputed on the gathered rows (`_post_hook`)
        options = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor) and k != "num_items_in_batch"}
        return (), {**step.model_kwargs, **options, "use_cache": False}

    def _post_hook(self, module, args: tuple, kwargs: dict[str, Any], output):
        step = self._step
        if not self.active or step is None or not kwargs.get("fused_lm_head"):
            return None
        self._step = None
        if getattr(output, "aux_loss", None) is not None and step.ctx.state.world > 1:
            raise ValueError("the MoE load-balancing loss of a scoring forward is not additive over CP shards; "
                             "set output_router_logits=False (or train without CP)")
        fields = {name: _rows_of(getattr(output, name), step) for name in PER_TOKEN_FIELDS
                  if getattr(output, name, None) is not None}
        log_probs = fields["log_probs"]
        count = step.targets if self._divisor is None else self._divisor  # as TRL's head divides
        fields["loss"] = -log_probs.sum() / (count.clamp(min=1) if isinstance(count, torch.Tensor) else max(count, 1))
        keep = torch.is_grad_enabled() and log_probs.requires_grad
        if keep:
            self._kept = step
        elif self._kept is not step:
            self._leave()
        values = {f.name: getattr(output, f.name) for f in dataclasses.fields(output)}
        return type(output)(**{**values, **fields})

    # -- steps --------------------------------------------------------------------------

    def _plan(self, kwargs: dict[str, Any]) -> ScoringStep:
        """The step of these rows: the pending one if the rows are the same, else a new one (entered)."""
        ids, labels = kwargs.get("input_ids"), kwargs.get("labels")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or not isinstance(labels, torch.Tensor):
            raise ValueError("a scoring forward under CP needs input_ids [B, T] and labels [B, T] (no inputs_embeds)")
        key = (ids, kwargs.get("attention_mask"), labels)
        if self._kept is not None:
            if not self._kept.same_rows(key):
                raise ValueError(
                    "a second scoring forward on other rows while the gradients of the first are still to be computed: "
                    "under CP one step is active at a time; score every row of the step in one forward"
                )
            return self._kept
        if kwargs.get("shift_labels") is not None:
            raise ValueError("a scoring forward under CP takes labels [B, T] and shifts them per row itself; "
                             "do not pass shift_labels")
        rows = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor) and k != "num_items_in_batch"}
        unknown = sorted(k for k in rows if k not in ROW_KEYS)
        if unknown:
            raise ValueError(f"a scoring forward under CP shards text rows ({', '.join(ROW_KEYS)}); it cannot shard "
                             f"{', '.join(unknown)} (e.g. images of a vision-language model): train this one without CP")
        batch = flatten_rows(rows)
        ctx, batch = make_cp_blockdiag_batch_and_ctx(self.cp_mesh, None, batch, config=self.config)
        for key_name in (*STEP_ONLY_KEYS, "labels"):
            batch.pop(key_name, None)
        self._leave()
        entered = ctx()
        entered.__enter__()
        self._entered = entered
        targets = int((labels[:, 1:] != -100).sum())
        return ScoringStep(ctx, tuple(ids.shape), key, batch, targets)

    def _leave(self) -> None:
        """Leave the entered step, if any (after a forward without gradients, or at the session's end)."""
        entered, self._entered = self._entered, None
        if entered is not None:
            entered.__exit__(None, None, None)


def _rows_of(values_1L: torch.Tensor, step: ScoringStep) -> torch.Tensor:
    """This rank's ``[1, L]`` per-token values -> ``[B, T - 1]`` (position t scores token t + 1 of its row)."""
    B, T = step.rows
    dtype = values_1L.dtype
    carried = values_1L.to(torch.uint8) if dtype == torch.bool else values_1L
    full = gather_sequence(carried, 1, state=step.ctx.state).reshape(B, T)[:, :-1]
    return full.to(torch.bool) if dtype == torch.bool else full
