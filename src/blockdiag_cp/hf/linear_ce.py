"""A transformers causal LM's next-token loss from its final hidden states and LM head, never holding the logits.

Note [The linear-CE loss of a causal LM]
----------------------------------------
The model's own forward runs (so DDP / FSDP / PEFT wrappers, a VLM's image merge and every
pre-head step run as they always do), with a forward pre-hook on its output embeddings: the
hook computes the shard's cross-entropy from the hidden states the head gets
(`step.linear_ce.linear_ce_sum`: torch's chunked ``linear_cross_entropy``) and hands the head
zero positions instead, so the model's logits are ``[B, 0, V]``. No labels reach the model,
so its own loss is never computed.

That is exact only where the logits are the head's output times a number. `linear_head` reads
the statements of the class's ``forward`` after the head call (its AST), up to the loss:

    logits = self.lm_head(hidden_states)                 the head: an ``nn.Linear`` (tied or not)
    logits = logits * self.logit_scale                   Cohere: a number, folded into the hidden states
    logits = logits / self.config.logits_scaling         Granite (and its VLMs): likewise
    if self.config.final_logit_softcapping is not None:  Gemma 2/3: exact while it is None;
        logits = torch.tanh(...)                         refused by name when it is set (not linear)

Any other statement that touches the logits (an added bias, a vocabulary slice, a mask) is
refused by name, quoting it; so is a head that is not a plain ``nn.Linear`` (a LoRA or
``modules_to_save`` head), a forward whose head call cannot be found, and an MoE router loss
(the model adds it to its own loss only with labels). The hook checks at run time that the head
was called once, on as many positions as there are targets, and that no logits came back.

The head runs with autocast off, in the hidden states' dtype (under bf16 autocast the plain
path's logits are bfloat16; these are computed in the model's dtype, float32 accumulation for
half dtypes). In bfloat16 the sum torch returns is rounded to bfloat16 (relative 2**-9);
its gradients are not.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch

from ..errors import ModelRefusal
from ..step.linear_ce import linear_ce_sum, linear_token_log_probs
from ..step.rows import IGNORE_INDEX, shifted_labels
from .parallelism import forward_with_loss_out

__all__ = ("LinearHead", "causal_lm_ce_sum", "causal_lm_log_probs", "linear_ce_loss", "linear_head")

#: inputs the model must not get on this path: the loss is computed here, from every position
LOSS_KEYS = ("labels", "shift_labels", "num_items_in_batch")
#: what `_self_attribute` returns for an expression that is no attribute chain of ``self`` (or a missing one)
NOT_FOUND = inspect.Parameter.empty


@dataclass(frozen=True)
class LinearHead:
    """How a causal LM's logits follow from what its head gets: ``logits = scale * head(hidden)``.

    Attributes:
        module: the output embeddings (``nn.Linear`` ``[V, H]``, bias or not, tied or not).
        scale: the number the forward multiplies the head's output by (1.0 for most models).
        name: the model class, for messages.
    """

    module: torch.nn.Linear
    scale: float
    name: str


def linear_head(model: torch.nn.Module) -> LinearHead:
    """`model`'s head and logit scale, or a `ModelRefusal` naming what is not linear (Note)."""
    inner = _unwrapped(model)
    name = type(inner).__name__
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear) or type(head).forward is not torch.nn.Linear.forward:
        raise _refusal(name, f"its output embeddings are a {type(head).__name__}, not a plain nn.Linear "
                             "(a LoRA or modules_to_save head, a quantized layer)")
    scale = 1.0
    for statement in _after_head(type(inner), inner, head, name):
        scale *= _linear_factor(statement, inner, name)
    return LinearHead(head, scale, name)


