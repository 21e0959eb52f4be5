"""K/V exchanges behind one interface (`KVExchange`), registered by name in
`blockdiag_cp.registry.EXCHANGES` and routed per step by `build_exchange` (choose.py).

    base.py       the interface, the buffer layer (local rows + received rows), traffic
    local.py      world 1: nothing moves         allgather.py  every rank's K/V
    needed.py     needed-only: halo, a2a         ring.py       needed-only around the ring, LSE merge
    ulysses.py    head all-to-alls inside head-parallel groups, any exchange between them
"""

from .base import ExchangeSetup, KVExchange, LayerBytes, Traffic
from .choose import build_exchange, route_exchange

__all__ = ("ExchangeSetup", "KVExchange", "LayerBytes", "Traffic", "build_exchange", "route_exchange")
