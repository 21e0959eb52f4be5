"""The eager attention of a call: a layer's inside a step, a single row's outside one (a
one-rank step), stock SDPA otherwise.

Its attention is reached only through `step.dispatch.attend` (eagerly) or the opaque op's run
time (opaque.py), never from an entry: Note [One way down] in dispatch.py. (transformers'
interface uses two helpers beside it: `refuse_late_recompute` on its own SDPA path, `row_state`
for Llama 4's query temperature.) Per call it does only host-side checks of shapes and dtypes
(no device synchronisation) and the math: everything else was planned once per step.

    attend_eagerly       a settled `AttentionCall`, by kind: step, row or stock
    attend_active_step   the active step's call: ranks agree on a signature's first call,
                         the call is noted for Note [Late recompute], then attend_in_step
    attend_in_step       state -> exchange -> kernel on this rank's [1, H, L, D] shards
    attend_row           one packed row outside a step: planned once per forward
                         (the first layer plans, the others reuse it), then attend_in_step
    stock_sdpa           F.scaled_dot_product_attention (no window, softcap or sinks)
"""

from __future__ import annotations

import math
import warnings
import zlib
from typing import Any, Optional

import torch
import torch.nn.functional as F

from ..config import CPConfig
from ..errors import ensure
from ..kernels import CallOptions
from ..parallel.agree import agree_across_ranks
from .call import AttentionCall, LayerFeatures
from .doc_ids import block_causal_mask, resolve_doc_ids
from .slot import STEP_SLOT, CallSignature
from .state import StepState, build_step_state


def attend_eagerly(call: AttentionCall, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The eager attention of `call`, settled (``"step"``, ``"row"`` or ``"stock"``): what `dispatch.attend` runs
    when nothing traces, and the opaque op at run time (Note [One way down] in dispatch.py)."""
    if call.kind == "row":
        return attend_row(call, query, key, value)
    if call.kind == "stock":
        refuse_late_recompute(query, key, value)
        return stock_sdpa(call, query, key, value)
    ensure(call.kind == "step", f"attention call {call.kind!r} reached the eager path unsettled")
    state = STEP_SLOT.reach()  # an attention call: the model reached the step
    if state is None:  # traced inside a step, run outside every turn: a checkpointed layer recomputed late
        refuse_late_recompute(query, key, value)
        raise RuntimeError(
            "attention was recomputed in backward (activation checkpointing) after the block-diagonal CP "
            "step ended; call loss.backward() inside `with train_ctx():`"
        )
    query, key, value = autocast_inputs(query, key, value)
    return attend_active_step(state, call, query, key, value)


def attend_active_step(
    state: StepState, call: AttentionCall, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> torch.Tensor:
    """A ``"step"`` `call` inside the step `state` (the slot's active one), its inputs already in the
    autocast dtype: the ranks agree on a signature's first call, the call is noted for
    Note [Late recompute], then `attend_in_step`."""
    features = call.features
    signature = call_signature(query, key, value, features)
    if STEP_SLOT.needs_agreement(signature):
        problem = call_problem(state, query, key, value, call.enable_gqa) or features.problem(query.shape[1], query.device)
        _agree_on_call(state, signature, problem)
    step_id = STEP_SLOT.note_call(signature)
    if query.requires_grad or key.requires_grad or value.requires_grad:
        query, key, value = _MarkStepBackward.apply(step_id, query, key, value)
    return attend_in_step(state, query, key, value, dropout_p=call.dropout_p, scale=call.scale,
                          enable_gqa=call.enable_gqa, features=features)


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
    """Per-document causal attention of this rank's shards under `state`: ``query [1, H, L, Dk]``, ``key
    [1, Hk, L, Dk]``, ``value [1, Hk, L, Dv]`` -> ``[1, H, L, Dv]`` (``Dv`` may differ from ``Dk``: MLA).

    Legal inputs that a fused kernel would get wrong are normalised first (host-side
    decisions, no synchronisation): a last dimension that is not unit-stride is copied
    contiguous, and a scale <= 0 is folded into the queries. A sliding window selects
    the routing and call tables of its layer kind (`StepState.exchange_for`).
    """
    features = LayerFeatures() if features is None else features
    problem = call_problem(state, query, key, value, enable_gqa) or features.problem(query.shape[1], query.device)
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
    inputs pass unchanged, and mismatched dtypes are an error later. Float64 inputs are not
    cast (autocast leaves float64 ops alone: SDPA runs them in float64).
    """
    device_type = tensors[0].device.type
    if device_type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype not in (dtype, torch.float64) else t for t in tensors)


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
        # the sequence dimension as the distance from this rank's shard length (ranks of a grouped plan own
        # different lengths; a wrong length is this rank's `problem`, raised on every rank below)
        shapes = [d - (state.local_len if i == 2 and len(shape) == 4 else 0)
                  for shape in signature.shapes for i, d in enumerate((*shape, *(-1,) * (4 - len(shape)))[:4])]
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
    """Raise if this call, outside every turn, must not run on this rank's shard alone: steps are in flight
    (Note [Attention outside every turn] in step/slot.py), or it is a checkpointed CP layer recomputed in
    backward after its step's ``train_ctx()`` exited (Note [Late recompute]).

    Such a call would silently compute unsharded, unmasked attention. Nothing while torch.compile
    traces (the slot is host state): a compiled call that may be one is the opaque op, whose run
    checks (Note [One way down] in dispatch.py).
    """
    if torch.compiler.is_compiling():
        return
    in_backward = torch._C._current_graph_task_id() != -1
    problem = STEP_SLOT.outside_turns(call_signature(query, key, value), in_backward)
    if problem is not None:
        raise RuntimeError(problem)


def call_problem(state: StepState, query, key, value, enable_gqa: bool) -> Optional[ValueError]:
    """The `ValueError` this call deserves (None if q/k/v are this rank's ``[1, H, L, Dk]``, ``[1, Hk, L, Dk]``
    and ``[1, Hk, L, Dv]`` shards)."""
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
    if key.shape[:-1] != value.shape[:-1] or value.shape[-1] < 1:
        return ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have the same batch, heads "
                          "and length (the value head dim may differ from the key's)")
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


