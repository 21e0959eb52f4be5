"""The attention and mask functions behind ``attn_implementation="blockdiag_cp"``.

`register` (run when `blockdiag_cp.hf` is imported) adds them to transformers' public
registries, ``AttentionInterface`` and ``AttentionMaskInterface``
(``pip install blockdiag-cp[hf]``); nothing of transformers or torch is monkeypatched.

- Inside a CP step (``with train_ctx():``) attention is block-diagonal CP attention
  and no mask is built at all.
- Outside a step, one row whose keys are exactly its queries (no cache, or a fresh
  one) still gets per-document attention: documents marked by ``cu_seq_lens_q`` or by
  ``position_ids`` that do not step by +1, as ``DataCollatorWithFlattening`` makes them,
  else one document; the padding of a ``[1, 1, S, S]`` mask transformers built for the
  row is honoured too. It is planned once per forward (the first layer plans, the
  others reuse it). Without an ``attention_mask`` such a row gets no mask at all.
- Every other call outside a step (several rows, a cache holding earlier tokens:
  static caches, decoding, chunked prefill) is transformers' ``sdpa``: the mask is
  ``sdpa_mask`` and attention is ``sdpa_attention_forward``, unchanged.
- Each layer's sliding window (``sliding_window``), logit softcap (``softcap``) and
  attention sinks (``s_aux``) are honoured per document: Mistral, Qwen2, Gemma 2 and
  3, gpt-oss. Softcap and sinks have no SDPA form, so the ``sdpa`` calls refuse them.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Optional

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..attention import cp_blockdiag_sdpa
from ..mixers import refuse_unrouted_mixers, unrouted_config_mixers
from ..mixers.routing import PREPARED_KINDS
from ..opaque import opaque_attention
from ..step.attend import LayerFeatures, attend_row, autocast_inputs, refuse_late_recompute
from ..step.slot import STEP_SLOT, current_step
from ..step.state import StepState
from ..eager import eager_under_compile

ATTN_IMPLEMENTATION = "blockdiag_cp"
#: when the in-step refusal of unrouted token mixers runs, for its message
IN_STEP = "inside a CP step"
_SDPA_MASK_SIGNATURE = inspect.signature(sdpa_mask)


def layer_features(module: torch.nn.Module, kwargs: dict[str, Any]) -> LayerFeatures:
    """The layer's sliding window, logit softcap and attention sinks, as transformers hands them over."""
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    return LayerFeatures(window, kwargs.get("softcap"), kwargs.get("s_aux"))