def causal_lm_ce_sum(
    model: torch.nn.Module, inputs: Mapping[str, Any], *, label_smoothing: float = 0.0,
    options: Optional[torch.nn.LinearCrossEntropyOptions] = None,
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """``(loss_sum, count, outputs)``: `model`'s forward on `inputs` with the loss from its hidden states.

    Args:
        model: a transformers causal LM (or a DDP / PEFT / compiled wrapper of one).
        inputs: its keyword inputs (``input_ids`` or ``inputs_embeds`` ``[B, S(, E)]``, positions, ...) with
            ``shift_labels`` ``[B, S]`` (next-token targets, -100 = none: a CP step's) or ``labels``
            (shifted per row, as the model's own loss shifts them).
        label_smoothing: transformers' ``LabelSmoother`` factor.
        options: torch's chunking (`step.linear_ce.linear_ce_sum`).

    Returns:
        The 0-d sum of every target's cross-entropy, the 0-d count of targets, and the model's outputs
        (logits ``[B, 0, V]``; no loss).
    """
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
    head = linear_head(model)
    _every_position(inputs)
    if _router_loss(model, inputs):
        raise _refusal(head.name, "its MoE router load-balancing loss is added to the model's own loss, which this "
                                  "path does not compute; set output_router_logits=False")
    targets_BS = _targets(inputs)
    kwargs = {k: v for k, v in inputs.items() if k not in LOSS_KEYS}
    loss_sum, outputs = _hooked_forward(model, head, kwargs, lambda h: _head_sum(h, head, targets_BS,
                                                                                    label_smoothing, options))
    return loss_sum, (targets_BS != IGNORE_INDEX).sum(), outputs


def linear_ce_loss(
    model: torch.nn.Module, inputs: Mapping[str, Any], *, num_items_in_batch: Any = None,
    label_smoothing: float = 0.0, options: Optional[torch.nn.LinearCrossEntropyOptions] = None,
) -> torch.Tensor:
    """The loss `BlockDiagCPMixin`'s plain path computes for this rank's batch, never holding the logits.

    Args:
        model, inputs, label_smoothing, options: as in `causal_lm_ce_sum` (`inputs`: the step's sharded
            batch, ``shift_labels`` in it; ``labels`` and ``num_items_in_batch`` in it are not read).
        num_items_in_batch: the divisor, as the model's ``ForCausalLMLoss`` / ``LabelSmoother`` (and the
            mixin's ``ShardLabelSmoother``) take it: under the mixin, ``RowsStep.replica_divisor(...)``;
            None: this batch's own count of targets (their mean; NaN without a target, as there).

    Returns:
        0-d: ``sum / num_items_in_batch``, with ``label_smoothing`` the smoothed loss of ``LabelSmoother``;
        before the Trainer's ``num_processes`` factor (the mixin applies it as ``Trainer.compute_loss`` does).
    """
    loss_sum, count, _ = causal_lm_ce_sum(model, inputs, label_smoothing=label_smoothing, options=options)
    divisor = count if num_items_in_batch is None else num_items_in_batch
    if torch.is_tensor(divisor):
        divisor = divisor.to(loss_sum.device)
    return loss_sum.to(torch.promote_types(loss_sum.dtype, torch.float32)) / divisor


def causal_lm_log_probs(
    model: torch.nn.Module, inputs: Mapping[str, Any], *, temperature: float = 1.0,
    options: Optional[torch.nn.LinearCrossEntropyOptions] = None,
) -> tuple[torch.Tensor, Any]:
    """``(log_probs [B, S], outputs)``: each target's log-probability (0 where -100), as `loss.token_log_probs`
    gives it from the logits, for DPO / GRPO-style losses of your own loop; no entropies (they need the logits).
    Arguments as in `causal_lm_ce_sum`; `temperature` divides the logits."""
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature!r}")
    head = linear_head(model)
    _every_position(inputs)
    targets_BS = _targets(inputs)
    kwargs = {k: v for k, v in inputs.items() if k not in LOSS_KEYS}

    def log_probs(hidden: torch.Tensor) -> torch.Tensor:
        weight, bias, hidden = _scaled(hidden, head, targets_BS)
        with torch.autocast(hidden.device.type, enabled=False):
            values, _ = linear_token_log_probs(hidden.reshape(1, -1, hidden.shape[-1]), weight, targets_BS.reshape(
                1, -1).to(hidden.device), bias_V=bias, temperature=temperature, options=options)
        return values.reshape(targets_BS.shape)

    return _hooked_forward(model, head, kwargs, log_probs)


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside DDP / DeepSpeed / FSDP1 (``.module``), torch.compile and PEFT wrappers."""
    while True:
        if isinstance(getattr(model, "module", None), torch.nn.Module):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            model = model._orig_mod
        elif callable(getattr(model, "get_base_model", None)) and model.get_base_model() is not model:
            model = model.get_base_model()
        else:
            return model


def _after_head(cls: type, inner: torch.nn.Module, head: torch.nn.Module, name: str) -> list[ast.stmt]:
    """The top-level statements of ``cls.forward`` after its head call, up to its loss, that touch the logits."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError) as exc:
        raise _refusal(name, f"its forward's source cannot be read ({exc})") from None
    body = tree.body[0].body
    for i, statement in enumerate(body):
        logits = _head_call(statement, inner, head)
        if logits is not None:
            break
    else:
        raise _refusal(name, "its forward does not assign `logits = self.<output embeddings>(...)` at its top level")
    kept = []
    for statement in body[i + 1:]:
        if _starts_loss(statement):
            break
        if any(isinstance(n, ast.Name) and n.id == logits for n in ast.walk(statement)):
            kept.append(statement)
    return kept