def row_doc_ids(
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


def row_state(query: torch.Tensor, attention_mask, position_ids, cu_seqlens, window) -> StepState:
    """The one-rank step state of a single row outside a step (its packed documents, or one),
    planned once per forward (`StepSlot.implicit_state`: the first layer plans, the others reuse it)."""
    S = query.shape[2]

    def plan() -> StepState:
        doc_ids = row_doc_ids(S, query.device, position_ids, cu_seqlens, attention_mask, window)
        return build_step_state(doc_ids, 1, 0, None, CPConfig(), query.device)

    return STEP_SLOT.implicit_state((position_ids, cu_seqlens, attention_mask), (S, query.device, window), plan)


def attend_row(call: AttentionCall, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A ``"row"`` `call`: per-document attention of one row outside a step, whose keys are its queries:
    ``query [1, H, S, Dk]``, ``key [1, Hk, S, Dk]``, ``value [1, Hk, S, Dv]`` -> ``[1, H, S, Dv]``. Its documents
    come from the call's ``cu_seq_lens``, else its ``position_ids`` ``[1, S]`` that restart, else one document, and
    its padding from a ``[1, 1, S, S]`` ``attn_mask`` (`row_doc_ids`). A call `refused_if_packed` raises that
    refusal on a row of several documents."""
    refuse_late_recompute(query, key, value)
    features = call.features
    local = row_state(query, call.attn_mask, call.position_ids, call.cu_seq_lens, features.sliding_window)
    if call.refused_if_packed is not None and int((local.geometry.doc_ids.unique() != 0).sum()) > 1:
        raise call.refused_if_packed
    query, key, value = autocast_inputs(query, key, value)
    return attend_in_step(local, query, key, value, dropout_p=call.dropout_p, scale=call.scale,
                          enable_gqa=call.enable_gqa, features=features)


def stock_sdpa(call: AttentionCall, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Outside a step: `F.scaled_dot_product_attention` itself, with the call's mask and causality (it has no
    window, softcap or sinks: refused)."""
    call.features.refuse_outside_a_step()
    return F.scaled_dot_product_attention(query, key, value, attn_mask=call.attn_mask, dropout_p=call.dropout_p,
                                          is_causal=call.is_causal, scale=call.scale, enable_gqa=call.enable_gqa)
