"""The frozen per-step state and the process-wide slot that holds the active one.

Note [Why a process-wide slot, not a ContextVar]
------------------------------------------------
`cp_blockdiag_sdpa` is a drop-in for SDPA, so it finds the step through a lookup,
not an argument. The lookup must work from any thread: activation checkpointing
re-runs a layer's forward inside backward, and the autograd engine may run that on
its own worker thread, where a `ContextVar` set by the training thread is invisible.
So the active step lives in one `StepSlot` per process, guarded by a lock. It is the
only module-level object that changes, and only through `StepSlot.activate`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from .config import CPConfig
from .exchange import ExchangeSetup, KVExchange, Traffic, build_exchange
from .geometry import StepGeometry
from .kernels import AttentionKernel, fallback_kernels, select_kernel
from .layout import ShardPlan, attention_work, make_plan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepState:
    """Everything one CP step needs, computed once (never per layer).

    Attributes:
        config: the step's `CPConfig`.
        rank, world: this rank's index in the CP group and the group's size.
        group: the CP process group (None when world == 1 without a mesh).
        device: where the step's tensors live (the batch's device).
        geometry: replicated document ids, plan and need matrix.
        exchange: the planned K/V exchange strategy; `exchange_reason` says why.
        kernel: the attention kernel; `kernel_reason` says why.
        fallback_kernels: with ``kernel="auto"``, kernels tried in order when `kernel`
            refuses a call (attention dropout, a dtype it lacks); empty otherwise.
    """

    config: CPConfig
    rank: int
    world: int
    group: Any
    device: torch.device
    geometry: StepGeometry
    exchange: KVExchange
    exchange_reason: str
    kernel: AttentionKernel
    kernel_reason: str
    fallback_kernels: tuple[AttentionKernel, ...]

    @property
    def plan(self) -> ShardPlan:
        return self.geometry.plan

    @property
    def local_len(self) -> int:
        return self.geometry.plan.local_len

    @property
    def positions(self) -> torch.Tensor:
        """``[L]``: the padded-sequence positions this rank owns, in local order."""
        return self.geometry.plan.rank_positions(self.rank)

    @property
    def traffic(self) -> Traffic:
        """K/V rows this rank sends/receives per attention call (forward and backward)."""
        return self.exchange.traffic

    def work_per_rank(self) -> torch.Tensor:
        """``[world]``: causal attention work (query-key pairs) per rank."""
        real = self.geometry.doc_ids[: self.plan.seq_len]
        return attention_work(self.plan, real)


class StepSlot:
    """Holds the active `StepState` for the whole process (Note [Why a process-wide slot])."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state: Optional[StepState] = None
        self._depth = 0
        self._last: Optional[StepState] = None

    def current(self) -> Optional[StepState]:
        with self._lock:
            return self._state

    def last_exited(self) -> Optional[StepState]:
        """The state of the most recently exited step (to diagnose late recomputation)."""
        with self._lock:
            return self._last

    @contextlib.contextmanager
    def activate(self, state: StepState) -> Iterator[StepState]:
        """Make `state` the active step for the duration of the block (re-entrant for the same state)."""
        with self._lock:
            if self._state is not None and self._state is not state:
                raise RuntimeError(
                    "another block-diagonal CP step is already active; exit its train_ctx() "
                    "before entering the next one"
                )
            self._state, self._depth = state, self._depth + 1
        try:
            yield state
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._state, self._last = None, state


STEP_SLOT = StepSlot()


def current_step() -> Optional[StepState]:
    """The active step's state, or None outside ``train_ctx()``."""
    return STEP_SLOT.current()


def build_step_state(
    doc_ids_S: torch.Tensor, world: int, rank: int, group: Any, config: CPConfig, device: torch.device
) -> StepState:
    """Plan a step from replicated, validated document ids ``[S]``: layout, exchange, kernel.

    Every input is identical on all ranks of the group (the ranks-agree check runs
    before this), so every rank reaches the same plan without communicating.
    """
    plan = make_plan(doc_ids_S.cpu(), world, config.layout)
    geometry = StepGeometry.build(plan, doc_ids_S)
    kernel, kernel_reason = select_kernel(config.kernel, device, need_lse=config.kv_exchange == "ring")
    fallbacks = fallback_kernels(config.kernel, kernel, device)
    setup = ExchangeSetup(geometry, rank, group, (kernel, *fallbacks), device)
    exchange, exchange_reason = build_exchange(config.kv_exchange, setup)
    if group is not None and exchange.uses_p2p and not config.check_ranks_agree and dist.get_backend(group) == "nccl":
        # NCCL: point-to-point must not be the first operation on a communicator
        dist.all_reduce(torch.zeros(1, device=device), group=group)
    logger.debug(
        "blockdiag-cp step: rank %d/%d layout=%s exchange=%s (%s) kernel=%s (%s)",
        rank, world, plan.layout, exchange.name, exchange_reason, kernel.name, kernel_reason,
    )
    return StepState(
        config, rank, world, group, device, geometry, exchange, exchange_reason, kernel, kernel_reason, fallbacks
    )
