"""`prefetched_world_steps`: the whole-batch step with the next micro-batch planned while the current one runs.

Note [Planning off the critical path]
-------------------------------------
A whole-batch step's planning (the global row, its plan, this rank's state and token route:
Note [A rank's step without a process group]) needs only the micro-batch's run lengths, known as
soon as it is sampled. For micro-batches ``b0, b1, ...`` the loop runs, on the main thread:

    agree(b0); submit plan(b0)
    wait plan(b0); move(b0); agree(b1); submit plan(b1); yield step 0    <- the caller runs b0
    wait plan(b1); move(b1); agree(b2); submit plan(b2); yield step 1    <- plan(b1) ran beside b0
    ...

``agree`` is the step's own small all-gathers of run lengths (collectives stay on the main thread,
in the same order on every rank; the next plan is submitted after the token exchange, so that it
does not compete with it for the interpreter); ``plan`` runs on one background thread and starts no collective
(no NCCL warm-up: the agreement's all-gathers already ran on the group); ``move`` is the token
exchange. The planning is numpy and torch work that releases the GIL for its large operations, so
it overlaps a step that waits on a device, a collective or a sleep; a step that holds the GIL in
Python (a CPU model's eager dispatch) shares the interpreter with it. Each step equals the step
`make_cp_world_batch_and_ctx` builds for the same batch.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Optional

import torch

from ..config import CPConfig
from ..errors import CPTypeError
from ..parallel.heads import HeadGroups, head_groups, make_head_groups
from ..plan.cost import candidate_degrees
from .pipeline import TrainCtx, mesh_device, read_row, step_head_groups, take_row_inputs
from .inputs import warn_unsharded
from .world import GlobalRow, WholeBatch, WorldView, plan_global_row, gather_replica_runs
from .world_plan import RankStep, build_rank_step

__all__ = ("PrefetchedStep", "prefetched_world_steps")


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
    """What the main thread settled for a micro-batch before planning it: its runs, heads, inputs."""

    runs: list
    heads: Optional[HeadGroups]
    seq_dims: Mapping[str, int]
    batch_device: torch.device


def prefetched_world_steps(mesh, batches: Iterable[dict[str, Any]], *, config: Optional[CPConfig] = None,
                           padding_token_id: int = 0,
                           seq_dims: Optional[Mapping[str, int]] = None) -> Iterator[PrefetchedStep]:
    """The whole-batch step of each of `batches`, the next one planned while the caller runs the current one
    (Note [Planning off the critical path]).

    Args:
        mesh, config, padding_token_id, seq_dims: as for `make_cp_world_batch_and_ctx`.
        batches: this replica's packed rows, one per micro-batch (each as `make_cp_world_batch_and_ctx` takes
            it; a ``loss_mask`` goes in the batch). Each is read one micro-batch ahead of the one yielded.

    Yields:
        `PrefetchedStep` per micro-batch: run its forward and backward inside ``step.train_ctx()`` before
        asking for the next (the next's agreement is a collective on the mesh's group).
    """
    config = CPConfig(layout="grouped") if config is None else config
    if not isinstance(config, CPConfig):
        raise CPTypeError(f"config must be a CPConfig, got {type(config).__name__}")
    view, device = WorldView.of(mesh), mesh_device(mesh)
    with ThreadPoolExecutor(1, thread_name_prefix="blockdiag-cp-plan") as planner:
        it = iter(batches)
        first = next(it, None)
        pending = None if first is None else _start(first, view, device, config, seq_dims, planner)
        while pending is not None:
            t0 = time.perf_counter()
            built: RankStep = pending.plan.result()
            blocking = time.perf_counter() - t0
            _finish(pending, built, view, padding_token_id)
            after = next(it, None)  # planned from here on, beside the step the caller now runs
            following = None if after is None else _start(after, view, device, config, seq_dims, planner)
            yield PrefetchedStep(TrainCtx(built.state, built.replica_of_row), pending.batch, blocking)
            pending = following


def _start(batch: dict[str, Any], view: WorldView, device: torch.device, config: CPConfig, seq_dims,
           planner: ThreadPoolExecutor) -> _Pending:
    """The main thread's part ahead of a micro-batch: its inputs read, the ranks' agreement (collectives), its
    head groups made; then its planning submitted to the background thread."""
    take_row_inputs(batch, None)
    seq_dims, S, doc_ids_1S, problem = read_row(batch, seq_dims, config, view.world)
    runs = gather_replica_runs(doc_ids_1S, view, config, device, problem)
    warn_unsharded(batch, S, seq_dims)
    if batch.get("position_ids") is None:
        batch["position_ids"] = torch.arange(S, device=doc_ids_1S.device).unsqueeze(0)
    degree = config.heads.ulysses_degree
    if degree == "auto":  # every candidate's groups now; the planner picks among them without a collective
        make_head_groups(view.group, view.world, view.rank, candidate_degrees(view.world, config.heads.attention_heads[0]))
        heads = None
    else:
        heads = head_groups(view.group, view.world, view.rank, degree)
    agreed = _Agreed(runs, heads, seq_dims, doc_ids_1S.device)
    return _Pending(batch, agreed, planner.submit(_plan_rank, agreed, view, device, config))


def _plan_rank(agreed: _Agreed, view: WorldView, device: torch.device, config: CPConfig) -> RankStep:
    """The background thread's part: the global row, its plan, this rank's state and token route (no collective)."""
    row = GlobalRow.of(agreed.runs, view)
    heads = agreed.heads or step_head_groups(row.doc_ids, view.world, view.rank, view.group, config)
    return build_rank_step(row, plan_global_row(row, view.world, config), view, config, device, heads, warm_up=False)


def _finish(pending: _Pending, built: RankStep, view: WorldView, padding_token_id: int) -> None:
    """The main thread's part once planned: the token exchange, `pending.batch` becoming this rank's shard."""
    state = built.state
    whole = WholeBatch(built.row, view, built.row.doc_ids, pending.agreed.batch_device)
    whole.move(pending.batch, state.plan, padding_token_id, pending.agreed.seq_dims, built.route)
