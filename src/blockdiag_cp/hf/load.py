"""Load a transformers model ready for block-diagonal CP: ``attn_implementation="blockdiag_cp"``
and its supported token mixers routed per document (`blockdiag_cp.mixers.prepare_model`).

    model = blockdiag_cp.hf.from_pretrained("Qwen/Qwen3.5-...", torch_dtype=torch.bfloat16)
    model = blockdiag_cp.hf.from_config(config)            # random weights, e.g. tests

Both equal loading with ``attn_implementation="blockdiag_cp"`` and then calling
``prepare_model(model)``; a model whose mixers are not supported loads, and is refused by
name when it meets a packed row or a CP step.
"""

from __future__ import annotations

from typing import Any, Optional

from ..mixers import prepare_model
from .interface import ATTN_IMPLEMENTATION


def from_pretrained(name_or_path: str, model_class: Optional[Any] = None, **kwargs: Any):
    """``model_class.from_pretrained(name_or_path, attn_implementation="blockdiag_cp", **kwargs)``,
    prepared; `model_class` defaults to ``AutoModelForCausalLM``."""
    model_class = model_class or _auto_causal_lm()
    model = model_class.from_pretrained(name_or_path, attn_implementation=_implementation(kwargs), **kwargs)
    prepare_model(model)
    return model


def from_config(config: Any, model_class: Optional[Any] = None, **kwargs: Any):
    """``model_class.from_config(config, attn_implementation="blockdiag_cp", **kwargs)``, prepared
    (a concrete model class, e.g. ``Qwen3_5ForCausalLM``, is built through its ``_from_config``)."""
    model_class = model_class or _auto_causal_lm()
    build = getattr(model_class, "from_config", None) or model_class._from_config
    model = build(config, attn_implementation=_implementation(kwargs), **kwargs)
    prepare_model(model)
    return model


def _implementation(kwargs: dict) -> str:
    asked = kwargs.pop("attn_implementation", ATTN_IMPLEMENTATION)
    if asked != ATTN_IMPLEMENTATION:
        raise ValueError(f"blockdiag_cp.hf loads models with attn_implementation={ATTN_IMPLEMENTATION!r}, "
                         f"not {asked!r}; load with transformers directly for another one")
    return asked


def _auto_causal_lm():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM
