"""The MoE router's load-balancing loss under CP: the value and gradients of the unsharded rows.

Note [The router's load-balancing loss under CP]
------------------------------------------------
transformers' MoE families (Mixtral's ``load_balancing_loss_func``, copied into each) add
``coef * aux`` to the causal-LM loss, where, over the ``n`` rows (tokens) of a forward and
every MoE layer's router logits ``r [n, E]`` (``p = softmax(r)``, ``top = topk(p, k)``)::

    count_e = sum over layers and rows of [e in top]        (non-padding rows only)
    prob_e  = sum over layers and rows of p[e]
    rows    = layers x non-padding rows
    aux     = E * sum_e (count_e / rows) * (prob_e / rows)

It is nonlinear in sums over *all* tokens of the batch, so a CP shard's own ``aux`` is not
a share of it. Under CP each rank computes its shard's ``(count, prob, rows)`` (padding rows
of the collator and of the CP row weighted 0, as transformers' ``attention_mask`` weights
them), the ranks sum them over the CP group (`replicated_sum`: one all-reduce of
``2E + 1`` numbers, whose backward all-reduces the gradients too), and every rank computes
the replica's ``aux`` from the sums: the value of the run without CP, on every CP rank.

Gradients: with the all-reduce in backward, each rank's router logits get the gradient of
the ``aux`` every CP rank computed, ``cp`` times the gradient of one. What each loss path
then adds (`RouterBalance.fix`):

- ``outputs.aux_loss`` is the replica's ``aux`` on every CP rank. TRL's ``SFTTrainer`` adds
  ``coef * aux_loss`` to each rank's loss, unscaled, and DDP averages over ``dp x cp``: the
  ``cp`` copies of a replica average to one, as without CP (where it averages over ``dp``).
- ``outputs.loss`` (the model's own ``ce + coef * aux``) becomes ``ce + coef * aux * share``.
  When the Trainer multiplies the loss by ``num_processes`` (``average_tokens_across_devices``
  with a token count) it multiplies by ``dp x cp`` where the run without CP multiplies by
  ``dp``, so ``share = 1 / cp``; otherwise ``share = 1``. The shard's own ``aux`` is removed
  (``- coef * own``: its gradient cancels exactly, its value to rounding).

Families (`SWITCH_BALANCE`): those whose causal-LM class calls the Switch-style function
above with ``(router_logits, num_experts, num_experts_per_tok, attention_mask)``, each checked
against transformers' own loss on the unsharded row (``tests/unit/test_moe_balance.py``).
Any other model with ``output_router_logits=True`` is refused at construction, by name.
DeepSeek-V2/V3 have no load-balancing loss in transformers (nothing to do).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from ..loss import replicated_sum


@dataclass(frozen=True)
class SwitchBalance:
    """How one family's causal-LM class names the load-balancing loss's settings.

    Attributes:
        experts: attribute of the causal-LM model holding ``E`` (experts per MoE layer).
        top_k: attribute holding ``k`` (experts per token).
        coef: attribute holding the weight the model adds ``aux`` with.
    """

    experts: str = "num_experts"
    top_k: str = "num_experts_per_tok"
    coef: str = "router_aux_loss_coef"


#: model_type -> how its causal-LM class computes the Switch-style loss (Note above)
SWITCH_BALANCE = types.MappingProxyType({
    "mixtral": SwitchBalance(),
    "qwen2_moe": SwitchBalance(),
    "qwen3_moe": SwitchBalance(),
    "olmoe": SwitchBalance(),
    "gpt_oss": SwitchBalance(),
    "phimoe": SwitchBalance(),
    "granitemoe": SwitchBalance(),
    "granitemoeshared": SwitchBalance(),
    "jetmoe": SwitchBalance(coef="aux_loss_coef"),
    "minimax_m2": SwitchBalance(),
    "qwen3_next": SwitchBalance(),
    "ernie4_5_moe": SwitchBalance(),
    "flex_olmo": SwitchBalance(),
    "laguna": SwitchBalance(),
    "mellum": SwitchBalance(),
    "lara_mini": SwitchBalance(),
})


@dataclass(frozen=True)
class BalanceStep:
    """What `RouterBalance` needs of the step in flight (None outside a CP step of rows).

    Attributes:
        weights_L: this rank's ``[L]`` row weights (1 = a token, 0 = padding of the collator or CP).
        group: the CP process group (None: one rank).
        share: the fraction of the replica's ``aux`` the model's loss keeps (Note: ``1 / cp`` or 1).
    """

    weights_L: torch.Tensor
    group: Any
    share: float


def aux_loss_enabled(model) -> bool:
    """Whether `model` computes a router load-balancing loss (``output_router_logits`` in its config)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    return bool(getattr(text, "output_router_logits", False) or getattr(config, "output_router_logits", False))


