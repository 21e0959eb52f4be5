"""What a model must allow for the mixin's loss and inputs to be the unsharded run's; refusals by name.

- PEFT methods that add virtual tokens inside the model (prompt tuning, P-tuning, prefix
  tuning, multitask prompt tuning, CPT, adaption prompts) change the sequence the attention
  sees after the mixin has sharded it: a rank's queries would no longer be the positions its
  shard holds (or extra keys would join every document). They are refused at construction;
  LoRA-family adapters (weights only) run as they come.
- The mixin hands the model ``shift_labels`` (next-token targets of the unsharded rows): a
  forward that cannot take them is refused.
- A model with ``accepts_loss_kwargs=False`` gets no token count from the Trainer; under CP
  its loss is its shard's mean, so the mixin passes the replica's count as
  ``num_items_in_batch`` (Note [Losses outside the model under CP] in losses.py), which only
  transformers' ``ForCausalLMLoss`` is known to read. Any other such model is refused.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

#: PEFT method names (``PeftType``) that add virtual tokens or key/value rows inside the model
VIRTUAL_TOKEN_METHODS = frozenset({"PROMPT_TUNING", "MULTITASK_PROMPT_TUNING", "P_TUNING", "PREFIX_TUNING", "CPT",
                                   "ADAPTION_PROMPT"})


def virtual_token_adapters(model: Any) -> list[str]:
    """``"name (METHOD)"`` of each PEFT adapter of `model` that adds virtual tokens (duck-typed: no peft import).

    PEFT's models (and transformers' own PEFT integration) keep ``peft_config``, a mapping
    from adapter name to a config with ``peft_type``; prompt-learning configs also say
    ``is_prompt_learning`` and carry ``num_virtual_tokens``, adaption prompts ``is_adaption_prompt``.
    """
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, Mapping):
        return []
    found = []
    for name, config in configs.items():
        peft_type = getattr(config, "peft_type", None)
        method = str(getattr(peft_type, "value", peft_type) or type(config).__name__).upper()
        if (method in VIRTUAL_TOKEN_METHODS or getattr(config, "is_prompt_learning", False)
                or getattr(config, "is_adaption_prompt", False) or getattr(config, "num_virtual_tokens", None)):
            found.append(f"{name} ({method})")
    return found


def refuse_virtual_tokens(model: Any, where: str) -> None:
    """`ValueError` naming the adapters of `model` that add virtual tokens inside it."""
    found = virtual_token_adapters(model)
    if found:
        raise ValueError(
            f"PEFT adapter(s) {', '.join(found)} add virtual tokens inside the model, after the mixin sharded the rows "
            f"{where}: the attention would see a sequence the shard plan does not describe. Use a LoRA-family adapter "
            "(LoRA, DoRA, IA3, ...), or train prompt tuning without the mixin"
        )


def forward_takes(model: Any, name: str) -> bool:
    """Whether ``model.forward`` accepts the keyword `name` (by name or through ``**kwargs``)."""
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):  # a builtin or C forward: no signature to read
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD or (p.name == name and p.kind is not p.POSITIONAL_ONLY)
               for p in parameters)


def check_loss_inputs(model: Any, accepts_loss_kwargs: bool, own_loss: bool, where: str) -> None:
    """Refuse `model` if its own loss (`own_loss`: no label smoothing, no ``compute_loss_func``) cannot
    see the unsharded rows' targets and count under the mixin (module docstring)."""
    if not own_loss:
        return
    name = type(model).__name__
    if not forward_takes(model, "shift_labels"):
        raise ValueError(
            f"{name}.forward takes no shift_labels (nor **kwargs): {where} its loss would shift each shard's labels "
            "on its own and lose the target at every shard boundary. Accept **kwargs and pass them to "
            "self.loss_function (transformers' models do), or pass compute_loss_func= to the trainer"
        )
    if accepts_loss_kwargs:
        return
    from transformers.loss.loss_utils import ForCausalLMLoss

    if getattr(model, "loss_function", None) is not ForCausalLMLoss:
        raise ValueError(
            f"{name} has accepts_loss_kwargs=False and a loss other than transformers' ForCausalLMLoss: {where} each "
            "rank's loss would be its shard's mean, and the mixin cannot give that loss the replica's token count. "
            "Pass compute_loss_func= to the trainer, or train without the mixin"
        )
