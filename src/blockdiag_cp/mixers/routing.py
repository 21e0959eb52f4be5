"""Route a hybrid model's token mixers through the library: `prepare_model`.

Note [Routed token mixers]
--------------------------
transformers' mixer layers call module-level functions that only the ``kernels`` package
can replace, and they never see ``position_ids``. So `prepare_model` installs, per
*instance* (no class and no transformers global changes):

- on each supported mixer, its own forward (an instance attribute). It computes the layer
  per document (`per_document_state`):
  inside a CP step across ranks, with the step's plans (`conv.conv_plan`,
  `recurrence.piece_schedule`); outside a step on one packed row (several documents, or
  padding, marked as the attention layers read them: ``position_ids`` that restart,
  ``cu_seq_lens_q``, a ``[1, S]`` padding mask) with the same plans at world 1. Anything
  else (several rows, one document, decoding from a cache) is the layer's own forward.
- on each decoder layer holding one, a forward pre-hook that hands the layer's
  ``position_ids`` and ``cu_seq_lens_q`` to its mixer for the call (`RowMarks`), and a
  forward hook that takes them back. transformers' checkpointing re-enters the layer
  through ``__call__``, so a recompute gets them again.
- on the model, a forward pre-hook telling the active step which layer kinds are routed
  (`CallNotes.routed_mixers`), and on every submodule the kinds (`PREPARED_KINDS`), which the
  attention layers read before refusing a packed row. Outside a step the same hook lends the
  call's marks to the attention modules too (`MODEL_CALL`): a model whose decoder layers do not
  hand their attention ``position_ids`` (CTRL, GPT-BigCode) still attends a packed row per document.

A packed row's forward does not fill a cache's convolution or recurrent states (continuing
several documents from one cache has no meaning): the cache is marked, and a later call
that would continue from it is a `ValueError`. A single document's forward is the layer's
own and fills the cache as usual.

Supported (`ROUTED_MIXERS`): LFM2's short convolutions; the Gated DeltaNet of Qwen3-Next
and Qwen3.5 (conv, then the gated delta rule); the Mamba2 mixers of Nemotron-H, Bamba,
Granite-4 hybrid and Falcon-H1 (conv, then the state-space scan). Everything else stays
refused (`detect.py`).
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any, Callable, Mapping, NamedTuple, Optional

import torch
import torch.nn.functional as F

from ..step.doc_ids import position_breaks
from .conv import conv_plan
from .marks import PREPARED_KINDS, ROUTED_KIND, STATE_SPACE
from .recurrence import piece_schedule
from ..step.slot import STEP_SLOT, current_step
from ..eager import eager_under_compile

#: attribute a decoder layer's pre-hook sets on its routed mixer for one call (`RowMarks`)
ROW_MARKS = "blockdiag_cp_row_marks"
#: attribute set on a decoder layer whose hooks lend its mixers their `RowMarks`
LENDS_MARKS = "blockdiag_cp_lends_row_marks"
#: attribute of a prepared model: the decoder layers that lend their mixers `RowMarks`
LENDERS = "blockdiag_cp_lenders"
#: attribute of those layers while the model runs outside a step: the model call's `RowMarks`
MODEL_CALL = "blockdiag_cp_model_call"
#: attribute of a prepared model: its modules whose attention reaches the interface (they get `MODEL_CALL` too)
ATTENDERS = "blockdiag_cp_attenders"
#: attribute of a prepared model: its `verify.ModelCheck` (set by `prepare_model` once the model is verified)
PREPARED = "blockdiag_cp_prepared"


class RowMarks(NamedTuple):
    """What marks the documents of the row a decoder layer is called on (outside a step)."""

    position_ids: Optional[torch.Tensor]
    cu_seq_lens_q: Optional[torch.Tensor]


def per_document_state(module: torch.nn.Module, hidden_states: torch.Tensor, attention_mask: Any, kwargs: dict,
                       cache: Any = None):
    """The `StepState` to run `module` per document with, or None (run its own forward).

    Inside a step: the step's. Outside: a world-1 state for one row of several documents, or of
    one document with padding when no `cache` is given (`hidden_states [1, S, E]`; documents
    from the layer's `RowMarks`, the mixer's ``cu_seq_lens_q`` and a ``[1, S]``
    `attention_mask`), planned once per forward. With a cache, one (left-padded) prompt is the
    layer's own forward, which fills the cache for decoding.
    """
    state = current_step()
    if state is not None:
        STEP_SLOT.note_reached()  # Note [A step the model never reached] in step/slot.py
        return state
    problem = STEP_SLOT.outside_turns(None, False)  # Note [Attention outside every turn] in step/slot.py
    if problem is not None:
        raise RuntimeError(problem)
    if hidden_states.shape[0] != 1:
        return None
    marks = getattr(module, ROW_MARKS, None) or RowMarks(None, None)
    cu = kwargs.get("cu_seq_lens_q", marks.cu_seq_lens_q)
    mask = attention_mask if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 else None
    if marks.position_ids is None and cu is None and mask is None:
        return None
    S, device = hidden_states.shape[1], hidden_states.device

    def plan():
        from ..config import CPConfig
        from ..step.doc_ids import resolve_doc_ids
        from ..step.state import build_step_state

        found = {"position_ids": marks.position_ids, "cu_seq_lens_q": cu, "attention_mask": mask}
        doc_ids = resolve_doc_ids({k: v for k, v in found.items() if v is not None}, S, device, 1)[0]
        documents = int((doc_ids.unique() != 0).sum())
        if documents <= 1 and (cached or bool((doc_ids != 0).all())):
            return None  # one document: the layer's own forward is exact (and fills a cache)
        return build_step_state(doc_ids, 1, 0, None, CPConfig(), device)

    cached = cache is not None
    return STEP_SLOT.implicit_state((marks.position_ids, cu, mask), ("mixer rows", S, device, cached), plan)


#: attribute set on a cache a packed row's forward ran with: its mixer states belong to no document
PACKED_CACHE = "blockdiag_cp_packed_row"
#: attribute set on a routed mixer instance: its own (transformers') forward
OWN_FORWARD = "blockdiag_cp_own_forward"


def _route(per_document: Callable) -> Callable:
    """Decorator: `per_document(module, state, hidden_states)` runs when `per_document_state` gives a
    state, else the instance's own forward (kept as `OWN_FORWARD`). It plans on the host, so under
    torch.compile it runs eagerly (`eager_under_compile`: a graph break around each routed mixer, exact)."""
    @eager_under_compile
    @functools.wraps(per_document)
    def forward(module, hidden_states, cache=None, attention_mask=None, **kwargs):
        state = per_document_state(module, hidden_states, attention_mask, kwargs, cache)
        if state is None:
            if getattr(cache, PACKED_CACHE, False):
                raise ValueError(
                    f"blockdiag-cp: this cache was filled by a forward over a packed row of several documents; "
                    f"its {type(module).__name__} holds no state of any one of them, so continuing from it would "
                    "be silently wrong. Start a new cache (or run the document alone) before generating."
                )
            return getattr(module, OWN_FORWARD)(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        if cache is not None:
            setattr(cache, PACKED_CACHE, True)  # its mixer states were not filled (Note [Routed token mixers])
        return per_document(module, state, hidden_states)
    return forward


@_route
def short_conv_forward(module: torch.nn.Module, state, hidden_states: torch.Tensor) -> torch.Tensor:
    """LFM2's ``ShortConv`` per document: ``y = out_proj(C * conv(B * x))``, ``B, C, x = in_proj(h)``;
    ``hidden_states [1, L, E]``."""
    B, C, x = module.in_proj(hidden_states[0]).chunk(3, dim=-1)  # [L, E] each
    conv = conv_plan(state, module.conv_kernel_size)(B * x, module.conv.weight[:, 0, :], module.conv.bias)
    return module.out_proj(C * conv).unsqueeze(0)


@_route
def qwen3_next_delta_forward(module: torch.nn.Module, state, hidden_states: torch.Tensor) -> torch.Tensor:
    """Qwen3-Next's Gated DeltaNet per document."""
    q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(hidden_states),
                                                           module.in_proj_ba(hidden_states))
    mixed = torch.cat([x.reshape(x.shape[1], -1) for x in (q, k, v)], dim=-1)  # [L, conv channels]
    return _gated_delta(module, state, mixed, z[0], b[0], a[0])


