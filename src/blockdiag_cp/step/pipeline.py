"""One step pipeline for both entries: a row source says where the step's row comes from.

Note [One step pipeline]
------------------------
Both step entries run the same sequence, once per step (`run_step`):

    inputs   the entry's inputs in the batch's form (`read_inputs`, with read: one call, no collective)
    read     this rank's row: its document ids, or the problem with its batch; its positions when absent
    agree    the ranks agree on their rows and the config (the source's one small collective); a
             problem on any rank raises on every rank
    plan     the row's shard plan over the group (the same on every rank)
    move     every sequence-aligned tensor becomes this rank's positions of the row
    heads    the head-parallel groups (``heads.ulysses_degree``; under ``"auto"`` chosen from the row)
    state    the frozen `StepState` over the source's group

What differs is the *row source* (`RowSource`): one replica's packed row over its CP group
(`ReplicaRow` in batch.py: the row is the batch's, the move a pad and a slice), or the global
row of every replica's documents over all dp x cp ranks (`GlobalRowSource` in world.py: the
rows' run lengths gathered, the move a point-to-point exchange of token rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Mapping, Optional, Protocol

import torch

from ..config import CPConfig
from ..parallel.heads import HeadGroups, head_groups, make_head_groups
from ..plan import ShardPlan
from ..plan.cost import candidate_degrees, choose_ulysses_degree
from ..plan.geometry import Runs
from .doc_ids import resolve_doc_ids
from .inputs import check_batch, check_seq_dims, warn_unsharded
from .slot import STEP_SLOT
from .state import StepState, build_step_state


class AgreedRow(Protocol):
    """The step's row once the ranks agreed on it (Note [One step pipeline]).

    Attributes:
        doc_ids: ``[S_row]`` the row's document ids, the same on every rank of the group, on the step's device.
        runs: the row's `Runs` when known without reading `doc_ids` (Note [Localized geometry]), else None.
        device: the step's device.
    """

    doc_ids: torch.Tensor
    runs: Optional[Runs]
    device: torch.device

    def plan(self, config: CPConfig) -> Optional[ShardPlan]:
        """The row's plan over the group (None: the state plans it with ``config.layout``)."""

    def move(self, batch: dict[str, Any], plan: ShardPlan, padding_token_id: int, seq_dims: Mapping[str, int]) -> None:
        """Replace every sequence-aligned tensor of `batch` by this rank's positions of the row (the unsharded
        row's metadata dropped, ``padding_mask`` added)."""

    def replica_of_row(self, plan: ShardPlan) -> Optional[torch.Tensor]:
        """``[L]`` the dp replica of each local row (-1: padding), or None when all are this rank's replica's."""


class RowSource(Protocol):
    """Where a step's row comes from (Note [One step pipeline]).

    Attributes:
        world, rank, group: the group the step runs over and this rank's place in it.
    """

    world: int
    rank: int
    group: Any

    def agree(self, doc_ids_1S: Optional[torch.Tensor], config: CPConfig, problem: Optional[Exception]) -> AgreedRow:
        """The ranks agree on their rows and the config, every rank raising alike if one cannot go on (a
        `problem` with its batch, rows or configs that differ); then the step's row."""


def run_step(source: RowSource, batch: dict[str, Any], config: CPConfig, loss_mask: Optional[torch.Tensor],
             padding_token_id: int, seq_dims: Optional[Mapping[str, int]]) -> tuple["TrainCtx", dict[str, Any]]:
    """The step of `batch` over `source`'s group (Note [One step pipeline]); `batch` becomes this rank's shard."""
    seq_dims, doc_ids_1S, problem = read_inputs(batch, loss_mask, seq_dims, config, source.world)
    row = source.agree(doc_ids_1S, config, problem)
    heads = step_head_groups(row, source.world, source.rank, source.group, config)
    return shard_agreed(source, row, batch, config, heads, padding_token_id, seq_dims), batch


