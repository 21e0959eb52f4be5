"""Bytes a routed token mixer moves per layer, and what head parallelism would move instead.

Across ranks a mixer layer moves two things (Note [A causal convolution per document, with a
halo], Note [Passing a recurrent state across ranks, in parallel]): the conv's halo, ``k - 1``
rows per straddling piece, and the recurrent state of each straddling piece, ``(P, B)``:
both independent of the documents' lengths. The alternative, head parallelism around the
mixer (an all-to-all of its inputs before, and of its outputs after, so each rank runs whole
documents for ``1 / W`` of the heads), moves ``(W - 1) / W`` of every local row instead.
Counts follow `Traffic`'s convention: a ring all-gather sends and receives ``W - 1``
contributions; backward moves the same amounts again. Under the grouped layout both travel
point-to-point to the ranks that read them (Note [Entry routes]): what each rank sends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..exchange.base import Traffic
from ..kernels.base import accumulate_dtype
from ..parallel.routes import EntryRoute
from .conv import conv_plan
from .recurrence import piece_schedule

KINDS = ("gated_delta", "mamba2", "conv")


@dataclass(frozen=True)
class MixerShape:
    """The sizes of one mixer layer.

    Attributes:
        kind: ``"gated_delta"`` (Qwen3-Next, Qwen3.5), ``"mamba2"`` or ``"conv"`` (LFM2).
        heads: value heads (delta rule) or heads (Mamba2); 0 for ``conv``.
        key_heads: key heads (delta rule) or groups (Mamba2).
        key_dim: key size ``dk`` (delta rule) or state size ``N`` (Mamba2).
        value_dim: value size ``dv`` (delta rule) or head size ``P`` (Mamba2).
        conv_width: the causal convolution's kernel size ``k``.
        conv_channels: channels the convolution runs over.
    """

    kind: str
    conv_width: int
    conv_channels: int
    heads: int = 0
    key_heads: int = 0
    key_dim: int = 0
    value_dim: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"MixerShape.kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind != "conv" and min(self.heads, self.key_heads, self.key_dim, self.value_dim) < 1:
            raise ValueError(f"a {self.kind} MixerShape needs heads, key_heads, key_dim and value_dim >= 1")

    @property
    def state_entry(self) -> int:
        """Elements of one piece's ``(P, B)`` in the all-gather."""
        if self.kind == "gated_delta":
            return self.heads * self.key_dim * (self.key_dim + self.value_dim)
        if self.kind == "mamba2":
            return self.heads * (1 + self.value_dim * self.key_dim)
        return 0

    @property
    def row_in(self) -> int:
        """Elements per token entering the mixer's sequence part (the conv's input, plus the gates)."""
        extra = {"gated_delta": 2 * self.heads, "mamba2": self.heads, "conv": 0}[self.kind]
        return self.conv_channels + extra

    def bytes_per_layer(self, state: Any, dtype: torch.dtype) -> "MixerBytes":
        """`mixer_bytes` of a layer of this shape in `state`'s step (what `StepState.mixer_bytes_per_layer` asks)."""
        return mixer_bytes(state, self, dtype)

    @property
    def row_out(self) -> int:
        """Elements per token leaving it (before the gated norm and the output projection)."""
        return self.conv_channels if self.kind == "conv" else self.heads * self.value_dim


@dataclass(frozen=True)
class MixerBytes:
    """Bytes one rank moves per mixer layer (`StepState.mixer_bytes_per_layer`).

    Attributes:
        halo: the conv's halo rows (all-gather, its reduce-scatter backward).
        state: the recurrent state hand-off ``(P, B)`` (all-gather; in the accumulate dtype).
        head_parallel: what an all-to-all around the mixer would move instead (inputs and outputs).
    """

    halo: Traffic
    state: Traffic
    head_parallel: Traffic

    @property
    def sent(self) -> int:
        """Sent forward and backward by the library's way (halo and state)."""
        return self.halo.sent + self.state.sent


def _both_ways(n: int) -> Traffic:
    return Traffic(n, n, n, n)


def mixer_bytes(state: Any, shape: MixerShape, dtype: torch.dtype) -> MixerBytes:
    """Bytes this rank moves for one mixer layer of `shape` in activations of `dtype` (`state`: the
    step's `StepState`; not imported here, which imports this module)."""
    size = torch.empty(0, dtype=dtype).element_size()
    state_size = torch.empty(0, dtype=accumulate_dtype(dtype)).element_size()
    W = state.world
    halo = _entry_bytes(conv_plan(state, shape.conv_width).route, shape.conv_channels * size)
    carried = (_entry_bytes(piece_schedule(state).route, shape.state_entry * state_size) if shape.kind != "conv"
               else Traffic(0, 0, 0, 0))
    crossing = state.local_len * (W - 1) // W
    head_parallel = crossing * (shape.row_in + shape.row_out) * size
    return MixerBytes(halo, carried, _both_ways(head_parallel))


def _entry_bytes(route: EntryRoute, entry_bytes: int) -> Traffic:
    """A route's entries moved, forward and backward, in bytes."""
    return Traffic(*(n * entry_bytes for n in route.moved()))
