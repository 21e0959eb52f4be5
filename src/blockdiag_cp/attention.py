"""`cp_blockdiag_sdpa`: a drop-in for `F.scaled_dot_product_attention` under block-diagonal CP.

Outside an active step it is stock SDPA. Inside one (``with train_ctx():``) the
local queries attend, causally, to exactly the keys of their own document, wherever
those keys live: state -> exchange -> kernel (step/attend.py). Under torch.compile the
call is one opaque op (Note [One opaque op] in opaque.py).
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.nn.functional as F

from .opaque import opaque_attention
from .step.attend import LayerFeatures, attend_active_step, autocast_inputs, refuse_late_recompute
from .step.slot import STEP_SLOT


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
        key, value: ``[1, Hk, L, D]`` local keys and ``[1, Hk, L, Dv]`` values; ``H % Hk == 0``.
            ``Dv`` may differ from ``D`` (multi-head latent attention, as SDPA allows).
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
        ``[1, H, L, Dv]``, dtype of `query`. Padding rows are zeros.
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
    state = STEP_SLOT.reach()  # an attention call: the model reached the step
    if state is None:
        return _stock_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, features)
    query, key, value = autocast_inputs(query, key, value)
    return attend_active_step(state, query, key, value, dropout_p, scale, enable_gqa, features)


def _traced_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, features) -> torch.Tensor:
    """`cp_blockdiag_sdpa` while torch.compile traces: one opaque op wherever a step is or could be
    involved (Note [One opaque op]); stock SDPA, traced, where neither."""
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


