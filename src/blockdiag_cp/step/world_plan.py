"""One rank's whole-batch step from lengths alone: what `make_cp_world_batch_and_ctx` builds, without a process group.

Note [A rank's step without a process group]
--------------------------------------------
After the whole-batch step gathered every replica's run lengths (Note [The whole-batch step]),
everything a rank builds is a function of those lengths, the mesh's shape ``(dp, cp)``, its rank
and the config: the global row, its plan (the same on every rank), this rank's `StepState` (pieces,
exchange peers and lists, entry routes) and the token route of the row exchange. `plan_world_step`
runs the part every rank shares (the global row and its plan: *planning*); `WorldStepPlan.rank_step`
the part each rank builds for itself (*host work per rank*). Together they give the very state the
step builds on rank `rank` of a ``(dp, cp)`` mesh whose rank ``d * cp + c`` is replica ``d``'s cp
rank ``c`` (the order of ``init_device_mesh(..., (dp, cp))``), with ``group`` None: how a benchmark
or a test sizes a thousand-rank step in one process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from ..config import CPConfig
from ..errors import CPTypeError
from ..parallel.heads import HeadGroups
from ..plan import ShardPlan
from .state import StepState, build_step_state
from .world import GlobalRow, WorldView, plan_global_row, TokenRoute

__all__ = ("RankStep", "WorldStepPlan", "build_rank_step", "plan_rank_state", "plan_world_step")


@dataclass(frozen=True)
class RankStep:
    """What one rank of the whole-batch step builds for itself (Note [A rank's step without a process group]).

    Attributes:
        state: the rank's `StepState` (``group`` None).
        route: the rank's part of the token exchange (rows it sends to each rank, where received rows go).
        replica_of_row: ``[L_r]`` the dp replica of each local row (-1: padding).
        row: the global row it was built from.
    """

    state: StepState
    route: TokenRoute
    replica_of_row: torch.Tensor
    row: GlobalRow


@dataclass(frozen=True)
class WorldStepPlan:
    """The part of the whole-batch step every rank shares: the global row and its plan.

    Attributes:
        row: every replica's documents in dp order; plan: the global row's plan over ``dp x cp`` ranks.
        dp, cp: the mesh's shape; config: the step's `CPConfig`.
    """

    row: GlobalRow
    plan: ShardPlan
    dp: int
    cp: int
    config: CPConfig

    @property
    def world(self) -> int:
        return self.dp * self.cp

    def rank_step(self, rank: int) -> RankStep:
        """Rank `rank`'s state and token route (``0 <= rank < dp * cp``)."""
        if not isinstance(rank, int) or not 0 <= rank < self.world:
            raise ValueError(f"rank must be an int in [0, {self.world}), got {rank!r}")
        return build_rank_step(self.row, self.plan, _view(self.dp, self.cp, rank), self.config, torch.device("cpu"))


def build_rank_step(row: GlobalRow, plan: ShardPlan, view: WorldView, config: CPConfig, device: torch.device,
                    heads: Optional[HeadGroups] = None, warm_up: bool = True) -> RankStep:
    """`view.rank`'s state over ``view.group`` and its token route, for the agreed `row` and its `plan` (no
    collective unless `warm_up` on NCCL, Note [A rank's step without a process group])."""
    state = build_step_state(None, view.world, view.rank, view.group, config, device, heads, plan, warm_up,
                             runs=row.runs)
    route = TokenRoute.build(row, plan, view)
    return RankStep(state, route, row.replica_of(plan.rank_positions(view.rank)).to(device), row)


def plan_world_step(replica_lengths: Sequence[Sequence[int]], dp: int, cp: int,
                    config: Optional[CPConfig] = None) -> WorldStepPlan:
    """The global row and its plan, as every rank of a ``(dp, cp)`` whole-batch step builds them.

    Args:
        replica_lengths: ``dp`` rows, each its replica's runs in row order: ``n > 0`` a document of ``n``
            tokens, ``-n`` a padding run of ``n`` positions (what the step gathers from the rows' doc ids).
        dp, cp: the mesh's shape; config: as for `make_cp_world_batch_and_ctx` (default grouped).
    """
    config = CPConfig(layout="grouped") if config is None else config
    if not isinstance(config, CPConfig):
        raise CPTypeError(f"config must be a CPConfig, got {type(config).__name__}")
    runs = _runs_of(replica_lengths, dp, cp)
    view = _view(dp, cp, 0)
    row = GlobalRow.of([runs[r // cp] for r in range(dp * cp)], view)
    return WorldStepPlan(row, plan_global_row(row, dp * cp, config), dp, cp, config)


def plan_rank_state(replica_lengths: Sequence[Sequence[int]], dp: int, cp: int, rank: int,
                    config: Optional[CPConfig] = None) -> StepState:
    """The `StepState` rank `rank` of a ``(dp, cp)`` mesh builds in `make_cp_world_batch_and_ctx` for these rows,
    built in this process without a process group (``state.group`` is None; Note [A rank's step without a
    process group]). `replica_lengths`, `config`: as for `plan_world_step`."""
    return plan_world_step(replica_lengths, dp, cp, config).rank_step(rank).state


def _view(dp: int, cp: int, rank: int) -> WorldView:
    """The `WorldView` of `rank` in a ``(dp, cp)`` mesh of ranks ``d * cp + c``, without a group."""
    rank_at = tuple(tuple(d * cp + c for c in range(cp)) for d in range(dp))
    return WorldView(None, rank, dp * cp, dp, cp, rank // cp, rank % cp, rank_at)


def _runs_of(replica_lengths: Sequence[Sequence[int]], dp: int, cp: int) -> list[np.ndarray]:
    """Each replica's ``[runs, 2]`` (length, real) table, as the step gathers it; `ValueError` for bad input."""
    for name, value in (("dp", dp), ("cp", cp)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if len(replica_lengths) != dp:
        raise ValueError(f"replica_lengths must hold dp={dp} rows, got {len(replica_lengths)}")
    tables = []
    for d, row in enumerate(replica_lengths):
        runs = np.asarray(row, dtype=np.int64).reshape(-1)
        if runs.size == 0 or (runs == 0).any():
            raise ValueError(f"replica {d}'s row must be non-empty runs n > 0 (a document) or -n (padding), got {row!r}")
        tables.append(np.stack([np.abs(runs), (runs > 0).astype(np.int64)], 1))
    return tables
