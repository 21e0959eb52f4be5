"""The strategies a step chooses from: one registry per family (kernels, K/V exchanges, layouts).

Config validation (`CPConfig`), the ``"auto"`` choices (`kernels.select_kernel`,
`exchange.build_exchange`), the planners (`plan.plan_shards`) and the CLI all read
these tables, so a strategy is added in one place. The module imports nothing heavy: a
strategy names its implementation as ``"module:attribute"`` and is imported on use, so
``blockdiag-cp --help`` lists the choices without importing torch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

#: the choice that lets the step pick a strategy itself, in every family
AUTO = "auto"


@dataclass(frozen=True)
class Strategy:
    """One named strategy of a family.

    Attributes:
        name: the value users pass (``kernel="sdpa"``).
        target: ``"module:attribute"`` of its implementation, relative to ``blockdiag_cp``.
        summary: one line for help texts and errors.
        gpu_only: it runs on CUDA devices only.
    """

    name: str
    target: str
    summary: str
    gpu_only: bool = False

    def load(self) -> Any:
        """The implementation (a class or a function), imported now."""
        module, attribute = self.target.split(":")
        return getattr(importlib.import_module(f"blockdiag_cp.{module}"), attribute)


@dataclass(frozen=True)
class Registry:
    """The strategies of one family, in the order help texts list them (``"auto"`` first where allowed)."""

    family: str
    strategies: tuple[Strategy, ...]
    has_auto: bool = True

    @property
    def choices(self) -> tuple[str, ...]:
        """Every value the family's knob accepts."""
        return ((AUTO,) if self.has_auto else ()) + tuple(s.name for s in self.strategies)

    @property
    def gpu_only(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.strategies if s.gpu_only)

    def __getitem__(self, name: str) -> Strategy:
        for strategy in self.strategies:
            if strategy.name == name:
                return strategy
        raise KeyError(f"no {self.family} named {name!r}; choose one of {', '.join(self.choices)}")

    def __iter__(self) -> Iterator[Strategy]:
        return iter(self.strategies)

    def help(self) -> str:
        """``name: summary`` for every choice, for ``--help``."""
        auto = [f"{AUTO}: the step picks (see docs)"] if self.has_auto else []
        return "; ".join(auto + [f"{s.name}: {s.summary}" for s in self.strategies])


def lazy_attribute(package: str, homes: Mapping[str, str], name: str) -> Any:
    """A lazy package's public `name` (PEP 562 ``__getattr__``): imported from its home module, relative to
    `package`, on first access; an `AttributeError` for a name the package does not have."""
    home = homes.get(name)
    if home is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home, package), name)


KERNELS = Registry("kernel", (
    Strategy("dense", "kernels.dense:DenseKernel", "masked reference attention (any device, exact, O(L x N) memory)"),
    Strategy("sdpa", "kernels.sdpa:SdpaKernel", "PyTorch fused attention per document piece (CPU and CUDA)"),
    Strategy("flash", "kernels.flash:FlashKernel", "flash-attn varlen, one call per rank (fp16/bf16)", gpu_only=True),
    Strategy("te", "kernels.te:TEKernel", "TransformerEngine THD attention (fp16/bf16)", gpu_only=True),
    Strategy("flex", "kernels.flex:FlexKernel", "FlexAttention over the step's block mask (no CPU backward)"),
))

EXCHANGES = Registry("kv_exchange", (
    Strategy("allgather", "exchange.allgather:AllGatherExchange", "every rank gathers every rank's K/V"),
    Strategy("halo", "exchange.needed:HaloExchange", "needed-only K/V from the left neighbour (documents cross one boundary)"),
    Strategy("a2a", "exchange.needed:AllToAllExchange", "needed-only K/V, one all-to-all-v"),
    Strategy("p2p", "exchange.needed:PeerExchange",
             "needed-only K/V, batched point-to-point with the ranks that share documents (grouped layout)"),
    Strategy("ring", "exchange.ring:RingExchange", "needed-only K/V passed around the ring, merged by log-sum-exp"),
))

LAYOUTS = Registry("layout", (
    Strategy("contiguous", "plan.contiguous:plan_contiguous", "equal contiguous chunks (the seed's)"),
    Strategy("balanced", "plan.balanced:plan_balanced", "equal tokens and equal causal attention work per rank"),
    Strategy("grouped", "plan.grouped:plan_grouped",
             "each document on the fewest nearby ranks its work needs, modeled time balanced (whole batches)"),
), has_auto=False)
