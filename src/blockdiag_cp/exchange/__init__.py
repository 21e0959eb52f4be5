"""K/V exchanges behind one interface (`KVExchange`), chosen per step from the plan."""

from __future__ import annotations

import warnings

from ..errors import ensure
from .allgather import AllGatherExchange
from .base import ExchangeSetup, KVExchange, Traffic
from .local import LocalExchange
from .needed import AllToAllExchange, HaloExchange, halo_unsupported_reason
from .ring import RingExchange


def build_exchange(requested: str, setup: ExchangeSetup) -> tuple[KVExchange, str]:
    """Route this step's exchange; return it and the reason it was chosen.

    Depends only on replicated inputs (geometry, request), so every rank of the
    group makes the same choice without a collective.
    """
    if setup.world == 1:
        return LocalExchange(setup), "world == 1: the rank owns every key"
    if requested == "allgather":
        return AllGatherExchange(setup), "requested"
    if requested == "a2a":
        return AllToAllExchange(setup), "requested"
    if requested == "halo":
        why_not = halo_unsupported_reason(setup)
        if why_not is None:
            return HaloExchange(setup), "requested"
        reason = f"halo requested but {why_not}: using a2a (exact, needed-only)"
        warnings.warn(f"blockdiag-cp kv_exchange: {reason}")
        return AllToAllExchange(setup), reason
    if requested == "ring":
        if setup.window is not None:
            reason = f"ring requested but these layers use a sliding window ({setup.window}): using a2a (exact, needed-only)"
            warnings.warn(f"blockdiag-cp kv_exchange: {reason}")
            return AllToAllExchange(setup), reason
        return RingExchange(setup), "requested"
    ensure(requested == "auto", f"unknown kv_exchange {requested!r} passed CPConfig")
    return _auto(setup)


def _auto(setup: ExchangeSetup) -> tuple[KVExchange, str]:
    """The cheapest exact exchange: needed-only rows, over the fewest messages."""
    transfer = setup.geometry.transfer_under(setup.window)
    if not bool(transfer.any()):
        return AllToAllExchange(setup), "auto: no document crosses a rank boundary; no communication"
    if halo_unsupported_reason(setup) is None:
        return HaloExchange(setup), "auto: every rank's missing keys sit on its left neighbour (halo)"
    return AllToAllExchange(setup), "auto: documents span several ranks; all-to-all-v of the needed rows"


__all__ = ("ExchangeSetup", "KVExchange", "Traffic", "build_exchange")
