"""Find the token mixers of a model that do not go through the attention interface.

Note [Detecting unrouted token mixers]
--------------------------------------
Detection reads the model's own structure, not a list of model names, so an unknown
hybrid is caught too. Three signs, each enough:

- the config's layer-type list (``layer_types``, ``layers_block_type``,
  ``block_types``) names a kind that is neither attention the library routes
  (`ROUTED_LAYER_TYPES`) nor a per-token block (`PER_TOKEN_LAYER_TYPES`):
  ``linear_attention``, ``conv``, ``mamba``, ``hybrid``, ``recurrent``, and also
  attention the library does not reproduce per document (``chunked_attention``,
  ``indexed_attention``: their masks or key selection live outside the interface);
- without such a list, the config carries state-space or convolution sizes
  (`MIXER_CONFIG_PREFIXES`: Falcon-H1's ``mamba_d_state``, Mamba2's ``state_size``, ...);
- in the decoder's modules (the vision and audio towers run before sharding and are not
  searched): an ``nn.Conv1d`` (a convolution over the sequence), a module owning an
  ``A_log`` or ``dt_bias`` parameter (the decay of a state-space or delta-rule
  recurrence), or a class named after a recurrent mechanism (`MIXER_CLASS_WORDS`).

A config with a layer-type list is trusted over its size fields: LFM2 configs carry
``conv_L_cache`` even when every layer is attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from ..errors import ModelRefusal
from ..step.slot import STEP_SLOT
from .marks import PREPARED_KINDS, ROUTED_KIND, STATE_SPACE

#: layer kinds whose token mixing is attention that blockdiag-cp computes per document
ROUTED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "attention"})
#: layer kinds that act on each token alone (feed-forward blocks in a layer-type list)
PER_TOKEN_LAYER_TYPES = frozenset({"mlp", "moe", "dense", "sparse", "ffn"})
#: config fields that list each layer's kind
LAYER_TYPE_FIELDS = ("layer_types", "layers_block_type", "block_types")
#: config field prefixes (lower case) that size a state-space scan or a sequence convolution
MIXER_CONFIG_PREFIXES = ("mamba", "ssm_", "state_size", "conv_kernel", "conv_l_cache", "conv1d", "linear_conv", "d_conv")
#: parameters that only recurrences own: the log-decay and the step bias of Mamba and gated delta rules
RECURRENCE_PARAMETERS = ("A_log", "dt_bias")
#: words in module class names that name a recurrent or convolutional token mixer
MIXER_CLASS_WORDS = ("Mamba", "DeltaNet", "GatedDelta", "ShortConv", "Rwkv", "RWKV", "Recurrent", "LinearAttention",
                     "LightningAttention", "Retention", "Hyena", "LSTM")


@dataclass(frozen=True)
class UnroutedMixer:
    """One token mixer outside the attention interface.

    Attributes:
        where: a module path (``model.layers.0.linear_attn``) or a config field
            (``config.layer_types[0]``).
        kind: the module's class name or the layer kind (``linear_attention``).
        why: what shows it mixes tokens.
    """

    where: str
    kind: str
    why: str

    def describe(self) -> str:
        return f"{self.kind} at {self.where} ({self.why})"


def unrouted_config_mixers(config: Any, routed: frozenset[str] = frozenset()) -> tuple[UnroutedMixer, ...]:
    """The token mixers a (text) config declares that the library does not route (Note [Detecting ...]);
    `routed`: layer kinds the model's prepared mixers serve (`routing.prepare_model`).

    Reads the config's attributes only (no copy), so it is cheap enough for every attention call.
    """
    if config is None:
        return ()
    text_config = getattr(config, "get_text_config", None)
    if callable(text_config):
        config = text_config() or config
    fields = vars(config) if hasattr(config, "__dict__") else {}
    listed = [name for name in LAYER_TYPE_FIELDS if isinstance(fields.get(name), (list, tuple))]
    if listed:
        return tuple(mixer for name in listed for mixer in _unrouted_layer_kinds(name, fields[name])
                     if mixer.kind not in routed)
    sizes = [name for name, value in fields.items() if value is not None and name.lower().startswith(MIXER_CONFIG_PREFIXES)]
    if not sizes:
        return ()
    if STATE_SPACE in routed:
        return ()
    shown = ", ".join(sizes[:3]) + (", ..." if len(sizes) > 3 else "")
    why = f"{type(config).__name__} sizes a state-space scan or a sequence convolution"
    return (UnroutedMixer(f"config.{shown}", STATE_SPACE, why),)


def _unrouted_layer_kinds(field: str, kinds: Any) -> tuple[UnroutedMixer, ...]:
    """One entry per layer kind of `field` that is neither routed attention nor per-token."""
    layers: dict[str, list[int]] = {}
    for i, kind in enumerate(kinds):
        if str(kind) not in ROUTED_LAYER_TYPES | PER_TOKEN_LAYER_TYPES:
            layers.setdefault(str(kind), []).append(i)
    return tuple(
        UnroutedMixer(f"config.{field}{indices}", kind, "a layer kind that does not mix tokens through the attention interface")
        for kind, indices in layers.items()
    )


def find_unrouted_mixers(model: torch.nn.Module) -> tuple[UnroutedMixer, ...]:
    """Every token mixer of `model` outside the attention interface: its config's and its decoder modules',
    less those `prepare_model` routed. A flagged or routed module's own submodules are not searched."""
    routed = getattr(model, PREPARED_KINDS, frozenset())
    return unrouted_config_mixers(getattr(model, "config", None), routed) + tuple(_module_mixers(decoder_of(model)))


