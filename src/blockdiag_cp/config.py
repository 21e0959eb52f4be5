"""`CPConfig`: the user-facing knobs of one block-diagonal CP step, validated once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .errors import CPTypeError

KV_EXCHANGES = ("auto", "allgather", "halo", "a2a", "ring")
KERNELS = ("auto", "dense", "sdpa", "flash", "te", "flex")
LAYOUTS = ("contiguous", "balanced")


def check_choice(knob: str, value: object, choices: tuple[str, ...]) -> str:
    """Return `value` if it is one of `choices`, else raise an error listing them
    (`CPTypeError` for a non-string, `ValueError` for an unknown string)."""
    if not isinstance(value, str):
        raise CPTypeError(f"{knob} must be a string, one of {', '.join(choices)}; got {type(value).__name__}")
    if value not in choices:
        raise ValueError(f"{knob}={value!r} is not supported; choose one of {', '.join(choices)}")
    return value


@dataclass(frozen=True, kw_only=True)
class CPConfig:
    """How a block-diagonal CP step exchanges K/V, computes attention and lays out tokens.

    Attributes:
        kv_exchange: how each rank obtains the keys/values its queries need.
            ``"auto"`` (default) picks the cheapest exact exchange for the step's
            layout; ``"allgather"`` gathers every rank's K/V; ``"halo"``,
            ``"a2a"`` and ``"ring"`` move only what the queries need.
        kernel: the local attention kernel. ``"auto"`` picks the fastest correct
            kernel available; ``"dense"`` is the masked reference; ``"sdpa"`` is
            PyTorch's fused attention called per document piece; ``"flash"``,
            ``"te"``, ``"flex"`` are the GPU kernels.
        layout: the token-to-rank assignment: ``"contiguous"`` (the seed's equal
            contiguous chunks) or ``"balanced"`` (equal attention work per rank).
        check_ranks_agree: at step start, verify with one small collective that
            every rank of the CP group holds the same document ids (a mismatch
            raises the same error everywhere instead of hanging). Turn off for speed.
        balance_window: the balanced layout's work model assumes every layer attends
            through this sliding window (a windowed document's work is linear in its
            length); None (default) balances full causal attention, right for any
            model with a global layer.
    """

    kv_exchange: str = "auto"
    kernel: str = "auto"
    layout: str = "contiguous"
    check_ranks_agree: bool = True
    balance_window: Optional[int] = None

    def __post_init__(self) -> None:
        check_choice("kv_exchange", self.kv_exchange, KV_EXCHANGES)
        check_choice("kernel", self.kernel, KERNELS)
        check_choice("layout", self.layout, LAYOUTS)
        if not isinstance(self.check_ranks_agree, bool):
            raise CPTypeError(f"check_ranks_agree must be a bool, got {self.check_ranks_agree!r}")
        window = self.balance_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
            raise CPTypeError(f"balance_window must be an int or None, got {type(window).__name__}")
        if window is not None and window < 1:
            raise ValueError(f"balance_window must be >= 1, got {window}")
