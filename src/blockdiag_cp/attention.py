"""`cp_blockdiag_sdpa`: a drop-in for `F.scaled_dot_product_attention` under block-diagonal CP.

Outside an active step it is stock SDPA. Inside one (``with train_ctx():``) the
local queries attend, causally, to exactly the keys of their own document, wherever
those keys live: state -> exchange -> kernel. Per call this does only host-side
checks of shapes and dtypes (no device synchronisation) and the math: everything
else was planned once per step.
"""

from __future__ import annotations

import math
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from .kernels import CallOptions
from .step.agree import agree_across_ranks
from .step.slot import STEP_SLOT, CallSignature
from .step.state import StepState


def cp_blockdiag_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    **kwargs,
) -> torch.Tensor:
    """Scaled dot-product attention; per-document causal CP attention inside a step.

    Args:
        query: ``[1, H, L, D]`` local queries (``L`` = this rank's shard length).
        key, value: ``[1, Hk, L, D]`` local keys/values; ``H % Hk == 0``.
        attn_mask, is_causal: used only outside a step; inside, the mask comes from
            the document ids (causal within each document, nothing across).
        dropout_p: attention dropout probability (routed to a kernel supporting it).
        scale: softmax scale, default ``1 / sqrt(D)``.
        enable_gqa: allow ``Hk < H`` (as in SDPA); inside a step equal heads or
            ``enable_gqa=True`` are required when ``Hk != H``.
        sliding_window: a query sees only its document's keys at positions
            ``(q - sliding_window, q]`` (transformers' convention; Mistral, Gemma, ...).
        softcap: logits become ``softcap * tanh(logit / softcap)`` (Gemma 2).
        sinks: ``[H]`` learned logits, one per head, added to every row's softmax
            denominator (gpt-oss); they receive a gradient.
        **kwargs: accepted as the seed's signature does, so callers that pass extra
            arguments keep working; unused, and named in a warning (once per call site: a
            typo such as ``sliding_windw=`` would otherwise change nothing silently).

    The three layer features exist inside a step only (stock SDPA has none).

    Returns:
        ``[1, H, L, D]``, dtype of `query`. Padding rows are zeros.
    """
    if kwargs:
        warnings.warn(
            f"cp_blockdiag_sdpa ignores the keyword argument(s) {', '.join(sorted(kwargs))} (unknown to it; a "
            "typo?). It takes attn_mask, dropout_p, is_causal, scale, enable_gqa, sliding_window, softcap, sinks.",
            stacklevel=2,
        )
    features = LayerFeatures(sliding_window, softcap, sinks)
    if torch.compiler.is_compiling():  # Note [One opaque op] in opaque.py
        return _traced_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, features)
    state = STEP_SLOT.current()
    if state is None:
        return _stock_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, features)
    query, key, value = autocast_inputs(query, key, value)
    return attend_active_step(state, query, key, value, dropout_p, scale, enable_gqa, features)


def attend_active_step(
    state: StepState, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float,
    scale: Optional[float], enable_gqa: bool, features: "LayerFeatures",
) -> torch.Tensor:
    """`cp_blockdiag_sdpa` inside the step `state` (the slot's active one), its inputs already in the
    autocast dtype: the ranks agree on a signature's first call, the call is noted for
    Note [Late recompute], then `attend_in_step`."""
    signature = call_signature(query, key, value, features)
    if STEP_SLOT.needs_agreement(signature):
        problem = call_problem(state, query, key, value, enable_gqa) or features.problem(query)
        _agree_on_call(state, signature, problem)
    step_id = STEP_SLOT.note_call(signature)
    if query.requires_grad or key.requires_grad or value.requires_grad:
        query, key, value = _MarkStepBackward.apply(step_id, query, key, value)
    return attend_in_step(state, query, key, value, dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa,
                          features=features)


def _traced_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, features) -> torch.Tensor:
    """`cp_blockdiag_sdpa` while torch.compile traces: one opaque op wherever a step is or could be
    involved (Note [One opaque op]); stock SDPA, traced, where neither."""
    from .opaque import opaque_attention

    window, softcap, sinks = features.sliding_window, features.softcap, features.sinks
    if STEP_SLOT.in_step:
        query, key, value = autocast_inputs(query, key, value)
        return opaque_attention("step", query, key, value, sinks=sinks, scale=scale, dropout_p=dropout_p,
                                sliding_window=window, softcap=softcap, enable_gqa=enable_gqa)
    _refuse_features_outside_a_step(features)
    if attn_mask is None and query.shape[0] == 1 and key.shape[-2] == query.shape[-2]:  # could be a late recompute
        query, key, value = autocast_inputs(query, key, value)
        return opaque_attention("sdpa", query, key, value, scale=scale, dropout_p=dropout_p, enable_gqa=enable_gqa,
                                is_causal=is_causal)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