def _head_call(statement: ast.stmt, inner: torch.nn.Module, head: torch.nn.Module) -> Optional[str]:
    """The name `statement` assigns the head's output to (``x = self.<head>(one argument)``), else None."""
    if not isinstance(statement, (ast.Assign, ast.AnnAssign)) or statement.value is None:
        return None
    targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
    call = statement.value
    if len(targets) != 1 or not isinstance(targets[0], ast.Name) or not isinstance(call, ast.Call):
        return None
    if _self_attribute(call.func, inner) is not head or len(call.args) != 1 or call.keywords:
        return None
    return targets[0].id


def _starts_loss(statement: ast.stmt) -> bool:
    """``loss = None``, an ``if`` on the labels, or a return: the loss part of a forward begins."""
    if isinstance(statement, ast.Return):
        return True
    if isinstance(statement, ast.If):
        return any(isinstance(n, ast.Name) and n.id in ("labels", "shift_labels") for n in ast.walk(statement.test))
    return (isinstance(statement, (ast.Assign, ast.AnnAssign)) and
            any(isinstance(t, ast.Name) and t.id == "loss"
                for t in (statement.targets if isinstance(statement, ast.Assign) else [statement.target])))


def _linear_factor(statement: ast.stmt, inner: torch.nn.Module, name: str) -> float:
    """The number a post-head `statement` multiplies the logits by (1.0: a branch not taken), or a refusal."""
    code = ast.unparse(statement).splitlines()[0]
    if isinstance(statement, ast.Assign) and isinstance(statement.value, ast.BinOp):
        op, left, right = statement.value.op, statement.value.left, statement.value.right
        value = _self_attribute(right, inner)
        target = statement.targets[0]
        same = isinstance(target, ast.Name) and isinstance(left, ast.Name) and left.id == target.id
        if same and isinstance(op, (ast.Mult, ast.Div)) and _is_number(value):
            return float(value) if isinstance(op, ast.Mult) else 1.0 / float(value)
    value = _self_attribute(statement.test.left, inner) if isinstance(statement, ast.If) and _is_none_check(
        statement.test) and not statement.orelse else NOT_FOUND
    if value is not NOT_FOUND:
        if value is None:
            return 1.0
        attribute = ast.unparse(statement.test.left).removeprefix("self.")
        first = ast.unparse(statement.body[0]).splitlines()[0]
        raise _refusal(name, f"{attribute}={value!r} sends its logits through `{first}` after the head, which is "
                             "not linear in the hidden states")
    raise _refusal(name, f"its forward changes the logits after the head with `{code}`, which the linear-CE "
                         "loss does not reproduce")


def _self_attribute(node: ast.AST, inner: torch.nn.Module) -> Any:
    """The value of an attribute chain ``self.a.b`` on `inner`; ``NOT_FOUND`` when `node` is none or it is missing."""
    chain = []
    while isinstance(node, ast.Attribute):
        chain.append(node.attr)
        node = node.value
    if not (isinstance(node, ast.Name) and node.id == "self" and chain):
        return NOT_FOUND
    value: Any = inner
    for attribute in reversed(chain):
        value = getattr(value, attribute, NOT_FOUND)
        if value is NOT_FOUND:
            break
    return value