def refuse_unrouted_mixers(model_or_config: Any, where: str, routed: frozenset[str] = frozenset()) -> None:
    """`ModelRefusal` (a `ValueError`) naming the model's unrouted token mixers, if it has any.

    Args:
        model_or_config: an ``nn.Module`` (config and modules are read) or a config.
        where: when the check runs, for the message ("inside a CP step", ...).
        routed: with a config, the layer kinds the running model routes (`CallNotes.routed_mixers`).
    """
    if isinstance(model_or_config, torch.nn.Module):
        found = find_unrouted_mixers(model_or_config)
    else:
        found = unrouted_config_mixers(model_or_config, routed)
    if not found:
        return
    if STEP_SLOT.in_step and not torch.compiler.is_compiling():
        STEP_SLOT.note_reached()  # the model reached the library (Note [A step the model never reached])
    raise unrouted_refusal(found, where)


def unrouted_refusal(found: tuple[UnroutedMixer, ...], where: str) -> ModelRefusal:
    """The `ModelRefusal` naming the unrouted token mixers `found` (`where`: as for `refuse_unrouted_mixers`),
    built, not raised."""
    return ModelRefusal(_unrouted_message(found, where), unrouted_reason(found))


def unrouted_reason(found: tuple[UnroutedMixer, ...]) -> str:
    """The refusal of `found` in a few words: the kinds of mixer, layers first."""
    kinds = list(dict.fromkeys(m.kind for m in sorted(found, key=lambda m: m.where.startswith("config."))))
    return "token mixers outside attention (" + ", ".join(kinds[:3]) + (", ..." if len(kinds) > 3 else "") + ")"


def _unrouted_message(found: tuple[UnroutedMixer, ...], where: str) -> str:
    routable = ("LFM2's short convolutions, the Gated DeltaNet of Qwen3-Next and Qwen3.5, and the Mamba2 mixers "
                "of Nemotron-H, Bamba, Granite-4 hybrid and Falcon-H1")
    listed = "; ".join(m.describe() for m in found[:3]) + (f"; and {len(found) - 3} more" if len(found) > 3 else "")
    return (
        f"blockdiag-cp: {where}, this model mixes tokens outside the attention interface: {listed}. Such layers "
        "(gated delta rules, Mamba/state-space scans, short convolutions, recurrences, sparse or chunked attention) "
        "would carry their state and convolution window across document boundaries of a packed row, and under CP "
        "would start from an empty state on every rank: a silently wrong result, so it is refused. Supported: "
        "models whose every token mixer is softmax attention reached through attn_implementation (full or "
        "sliding-window, with softcapping or sinks: Llama, Qwen2/3, Mistral, Gemma 2/3, gpt-oss and their VLMs), "
        f"and, after blockdiag_cp.hf.prepare_model(model) (the Trainer mixin calls it), {routable}. Otherwise train this "
        "model on unpacked rows without CP."
    )


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The language part of `model` (transformers' ``get_decoder()``, when it is a model with a config: ModernBERT's
    decoder is its head), else the whole model."""
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        try:
            decoder = get_decoder()
        except (AttributeError, NotImplementedError, ValueError):
            decoder = None
        if isinstance(decoder, torch.nn.Module) and getattr(decoder, "config", None) is not None:
            return decoder
    return model


def _module_mixers(root: torch.nn.Module) -> Iterator[UnroutedMixer]:
    flagged: list[str] = []
    for name, module in root.named_modules():
        if any(name.startswith(f"{parent}.") for parent in flagged):
            continue
        if getattr(module, ROUTED_KIND, None) is not None:
            flagged.append(name)  # routed (routing.py): it and its submodules keep documents apart
            continue
        why = _mixer_sign(module, container=not name)
        if why is not None:
            flagged.append(name)
            yield UnroutedMixer(name or type(root).__name__, type(module).__name__, why)


def _mixer_sign(module: torch.nn.Module, container: bool = False) -> Optional[str]:
    """Why `module` mixes tokens outside attention, or None. A `container` (the decoder itself) and a
    normalisation (``MambaRMSNorm``) are not judged by their class names: they hold mixers, or act per token."""
    if isinstance(module, torch.nn.Conv1d):
        return "a Conv1d over the sequence"
    owned = [p for p in RECURRENCE_PARAMETERS if p in module._parameters]
    if owned:
        return f"owns {owned[0]}: the decay of a state-space or delta-rule recurrence"
    name = type(module).__name__
    words = [w for w in MIXER_CLASS_WORDS if w in name]
    if words and not container and not name.endswith("Norm"):
        return f"a {words[0]} token mixer"
    return None