def balance_settings(model, where: str) -> tuple[int, int, float]:
    """``(E, k, coef)`` of `model`'s load-balancing loss; a `ValueError` naming the family if it is not verified."""
    model_type = getattr(model.config, "model_type", type(model).__name__)
    family = SWITCH_BALANCE.get(model_type)
    if family is None:
        raise ValueError(
            f"{type(model).__name__} ({model_type}) computes a router load-balancing loss (output_router_logits=True) "
            f"{where}, and blockdiag-cp has not verified that family's loss under CP (verified: "
            f"{', '.join(sorted(SWITCH_BALANCE))}): set output_router_logits=False in the model config, or train "
            "without the mixin"
        )
    values = tuple(getattr(model, name, None) for name in (family.experts, family.top_k, family.coef))
    if any(v is None for v in values):
        raise ValueError(f"{type(model).__name__} lacks {family}: its load-balancing loss cannot be recomputed under CP")
    text = model.config.get_text_config()
    config_values = (getattr(text, "num_experts", values[0]), getattr(text, "num_experts_per_tok", values[1]))
    if tuple(config_values) != values[:2]:
        raise ValueError(f"{type(model).__name__}: num_experts / num_experts_per_tok of the model {values[:2]} and of "
                         f"its config {config_values} differ (TRL's fused head reads the config)")
    return int(values[0]), int(values[1]), float(values[2])


def balance_statistics(router_logits: Sequence[torch.Tensor], weights_T: torch.Tensor, experts: int,
                       top_k: int) -> torch.Tensor:
    """``[2E + 1]`` float32: ``(count_e, prob_e, rows)`` of these rows, as transformers' loss sums them.

    Args:
        router_logits: one ``[T, E]`` tensor per MoE layer (T rows of this shard, in order).
        weights_T: ``[T]`` 1 for a token, 0 for padding (transformers' ``attention_mask``).
        experts, top_k: ``E`` and ``k``.
    """
    device = router_logits[0].device
    weights_T = weights_T.reshape(-1).to(device=device, dtype=torch.float32)
    count_E = torch.zeros(experts, dtype=torch.float32, device=device)
    prob_E = torch.zeros(experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for logits_TE in router_logits:
        if logits_TE.shape[0] != weights_T.shape[0]:
            raise ValueError(f"router logits of {logits_TE.shape[0]} rows for {weights_T.shape[0]} tokens: "
                             "the load-balancing loss cannot be recomputed under CP")
        probs_TE = torch.softmax(logits_TE, dim=-1)
        _, top_TK = torch.topk(probs_TE, top_k, dim=-1)
        count_E = count_E + torch.zeros_like(count_E).scatter_add_(0, top_TK.reshape(-1),
                                                                   weights_T.repeat_interleave(top_k))
        prob_E = prob_E + (probs_TE.float() * weights_T.unsqueeze(-1)).sum(dim=0)
        rows = rows + weights_T.sum()
    return torch.cat([count_E, prob_E, rows.reshape(1)])


def balance_loss(stats: torch.Tensor, experts: int) -> torch.Tensor:
    """The Switch-style loss from `balance_statistics` (summed over every shard of the rows)."""
    count_E, prob_E, rows = stats[:experts], stats[experts: 2 * experts], stats[2 * experts]
    return torch.sum((count_E / rows) * (prob_E / rows).unsqueeze(0)) * experts


class RouterBalance:
    """Replaces a model's load-balancing loss by the unsharded rows' inside CP steps (see the Note).

    Args:
        model: the causal-LM model (its own forward, or TRL's fused head patched onto it); a PEFT
            wrapper's (``get_base_model()``) is found inside it.
        step_of: returns the `BalanceStep` of the forward in flight, or None outside a CP step
            of rows (then the model's outputs pass unchanged).
        where: for the refusal message.

    `install` adds a forward hook on the backbone (it keeps the router logits: TRL's fused
    output does not return them) and one on the model (it fixes ``aux_loss`` and ``loss``).
    """

    def __init__(self, model, step_of: Callable[[], Optional[BalanceStep]], where: str) -> None:
        if callable(getattr(model, "get_base_model", None)):  # a PEFT wrapper: the causal-LM model inside it
            model = model.get_base_model()
        self.experts, self.top_k, self.coef = balance_settings(model, where)
        self.model, self.step_of = model, step_of
        self._router_logits: Optional[tuple[torch.Tensor, ...]] = None
        self.last_aux: Optional[torch.Tensor] = None  # the replica's aux of the last forward in a CP step

    def install(self) -> None:
        backbone = getattr(self.model, "base_model", None)
        if not isinstance(backbone, torch.nn.Module) or backbone is self.model:
            raise ValueError(f"{type(self.model).__name__} has no backbone module (base_model) to read the router "
                             "logits from under CP")
        backbone.register_forward_hook(self._keep_router_logits)
        self.model.register_forward_hook(self.fix)

    def _keep_router_logits(self, module, args, output) -> None:
        logits = getattr(output, "router_logits", None)
        self._router_logits = tuple(logits) if logits is not None and self.step_of() is not None else None

    def fix(self, module, args, output):
        """The model's forward hook: ``aux_loss`` -> the replica's, ``loss`` -> its share (Note)."""
        router_logits, self._router_logits = self._router_logits, None
        step = self.step_of()
        own = getattr(output, "aux_loss", None)
        self.last_aux = None
        if step is None or own is None:
            return None
        if router_logits is None:
            raise ValueError(f"{type(self.model).__name__} returned aux_loss but its backbone gave no router logits")
        stats = balance_statistics(router_logits, step.weights_L, self.experts, self.top_k)
        exact = balance_loss(replicated_sum(stats, step.group), self.experts)
        output.aux_loss = self.last_aux = exact
        if getattr(output, "loss", None) is not None:
            output.loss = output.loss + self.coef * (exact * step.share - own).to(output.loss.device)
        return output
