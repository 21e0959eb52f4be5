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
- Inside a step and on a packed row, anything else the model hands its attention is refused
  by name (`ModelRefusal`) rather than dropped: an ``attention_mask`` the library did not build
  (Doge's learned mask), an argument it does not apply (``position_bias``, ``indices``, ...), a
  model whose attention does not call this interface at all (the mask function, called before
  the first layer, checks the config's model), and Llama 4's query temperature from positions in
  the call (applied per document once `prepare_model` ran: mixers/temperature.py).

Note [Rows whose layers are not handed positions]
---------------------------------------------------
The documents of a packed row come from the layer's ``cu_seq_lens_q`` or ``position_ids``. Some
models do not hand their attention either (Llama 4, GPT-BigCode, CTRL, Persimmon, Whisper, ...).
A prepared model lends its attention modules the model call's marks (Note [Routed token
mixers]). Without it, transformers' mask function, called before the first layer with the whole
row's positions, marks the documents when the model hands it the positions (Llama 4, Whisper; not
CTRL or GPT-BigCode): `blockdiag_cp_mask` reads them from that function (a token starts a document
where it may not see the token before it: O(S), no S x S mask), notes them for the config
(`StepSlot.note_row_marks`, replaced by the next forward's note), and a layer handed no marks takes
them from there. A mask that lets a token see a later one (an encoder's, a bidirectional overlay)
is transformers' own, built for real: a layer that uses it is refused, inside a step (a mask the
step did not build) and on the row (not causal within its documents). An unprepared
model whose positions reach neither is attended as one document outside a step (inside a step the
documents come from the step).
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from transformers.utils.generic import TransformersKwargs

from ..eager import eager_under_compile
from ..mixers import refuse_unrouted_mixers, unrouted_config_mixers
from ..mixers.detect import unrouted_refusal
from ..mixers.routing import MODEL_CALL, PREPARED_KINDS
from ..mixers.temperature import IMPLEMENTATION, document_positions, pending_temperature, tunes_queries
from ..mixers.verify import config_problem, refusal
from ..step.attend import refuse_late_recompute, row_state
from ..step.call import AttentionCall, LayerFeatures
from ..step.dispatch import attend
from ..step.slot import STEP_SLOT, current_step

ATTN_IMPLEMENTATION = IMPLEMENTATION  # "blockdiag_cp"
#: arguments of an attention call the library applies, or that do not change attention's result (transformers'
#: own per-call keyword arguments: ``num_items_in_batch``, ``output_*``, ``seq_idx``, the varlen ones)
KNOWN_ARGUMENTS = frozenset(TransformersKwargs.__annotations__) | {
    "sliding_window", "softcap", "s_aux", "use_cache", "logits_to_keep", "cache_position", "shift_labels", "return_dict"}
#: when the in-step refusal of unrouted token mixers runs, for its message
IN_STEP = "inside a CP step"
ON_A_ROW = "on a packed row outside a CP step"
ON_A_PACKED_ROW = "on a packed row (several documents) outside a CP step"
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


def _own_mask_on_a_row(query: torch.Tensor, key: torch.Tensor, attention_mask: Any) -> bool:
    """One row whose keys are its queries, with a mask transformers' mask function cannot have made (it makes
    ``[1, 1, S, S]`` or None there): the model built it (Doge's ``[1, H, S, S]``) on a row the mask function
    left to the attention."""
    S = query.shape[2]
    return (query.shape[0] == 1 and key.shape[2] == S and isinstance(attention_mask, torch.Tensor)
            and attention_mask.shape != (1, 1, S, S))


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

    Inside a step: block-diagonal CP attention (a ``"step"`` call). Outside: one row whose keys
    are its queries (`_one_row`) gets per-document attention (a ``"row"`` call); anything else is
    transformers' own ``sdpa_attention_forward`` with the mask transformers built
    (`attention_mask`, from ``blockdiag_cp_mask``), softcap and sinks refused. The first two only
    name their call and hand it to `step.dispatch.attend`, which alone picks the compiled op or
    the eager path (Note [One way down] in step/dispatch.py); every decision here reads shapes,
    the module and `StepSlot.in_step` only, so it traces without a break.
    """
    features = layer_features(module, kwargs)
    if STEP_SLOT.in_step:
        STEP_SLOT.note_reached()  # Note [A step the model never reached] in step/slot.py
        config = getattr(module, "config", None)
        refuse_unrouted_mixers(config, IN_STEP, getattr(module, PREPARED_KINDS, frozenset()))
        if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
            raise ValueError(
                f"{type(module).__name__} is not causal (e.g. a vision encoder); inside a CP step blockdiag_cp "
                "computes causal attention per document. Run non-causal modules before sharding, or give them "
                "another attn_implementation."
            )
        _refuse_unapplied(module, attention_mask, kwargs, IN_STEP)
        query = _tuned_in_step(module, query)
        out = attend(AttentionCall("step", features, scale=scaling, dropout_p=dropout, enable_gqa=True), query, key,
                     value)
        return out.transpose(1, 2).contiguous(), None
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    if causal and _own_mask_on_a_row(query, key, attention_mask):
        _refuse_unapplied(module, attention_mask, {}, ON_A_ROW)
    if causal and _one_row(query, key, attention_mask):
        _refuse_unapplied(module, None, kwargs, ON_A_ROW)  # its [1, 1, S, S] mask marks padding (row_doc_ids)
        out = _attend_one_row(module, query, key, value, attention_mask, dropout, scaling, features, kwargs)
        return out.transpose(1, 2).contiguous(), None
    refuse_late_recompute(query, key, value)
    _refuse_beyond_sdpa(module, kwargs)
    pending = pending_temperature(module)
    if pending is not None:  # transformers' own positions (the call's tokens after the cached ones)
        temperature, cached = pending
        query = temperature.apply(query, torch.arange(query.shape[2], device=query.device) + cached)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def _refuse_unapplied(module: torch.nn.Module, attention_mask: Any, kwargs: dict[str, Any], where: str) -> None:
    """`ModelRefusal` for what the model hands its attention that the library would not apply: an
    ``attention_mask`` of its own inside a step (the step builds none: its mask function returns None),
    an argument outside `KNOWN_ARGUMENTS`. Reads the call's arguments only: the same on every rank."""
    model = type(module).__name__
    if attention_mask is not None:
        raise refusal(model, where, "its attention gets a mask the model built itself (e.g. a learned or "
                      "dynamic mask), which the CP step would drop")
    unknown = sorted(name for name, value in kwargs.items() if value is not None and name not in KNOWN_ARGUMENTS)
    if unknown:
        raise refusal(model, where, f"its attention gets {', '.join(unknown)}, which blockdiag-cp does not apply")


def _tuned_in_step(module: torch.nn.Module, query: torch.Tensor) -> torch.Tensor:
    """`query` scaled by Llama 4's temperature at each local token's position in its document (Note [Query
    temperature by document position]); `ModelRefusal` for a module that tunes them itself (not prepared)."""
    pending = pending_temperature(module)
    if pending is not None:
        return pending[0].apply(query, _step_positions())
    if tunes_queries(module):
        raise _unprepared_temperature(module, IN_STEP)
    return query


@eager_under_compile
def _step_positions() -> torch.Tensor:
    return document_positions(current_step())


def _unprepared_temperature(module: torch.nn.Module, where: str) -> ValueError:
    return refusal(type(module).__name__, where,
                   "it scales its queries by their position in the call (attn_temperature_tuning on a NoPE layer), "
                   "not in their document",
                   "Call blockdiag_cp.hf.prepare_model(model) (or load it with blockdiag_cp.hf.from_pretrained / "
                   "from_config, or use the Trainer mixin): the tuning then uses each token's position in its "
                   "document.")


def _attend_one_row(module, query, key, value, attention_mask, dropout, scaling, features, kwargs) -> torch.Tensor:
    """The ``"row"`` call of one packed row outside a step: its marks (the layer's, else lent), the query
    temperature, and for a model with unrouted token mixers the refusal its row of several documents gets."""
    position_ids, cu_seqlens = kwargs.get("position_ids"), kwargs.get("cu_seq_lens_q")
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape != (1, query.shape[2]):
        position_ids = None
    if position_ids is None and cu_seqlens is None:  # Note [Rows whose layers are not handed positions]
        position_ids, cu_seqlens = _lent_marks(module, query.shape[2], attention_mask is None)
    if pending_temperature(module) is not None or tunes_queries(module):
        query = _tuned_on_row(module, query, attention_mask, position_ids, cu_seqlens, features.sliding_window)
    config, routed = getattr(module, "config", None), getattr(module, PREPARED_KINDS, frozenset())
    refused = _packed_row_refusal(config, routed) if unrouted_config_mixers(config, routed) else None
    call = AttentionCall("row", features, scale=scaling, dropout_p=dropout, enable_gqa=True, attn_mask=attention_mask,
                         position_ids=position_ids, cu_seq_lens=cu_seqlens, refused_if_packed=refused)
    return attend(call, query, key, value)


def _lent_marks(module: torch.nn.Module, length: int, unmasked: bool) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(position_ids, cu_seqlens)`` of a row whose layer was handed neither: the model call's (a prepared
    model lends them, Note [Routed token mixers]), else, for a row the mask function left `unmasked`, the
    documents it marked."""
    call = getattr(module, MODEL_CALL, None)
    if call is not None and call.cu_seq_lens_q is not None:
        return None, call.cu_seq_lens_q
    if call is not None and isinstance(call.position_ids, torch.Tensor) and call.position_ids.shape == (1, length):
        return call.position_ids, None
    return None, STEP_SLOT.row_marks(getattr(module, "config", None), length) if unmasked else None


@eager_under_compile
def _tuned_on_row(module, query, attention_mask, position_ids, cu_seqlens, window) -> torch.Tensor:
    """`query [1, H, S, D]` scaled by Llama 4's temperature at each token's position in its document of the row
    (Note [Query temperature by document position]); `ModelRefusal` for a module that tuned them itself (not
    prepared) at positions that are not those, i.e. a row whose documents do not all start at 0."""
    positions = document_positions(row_state(query, attention_mask, position_ids, cu_seqlens, window))
    pending = pending_temperature(module)
    if pending is not None:
        return pending[0].apply(query, positions)
    if not torch.equal(positions, torch.arange(positions.numel())):
        raise _unprepared_temperature(module, ON_A_ROW)
    return query


@eager_under_compile
def _packed_row_refusal(config: Any, routed: frozenset[str]) -> ValueError:
    """The refusal of a row of several documents for a model whose token mixers outside attention are not routed
    (their state would cross document boundaries; one document is what they compute right)."""
    return unrouted_refusal(unrouted_config_mixers(config, routed), ON_A_PACKED_ROW)


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
    attention derives its documents itself (the row's, read from transformers' mask function, are
    noted for layers handed no positions). Otherwise, and for a mask function that lets a token
    see a later one, exactly ``sdpa_mask(*args, **kwargs)`` (a ``[B, 1, q_length, kv_length]``
    boolean mask, or None where SDPA's ``is_causal`` does). Before the first layer: a model whose
    attention is not served here is refused (`verify.config_problem`).
    """
    arguments = kwargs if not args else _keywords(_SDPA_MASK_SIGNATURE.bind(*args, **kwargs).arguments)
    config = arguments.get("config")
    in_step = STEP_SLOT.in_step
    if in_step:
        if unrouted_config_mixers(config):  # which kinds the running model routes: the step knows
            _refuse_unrouted_in_step(config)
        _refuse_config_model(config, IN_STEP)
    elif not _may_be_packed_row(arguments):
        return sdpa_mask(*args, **kwargs)
    else:
        _refuse_config_model(config, "on a row outside a CP step")
    bidirectional, cu_seqlens = _read_mask_function(arguments)
    if bidirectional:  # transformers' own mask, built for real: a layer that uses it is refused (not causal)
        return sdpa_mask(**{**arguments, "allow_is_causal_skip": False, "allow_is_bidirectional_skip": False})
    if not in_step and config is not None and not torch.compiler.is_compiling():
        STEP_SLOT.note_row_marks(config, arguments["q_length"], cu_seqlens)
    return None


