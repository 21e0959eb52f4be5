"""Verify that every token mixer of a model goes through blockdiag-cp, or refuse it by name.

Note [Every token mixer verified]
---------------------------------
blockdiag-cp keeps documents apart where tokens meet: in transformers' attention interface
(``attn_implementation="blockdiag_cp"``) and in the mixers `prepare_model` routes. A model
trains under CP only when every place where its tokens meet is one of those; the verdict
is positive (what is verified), not a list of models known to be wrong:

- *attention through the interface*: a module of the decoder whose code (its methods, and
  the functions nested in them) looks up transformers' ``ALL_ATTENTION_FUNCTIONS``, the
  registry ``"blockdiag_cp"`` is registered in (`reaches_interface`, read from the bytecode:
  no source needed);
- *routed mixers*: the instances `prepare_model` gave a per-document forward (routing.py).

Refused, naming the module (`check_model`):

- a decoder that takes no ``position_ids`` (BART's, Marian's, Pegasus's, Blenderbot's, ... when
  used as a causal LM): it numbers its tokens ``0..n-1`` over the call, so a packed row's
  documents, and under CP every shard but the first, get other positions than alone;

- an attention of its own: a decoder module named as attention (``Attention``/``Attn`` in its
  class name, the convention transformers itself keys on) that neither reaches the interface
  nor holds a module that does (Bloom's and MPT's ALiBi, XGLM, OpenAI-GPT, GPT-NeoX-Japanese,
  CPM-Ant, Falcon, GPT-Neo, Reformer, XLNet ...);
- a token mixer outside attention that is not routed (detect.py: Mamba-1, RWKV, xLSTM, ...);
- no attention through the interface and no routed mixer at all (nothing of the library
  would run: whatever mixes the tokens, it is not verified).

The check runs on the model instance where one is handed over (`prepare_model`, the loaders of
`blockdiag_cp.hf`, the Trainer mixin), and on its config's modeling module where only the
config is (`config_problem`: the mask function transformers calls before the first layer).
What the structure cannot show (an argument of the attention call the library does not apply,
a mask the model builds itself, positions computed from the call's length, a model that makes
no call at all inside a step) is refused at run time, in hf/interface.py and step/slot.py.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..errors import ModelRefusal
from ..step.slot import STEP_SLOT
from .detect import UnroutedMixer, decoder_of, find_unrouted_mixers, refuse_unrouted_mixers, unrouted_reason
from .marks import ROUTED_KIND

#: the name transformers' attention modules look their attention function up in
INTERFACE_NAME = "ALL_ATTENTION_FUNCTIONS"
#: modules whose classes are bases of every model, not attention (their methods read the registry to set it)
LIBRARY_BASES = frozenset({"transformers.modeling_utils", "builtins"})
#: words of module class names that say "attention" (transformers' own heuristic keys on ``Attention``)
ATTENTION_WORDS = ("Attention", "Attn")
#: what a refused model can do instead
ADVICE = (
    "Models whose every token mixer is softmax attention through attn_implementation (Llama, Qwen2/3, Mistral, "
    "Gemma, GPT-NeoX, gpt-oss, ... : docs/models.md lists each transformers causal LM) train under CP, and hybrids "
    "whose mixers blockdiag_cp.hf.prepare_model routes. Train this model without CP, on unpacked rows."
)


@dataclass(frozen=True)
class ModelCheck:
    """What `check_model` found in a model's decoder.

    Attributes:
        model: the model's class name.
        attention: module paths whose attention reaches the interface.
        routed: module paths of routed mixers.
        own_attention: ``"path (Class)"`` of attention modules that compute attention themselves.
        mixers: token mixers outside attention that are not routed (detect.py).
        numbers_tokens: the decoder class that takes no ``position_ids`` (it numbers its tokens
            ``0..n-1`` over the call, BART's decoders), else None.
    """

    model: str
    attention: tuple[str, ...]
    routed: tuple[str, ...]
    own_attention: tuple[str, ...]
    mixers: tuple[UnroutedMixer, ...]
    numbers_tokens: Optional[str] = None

    @property
    def reason(self) -> Optional[str]:
        """Why the model is refused, in a few words (None when every token mixer is verified)."""
        if self.own_attention:
            return f"its own attention, not transformers' attention interface ({_listed(self.own_attention)})"
        if self.mixers:
            return unrouted_reason(self.mixers)
        if self.numbers_tokens is not None:
            return numbering_reason(self.numbers_tokens)
        if not self.attention and not self.routed:
            return "no layer calls the attention interface (no attention layer the library serves)"
        return None


def check_model(model: torch.nn.Module) -> ModelCheck:
    """Every token mixer of `model`'s decoder, sorted into verified and not (Note [Every token mixer verified])."""
    decoder = decoder_of(model)
    reaching, routed, named = [], [], []
    for path, module in decoder.named_modules():
        if getattr(module, ROUTED_KIND, None) is not None:
            routed.append(path)
        elif reaches_interface(type(module)):
            reaching.append(path)
        elif attention_named(type(module)):
            named.append((path, type(module).__name__))
    own = tuple(f"{path or type(decoder).__name__} ({cls})" for path, cls in named if not _holds(path, reaching))
    numbers = type(decoder).__name__ if hasattr(decoder, "config") and not takes_positions(type(decoder)) else None
    return ModelCheck(type(model).__name__, tuple(reaching), tuple(routed), own, find_unrouted_mixers(model), numbers)


def takes_positions(decoder_class: type) -> bool:
    """Whether the decoder's forward takes ``position_ids``: without it, it numbers its tokens over the call
    (``arange`` of the call's length: under CP the shard's, on a packed row the row's), not in their documents."""
    try:
        return "position_ids" in inspect.signature(decoder_class.forward).parameters
    except (TypeError, ValueError):  # no signature to read: nothing to say
        return True


def numbering_reason(decoder: str) -> str:
    return (f"its decoder ({decoder}) takes no position_ids: it numbers the tokens of each call 0..n-1, not "
            "each token's position in its document")


def _holds(path: str, inner_paths: list[str]) -> bool:
    """Whether the module at `path` holds one of `inner_paths` (a wrapper around an interface attention)."""
    return any(not path or inner.startswith(f"{path}.") for inner in inner_paths)


def verify_model(model: torch.nn.Module, where: str) -> ModelCheck:
    """`check_model`, raising `ModelRefusal` naming the model when a token mixer is not verified."""
    check = check_model(model)
    if check.mixers and not check.own_attention:
        refuse_unrouted_mixers(model, where)  # names each layer and the mixers prepare_model routes
    if check.reason is not None:
        raise refusal(check.model, where, check.reason)
    return check


def refusal(model: str, where: str, reason: str, advice: str = ADVICE) -> ModelRefusal:
    """The `ModelRefusal` of `model` (``LlamaForCausalLM``), `where` it was found, for `reason` (noted by an
    active step: the model reached the library, Note [A step the model never reached] in step/slot.py)."""
    if STEP_SLOT.in_step and not torch.compiler.is_compiling():
        STEP_SLOT.note_reached()
    return ModelRefusal(f"blockdiag-cp: {where}, {model} is refused: {reason}. Under CP (and on a packed row) such a "
                        f"layer would see other documents' tokens or only this rank's shard: a silently wrong result. "
                        f"{advice}", reason)


def config_problem(config: Any) -> Optional[str]:
    """Why the model of `config` cannot be served, read from its modeling module's classes (None: no
    problem found). For the mask function, which sees the config and not the model: a modeling module
    with attention classes none of which reaches the interface. A module without attention classes
    (Fuyu's reuses Persimmon's) or a config of no known module passes: the model's own verification
    and the step's run-time checks remain."""
    if config is None:
        return None
    config_module = type(config).__module__
    module = sys.modules.get(config_module.replace(".configuration_", ".modeling_"))
    return None if module is None or module.__name__ == config_module else _module_problem(module)


@functools.lru_cache(maxsize=None)
def _module_problem(module: types.ModuleType) -> Optional[str]:
    classes = [c for c in vars(module).values()
               if isinstance(c, type) and issubclass(c, torch.nn.Module) and c.__module__ == module.__name__]
    named = [c.__name__ for c in classes if attention_named(c)]
    if named and not any(reaches_interface(c) for c in classes):
        return f"its own attention, not transformers' attention interface ({_listed(named)})"
    numbering = [c.__name__ for c in classes if c.__name__.endswith("Decoder") and hasattr(c, "config_class")
                 and not takes_positions(c)]
    return numbering_reason(numbering[0]) if numbering else None


@functools.lru_cache(maxsize=None)
def reaches_interface(cls: type) -> bool:
    """Whether a method of `cls` looks up `INTERFACE_NAME`: its own or inherited, not those of torch's
    ``nn.Module`` or transformers' ``PreTrainedModel`` (whose ``set_attn_implementation`` reads the registry)."""
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] == "torch" or klass.__module__ in LIBRARY_BASES:
            continue
        if any(INTERFACE_NAME in _function_names(value) for value in vars(klass).values()):
            return True
    return False


def _function_names(value: Any, depth: int = 3) -> set[str]:
    """The names the function `value` uses: through decorators (``__wrapped__``, or a function in the
    wrapper's closure) down to `depth` wrappers; empty for anything that is not a function."""
    function = getattr(value, "__func__", value)
    code = getattr(function, "__code__", None)
    if not isinstance(code, types.CodeType):
        return set()
    names = _names(code)
    if depth:
        inner = [getattr(function, "__wrapped__", None)]
        inner += [cell.cell_contents for cell in getattr(function, "__closure__", None) or () if _is_filled(cell)]
        for wrapped in inner:
            if callable(wrapped) and not isinstance(wrapped, type):
                names |= _function_names(wrapped, depth - 1)
    return names


def _is_filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def attention_named(cls: type) -> bool:
    return any(word in cls.__name__ for word in ATTENTION_WORDS)


def _names(code: types.CodeType) -> set[str]:
    """The global and attribute names `code` and the functions nested in it use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _listed(items: Any, shown: int = 2) -> str:
    items = list(items)
    return ", ".join(items[:shown]) + (f" and {len(items) - shown} more" if len(items) > shown else "")
