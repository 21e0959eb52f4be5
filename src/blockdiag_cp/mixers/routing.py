"""Route a hybrid model's token mixers through the library: `prepare_model`.

Note [Routed token mixers]
--------------------------
transformers' mixer layers call module-level functions that only the ``kernels`` package
can replace, so `prepare_model` gives each supported mixer *instance* its own forward
(an instance attribute; no class and no transformers global changes). Inside a CP step
that forward computes the layer per document across ranks (`StepState.conv_plan`);
outside a step it is the layer's own forward, unchanged (generation, unpacked batches).
A forward pre-hook on the model tells the active step, before the mask function refuses
unrouted mixer kinds, which kinds this model routes (`CallNotes.routed_mixers`). Supported: LFM2's short convolutions (``Lfm2ShortConv``,
``Lfm2MoeShortConv``: layer kind ``"conv"``) and the Gated DeltaNet of Qwen3-Next and
Qwen3.5 (layer kind ``"linear_attention"``: conv, then the gated delta rule per document,
`recurrence.py`). Everything else stays refused (`detect.py`).
"""

from __future__ import annotations

import types
from typing import Any, Callable, Mapping

import torch

from ..step.slot import current_step

#: attribute set on a routed mixer instance: the layer kind it serves (``"conv"``)
ROUTED_KIND = "blockdiag_cp_mixer_kind"
#: attribute set on a prepared model: the layer kinds its mixers route
PREPARED_KINDS = "blockdiag_cp_routed_kinds"


def short_conv_forward(module: torch.nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any):
    """LFM2's ``ShortConv`` (``y = out_proj(C * conv(B * x))``, ``B, C, x = in_proj(h)``) per document
    inside a CP step; its own forward outside one. ``hidden_states [1, L, E]``."""
    state = current_step()
    if state is None:
        return module.blockdiag_cp_own_forward(hidden_states, *args, **kwargs)
    B, C, x = module.in_proj(hidden_states[0]).chunk(3, dim=-1)  # [L, E] each
    conv = state.conv_plan(module.conv_kernel_size)(B * x, module.conv.weight[:, 0, :], module.conv.bias)
    return module.out_proj(C * conv).unsqueeze(0)


def qwen3_next_delta_forward(module: torch.nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any):
    """Qwen3-Next's Gated DeltaNet per document inside a CP step (its own forward outside one)."""
    state = current_step()
    if state is None:
        return module.blockdiag_cp_own_forward(hidden_states, *args, **kwargs)
    q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(hidden_states),
                                                           module.in_proj_ba(hidden_states))
    mixed = torch.cat([x.reshape(x.shape[1], -1) for x in (q, k, v)], dim=-1)  # [L, conv channels]
    return _gated_delta_in_step(module, state, mixed, z[0], b[0], a[0])


def qwen3_5_delta_forward(module: torch.nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any):
    """Qwen3.5's Gated DeltaNet per document inside a CP step (its own forward outside one)."""
    state = current_step()
    if state is None:
        return module.blockdiag_cp_own_forward(hidden_states, *args, **kwargs)
    h = hidden_states[0]
    z = module.in_proj_z(h).reshape(h.shape[0], -1, module.head_v_dim)
    return _gated_delta_in_step(module, state, module.in_proj_qkv(h), z, module.in_proj_b(h), module.in_proj_a(h))


def _gated_delta_in_step(module, state, mixed_LC, z_LHD, b_LH, a_LH) -> torch.Tensor:
    """The shared part of a Gated DeltaNet layer: conv and activation per document, the gated delta
    rule per document (`StepState.piece_schedule`), the gated norm and the output projection.
    ``mixed [L, 2 key_dim + value_dim]`` (q, k, v before the conv) -> ``[1, L, hidden]``."""
    from transformers.activations import ACT2FN

    L = mixed_LC.shape[0]
    conv = state.conv_plan(module.conv_kernel_size)(mixed_LC, module.conv1d.weight[:, 0, :], module.conv1d.bias)
    q, k, v = torch.split(ACT2FN[module.activation](conv), [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    beta = b_LH.sigmoid()
    g = -module.A_log.float().exp() * torch.nn.functional.softplus(a_LH.float() + module.dt_bias)
    core = state.piece_schedule.gated_delta_rule(q.reshape(L, -1, module.head_k_dim), k.reshape(L, -1, module.head_k_dim),
                                                 v.reshape(L, -1, module.head_v_dim), g, beta)
    core = module.norm(core.reshape(-1, module.head_v_dim), z_LHD.reshape(-1, module.head_v_dim))
    return module.out_proj(core.reshape(1, L, -1))


#: mixer classes the library routes: class name -> (layer kind, forward)
ROUTED_MIXERS: Mapping[str, tuple[str, Callable]] = types.MappingProxyType({
    "Lfm2ShortConv": ("conv", short_conv_forward),
    "Lfm2MoeShortConv": ("conv", short_conv_forward),
    "Qwen3NextGatedDeltaNet": ("linear_attention", qwen3_next_delta_forward),
    "Qwen3_5GatedDeltaNet": ("linear_attention", qwen3_5_delta_forward),
    "Qwen3_5MoeGatedDeltaNet": ("linear_attention", qwen3_5_delta_forward),
})


def prepare_model(model: torch.nn.Module) -> frozenset[str]:
    """Route every supported token mixer of `model` (idempotent); return the layer kinds routed.

    Models without such mixers are left as they are. Call it once after loading (the Trainer
    mixin does); mixers it does not support stay refused inside a step, naming them.
    """
    kinds = set()
    for module in model.modules():
        routed = ROUTED_MIXERS.get(type(module).__name__)
        if routed is None:
            continue
        kind, forward = routed
        if getattr(module, ROUTED_KIND, None) is None:
            module.blockdiag_cp_own_forward = module.forward
            module.forward = types.MethodType(forward, module)
            setattr(module, ROUTED_KIND, kind)
        kinds.add(kind)
    if kinds and getattr(model, PREPARED_KINDS, None) is None:
        setattr(model, PREPARED_KINDS, frozenset(kinds))
        model.register_forward_pre_hook(_tell_the_step)
    return frozenset(kinds)


def _tell_the_step(model: torch.nn.Module, args: tuple) -> None:
    """Forward pre-hook of a prepared model: the active step (if any) learns which mixer kinds it routes."""
    state = current_step()
    if state is not None:
        state.call_notes.record_routed_mixers(getattr(model, PREPARED_KINDS))
