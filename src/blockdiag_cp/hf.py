"""transformers integration: importing this module registers ``attn_implementation="blockdiag_cp"``.

The only module that imports transformers (``pip install blockdiag-cp[hf]``). It
uses transformers' public registries, ``AttentionInterface`` and
``AttentionMaskInterface``; nothing of transformers or torch is monkeypatched.

- Inside a CP step (``with train_ctx():``) attention is block-diagonal CP attention
  and no mask is built at all.
- Outside a step, a single row (documents marked by ``cu_seq_lens_q`` or by
  ``position_ids`` that do not step by +1, as ``DataCollatorWithFlattening`` makes
  them, else one document; a padding ``attention_mask`` is honoured too) still gets
  per-document attention, planned once per forward (the first layer plans, the others
  reuse it); batches of several rows and cached decoding get stock SDPA with the mask
  transformers builds for them.
- Each layer's sliding window (``sliding_window``), logit softcap (``softcap``) and
  attention sinks (``s_aux``) are honoured per document: Mistral, Qwen2, Gemma 2 and
  3, gpt-oss.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .attention import LayerFeatures, attend_in_step, autocast_inputs, cp_blockdiag_sdpa, refuse_late_recompute
from .config import CPConfig
from .doc_ids import block_causal_mask, resolve_doc_ids
from .slot import STEP_SLOT, current_step
from .state import StepState, build_step_state
from .vlm import make_cp_vlm_batch_and_ctx  # noqa: F401  (the VLM entry, public here)
from .vlm import model_inputs as vlm_model_inputs  # noqa: F401

ATTN_IMPLEMENTATION = "blockdiag_cp"


def layer_features(module: torch.nn.Module, kwargs: dict[str, Any]) -> LayerFeatures:
    """The layer's sliding window, logit softcap and attention sinks, as transformers hands them over."""
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    return LayerFeatures(window, kwargs.get("softcap"), kwargs.get("s_aux"))


def _row_doc_ids(
    S: int, device: torch.device, position_ids: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
    mask_11SS: Optional[torch.Tensor], window: Optional[int],
) -> torch.Tensor:
    """Document ids ``[S]`` of a single row: its packed documents, or one document.

    Packed: ``cu_seq_lens_q`` is given, or 2-D ``position_ids`` break (do not step by
    +1). The padding of a 4-D ``[1, 1, S, S]`` mask (its diagonal) marks padding
    tokens; within each document the mask must be causal (under the layer's sliding
    `window`), else a `ValueError`.
    """
    marks: dict[str, Any] = {"cu_seq_lens_q": cu_seqlens}
    if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2 and position_ids.shape == (1, S):
        marks["position_ids"] = position_ids
    if mask_11SS is not None:
        marks["attention_mask"] = mask_11SS[0, 0].diagonal().unsqueeze(0).long()
    doc_ids_S = resolve_doc_ids({k: v for k, v in marks.items() if v is not None}, S, device, 1)[0]
    if mask_11SS is not None:
        _check_mask_is_causal_within_documents(mask_11SS[0, 0], doc_ids_S, window)
    return doc_ids_S


def _check_mask_is_causal_within_documents(mask_SS: torch.Tensor, doc_ids_S: torch.Tensor, window) -> None:
    """`ValueError` unless the model's mask, inside each document, is exactly causal (within `window`)."""
    allowed = mask_SS == 0 if mask_SS.is_floating_point() else mask_SS.bool()
    ours = block_causal_mask(doc_ids_S.unsqueeze(0))[0]
    if window is not None:
        ours &= torch.ones_like(ours).triu(-(window - 1))
    same_doc = (doc_ids_S.unsqueeze(0) == doc_ids_S.unsqueeze(1)) & (doc_ids_S != 0).unsqueeze(0)
    if not torch.equal(allowed & same_doc, ours):
        raise ValueError(
            "the attention mask transformers built for this packed row is not causal inside each document "
            "(e.g. bidirectional image tokens); blockdiag_cp computes causal attention per document and refuses "
            "rather than be silently wrong"
        )