def _one_row(query: torch.Tensor, key: torch.Tensor, attention_mask: Any) -> bool:
    """Whether this call outside a step is one row whose keys are exactly its queries
    (``query [1, H, S, D]``, ``key [1, Hk, S, D]``, a mask None or ``[1, 1, S, S]``): shapes only.
    Batches of several rows and caches holding earlier tokens are SDPA's."""
    S = query.shape[2]
    if query.shape[0] != 1 or key.shape[2] != S:
        return False
    return attention_mask is None or (isinstance(attention_mask, torch.Tensor) and attention_mask.shape == (1, 1, S, S))


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
    """transformers attention function: ``query [B, H, S, D]``, ``key``/``value [B, Hk, K, D]``
    -> ``([B, S, H, D], None)``.

    Inside a step: block-diagonal CP attention. Outside: one row whose keys are its queries
    (`_one_row`) gets per-document attention (`attend_row`); anything else is transformers' own
    ``sdpa_attention_forward`` with the mask transformers built (`attention_mask`, from
    ``blockdiag_cp_mask``), softcap and sinks refused. Under ``torch.compile`` the first two
    are one opaque op each (Note [One opaque op] in opaque.py); every decision here reads
    shapes, the module and `StepSlot.in_step` only, so it traces without a break.
    """
    features = layer_features(module, kwargs)
    if STEP_SLOT.in_step:
        config = getattr(module, "config", None)
        refuse_unrouted_mixers(config, IN_STEP, getattr(module, PREPARED_KINDS, frozenset()))
        if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
            raise ValueError(
                f"{type(module).__name__} is not causal (e.g. a vision encoder); inside a CP step blockdiag_cp "
                "computes causal attention per document. Run non-causal modules before sharding, or give them "
                "another attn_implementation."
            )
        out = cp_blockdiag_sdpa(query, key, value, dropout_p=dropout, scale=scaling, enable_gqa=True,
                                sliding_window=features.sliding_window, softcap=features.softcap, sinks=features.sinks)
        return out.transpose(1, 2).contiguous(), None
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    if causal and _one_row(query, key, attention_mask):
        out = _attend_one_row(module, query, key, value, attention_mask, dropout, scaling, features, kwargs)
        return out.transpose(1, 2).contiguous(), None
    if not torch.compiler.is_compiling():
        refuse_late_recompute(query, key, value)
    _refuse_beyond_sdpa(module, kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def _attend_one_row(module, query, key, value, attention_mask, dropout, scaling, features, kwargs) -> torch.Tensor:
    """`attend_row`, or under torch.compile its opaque op (a model with unrouted token mixers, which
    must count the row's documents on the host, runs it eagerly: a graph break, not a silent result)."""
    position_ids, cu_seqlens = kwargs.get("position_ids"), kwargs.get("cu_seq_lens_q")
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape != (1, query.shape[2]):
        position_ids = None
    check = functools.partial(_refuse_unrouted_on_packed_row, module)
    if not torch.compiler.is_compiling():
        return attend_row(query, key, value, attention_mask, position_ids, cu_seqlens, dropout, scaling, features, check)
    if unrouted_config_mixers(getattr(module, "config", None), getattr(module, PREPARED_KINDS, frozenset())):
        return _attend_row_eagerly(query, key, value, attention_mask, position_ids, cu_seqlens, dropout, scaling,
                                   features, check)
    query, key, value = autocast_inputs(query, key, value)
    return opaque_attention("row", query, key, value, sinks=features.sinks, position_ids=position_ids,
                            cu_seq_lens=cu_seqlens, attn_mask=attention_mask, scale=scaling, dropout_p=dropout,
                            sliding_window=features.sliding_window, softcap=features.softcap, enable_gqa=True)


@eager_under_compile
def _attend_row_eagerly(*args: Any) -> torch.Tensor:
    """`attend_row`, run eagerly under torch.compile (a graph break)."""
    return attend_row(*args)


def _refuse_unrouted_on_packed_row(module: torch.nn.Module, local: StepState) -> None:
    """`ValueError` if the model has token mixers outside attention and the row holds several documents
    (their state would cross document boundaries; one document is what they compute right)."""
    config = getattr(module, "config", None)
    routed = getattr(module, PREPARED_KINDS, frozenset())  # set by mixers.prepare_model on every submodule
    if unrouted_config_mixers(config, routed):
        ids = local.geometry.doc_ids
        if int((ids.unique() != 0).sum()) > 1:
            refuse_unrouted_mixers(config, "on a packed row (several documents) outside a CP step", routed)


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
    """Mask function, called as transformers calls ``sdpa_mask`` (same arguments).

    None inside a step, and for a call that may be one packed row (`_may_be_packed_row`): the
    attention derives its documents itself. Otherwise exactly ``sdpa_mask(*args, **kwargs)``
    (a ``[B, 1, q_length, kv_length]`` boolean mask, or None where SDPA's ``is_causal`` does).
    """
    if STEP_SLOT.in_step:
        config = kwargs.get("config")
        if unrouted_config_mixers(config):  # which kinds the running model routes: the step knows
            _refuse_unrouted_in_step(config)
        return None
    arguments = kwargs if not args else _SDPA_MASK_SIGNATURE.bind(*args, **kwargs).arguments
    if _may_be_packed_row(arguments):
        return None
    return sdpa_mask(*args, **kwargs)


@eager_under_compile
def _refuse_unrouted_in_step(config: Any) -> None:
    """The in-step refusal for a config that declares token mixers, against the kinds the running model
    routes (`CallNotes.routed_mixers`); read from the step, so not traced (hybrid models only)."""
    state = current_step()
    refuse_unrouted_mixers(config, IN_STEP, frozenset() if state is None else state.call_notes.routed_mixers)


def _may_be_packed_row(call: dict[str, Any]) -> bool:
    """Whether the ``sdpa_mask`` arguments `call` describe one row without an ``attention_mask``
    whose keys are exactly its queries: no cache, or a fresh one (the first forward into a
    DynamicCache, as ``model(input_ids)`` makes with ``use_cache`` on; its prefill with
    ``position_ids`` 0..n-1 is one document, i.e. causal SDPA). Sizes only, no host sync: a
    static cache's tensor ``q_offset`` is not read (its ``kv_length`` is the cache length, so
    the keys are the queries only when the queries fill the whole cache from position 0)."""
    if call.get("batch_size") != 1 or call.get("attention_mask") is not None:
        return False
    q_length = call.get("q_length")
    if q_length is None:  # transformers < 5: the queries are given by their cache positions
        cache_position = call.get("cache_position")
        q_length = cache_position.shape[0] if isinstance(cache_position, torch.Tensor) else None
    if q_length is None or call.get("kv_length") != q_length or call.get("kv_offset", 0) != 0:
        return False
    q_offset = call.get("q_offset", 0)
    return isinstance(q_offset, torch.Tensor) or q_offset == 0


def register() -> str:
    """Register the implementation (idempotent); return its name for ``attn_implementation``."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, blockdiag_cp_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, blockdiag_cp_mask)
    return ATTN_IMPLEMENTATION