def _is_none_check(test: ast.expr) -> bool:
    return (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.IsNot)
            and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None
            and isinstance(test.left, ast.Attribute))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value != 0


def _every_position(inputs: Mapping[str, Any]) -> None:
    keep = inputs.get("logits_to_keep")
    if isinstance(keep, torch.Tensor) or keep not in (None, 0):
        raise ValueError("logits_to_keep is set: the linear-CE loss scores every position itself")


def _router_loss(model: torch.nn.Module, inputs: Mapping[str, Any]) -> bool:
    config = getattr(_unwrapped(model), "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(inputs.get("output_router_logits", getattr(text, "output_router_logits", False)))


def _targets(inputs: Mapping[str, Any]) -> torch.Tensor:
    """``[B, S]`` next-token targets: ``shift_labels``, else ``labels`` shifted per row."""
    if isinstance(inputs.get("shift_labels"), torch.Tensor):
        return inputs["shift_labels"]
    if isinstance(inputs.get("labels"), torch.Tensor):
        return shifted_labels(inputs["labels"])
    raise ValueError("the linear-CE loss needs shift_labels [B, S] (a CP step's, from add_shift_labels) or labels")


def _scaled(hidden: torch.Tensor, head: LinearHead, targets_BS: torch.Tensor):
    """``(weight, bias, hidden)`` with the logit scale folded into the hidden states and the bias."""
    if hidden.shape[:-1] != targets_BS.shape:
        raise ValueError(f"{head.name}'s head got {tuple(hidden.shape)} for targets {tuple(targets_BS.shape)}: it "
                         "must score every position of the batch once")
    weight, bias = head.module.weight, head.module.bias
    if head.scale != 1.0:  # scale * (h W^T + b) = (scale h) W^T + scale b
        hidden, bias = hidden * head.scale, None if bias is None else bias * head.scale
    return weight, bias, hidden


def _head_sum(hidden: torch.Tensor, head: LinearHead, targets_BS: torch.Tensor, label_smoothing: float,
              options: Optional[torch.nn.LinearCrossEntropyOptions]) -> torch.Tensor:
    """The CE sum of the positions the head got (``[B, S, H]``, the targets' ``[B, S]``), autocast off (the
    head in the model's dtype)."""
    weight, bias, hidden = _scaled(hidden, head, targets_BS)
    with torch.autocast(hidden.device.type, enabled=False):
        return linear_ce_sum(hidden.reshape(1, -1, hidden.shape[-1]), weight, targets_BS.reshape(1, -1).to(
            hidden.device), bias_V=bias, label_smoothing=label_smoothing, options=options)


def _hooked_forward(model: torch.nn.Module, head: LinearHead, kwargs: dict[str, Any],
                    compute: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, Any]:
    """``(compute(what the head gets), outputs)`` of ``model(**kwargs)``, the head given zero positions (Note)."""
    kept: list[torch.Tensor] = []

    def give_head_nothing(module, args, hook_kwargs):
        hidden = args[0] if args else hook_kwargs["input"]
        if kept:
            raise ValueError(f"{head.name} calls its head twice in one forward; the linear-CE loss scores one call")
        kept.append(compute(hidden))
        return (hidden[..., :0, :],), {}

    handle = head.module.register_forward_pre_hook(give_head_nothing, with_kwargs=True)
    try:  # under ZeRO-3 the value leaves the model as an output, the head's parameters gathered for its backward
        outputs, value = forward_with_loss_out(model, kwargs, list(head.module.parameters(recurse=False)),
                                               lambda: kept[0] if kept else None)
    finally:
        handle.remove()
    if value is None:
        raise _refusal(head.name, "its forward never called its output embeddings")
    logits = outputs.get("logits") if isinstance(outputs, Mapping) else getattr(outputs, "logits", None)
    if isinstance(logits, torch.Tensor) and logits.numel():
        raise ValueError(f"{head.name} built logits {tuple(logits.shape)} beside its head; the linear-CE loss refuses it")
    return value, outputs


def _refusal(name: str, reason: str) -> ModelRefusal:
    return ModelRefusal(f"blockdiag-cp: the linear-CE loss refuses {name}: {reason}. Train it with the plain loss "
                        "(the logits held)", reason)