def _keywords(bound: dict[str, Any]) -> dict[str, Any]:
    """``sdpa_mask``'s bound arguments as keywords (its ``**kwargs`` flattened)."""
    extra = bound.get("kwargs", {})
    return {**{k: v for k, v in bound.items() if k != "kwargs"}, **(extra if isinstance(extra, dict) else {})}


def _read_mask_function(call: dict[str, Any]) -> tuple[bool, Optional[torch.Tensor]]:
    """``(bidirectional, cu_seqlens)`` of the row transformers' mask function describes (Note [Rows whose layers
    are not handed positions]): whether a token may see a later one (an encoder's mask, a bidirectional overlay
    for image tokens), and the documents it marks (None: one document). O(S) calls of the function, no S x S."""
    mask_function, length = call.get("mask_function"), call.get("q_length")
    if mask_function is None or not isinstance(length, int) or length < 2 or torch.compiler.is_compiling():
        return False, None
    device = call.get("device") or "cpu"
    later = torch.arange(1, length, device=device)
    zero = torch.zeros((), dtype=torch.long, device=device)
    if bool(torch.as_tensor(mask_function(zero, zero, later - 1, later)).any()):
        return True, None
    sees_previous = torch.as_tensor(mask_function(zero, zero, later, later - 1))
    starts = torch.nonzero(~sees_previous.cpu()).flatten() + 1
    if starts.numel() == 0:
        return False, None
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long), starts, torch.tensor([length])]).to(torch.int32)
    return False, cu_seqlens.to(device)


def _refuse_config_model(config: Any, where: str) -> None:
    """`ModelRefusal` before the first layer when `config`'s model computes attention without this interface
    (`verify.config_problem`): blockdiag_cp would build it no mask and its own attention would run unmasked."""
    if config is None or torch.compiler.is_compiling():
        return
    problem = config_problem(config)
    if problem is not None:
        model = type(config).__name__.removesuffix("Config") or type(config).__name__
        raise refusal(model, where, problem)


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