def _stock_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, features) -> torch.Tensor:
    """Outside a step: `F.scaled_dot_product_attention` itself (it has no window, softcap or sinks)."""
    refuse_late_recompute(query, key, value)
    _refuse_features_outside_a_step(features)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        enable_gqa=enable_gqa,
    )


def _refuse_features_outside_a_step(features: "LayerFeatures") -> None:
    if features != LayerFeatures():
        raise ValueError(
            "sliding_window, softcap and sinks work inside a block-diagonal CP step (or through "
            "attn_implementation='blockdiag_cp'); outside one, cp_blockdiag_sdpa is stock SDPA, which has none"
        )


def attend_in_step(
    state: StepState,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    dropout_p: float = 0.0,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    features: Optional["LayerFeatures"] = None,
) -> torch.Tensor:
    """Per-document causal attention of this rank's ``[1, H, L, D]`` shards under `state`.

    Legal inputs that a fused kernel would get wrong are normalised first (host-side
    decisions, no synchronisation): a last dimension that is not unit-stride is copied
    contiguous, and a scale <= 0 is folded into the queries. A sliding window selects
    the routing and call tables of its layer kind (`StepState.exchange_for`).
    """
    features = LayerFeatures() if features is None else features
    problem = call_problem(state, query, key, value, enable_gqa) or features.problem(query)
    if problem is not None:
        raise problem
    kernel = _kernel_for(state, query, float(dropout_p), features)
    exchange = state.exchange_for(features.sliding_window)
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    if scale <= 0.0:  # softmax((s q) k^T) with scale 1: the fused CPU kernel mishandles s <= 0
        query, scale = query * scale, 1.0
    q, k, v = query.squeeze(0), key.squeeze(0), value.squeeze(0)
    options = CallOptions(scale, float(dropout_p), features.softcap)
    out_HLD = exchange.attend(q, k, v, kernel, options, sinks=features.sinks)
    return out_HLD.unsqueeze(0)


