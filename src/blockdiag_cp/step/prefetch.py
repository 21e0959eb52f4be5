"""`prefetched_world_steps`: the whole-batch step with the next micro-batch planned while the current one runs.

Note [Planning off the critical path]
-------------------------------------
A whole-batch step's planning (the global row, its plan, this rank's state and token route:
Note [A rank's step without a process group]) needs only the micro-batch's run lengths, known as
soon as it is sampled. For micro-batches ``b0, b1, ...`` the loop runs, on the main thread:

    submit agree+plan(b0)
    wait(b0); move(b0); submit agree+plan(b1); yield step 0    <- the caller runs b0
    wait(b1); move(b1); submit agree+plan(b2); yield step 1    <- b1 agreed and planned beside b0
    ...

``agree`` is the step's small all-gathers of run lengths (Note [Ranks agree]: every rank raises alike
on a bad batch, here when it asks for that batch's step); it runs on the background thread over a
gloo group of the mesh's ranks made for it, so no collective of the step's own group leaves the main
thread (every rank submits the batches in the same order: the group's collectives match). ``plan``
(the global row, its plan, the rank's state and token route) starts no collective (no NCCL warm-up
there: the loop makes one all-reduce on the step's group when it starts, so the token exchange, the
first point-to-point, never opens an NCCL communicator).
``move`` is the token exchange, on the main thread; the next micro-batch is submitted after it, so
that the planning does not compete with it for the interpreter. The loop's blocking work per step is
then the wait for a plan not yet done (`PrefetchedStep.blocking_s`) and the token exchange.

The planning is numpy and torch work that releases the GIL for its large operations, so it overlaps
a step that waits on a device, on collectives or in a sleep; a step that holds the GIL in Python (a
CPU model's eager dispatch) shares the interpreter with it. On a GPU the batch's document ids are
copied to the host on the main thread (as the step without prefetch reads them). Each step equals
the step `make_cp_world_batch_and_ctx` builds for the same batch. `WorldStepPrefetcher` is the loop as
an object (the Trainer mixin submits an optimizer step's micro-batches as the Trainer fetches them).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Iterable, Iterator, Mapping, Optional

import torch
import torch.distributed as dist

from ..config import CPConfig
from ..errors import CPTypeError
from ..parallel.heads import HeadGroups, head_groups, make_head_groups
from ..plan.cost import candidate_degrees
from .pipeline import TrainCtx, mesh_device, read_inputs, step_head_groups
from .world import GlobalRow, WholeBatch, WorldView, plan_global_row, gather_replica_runs
from .world_plan import RankStep, build_rank_step

__all__ = ("PrefetchedStep", "WorldStepPrefetcher", "prefetched_world_steps")


@dataclass(frozen=True)
class PrefetchedStep:
    """One micro-batch's step from `prefetched_world_steps`.

    Attributes:
        train_ctx: as `make_cp_world_batch_and_ctx` returns it (``train_ctx()`` activates the step).
        batch: this rank's shard of the micro-batch. blocking_s: seconds the loop waited for this step's plan
            after the previous step was handed out (0 when planning was hidden behind it).
    """

    train_ctx: TrainCtx
    batch: dict[str, Any]
    blocking_s: float


@dataclass(frozen=True)
class _Pending:
    batch: dict[str, Any]
    agreed: "_Agreed"
    plan: Future


@dataclass(frozen=True)
class _Agreed:
    """What the main thread read of a micro-batch before its agreement and planning: its document ids (CPU) or
    the problem with it, its head groups, its inputs."""

    doc_ids_1S: Optional[torch.Tensor]
    problem: Optional[Exception]
    heads: Optional[HeadGroups]
    seq_dims: Mapping[str, int]
    batch_device: Optional[torch.device]


class WorldStepPrefetcher:
    """The whole-batch step with its agreement and planning on a background thread (Note [Planning off the
    critical path]): `submit` a micro-batch as soon as it is sampled, `step` it when its turn comes. Every rank
    submits the same micro-batches in the same order and steps them in that order; `close` when done.

    Args:
        mesh, config, seq_dims: as for `make_cp_world_batch_and_ctx` (made once: one gloo group of the mesh's
            ranks for the agreements, one planning thread).
    """

    def __init__(self, mesh, *, config: Optional[CPConfig] = None,
                 seq_dims: Optional[Mapping[str, int]] = None) -> None:
        config = CPConfig(layout="grouped") if config is None else config
        if not isinstance(config, CPConfig):
            raise CPTypeError(f"config must be a CPConfig, got {type(config).__name__}")
        self.view, self.device, self.config, self.seq_dims = WorldView.of(mesh), mesh_device(mesh), config, seq_dims
        if "nccl" in str(dist.get_backend(self.view.group)):  # point-to-point must not be a communicator's first
            dist.all_reduce(torch.zeros(1, device=self.device), group=self.view.group)
        self.lengths = replace(self.view, group=dist.new_group(sorted(mesh.mesh.flatten().tolist()), backend="gloo",
                                                               use_local_synchronization=True))
        self.planner = ThreadPoolExecutor(1, thread_name_prefix="blockdiag-cp-plan")

    def submit(self, batch: dict[str, Any]) -> _Pending:
        """Start the agreement and planning of `batch` (this replica's row, as `make_cp_world_batch_and_ctx`
        takes it, a ``loss_mask`` in it); `batch` becomes its shard in `step`."""
        return _start(batch, view=self.view, lengths=self.lengths, device=self.device, config=self.config,
                      seq_dims=self.seq_dims, planner=self.planner)

    def step(self, pending: _Pending, padding_token_id: int = 0) -> PrefetchedStep:
        """The step of a submitted micro-batch: its plan awaited, its rows exchanged (a bad batch on any rank
        raises here on every rank)."""
        t0 = time.perf_counter()
        built: RankStep = pending.plan.result()
        blocking = time.perf_counter() - t0
        _finish(pending, built, self.view, padding_token_id)
        return PrefetchedStep(TrainCtx(built.state, built.replica_of_row), pending.batch, blocking)

    def close(self, wait: bool = True) -> None:
        """Wait for the submitted plans, stop the thread, destroy the agreements' group; `wait` False (after an
        error, when a peer may be gone): cancel the plans not started and leave the group, without waiting."""
        self.planner.shutdown(wait=wait, cancel_futures=not wait)
        if wait:
            dist.destroy_process_group(self.lengths.group)


def prefetched_world_steps(mesh, batches: Iterable[dict[str, Any]], *, config: Optional[CPConfig] = None,
                           padding_token_id: int = 0,
                           seq_dims: Optional[Mapping[str, int]] = None) -> Iterator[PrefetchedStep]:
    """The whole-batch step of each of `batches`, the next one agreed and planned while the caller runs the
    current one (Note [Planning off the critical path]).

    Args:
        mesh, config, padding_token_id, seq_dims: as for `make_cp_world_batch_and_ctx`.
        batches: this replica's packed rows, one per micro-batch (each as `make_cp_world_batch_and_ctx` takes
            it; a ``loss_mask`` goes in the batch). Each is read one micro-batch ahead of the one yielded.

    Yields:
        `PrefetchedStep` per micro-batch: run its forward and backward inside ``step.train_ctx()`` before
        asking for the next.
    """
    prefetcher = WorldStepPrefetcher(mesh, config=config, seq_dims=seq_dims)
    try:
        it = iter(batches)
        first = next(it, None)
        pending = None if first is None else prefetcher.submit(first)
        while pending is not None:
            step = prefetcher.step(pending, padding_token_id)
            after = next(it, None)  # agreed and planned from here on, beside the step the caller now runs
            pending = None if after is None else prefetcher.submit(after)
            yield step
    finally:
        prefetcher.close()


def _start(batch: dict[str, Any], *, view: WorldView, lengths: WorldView, device: torch.device, config: CPConfig,
           seq_dims, planner: ThreadPoolExecutor) -> _Pending:
    """The main thread's part ahead of a micro-batch: its inputs read, its head groups made; then its agreement
    and planning submitted to the background thread."""
    seq_dims, doc_ids_1S, problem = read_inputs(batch, None, seq_dims, config, view.world)
    degree = config.heads.ulysses_degree
    if degree == "auto":  # every candidate's groups now; the planner picks among them without a collective
        make_head_groups(view.group, view.world, view.rank, candidate_degrees(view.world, config.heads.attention_heads[0]))
        heads = None
    else:
        heads = head_groups(view.group, view.world, view.rank, degree)
    ids = None if doc_ids_1S is None else doc_ids_1S.cpu()
    agreed = _Agreed(ids, problem, heads, seq_dims, None if doc_ids_1S is None else doc_ids_1S.device)
    return _Pending(batch, agreed, planner.submit(_agree_and_plan, agreed, view, lengths, device, config))


def _agree_and_plan(agreed: _Agreed, view: WorldView, lengths: WorldView, device: torch.device,
                    config: CPConfig) -> RankStep:
    """The background thread's part: the ranks' agreement over the step's own gloo group (`lengths.group`; every
    rank raises alike on a bad batch), then the global row, its plan, this rank's state and token route (with
    no collective on the step's group)."""
    runs = gather_replica_runs(agreed.doc_ids_1S, lengths, config, torch.device("cpu"), agreed.problem)
    row = GlobalRow.of(runs, view)
    heads = agreed.heads or step_head_groups(row, view.world, view.rank, view.group, config)
    return build_rank_step(row, plan_global_row(row, view.world, config), view, config, device, heads, warm_up=False)


def _finish(pending: _Pending, built: RankStep, view: WorldView, padding_token_id: int) -> None:
    """The main thread's part once planned: the token exchange, `pending.batch` becoming this rank's shard."""
    state = built.state
    whole = WholeBatch(built.row, view, built.state.device, pending.agreed.batch_device)
    whole.move(pending.batch, state.plan, padding_token_id, pending.agreed.seq_dims, built.route)