def shard_agreed(source: RowSource, row: AgreedRow, batch: dict[str, Any], config: CPConfig,
                 heads: Optional[HeadGroups], padding_token_id: int = 0,
                 seq_dims: Optional[Mapping[str, int]] = None) -> "TrainCtx":
    """The pipeline once the ranks agreed and the heads are known: plan, state, move. `heads` None: the
    state places ``heads.ulysses_degree`` without process groups (what tools and benchmarks plan)."""
    ids = None if row.runs is not None else row.doc_ids  # known runs: the ids are not read
    state = build_step_state(ids, source.world, source.rank, source.group, config, row.device, heads,
                             row.plan(config), runs=row.runs)
    row.move(batch, state.plan, padding_token_id, seq_dims or {})
    return TrainCtx(state, row.replica_of_row(state.plan))


def read_inputs(batch: dict[str, Any], loss_mask: Optional[torch.Tensor], seq_dims: Optional[Mapping[str, int]],
                config: CPConfig, world: int) -> tuple[Mapping[str, int], Optional[torch.Tensor], Optional[Exception]]:
    """The pipeline's *inputs* and *read* (no collective): ``(seq_dims, doc ids [1, S], problem)`` of this rank's
    batch; a valid batch gets its ``position_ids`` (0..S-1, as the unsharded model would use) when it has none,
    and a warning for tensors that look sequence-aligned but that no rule shards."""
    take_row_inputs(batch, loss_mask)
    seq_dims, S, doc_ids_1S, problem = read_row(batch, seq_dims, config, world)
    if problem is None:
        warn_unsharded(batch, S, seq_dims)
        if batch.get("position_ids") is None:
            batch["position_ids"] = torch.arange(S, device=doc_ids_1S.device).unsqueeze(0)
    return seq_dims, doc_ids_1S, problem


def take_row_inputs(batch: dict[str, Any], loss_mask: Optional[torch.Tensor]) -> None:
    """The entry's inputs in the batch's form: `loss_mask` as ``batch["loss_mask"]``, ``_packed_seq_ids`` ``[1, S]``."""
    if loss_mask is not None:
        batch["loss_mask"] = loss_mask
    packed = batch.get("_packed_seq_ids")
    if isinstance(packed, torch.Tensor) and packed.dim() == 1:
        batch["_packed_seq_ids"] = packed.unsqueeze(0)


def read_row(batch: dict[str, Any], seq_dims, config: CPConfig, world: int):
    """``(seq_dims, S, doc ids [1, S], problem)`` of this rank's batch; a bad batch is a `problem`
    (raised after the ranks agree, so every rank fails alike), with None for what it lacks."""
    try:
        seq_dims = check_seq_dims(seq_dims)
        _, S, device = check_batch(batch, seq_dims)
        return seq_dims, S, resolve_doc_ids(batch, S, device, 1), config.ulysses_problem(world)
    except ValueError as exc:
        return {}, 0, None, exc


def step_head_groups(row: Any, world: int, rank: int, group: Any, config: CPConfig) -> HeadGroups:
    """This rank's head-parallel groups for the step: ``config.heads.ulysses_degree``, or under ``"auto"``
    the degree of the fewest bytes per rank (`cost.choose_ulysses_degree`) for the row's ``doc_ids`` ``[S]`` (read
    only then), its groups made once."""
    if config.heads.ulysses_degree != "auto":
        return head_groups(group, world, rank, config.heads.ulysses_degree)
    # every candidate's groups first, whatever this row picks: the same groups on every dp replica
    make_head_groups(group, world, rank, candidate_degrees(world, config.heads.attention_heads[0]))
    choice = choose_ulysses_degree(row.doc_ids, world, config.heads.attention_heads, layout=config.layout,
                                   options=config.plan, exchange=config.kv_exchange)
    return head_groups(group, world, rank, choice.degree, choice.reason)


@dataclass(frozen=True)
class TrainCtx:
    """``train_ctx()``: the context manager that makes this step the active one; ``.state`` is the step.

    ``replica_of_row``: under the whole-batch step (`make_cp_world_batch_and_ctx`), ``[L]`` the dp replica
    each local row came from (-1: padding); None for a step of one row, whose rows are all its replica's.
    """

    state: StepState
    replica_of_row: Optional[torch.Tensor] = None

    def __call__(self) -> ContextManager[StepState]:
        return STEP_SLOT.activate(self.state)


def mesh_device(cp_mesh) -> torch.device:
    if cp_mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(cp_mesh.device_type)
