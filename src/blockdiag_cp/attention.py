"""`cp_blockdiag_sdpa`: a drop-in for `F.scaled_dot_product_attention` under block-diagonal CP.

Outside an active step it is stock SDPA. Inside one (``with train_ctx():``) the
local queries attend, causally, to exactly the keys of their own document, wherever
those keys live: state -> exchange -> kernel. It only names its call (an `AttentionCall`) and hands
it to `step.dispatch.attend`, which picks the compiled op or the eager path: Note [One way down]
in step/dispatch.py.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from .step.call import AttentionCall, LayerFeatures
from .step.dispatch import attend


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
    call = AttentionCall("sdpa", LayerFeatures(sliding_window, softcap, sinks), scale=scale, dropout_p=dropout_p,
                         enable_gqa=enable_gqa, is_causal=is_causal, attn_mask=attn_mask)
    return attend(call, query, key, value)