def _row_state(query: torch.Tensor, key: torch.Tensor, attention_mask, window, kwargs) -> Optional[StepState]:
    """The one-rank step state of a single row outside a step (its packed documents, or one),
    planned once per forward; None for batches of several rows or with a cache (q_len != k_len)."""
    S = query.shape[2]
    if query.shape[0] != 1 or key.shape[2] != S:
        return None
    if attention_mask is not None and not (isinstance(attention_mask, torch.Tensor) and attention_mask.shape == (1, 1, S, S)):
        return None
    position_ids, cu_seqlens = kwargs.get("position_ids"), kwargs.get("cu_seq_lens_q")

    def plan() -> StepState:
        doc_ids = _row_doc_ids(S, query.device, position_ids, cu_seqlens, attention_mask, window)
        return build_step_state(doc_ids, 1, 0, None, CPConfig(), query.device)

    return STEP_SLOT.implicit_state((position_ids, cu_seqlens, attention_mask), (S, query.device, window), plan)


def blockdiag_cp_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query [B, H, S, D]`` -> ``([B, S, H, D], None)``."""
    state = current_step()
    if state is not None:
        if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
            raise ValueError(
                f"{type(module).__name__} is not causal (e.g. a vision encoder); inside a CP step blockdiag_cp "
                "computes causal attention per document. Run non-causal modules before sharding, or give them "
                "another attn_implementation."
            )
        features = layer_features(module, kwargs)
        out = cp_blockdiag_sdpa(query, key, value, dropout_p=dropout, scale=scaling, enable_gqa=True,
                                sliding_window=features.sliding_window, softcap=features.softcap, sinks=features.sinks)
        return out.transpose(1, 2).contiguous(), None
    refuse_late_recompute(query, key, value)
    features = layer_features(module, kwargs)
    causal = getattr(module, "is_causal", True)
    local = _row_state(query, key, attention_mask, features.sliding_window, kwargs) if causal else None
    if local is not None:
        query, key, value = autocast_inputs(query, key, value)
        out = attend_in_step(local, query, key, value, dropout_p=dropout, scale=scaling, enable_gqa=True,
                             features=features)
        return out.transpose(1, 2).contiguous(), None
    _refuse_beyond_sdpa(module, kwargs)
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is None and q_len > 1 and getattr(module, "is_causal", True):
        # causal, aligned bottom-right (queries are the last q_len positions, as with a cache)
        attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout,
        scale=scaling, enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def _refuse_beyond_sdpa(module: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    """A padded (not packed) batch outside a step runs stock SDPA with transformers' mask (its
    sliding window included): softcap and sinks have no SDPA form, so refuse them there."""
    features = layer_features(module, kwargs)
    for name in ("softcap", "sinks"):
        if getattr(features, name) is not None:
            raise ValueError(
                f"blockdiag_cp attention runs {name!r} for packed rows and inside CP steps; this batch is neither "
                "(padded rows outside a step run stock SDPA, which has no such input). Pack the rows "
                "(DataCollatorWithFlattening) or use the model's eager attention for it."
            )


def blockdiag_cp_mask(*args: Any, **kwargs: Any) -> Optional[torch.Tensor]:
    """Mask function: none inside a step or for one unpadded row (the attention derives
    documents itself); SDPA's mask for padded or multi-row batches."""
    if current_step() is not None:
        return None
    if kwargs.get("attention_mask") is None and kwargs.get("batch_size") == 1:
        return None
    return sdpa_mask(*args, **kwargs)


def register() -> str:
    """Register the implementation (idempotent); return its name for ``attn_implementation``."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, blockdiag_cp_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, blockdiag_cp_mask)
    return ATTN_IMPLEMENTATION


register()