@_route
def qwen3_5_delta_forward(module: torch.nn.Module, state, hidden_states: torch.Tensor) -> torch.Tensor:
    """Qwen3.5's Gated DeltaNet per document."""
    h = hidden_states[0]
    z = module.in_proj_z(h).reshape(h.shape[0], -1, module.head_v_dim)
    return _gated_delta(module, state, module.in_proj_qkv(h), z, module.in_proj_b(h), module.in_proj_a(h))


def _gated_delta(module, state, mixed_LC, z_LHD, b_LH, a_LH) -> torch.Tensor:
    """The shared part of a Gated DeltaNet layer: conv and activation per document, the gated delta
    rule per document (`recurrence.piece_schedule`), the gated norm and the output projection.
    ``mixed [L, 2 key_dim + value_dim]`` (q, k, v before the conv) -> ``[1, L, hidden]``."""
    from transformers.activations import ACT2FN

    L = mixed_LC.shape[0]
    conv = conv_plan(state, module.conv_kernel_size)(mixed_LC, module.conv1d.weight[:, 0, :], module.conv1d.bias)
    q, k, v = torch.split(ACT2FN[module.activation](conv), [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    beta = b_LH.sigmoid()
    g = -module.A_log.float().exp() * F.softplus(a_LH.float() + module.dt_bias)  # as transformers computes it
    core = piece_schedule(state).gated_delta_rule(q.reshape(L, -1, module.head_k_dim), k.reshape(L, -1, module.head_k_dim),
                                                 v.reshape(L, -1, module.head_v_dim), g, beta)
    core = module.norm(core.reshape(-1, module.head_v_dim), z_LHD.reshape(-1, module.head_v_dim))
    return module.out_proj(core.reshape(1, L, -1))


@_route
def mamba2_forward(module: torch.nn.Module, state, hidden_states: torch.Tensor) -> torch.Tensor:
    """A Mamba2 mixer per document (Nemotron-H, Bamba, Granite-4 hybrid; Falcon-H1 with its
    multipliers and optional norm): in_proj -> (gate, xBC, dt); conv and activation per document;
    the scan per document (`PieceSchedule.ssd`) plus ``D x``; gated norm; out_proj."""
    h = hidden_states[0]
    dtype = h.dtype
    if hasattr(module, "ssm_in_multiplier"):
        h = h * module.ssm_in_multiplier
    projected = module.in_proj(h)
    if hasattr(module, "mup_vector"):
        projected = projected * module.mup_vector.reshape(-1)
    I, H, P = module.intermediate_size, module.num_heads, module.head_dim
    GN = module.n_groups * module.ssm_state_size
    gate, xBC, dt = projected.split([I, module.conv_dim, H], dim=-1)
    xBC = module.act(conv_plan(state, module.conv_kernel_size)(xBC, module.conv1d.weight[:, 0, :], module.conv1d.bias))
    x, B, C = xBC.split([I, GN, GN], dim=-1)
    L = x.shape[0]
    low, high = module.time_step_limit
    dt = torch.clamp(F.softplus(dt + module.dt_bias.to(dt.dtype)), min=low, max=high)
    A = -torch.exp(module.A_log.float())  # as transformers computes it
    groups = (L, module.n_groups, module.ssm_state_size)
    y = piece_schedule(state).ssd(x.reshape(L, H, P), dt, A, B.reshape(groups), C.reshape(groups))
    y = (y + module.D[:, None].to(y.dtype) * x.reshape(L, H, P)).reshape(1, L, I)
    if getattr(module, "mamba_rms_norm", True):
        y = module.norm(y, gate.unsqueeze(0))
    else:
        y = y * F.silu(gate.unsqueeze(0))
    return module.out_proj(y.to(dtype))


#: mixer classes the library routes: class name -> (layer kinds it serves, forward)
ROUTED_MIXERS: Mapping[str, tuple[tuple[str, ...], Callable]] = types.MappingProxyType({
    "Lfm2ShortConv": (("conv",), short_conv_forward),
    "Lfm2MoeShortConv": (("conv",), short_conv_forward),
    "Qwen3NextGatedDeltaNet": (("linear_attention",), qwen3_next_delta_forward),
    "Qwen3_5GatedDeltaNet": (("linear_attention",), qwen3_5_delta_forward),
    "Qwen3_5MoeGatedDeltaNet": (("linear_attention",), qwen3_5_delta_forward),
    "NemotronHMamba2Mixer": (("linear_attention", "mamba", STATE_SPACE), mamba2_forward),
    "BambaMixer": (("linear_attention", "mamba", STATE_SPACE), mamba2_forward),
    "GraniteMoeHybridMambaLayer": (("linear_attention", "mamba", STATE_SPACE), mamba2_forward),
    "FalconH1Mixer": (("linear_attention", "mamba", STATE_SPACE), mamba2_forward),
})


def prepare_model(model: torch.nn.Module, where: str = "in prepare_model") -> frozenset[str]:
    """Make `model` ready for packed rows and CP steps (idempotent); return the layer kinds its mixers route.

    Routes every supported token mixer per document (Note [Routed token mixers]), gives Llama 4's
    temperature-tuned attention its document positions (Note [Query temperature by document position]
    in temperature.py), then verifies that every token mixer goes through the library and refuses the
    model by name (`ModelRefusal`, `where` it was found) otherwise (Note [Every token mixer verified]
    in verify.py). The Trainer mixin and `blockdiag_cp.hf.from_pretrained` / `from_config` call it.
    """
    from .detect import decoder_of
    from .temperature import install_temperature
    from .verify import verify_model

    kinds: set[str] = set()
    modules = dict(model.named_modules())
    lenders: list[torch.nn.Module] = list(getattr(model, LENDERS, ()))
    for name, module in modules.items():
        install_temperature(module)
        routed = ROUTED_MIXERS.get(type(module).__name__)
        if routed is None:
            continue
        served, forward = routed
        if getattr(module, ROUTED_KIND, None) is None:
            setattr(module, OWN_FORWARD, module.forward)
            module.forward = types.MethodType(forward, module)
            setattr(module, ROUTED_KIND, served)
            lenders.append(modules.get(name.rpartition(".")[0], model))
            _hand_marks_from(lenders[-1])
        kinds.update(served)
    if getattr(model, LENDERS, None) is None:  # the model's hooks, once
        if kinds:
            for module in modules.values():
                setattr(module, PREPARED_KINDS, frozenset(kinds))
        setattr(model, LENDERS, tuple(lenders))
        model.register_forward_pre_hook(_note_the_call, with_kwargs=True)
        model.register_forward_hook(_end_the_call, always_call=True)
    check = verify_model(model, where)
    setattr(model, PREPARED, check)
    decoder = dict(decoder_of(model).named_modules())
    setattr(model, ATTENDERS, tuple(decoder[path] for path in check.attention))
    return frozenset(kinds)


def _hand_marks_from(layer: torch.nn.Module) -> None:
    """Hooks on `layer` that lend its routed mixers the call's `RowMarks` (Note [Routed token mixers]).
    Module-level functions, not closures: a deep copy of the model keeps hooks that act on its own mixers."""
    if getattr(layer, LENDS_MARKS, False):
        return
    setattr(layer, LENDS_MARKS, True)
    layer.register_forward_pre_hook(_lend_marks, with_kwargs=True)
    layer.register_forward_hook(_take_marks_back, always_call=True)


@eager_under_compile  # host work on the call's marks: not traced
def _lend_marks(layer: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    if len(args) > 1:  # positional arguments past hidden_states: name them (transformers passes keywords)
        kwargs = inspect.signature(layer.forward).bind_partial(*args, **kwargs).arguments
        kwargs = {**kwargs.get("kwargs", {}), **kwargs} if isinstance(kwargs.get("kwargs"), dict) else kwargs
    position_ids = kwargs.get("position_ids")
    marks = RowMarks(position_ids if isinstance(position_ids, torch.Tensor) else None, kwargs.get("cu_seq_lens_q"))
    call = getattr(layer, MODEL_CALL, None)
    if marks == (None, None) and current_step() is None and _packed(call):
        marks = call  # a layer not handed the positions (Granite-4 hybrid): the model call's are the row's
    _set_marks(layer, marks)


def _packed(call: Optional[RowMarks]) -> bool:
    """Whether the model's call marks one packed row by its ``position_ids`` alone."""
    if call is None or call.cu_seq_lens_q is not None or not isinstance(call.position_ids, torch.Tensor):
        return False
    ids = call.position_ids
    return ids.dim() == 2 and ids.shape[0] == 1 and bool(position_breaks(ids).any())


@eager_under_compile  # host work on the call's marks: not traced
def _take_marks_back(layer: torch.nn.Module, *_: Any) -> None:
    _set_marks(layer, None)


def _set_marks(layer: torch.nn.Module, marks: Optional[RowMarks]) -> None:
    for child in layer.children():
        if getattr(child, ROUTED_KIND, None) is not None:
            setattr(child, ROW_MARKS, marks)


@eager_under_compile  # host work on the call's marks: not traced
def _note_the_call(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of a prepared model. Inside a step: the model must still run the library's
    attention (else `ModelRefusal`, before its first layer), and the step learns which mixer kinds it
    routes. Outside: its lending layers keep the call's marks (`MODEL_CALL`), so that one not handed
    them can refuse a packed row (checked only there: no host sync otherwise)."""
    state = current_step()
    if state is not None:
        _refuse_another_implementation(model)
        state.call_notes.record_routed_mixers(getattr(model, PREPARED_KINDS, frozenset()))
        return
    call = RowMarks(kwargs.get("position_ids"), kwargs.get("cu_seq_lens_q"))
    for layer in (*getattr(model, LENDERS, ()), *getattr(model, ATTENDERS, ())):
        setattr(layer, MODEL_CALL, call)


def _refuse_another_implementation(model: torch.nn.Module) -> None:
    """`ModelRefusal` at step entry when the prepared model's (text) attention is not ``"blockdiag_cp"``."""
    from .temperature import IMPLEMENTATION
    from .verify import refusal

    config = getattr(model, "config", None)
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    implementation = getattr(text, "_attn_implementation", IMPLEMENTATION)
    if implementation != IMPLEMENTATION:
        raise refusal(type(model).__name__, "at the start of its forward inside a CP step",
                      f"its attention runs attn_implementation={implementation!r}, not {IMPLEMENTATION!r}",
                      f"Call model.set_attn_implementation({IMPLEMENTATION!r}) before the step.")


@eager_under_compile  # host work on the call's marks: not traced
def _end_the_call(model: torch.nn.Module, *_: Any) -> None:
    for layer in (*getattr(model, LENDERS, ()), *getattr(model, ATTENDERS, ())):
        setattr(layer, MODEL_CALL, None)
