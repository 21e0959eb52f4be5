"""Load a transformers model ready for block-diagonal CP: ``attn_implementation="blockdiag_cp"``
and its supported token mixers routed per document (`blockdiag_cp.mixers.prepare_model`).

    model = blockdiag_cp.hf.from_pretrained("Qwen/Qwen3.5-...", torch_dtype=torch.bfloat16)
    model = blockdiag_cp.hf.from_config(config)            # random weights, e.g. tests

Both equal loading with ``attn_implementation="blockdiag_cp"`` and then calling
``prepare_model(model)``, which refuses by name a model whose token mixing does not go
through the library (Note [Every token mixer verified] in mixers/verify.py). A model whose
attention is its own is refused from its config before it is built (Falcon and GPT-Neo
would otherwise fail inside transformers with ``KeyError: 'blockdiag_cp'``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

from ..mixers import prepare_model
from ..mixers.verify import config_problem, refusal
from .interface import ATTN_IMPLEMENTATION


def from_pretrained(name_or_path: str, model_class: Optional[Any] = None, **kwargs: Any):
    """``model_class.from_pretrained(name_or_path, attn_implementation="blockdiag_cp", **kwargs)``,
    prepared; `model_class` defaults to ``AutoModelForCausalLM``."""
    model_class = model_class or _auto_causal_lm()
    implementation = _implementation(kwargs)
    config = kwargs.get("config")
    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(name_or_path, **{k: kwargs[k] for k in HUB_ARGUMENTS if k in kwargs})
    where = "in blockdiag_cp.hf.from_pretrained"
    _refuse_before_building(config, where)
    with _own_attention_table(config, where):
        model = model_class.from_pretrained(name_or_path, attn_implementation=implementation, **kwargs)
    prepare_model(model, where)
    return model


def from_config(config: Any, model_class: Optional[Any] = None, **kwargs: Any):
    """``model_class.from_config(config, attn_implementation="blockdiag_cp", **kwargs)``, prepared
    (a concrete model class, e.g. ``Qwen3_5ForCausalLM``, is built through its ``_from_config``)."""
    model_class = model_class or _auto_causal_lm()
    build = getattr(model_class, "from_config", None) or model_class._from_config
    implementation = _implementation(kwargs)
    where = "in blockdiag_cp.hf.from_config"
    _refuse_before_building(config, where)
    with _own_attention_table(config, where):
        model = build(config, attn_implementation=implementation, **kwargs)
    prepare_model(model, where)
    return model


#: the arguments of ``from_pretrained`` that say where its config comes from
HUB_ARGUMENTS = ("revision", "trust_remote_code", "token", "cache_dir", "local_files_only", "subfolder",
                 "force_download", "proxies")


@contextlib.contextmanager
def _own_attention_table(config: Any, where: str) -> Iterator[None]:
    """`ModelRefusal` for a model class that picks its attention from a table of its own keyed by the
    implementation's name (Git: ``KeyError: 'blockdiag_cp'`` while it is built): its attention is its own."""
    try:
        yield
    except KeyError as exc:
        if exc.args != (ATTN_IMPLEMENTATION,):
            raise
        raise refusal(type(config).__name__.removesuffix("Config"), where,
                      "its own attention, chosen from its own table of attention classes, not transformers' "
                      "attention interface") from exc


def _refuse_before_building(config: Any, where: str) -> None:
    """`ModelRefusal` when `config`'s modeling module computes attention without the interface
    (`verify.config_problem`, its module imported first); the built model is verified by `prepare_model`."""
    import importlib

    name = type(config).__module__.replace(".configuration_", ".modeling_")
    if name != type(config).__module__:
        try:
            importlib.import_module(name)
        except ImportError:  # no such module (e.g. a config of remote code): the built model is verified
            return
    problem = config_problem(config)
    if problem is not None:
        raise refusal(type(config).__name__.removesuffix("Config"), where, problem)


def _implementation(kwargs: dict) -> str:
    asked = kwargs.pop("attn_implementation", ATTN_IMPLEMENTATION)
    if asked != ATTN_IMPLEMENTATION:
        raise ValueError(f"blockdiag_cp.hf loads models with attn_implementation={ATTN_IMPLEMENTATION!r}, "
                         f"not {asked!r}; load with transformers directly for another one")
    return asked


def _auto_causal_lm():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM
