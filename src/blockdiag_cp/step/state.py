"""`StepState`: everything one CP step needs, planned once from replicated document ids.

`build_step_state` runs the shard plan, the geometry, the kernel choice (and each
kernel's call table) and the exchange's routing. Its fields are fixed once built; what a
step adds later is the routing of each sliding-window layer kind, made on its first call
and kept (`exchange_for`), and the notes of its calls (`call_notes`). The slot that makes
a state the active one is in slot.py.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional

import torch
import torch.distributed as dist

from ..config import CPConfig
from ..exchange import KVExchange, LayerBytes, Traffic, route_exchange
from ..kernels import AttentionKernel, fallback_kernels, select_kernel
from ..parallel.heads import HeadGroups, HeadParallel
from ..plan.traffic import split_kv_heads, ulysses_elements
from ..plan import ShardPlan, attention_work, make_plan
from ..plan.geometry import Runs, StepGeometry
from .notes import CallNotes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepState:
    """Everything one CP step needs, computed once (never per layer).

    Attributes:
        config: the step's `CPConfig`.
        rank, world: this rank's index in the CP group and the group's size.
        group: the CP process group (None when world == 1 without a mesh).
        device: where the step's tensors live (the batch's device).
        geometry: replicated document ids, shard plan and need matrix.
        exchange: the routed K/V exchange strategy; `exchange_reason` says why.
        kernel: the attention kernel; `kernel_reason` says why.
        fallback_kernels: with ``kernel="auto"``, kernels tried in order when `kernel`
            refuses a call (attention dropout, a dtype it lacks); empty otherwise.
        call_notes: the fallbacks that calls actually took, with their reasons.
        heads: the head-parallel view under ``ulysses_degree > 1`` (None otherwise).

    `exchange` serves full-causal layers; a layer kind with a sliding window gets its
    own routing and call tables from `exchange_for` (built on its first call in the
    step, then reused by every layer of that kind).
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
    heads: Optional[HeadParallel] = None
    call_notes: CallNotes = field(default_factory=CallNotes, compare=False, repr=False)
    _kinds: dict = field(default_factory=dict, compare=False, repr=False)
    _kinds_lock: Any = field(default_factory=threading.Lock, compare=False, repr=False)
    _derived: dict = field(default_factory=dict, compare=False, repr=False)

    def effective_window(self, window: Optional[int]) -> Optional[int]:
        """`window`, or None when it cannot cut any document of the row (it changes nothing)."""
        return None if window is None or window >= self.geometry.longest_document else int(window)

    def exchange_for(self, window: Optional[int]) -> KVExchange:
        """The exchange of the layers with this sliding window (the same on every rank)."""
        window = self.effective_window(window)
        if window is None:
            return self.exchange
        with self._kinds_lock:
            if window not in self._kinds:
                exchange, reason = route_exchange(
                    self.config.kv_exchange, self.geometry, self.rank, self.group,
                    (self.kernel, *self.fallback_kernels), self.device, window, self.heads)
                self.call_notes.record_kind(window, exchange.name, reason)
                self._kinds[window] = exchange
            return self._kinds[window]

    @property
    def peer_routes(self) -> bool:
        """Mixers hand their halos and states point-to-point to the ranks that read them (the grouped
        layout: a document's ranks are a few of a large group), else with one all-gather."""
        return self.plan.layout == "grouped"

    def derived(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """What a layer kind plans once per step from this state (a mixer's conv plan, its piece schedule),
        built by `build` on the first call with `key` and then kept for the step (the same on every rank)."""
        with self._kinds_lock:
            if key not in self._derived:
                self._derived[key] = build()
            return self._derived[key]

    @property
    def plan(self) -> ShardPlan:
        return self.geometry.plan

    @property
    def local_len(self) -> int:
        """``L``: the positions this rank owns (ranks of a grouped plan may own different numbers)."""
        return self.geometry.plan.local_len_of(self.rank)

    @property
    def positions(self) -> torch.Tensor:
        """``[L]``: the padded-sequence positions this rank owns, in local order."""
        return self.geometry.plan.rank_positions(self.rank)

    @property
    def traffic(self) -> Traffic:
        """K/V rows this rank sends/receives per attention call (forward and backward)."""
        return self.exchange.traffic

    def bytes_per_layer(self, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                        window: Optional[int] = None, *, v_head_dim: Optional[int] = None) -> LayerBytes:
        """Bytes this rank moves per attention layer of `heads` / `kv_heads` heads of `head_dim` (queries
        and keys) and `v_head_dim` (values and the output; None: `head_dim`): the head all-to-alls and the
        K/V rows, each sent/received, forward/backward, every tensor counted at its own width."""
        size = torch.empty(0, dtype=dtype).element_size()
        degree = 1 if self.heads is None else self.heads.groups.degree
        kv_per_rank = split_kv_heads(kv_heads, degree)
        moved = ulysses_elements(degree, self.local_len, heads, kv_heads, head_dim, v_head_dim) * size
        kv = self.exchange_for(window).traffic.bytes(kv_per_rank, head_dim, dtype, v_head_dim)
        return LayerBytes(Traffic(moved, moved, moved, moved), kv)

    def mixer_bytes_per_layer(self, shape: Any, dtype: torch.dtype) -> Any:
        """Bytes this rank moves per routed token-mixer layer of `shape` (a `blockdiag_cp.mixers.MixerShape`,
        which computes them: `MixerBytes`): the conv halo and the recurrent state hand-off, beside what head
        parallelism around it would move."""
        return shape.bytes_per_layer(self, dtype)

    def work_per_rank(self, window: Optional[int] = None) -> torch.Tensor:
        """``[W]``: causal attention work (query-key pairs, all heads) per rank (under a sliding `window`).

        Under ``ulysses_degree = u`` each rank computes its head-parallel group's pairs for
        ``H / u`` heads: the group's work divided by ``u`` (float64).
        """
        real = self.geometry.doc_ids[: self.plan.seq_len]
        if self.heads is None:
            return attention_work(self.plan, real, window)
        degree = self.heads.groups.degree
        return attention_work(self.heads.geometry.plan, real, window).double().repeat_interleave(degree) / degree


def build_step_state(
    doc_ids_S: Optional[torch.Tensor], world: int, rank: int, group: Any, config: CPConfig, device: torch.device,
    heads: Optional[HeadGroups] = None, plan: Optional[ShardPlan] = None, warm_up: bool = True,
    runs: Optional[Runs] = None,
) -> StepState:
    """Plan a step from replicated, validated document ids ``[S]``: layout, exchange, kernel.

    Every input is identical on all ranks of the group (the ranks-agree check runs
    before this), so every rank reaches the same state without exchanging plans (on NCCL,
    one warm-up all-reduce runs when the step's first operation would be point-to-point).
    `heads`: this rank's head-parallel groups (`parallel.heads.head_groups`); None plans
    ``config.heads.ulysses_degree`` (an int) without process groups, as tools do. `plan`: the shard plan
    when the caller made it already (the whole-batch step plans from lengths), else the layout's. `warm_up`
    False: no NCCL warm-up (the prefetching whole-batch step builds states off the main thread, after its
    agreement's all-gathers ran on the group: no collective may start from there). `runs`: the row's `Runs`
    when the caller knows them (Note [Localized geometry]).
    """
    if plan is None:
        plan = make_plan(doc_ids_S.cpu(), world, config.layout, config.plan)
    geometry = StepGeometry.build(plan, doc_ids_S, runs)
    if heads is None and isinstance(config.heads.ulysses_degree, int) and config.heads.ulysses_degree > 1:
        heads = HeadGroups.place(rank, config.heads.ulysses_degree)
    head_parallel = None
    if heads and heads.degree > 1:
        ids = geometry.doc_ids[: plan.seq_len] if doc_ids_S is None else doc_ids_S
        head_parallel = HeadParallel.build(plan, ids, heads, device)
    kernel, kernel_reason = select_kernel(config.kernel, device, need_lse=config.kv_exchange == "ring")
    fallbacks = fallback_kernels(config.kernel, kernel, device)
    exchange, exchange_reason = route_exchange(config.kv_exchange, geometry, rank, group, (kernel, *fallbacks),
                                               device, None, head_parallel)
    if heads is not None and heads.degree == 1 and heads.reason != "requested":
        exchange_reason = f"ulysses_degree=1 ({heads.reason}); {exchange_reason}"
    if (warm_up and head_parallel is None and group is not None and exchange.uses_p2p and not config.check_ranks_agree
            and "nccl" in str(dist.get_backend(group))):
        # NCCL: point-to-point must not be the first operation on a communicator (the ranks-agree
        # check is one otherwise; head-parallel cross groups are warmed when they are made)
        dist.all_reduce(torch.zeros(1, device=device), group=group)
    logger.debug(
        "blockdiag-cp step: rank %d/%d layout=%s exchange=%s (%s) kernel=%s (%s)",
        rank, world, plan.layout, exchange.name, exchange_reason, kernel.name, kernel_reason,
    )
    return StepState(
        config, rank, world, group, device, geometry, exchange, exchange_reason, kernel, kernel_reason, fallbacks,
        head_parallel,
    )
