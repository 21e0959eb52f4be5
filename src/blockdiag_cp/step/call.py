"""An attention call as its entry names it (`AttentionCall`), and what a layer asks beyond
per-document causal attention (`LayerFeatures`).

An entry (`cp_blockdiag_sdpa`, transformers' attention function) builds one record and hands
it, with q, k and v, to `step.dispatch.attend`: Note [One way down] in dispatch.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ..errors import ensure

#: what an entry may name (the dispatcher settles ``"sdpa"`` into ``"step"`` or ``"stock"``)
KINDS = ("sdpa", "step", "row", "stock")


@dataclass(frozen=True)
class LayerFeatures:
    """What a layer asks beyond per-document causal attention (see `cp_blockdiag_sdpa`)."""

    sliding_window: Optional[int] = None
    softcap: Optional[float] = None
    sinks: Optional[torch.Tensor] = field(default=None, compare=False)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LayerFeatures) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def key(self) -> tuple:
        """The features as plain values (the sinks by shape): what ranks must agree on."""
        sinks = None if self.sinks is None else tuple(self.sinks.shape)
        return (self.sliding_window, self.softcap, sinks)

    def problem(self, heads: int, device: torch.device) -> Optional[ValueError]:
        """The `ValueError` these features deserve for queries of `heads` heads on `device` (None: valid)."""
        window, softcap, sinks = self.sliding_window, self.softcap, self.sinks
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            return ValueError(f"sliding_window must be a positive int (keys (q - w, q]), got {window!r}")
        if softcap is not None and (not isinstance(softcap, (int, float)) or not softcap > 0):
            return ValueError(f"softcap must be a positive number, got {softcap!r}")
        if sinks is not None:
            if not isinstance(sinks, torch.Tensor) or sinks.shape != (heads,):
                shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
                return ValueError(f"sinks must be one logit per query head, [{heads}], got {shape}")
            if sinks.device != device:
                return ValueError(f"sinks are on {sinks.device}, the queries on {device}")
        return None

    def refuse_outside_a_step(self) -> None:
        """`ValueError` unless these are no features: stock SDPA, outside a step, has none."""
        if self != LayerFeatures():
            raise ValueError(
                "sliding_window, softcap and sinks work inside a block-diagonal CP step (or through "
                "attn_implementation='blockdiag_cp'); outside one, cp_blockdiag_sdpa is stock SDPA, which has none"
            )


@dataclass(frozen=True, eq=False)
class AttentionCall:
    """One attention call, all but its ``query``, ``key`` and ``value``; `kind` names which:

        sdpa   `cp_blockdiag_sdpa` as it names itself; the dispatcher settles it (`settled`):
               ``step`` inside a step, ``stock`` outside
        step   inside a step: the active step's CP attention (transformers' interface names it
               directly: it checked that a step is active)
        row    outside a step, one packed row whose keys are its queries (transformers' interface):
               a one-rank step of its documents (`cu_seq_lens`, else `position_ids` ``[1, S]`` that
               restart, else one) and its padding (the diagonal of a ``[1, 1, S, S]`` `attn_mask`)
        stock  outside a step: `F.scaled_dot_product_attention` (with `attn_mask`, `is_causal`),
               after the late-recompute check (Note [Late recompute] in slot.py)

    `refused_if_packed` (``row`` only): the refusal to raise when the planned row holds more than
    one document (a model whose token mixers outside attention are not routed: they are right on
    one document only). Data, not a callback: the walk never climbs back into its entry.

    Every field but `kind` and `features` has a constant default (None, a number, a bool): calls are built inside
    compiled blocks, and torch 2.11's dynamo builds a frozen dataclass's defaults without a source, which it can do
    for constants only (a ``LayerFeatures()`` default failed ``fullgraph=True`` on an H200: "SourcelessBuilder.create
    does not know how to wrap LayerFeatures"; torch 2.13 accepts it). `features` is therefore always passed.
    """

    kind: str
    features: LayerFeatures
    scale: Optional[float] = None
    dropout_p: float = 0.0
    enable_gqa: bool = False
    is_causal: bool = False
    attn_mask: Optional[torch.Tensor] = None
    position_ids: Optional[torch.Tensor] = None
    cu_seq_lens: Optional[torch.Tensor] = None
    refused_if_packed: Optional[ValueError] = None

    def __post_init__(self) -> None:
        ensure(self.kind in KINDS, f"unknown attention call kind {self.kind!r} (one of {KINDS})")

    def settled(self, in_step: bool) -> "AttentionCall":
        """This call with ``"sdpa"`` settled by whether a step is active (`StepSlot.in_step`)."""
        if self.kind != "sdpa":
            return self
        return AttentionCall("step" if in_step else "stock", self.features, self.scale, self.dropout_p,
                             self.enable_gqa, self.is_causal, self.attn_mask, self.position_ids, self.cu_seq_lens,
                             self.refused_if_packed)
