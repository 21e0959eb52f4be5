"""torchtitan's inner attention routed per document through blockdiag-cp (`route_attention`, issue #52).

Note [Routing torchtitan's attention configs]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torchtitan 0.3.0 picks a layer's attention kernel by its ``inner_attention`` config; a decoder whose
``get_attention_masks`` is torchtitan's default masks every packed row per document (causal inside a document,
nothing across), the rule `cp_blockdiag_sdpa` applies. Each config becomes a `BlockDiagCPAttention.Config`, every
one of its fields read (`ROUTED_FIELDS` lists them per config type, so a torchtitan upgrade or a subclass that
adds a field is refused by name until it is read here):

    VarlenAttention.Config.window_size   (-1, 0): causal inside the document;
                                         (W, 0): causal with a window of W keys before the query and the query
                                         itself, i.e. ``sliding_window = W + 1`` (transformers' convention, keys
                                         (q - w, q]); a right window (look-ahead, bidirectional) is refused
    FlexAttention.Config.block_size,     FlexAttention's tiling and kernel choice: they change how FlexAttention
      .kernel_options                    computes the same masked attention, not what; blockdiag-cp uses its own
                                         kernels (`CPConfig.kernel`), said once in a warning when set
    Module.Config.param_init,            carried over (the attention has no parameters; torchtitan's sharding
      .sharding_config                   rules wrap it as they would wrap the original: TP's local heads)
    ScaledDotProductAttention.Config     refused: torchtitan's SDPA is causal over the whole row, across
                                         documents, which per-document attention would silently change
    any other config type                refused by name

At run time the routed module also refuses what its caller passes and it would drop (a FlexAttention
``score_mod``, an ``out_transform``, ``is_causal``).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Optional

import torch
from torchtitan.models.common.attention import (
    BaseAttention,
    FlexAttention,
    ScaledDotProductAttention,
    VarlenAttention,
)
from torchtitan.models.common.decoder import Decoder
from torchtitan.protocols.model import ModelConfigConverter
from torchtitan.protocols.module import Module

from ..attention import cp_blockdiag_sdpa
from ..step.slot import STEP_SLOT

logger = logging.getLogger(__name__)

__all__ = (
    "ROUTED_FIELDS",
    "BlockDiagCPAttention",
    "BlockDiagCPConverter",
    "route_attention",
    "routed_inner_attention",
    "sliding_window_of",
)

#: the fields of every Module config (torchtitan's `Module.Config`): carried over to the routed config
_MODULE_FIELDS = frozenset({"param_init", "sharding_config"})
#: per inner-attention config type, every field the routing reads (Note [Routing torchtitan's attention configs])
ROUTED_FIELDS = MappingProxyType({
    VarlenAttention.Config: _MODULE_FIELDS | {"window_size"},
    FlexAttention.Config: _MODULE_FIELDS | {"block_size", "kernel_options"},
})


class BlockDiagCPAttention(Module):
    """torchtitan inner attention: per-document causal attention of this rank's shard, through `cp_blockdiag_sdpa`.

    Takes torchtitan's ``(B, L, N, H)`` layout (``B == 1``, ``L`` this rank's shard) and returns the same layout.
    torchtitan's ``attention_masks`` are not read: the step's document ids are the mask.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        sliding_window: Optional[int] = None
        """A query sees its document's keys at positions (q - sliding_window, q]; None: the whole document."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.sliding_window = config.sliding_window

    def forward(self, q_BLNH: torch.Tensor, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor, *,
                attention_masks: Any = None, scale: Optional[float] = None, enable_gqa: bool = False,
                **kwargs) -> torch.Tensor:
        if not STEP_SLOT.in_step:  # a plain bool: what torch.compile guards on (a compiled block traces this)
            raise RuntimeError(
                "BlockDiagCPAttention ran outside a blockdiag-cp step: plain attention there would let a packed "
                "row's documents attend to each other. Run the model through BlockDiagCPTrainer (its train step "
                "opens the step), or open one with make_cp_blockdiag_batch_and_ctx(...)'s train_ctx().")
        dropped = sorted(k for k, v in kwargs.items() if v is not None)
        if dropped:
            raise ValueError(f"BlockDiagCPAttention got {dropped}, which it would drop (e.g. a FlexAttention score_mod); "
                             "only per-document causal attention with a scale is routed through blockdiag-cp")
        q_BNLH, k_BNLH, v_BNLH = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        out_BNLH = cp_blockdiag_sdpa(q_BNLH, k_BNLH, v_BNLH, is_causal=True, scale=scale, enable_gqa=enable_gqa,
                                     sliding_window=self.sliding_window)
        return out_BNLH.transpose(1, 2)


def sliding_window_of(window_size: tuple[int, int]) -> Optional[int]:
    """torchtitan's varlen ``window_size=(left, right)`` as `cp_blockdiag_sdpa`'s ``sliding_window`` (None: none).

    ``(-1, 0)`` is causal attention (None); ``(W, 0)`` sees the W keys before the query and the query itself
    (flash-attention's rule ``q - W <= k <= q``), which is ``sliding_window = W + 1`` (keys ``(q - w, q]``).

    Raises:
        ValueError: a right window (``right != 0``: look-ahead or bidirectional attention) or a left one below -1.
    """
    left, right = window_size
    if right != 0:
        raise ValueError(
            f"VarlenAttention.Config.window_size={tuple(window_size)} lets a query see {right if right > 0 else 'all'} "
            "keys after it (bidirectional or look-ahead attention); blockdiag-cp routes causal attention only. "
            "Use window_size=(-1, 0) (causal) or (W, 0) (a causal sliding window)")
    if left < -1:
        raise ValueError(f"VarlenAttention.Config.window_size={tuple(window_size)}: the left window must be -1 "
                         "(unlimited) or >= 0")
    return None if left == -1 else left + 1


def routed_inner_attention(inner: Module.Config) -> BlockDiagCPAttention.Config:
    """The `BlockDiagCPAttention.Config` computing what `inner` computes per document (Note [Routing torchtitan's
    attention configs]); an already routed config is returned as it is.

    Raises:
        ValueError: `inner` is torchtitan's `ScaledDotProductAttention` (causal across documents), a config type
            not known here, or has a field the routing does not read, or a window it cannot honour.
    """
    if isinstance(inner, BlockDiagCPAttention.Config):
        return inner
    if isinstance(inner, ScaledDotProductAttention.Config):
        raise ValueError(
            "ScaledDotProductAttention.Config attends causally over the whole packed row, across its documents "
            "(torchtitan's own rule for it); blockdiag-cp attends per document and would silently change that. "
            "Use torchtitan's flex or varlen attention (attn_backend='flex' / 'varlen'), which mask per document")
    routed_type = next((t for t in type(inner).__mro__ if t in ROUTED_FIELDS), None)
    if routed_type is None:
        raise ValueError(f"{type(inner).__qualname__} is not an inner attention blockdiag-cp can route; routed: "
                         f"{sorted(t.__qualname__ for t in ROUTED_FIELDS)}")
    unread = sorted({f.name for f in dataclasses.fields(inner)} - ROUTED_FIELDS[routed_type])
    if unread:
        raise ValueError(f"{type(inner).__qualname__} has the field(s) {unread}, which blockdiag-cp does not read; "
                         "routing it would drop them")
    window = sliding_window_of(inner.window_size) if isinstance(inner, VarlenAttention.Config) else None
    if isinstance(inner, FlexAttention.Config):
        _say_flex_tiling_is_not_used(inner)
    return BlockDiagCPAttention.Config(sliding_window=window, param_init=inner.param_init,
                                       sharding_config=inner.sharding_config)


def _say_flex_tiling_is_not_used(inner: FlexAttention.Config) -> None:
    default = FlexAttention.Config()
    if inner.block_size != default.block_size or inner.kernel_options != default.kernel_options:
        logger.warning("FlexAttention's block_size=%s and kernel_options=%s choose how FlexAttention computes the "
                       "masked attention; blockdiag-cp computes the same attention with its own kernels "
                       "(CPConfig.kernel), so they are not used", inner.block_size, inner.kernel_options)


def route_attention(model_config: Decoder.Config) -> Decoder.Config:
    """Return a copy of `model_config` whose every attention layer's ``inner_attention`` is `BlockDiagCPAttention`,
    each computing what its original computes per document (`routed_inner_attention`).

    Raises:
        ValueError: the model is not a torchtitan `Decoder`, builds its own masks (sliding windows, chunked or
            bidirectional attention: overriding ``get_attention_masks``), has no attention layer to route, or a
            layer's inner attention cannot be routed exactly (`routed_inner_attention`).
    """
    owner = type(model_config)._owner
    if not isinstance(model_config, Decoder.Config) or owner is None:
        raise ValueError(f"route_attention takes a torchtitan Decoder config, got {type(model_config).__name__}")
    if owner.get_attention_masks is not Decoder.get_attention_masks:
        raise ValueError(
            f"{owner.__name__} builds its own attention masks (get_attention_masks is overridden: sliding windows, "
            "chunked or bidirectional spans); blockdiag-cp would drop them. Only decoders masked by torchtitan's "
            "default per-document causal rule are routed (verified: llama3, qwen3).")
    routed = copy.deepcopy(model_config)
    found = [cfg for _, cfg, _, _ in routed.traverse(BaseAttention.Config)]
    if not found:
        raise ValueError(f"{type(model_config).__name__} has no attention layer to route through blockdiag-cp")
    for cfg in found:
        cfg.inner_attention = routed_inner_attention(cfg.inner_attention)
    return routed


class BlockDiagCPConverter(ModelConfigConverter):
    """torchtitan model converter (``model_registry(flavor, converters=[BlockDiagCPConverter.Config()])``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        pass

    def __init__(self, config: Config) -> None:
        self.config = config

    def convert(self, model_config: Decoder.Config) -> Decoder.Config:
        return route_attention(model_config)
