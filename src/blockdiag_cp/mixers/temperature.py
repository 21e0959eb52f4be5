"""Llama 4's attention temperature from each token's position in its document.

Note [Query temperature by document position]
---------------------------------------------
Llama 4's NoPE layers (``use_rope`` off, ``attn_temperature_tuning`` on) scale each query
by ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1``, where transformers takes ``p``
from ``arange`` over the call's length (plus the tokens already in the cache). For one
document from its start that is the token's position in it; for a packed row it is the
position in the row, and under CP the position in this rank's shard: every query past a
document's first ``floor_scale - 1`` tokens, or after another document, gets the wrong
scale (measured: logits off 3.7e-3 at floor_scale 8192 on an 8,600-token row).

`prepare_model` gives each such attention module (per instance, no class changes) a forward
pre-hook and a forward hook. When the model runs with ``attn_implementation="blockdiag_cp"``
the pre-hook turns the module's own tuning off for the call and notes the tokens already in
the cache (as transformers reads them: ``cache.get_seq_length(layer_idx)``), and the hook
turns it back on. In between, blockdiag-cp's attention function scales the queries itself,
by the same formula (float32 scales, as transformers computes them) at each token's position
*in its document*: inside a step from the step's geometry (every local token's global
position and its document's start), on a packed row outside a step from the row's documents,
and on transformers' own path (several rows, a cache) at ``arange + cached`` as transformers
would. With another implementation the hooks do nothing: transformers' own tuning runs.

An unprepared model with the tuning on is refused by name where its positions would be wrong
(hf/interface.py): inside a step, and on a row whose documents do not start at 0.
Checkpointing re-enters the module through ``__call__``, so a recompute gets the hooks too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..eager import eager_under_compile

#: attribute set on a prepared attention module that tunes its queries: its `QueryTemperature`
TEMPERATURE = "blockdiag_cp_query_temperature"
#: attribute set for the duration of a call whose tuning blockdiag-cp applies: the tokens already cached
CACHED = "blockdiag_cp_temperature_cached"
#: the attention implementation under which the library applies the tuning (hf/interface.py registers it)
IMPLEMENTATION = "blockdiag_cp"


@dataclass(frozen=True)
class QueryTemperature:
    """Llama 4's query scale ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1`` at positions ``p``."""

    floor_scale: float
    attn_scale: float

    def scales(self, positions_L: torch.Tensor) -> torch.Tensor:
        """``[L]`` float32 scales at the integer positions ``positions_L [L]`` (as transformers computes them)."""
        return torch.log1p(torch.floor((positions_L.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0

    def apply(self, query_BHLD: torch.Tensor, positions_L: torch.Tensor) -> torch.Tensor:
        """``query [B, H, L, D]`` scaled per token at ``positions_L [L]``, in the query's dtype."""
        scales = self.scales(positions_L.to(query_BHLD.device)).view(1, 1, -1, 1)
        return (query_BHLD * scales).to(query_BHLD.dtype)


def tunes_queries(module: torch.nn.Module) -> bool:
    """Whether transformers scales this module's queries by their position in the call (Llama 4's NoPE layers:
    its own condition, ``attn_temperature_tuning and not use_rope``; ``use_rope`` is the config's 0 or 1)."""
    return bool(getattr(module, "attn_temperature_tuning", False)) and not getattr(module, "use_rope", True)


def install_temperature(module: torch.nn.Module) -> bool:
    """Give `module` the hooks of Note [Query temperature by document position] (idempotent); whether it tunes."""
    if getattr(module, TEMPERATURE, None) is not None:
        return True
    if not tunes_queries(module):
        return False
    setattr(module, TEMPERATURE, QueryTemperature(float(module.floor_scale), float(module.attn_scale)))
    setattr(module, CACHED, None)
    module.register_forward_pre_hook(_take_over, with_kwargs=True)
    module.register_forward_hook(_give_back, always_call=True)
    return True


def pending_temperature(module: torch.nn.Module) -> Optional[tuple[QueryTemperature, int]]:
    """``(temperature, tokens already cached)`` when the library applies `module`'s tuning in this call, else None."""
    cached = getattr(module, CACHED, None)
    return None if cached is None else (getattr(module, TEMPERATURE), cached)


@eager_under_compile  # host work on the module's attributes: not traced
def _take_over(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    config = getattr(module, "config", None)
    if getattr(config, "_attn_implementation", None) != IMPLEMENTATION:
        return
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    cached = cache.get_seq_length(module.layer_idx) if cache is not None else 0
    module.attn_temperature_tuning = False  # this call's tuning is the attention function's
    setattr(module, CACHED, int(cached))


@eager_under_compile  # host work on the module's attributes: not traced
def _give_back(module: torch.nn.Module, *_: Any) -> None:
    if getattr(module, CACHED, None) is not None:
        setattr(module, CACHED, None)
        module.attn_temperature_tuning = True


def document_positions(state: Any) -> torch.Tensor:
    """``[L]`` int64: each of this rank's tokens' position in its document under the step `state`
    (its global position less its document's start; padding gets its run's offset, unused)."""
    positions = state.positions
    return positions - state.geometry.doc_start_of(positions)