def autocast_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Under `torch.autocast`, the floating inputs in the autocast dtype, as SDPA takes them.

    (Under autocast, Llama-style RoPE returns q/k in float32 while v is already in the
    autocast dtype; SDPA casts all three, so a drop-in must too.) Without autocast the
    inputs pass unchanged, and mismatched dtypes are an error later.
    """
    device_type = tensors[0].device.type
    if device_type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t for t in tensors)


@dataclass(frozen=True)
class LayerFeatures:
    """What a layer asks beyond per-document causal attention (see `cp_blockdiag_sdpa`)."""

    sliding_window: Optional[int] = None
    softcap: Optional[float] = None
    sinks: Optional[torch.Tensor] = field(default=None, compare=False)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LayerFeatures) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def key(self) -> tuple:
        """The features as plain values (the sinks by shape): what ranks must agree on."""
        sinks = None if self.sinks is None else tuple(self.sinks.shape)
        return (self.sliding_window, self.softcap, sinks)

    def problem(self, query: torch.Tensor) -> Optional[ValueError]:
        """The `ValueError` these features deserve for `query` (None when they are valid)."""
        window, softcap, sinks = self.sliding_window, self.softcap, self.sinks
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            return ValueError(f"sliding_window must be a positive int (keys (q - w, q]), got {window!r}")
        if softcap is not None and (not isinstance(softcap, (int, float)) or not softcap > 0):
            return ValueError(f"softcap must be a positive number, got {softcap!r}")
        if sinks is not None:
            if not isinstance(sinks, torch.Tensor) or sinks.shape != (query.shape[1],):
                shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
                return ValueError(f"sinks must be one logit per query head, [{query.shape[1]}], got {shape}")
            if sinks.device != query.device:
                return ValueError(f"sinks are on {sinks.device}, the queries on {query.device}")
        return None


def call_signature(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, features: Optional[LayerFeatures] = None
) -> CallSignature:
    """What every rank's call must share: the shapes and dtypes of q, k and v, and the layer's features."""
    features = LayerFeatures() if features is None else features
    return CallSignature(tuple(query.shape), tuple(key.shape), tuple(value.shape), query.dtype, key.dtype,
                         value.dtype, *features.key())


def _agree_on_call(state: StepState, signature: CallSignature, problem: Optional[ValueError]) -> None:
    """First call of a signature in this step: every rank checks it passes the same (Note [Ranks agree])."""
    if state.group is not None and state.world > 1 and state.config.check_ranks_agree:
        shapes = [d for shape in signature.shapes for d in (*shape, *(-1,) * (4 - len(shape)))[:4]]
        others = [zlib.crc32(repr(x).encode()) for x in signature.tensors[3:] + signature.features]
        agree_across_ranks(
            state.group, state.device, [len(s) for s in signature.shapes] + shapes + others, problem,
            "attention call (query/key/value shapes and dtypes, window, softcap, sinks)",
            "ranks of q/k/v, q shape, k shape, v shape, crcs of the dtypes and features",
        )
    if problem is not None:
        raise problem
    STEP_SLOT.mark_agreed(signature)


class _MarkStepBackward(torch.autograd.Function):
    """Identity on ``(q, k, v)`` whose backward tells the slot that backward reached
    step `step_id` (Note [Late recompute] in step/slot.py).

    It marks the inputs, not the output: backward reaches it only after the attention's
    own backward, so a late recompute (triggered by that backward) is caught first.
    """

    @staticmethod
    def forward(ctx, step_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        ctx.step_id = step_id
        return q.view_as(q), k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        STEP_SLOT.note_backward(ctx.step_id)
        return None, dq, dk, dv


def refuse_late_recompute(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """Raise if this call, outside any step, is a checkpointed CP layer recomputed in
    backward after its step's ``train_ctx()`` exited (Note [Late recompute] in step/slot.py).

    Such a recompute would silently compute unsharded, unmasked attention.
    """
    ended = STEP_SLOT.ended_step()
    if ended is None or torch._C._current_graph_task_id() == -1:
        return
    if ended.matches(call_signature(query, key, value)):
        raise RuntimeError(
            "attention was recomputed in backward (activation checkpointing) after the "
            "block-diagonal CP step ended; call loss.backward() inside `with train_ctx():`"
        )


def call_problem(state: StepState, query, key, value, enable_gqa: bool) -> Optional[ValueError]:
    """The `ValueError` this call deserves (None if q/k/v are this rank's ``[1, H, L, D]`` shards)."""
    L = state.local_len
    if query.device.type != state.device.type or (
        query.device.index is not None and state.device.index is not None and query.device.index != state.device.index
    ):
        return ValueError(f"query is on {query.device} but the step was planned on {state.device} (the batch's device)")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4 or t.shape[0] != 1 or t.shape[2] != L:
            return ValueError(
                f"inside a block-diagonal CP step, {name} must be [1, heads, {L}, head_dim] "
                f"(this rank's shard of length {L}), got {tuple(t.shape)}"
            )
    if key.shape != value.shape:
        return ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have the same shape")
    if query.shape[-1] != key.shape[-1]:
        return ValueError(f"query head_dim {query.shape[-1]} != key head_dim {key.shape[-1]}")
    H, Hk = query.shape[1], key.shape[1]
    if H % Hk:
        return ValueError(f"query heads ({H}) must be a multiple of key/value heads ({Hk})")
    if H != Hk and not enable_gqa:
        return ValueError(f"query has {H} heads and key/value {Hk}: pass enable_gqa=True for grouped-query attention")
    if not (query.dtype == key.dtype == value.dtype):
        return ValueError(f"query, key and value dtypes differ: {query.dtype}, {key.dtype}, {value.dtype}")
    return None if state.heads is None else state.heads.split.problem(H)


def _kernel_for(state: StepState, query: torch.Tensor, dropout_p: float, features: LayerFeatures):
    """The first of the step's kernels that accepts this call (the same on every rank).

    An explicitly requested kernel has no fallbacks, so its refusal is raised as is.
    """
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    refusals = []
    for kernel in (state.kernel, *state.fallback_kernels):
        if dropout_p > 0.0 and not kernel.supports_dropout:
            refusals.append(f"kernel={kernel.name!r} has no attention dropout")
            continue
        lacking = kernel.feature_problem(softcap=features.softcap, sinks=features.sinks is not None)
        if lacking is not None:
            refusals.append(lacking)
            continue
        try:
            kernel.check(query[0], dropout_p)
        except ValueError as exc:
            refusals.append(str(exc))
            continue
        if refusals:  # shown once per distinct reason (Python's warning registry), and recorded
            reason = "; ".join(refusals)
            state.call_notes.record_fallback(kernel.name, reason)
            warnings.warn(f"blockdiag-cp kernel='auto' uses {kernel.name!r} for this call: {reason}")
        return kernel
    hint = "" if state.fallback_kernels else "; use CPConfig(kernel='auto') or another kernel"
    raise ValueError("; ".join(refusals) + hint)
