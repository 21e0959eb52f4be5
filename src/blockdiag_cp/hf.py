"""transformers integration: importing this module registers ``attn_implementation="blockdiag_cp"``.

The only module that imports transformers (``pip install blockdiag-cp[hf]``). It
uses transformers' public registries, ``AttentionInterface`` and
``AttentionMaskInterface``; nothing of transformers or torch is monkeypatched.

- Inside a CP step (``with train_ctx():``) attention is block-diagonal CP attention
  and no mask is built at all.
- Outside a step, a packed row (documents marked by ``cu_seq_lens_q`` or by
  ``position_ids`` restarting at 0, as ``DataCollatorWithFlattening`` makes them)
  still gets per-document attention; any other batch gets stock SDPA with the mask
  transformers builds for it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .config import CPConfig
from .docs import resolve_doc_ids
from .sdpa import attend_in_step, cp_blockdiag_sdpa
from .state import build_step_state, current_step

ATTN_IMPLEMENTATION = "blockdiag_cp"


def _refuse_unsupported(
    module: torch.nn.Module, kwargs: dict[str, Any], longest_doc: Callable[[], Optional[int]]
) -> None:
    """Refuse what per-document causal attention would silently get wrong.

    `longest_doc` is called only when the layer has a sliding window (None: unknown).
    """
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    longest = longest_doc() if window is not None else None
    if window is not None and (longest is None or longest > window):
        raise ValueError(
            f"layer {getattr(module, 'layer_idx', '?')} uses sliding-window attention (window {window}) and a "
            f"document is longer than the window; blockdiag_cp computes full causal attention per document, so it "
            "refuses rather than be silently wrong. Use documents no longer than the window or another implementation."
        )
    for unsupported in ("softcap", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"blockdiag_cp attention does not support {unsupported!r}")


def _packed_doc_ids(query: torch.Tensor, kwargs: dict[str, Any]) -> Optional[torch.Tensor]:
    """Document ids ``[S]`` of a packed single row outside a step, or None if not packed."""
    if query.shape[0] != 1:
        return None
    S = query.shape[2]
    marks = {k: kwargs[k] for k in ("cu_seq_lens_q", "position_ids") if kwargs.get(k) is not None}
    if "cu_seq_lens_q" not in marks:
        pos = marks.get("position_ids")
        if pos is None or pos.dim() != 2 or pos.shape[-1] != S or not bool((pos[0, 1:] == 0).any()):
            return None
    return resolve_doc_ids(marks, S, query.device, 1)[0]


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
        _refuse_unsupported(module, kwargs, lambda: state.geometry.longest_document)
        out = cp_blockdiag_sdpa(query, key, value, dropout_p=dropout, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    doc_ids = _packed_doc_ids(query, kwargs)
    if doc_ids is not None:
        local = build_step_state(doc_ids, 1, 0, None, CPConfig(), query.device)
        _refuse_unsupported(module, kwargs, lambda: local.geometry.longest_document)
        out = attend_in_step(local, query, key, value, dropout_p=dropout, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    _refuse_unsupported(module, kwargs, lambda: None)
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is None and q_len > 1 and getattr(module, "is_causal", True):
        # causal, aligned bottom-right (queries are the last q_len positions, as with a cache)
        attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout,
        scale=scaling, enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


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
