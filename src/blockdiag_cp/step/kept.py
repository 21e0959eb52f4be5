"""`KeptGraphs`: the autograd graphs of opaque attention calls, kept until their backward runs.

Part of the step slot (slot.py): the one piece of mutable process state. See
Note [One opaque op] in opaque.py (beside this file) for why a compiled graph's attention keeps its eager
autograd graph here, under a small integer handle.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KeptGraph:
    """One call's eager autograd graph: its output and the detached inputs it was built on."""

    output: torch.Tensor
    inputs: tuple[torch.Tensor, ...]


class KeptGraphs:
    """Graphs kept by handle; each is taken once (by its backward) or dropped with its handle tensor."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._graphs: dict[int, KeptGraph] = {}
        self._next = 0

    def keep(self, graph: KeptGraph) -> torch.Tensor:
        """Keep `graph`; return its handle, a 0-d int64 CPU tensor whose death drops the graph."""
        with self._lock:
            self._next += 1
            number = self._next
            self._graphs[number] = graph
        handle = torch.tensor(number, dtype=torch.int64)
        weakref.finalize(handle, self._drop, number)
        return handle

    def take(self, number: int) -> KeptGraph:
        """The graph of handle `number`, removed (its backward runs once)."""
        with self._lock:
            graph = self._graphs.pop(number, None)
        if graph is None:
            raise RuntimeError(
                "blockdiag-cp: a compiled attention call's backward ran twice, or after its graph was freed; "
                "backward through a compiled CP attention once (retain_graph=True is not supported there)"
            )
        return graph

    def _drop(self, number: int) -> None:
        with self._lock:
            self._graphs.pop(number, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._graphs)
