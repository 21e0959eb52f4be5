"""Which K/V exchange a step uses: the request and the step's geometry (the exchange registry's strategies).

Every decision depends only on replicated inputs (geometry, request), so every rank of
the group makes the same choice without a collective.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

from ..errors import ensure
from ..kernels import AttentionKernel
from ..parallel.heads import HeadParallel
from ..plan.geometry import StepGeometry
from ..registry import AUTO, EXCHANGES
from .base import ExchangeSetup, KVExchange
from .local import LocalExchange
from .needed import halo_unsupported_reason
from .ulysses import UlyssesExchange


def build_exchange(requested: str, setup: ExchangeSetup) -> tuple[KVExchange, str]:
    """Route this step's exchange; return it and the reason it was chosen."""
    if setup.world == 1:
        return LocalExchange(setup), "world == 1: the rank owns every key"
    ensure(requested in EXCHANGES.choices, f"unknown kv_exchange {requested!r} passed CPConfig")
    if requested == AUTO:
        return _auto(setup)
    why_not = _unsupported_reason(requested, setup)
    if why_not is not None:
        reason = f"{requested} requested but {why_not}: using a2a (exact, needed-only)"
        warnings.warn(f"blockdiag-cp kv_exchange: {reason}")
        return _build("a2a", setup), reason
    return _build(requested, setup), "requested"


def _build(name: str, setup: ExchangeSetup) -> KVExchange:
    return EXCHANGES[name].load()(setup)


def _unsupported_reason(name: str, setup: ExchangeSetup) -> Optional[str]:
    """Why the exchange `name` cannot serve this step exactly (None if it can)."""
    if name == "halo":
        return halo_unsupported_reason(setup)
    if name == "ring" and setup.window is not None:
        return f"these layers use a sliding window ({setup.window})"
    return None


def _auto(setup: ExchangeSetup) -> tuple[KVExchange, str]:
    """The cheapest exact exchange: needed-only rows, over the fewest messages."""
    if not setup.geometry.documents_cross_ranks(setup.window):
        return _build("a2a", setup), "auto: no document crosses a rank boundary; no communication"
    if setup.geometry.plan.layout == "grouped":
        return _build("p2p", setup), ("auto: grouped layout, each document on a few nearby ranks; point-to-point "
                                      "with the ranks that share one (no collective over the group)")
    if halo_unsupported_reason(setup) is None:
        return _build("halo", setup), "auto: every rank's missing keys sit on its left neighbour (halo)"
    return _build("a2a", setup), "auto: documents span several ranks; all-to-all-v of the needed rows"


def route_exchange(
    requested: str, geometry: StepGeometry, rank: int, group: Any, kernels: tuple[AttentionKernel, ...],
    device: torch.device, window: Optional[int], heads: Optional[HeadParallel],
) -> tuple[KVExchange, str]:
    """The step's exchange for layers with `window`: `requested` over the CP group, or, with
    head parallelism, over the cross group on the groups' plan, inside the head all-to-alls."""
    if heads is None:
        return build_exchange(requested, ExchangeSetup(geometry, rank, group, kernels, device, window))
    groups = heads.groups
    setup = ExchangeSetup(heads.geometry, groups.index, groups.cross_group, kernels, device, window)
    inner, reason = build_exchange(requested, setup)
    return UlyssesExchange(inner, heads.split), (
        f"ulysses_degree={groups.degree} ({groups.reason}): head all-to-all in groups of {groups.degree} "
        f"ranks; between the {heads.geometry.world} groups: {reason}")
