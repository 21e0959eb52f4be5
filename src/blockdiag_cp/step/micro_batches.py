"""Pipeline parallelism x CP: a step per micro-batch, each schedule action a turn of its micro-batch's step.

    make_cp_pipeline_batch_and_ctx   the rows of one schedule step, each sharded by the seed's step, stacked
                                     ``[M, L]``; with the `PipelineSteps` of their micro-batches
    PipelineSteps(ctxs)(schedule)    the context of one ``schedule.step(...)``: binds every local stage of the
                                     schedule to the micro-batches' steps for its duration

Note [Binding a schedule's stages to their micro-batches' steps]
----------------------------------------------------------------
torch's schedules (``torch.distributed.pipelining``: GPipe, 1F1B, Interleaved1F1B, LoopedBFS,
InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) run every piece of work through a few methods of
the stage, each naming its micro-batch: ``forward_one_chunk(k, ...)``, ``backward_one_chunk(k, ...)``
(the full backward, or zero-bubble's input part), ``backward_weight_one_chunk(k)`` (zero-bubble's
weight part); a DualPipeV overlap runs them one after the other. Before the first step, a stage
without static shapes runs micro-batch 0's forward and backward once to infer them
(``_prepare_forward_infra``, ``_prepare_backward_infra``).

Inside ``with steps(schedule):`` each of those methods of each local stage is, on the stage instance
(its class is untouched), the same method run as a turn of its micro-batch's step (Note [Steps in
flight, one turn at a time] in slot.py): every attention call, routed token mixer and checkpoint
recompute of that work finds that micro-batch's state, on every stage (those that receive hidden
states too: each rank holds every micro-batch's step), whatever order the schedule runs them in.
On exit the methods are the class's again and the steps end together.

The loss function runs outside the stage methods (torch's schedule calls it), so outside every
turn: it gets the last stage's output and the target, as in any pipeline.

Entering refuses, by name, before any work, what cannot be exact (Note [Ranks agree]: every rank of
the pipeline group raises alike): a number of steps that is not the schedule's number of
micro-batches; a schedule whose chunk spec splits its inputs along another dimension than the
batch's (each micro-batch must be whole packed rows: one split along the sequence cuts documents
apart); micro-batches of different local lengths (torch's stages take one shape); a stage bound
twice; and stages of one pipeline whose micro-batches differ (other rows or documents, another CP
rank, another length): a stage that dropped or replaced the documents.

The schedule's micro-batch inputs are checked where torch hands them to the stages: inside ``with
steps(schedule):`` the schedule's ``_step_microbatches`` (every ``step`` and ``eval`` of every torch
schedule goes through it, after splitting the whole-batch inputs, before any stage work: shape
inference, sends, forwards) is, on the schedule instance, the same method after a check of the
micro-batches this rank holds: ``M`` of them, each one packed row (the first stage's inputs
``[1, L, ...]`` of this rank's local length, every keyword tensor and target ``[1, ...]``). Only the
ranks of the first stage hold its inputs, so the verdict is agreed over the pipeline group (one small
all-gather, Note [Ranks agree]): every rank of the pipeline raises, none waits for a stage that
refused.

When the schedule's step is over, a micro-batch that no rank of the pipeline reached through the
library is refused (Note [A step the model never reached]: one small all-reduce); a rank whose stages
hold no token mixer (the embeddings alone, the head alone) reaches none and is not refused for it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import zlib
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from ..config import ENTRY_LAYOUT, CPConfig
from ..errors import CPTypeError, ensure
from ..parallel.agree import gather_fingerprints
from .batch import make_cp_blockdiag_batch_and_ctx
from .pipeline import TrainCtx
from .slot import STEP_SLOT, StepTicket, never_reached_refusal
from .state import StepState

__all__ = ("PipelineSteps", "STAGE_ACTIONS", "make_cp_pipeline_batch_and_ctx")

#: the stage methods that run a schedule's work, and the positional argument naming their micro-batch (None:
#: micro-batch 0, whose forward and backward torch's shape inference runs): Note [Binding a schedule's stages ...]
STAGE_ACTIONS: Mapping[str, Optional[int]] = MappingProxyType({
    "forward_one_chunk": 0,
    "backward_one_chunk": 0,
    "backward_weight_one_chunk": 0,
    "_prepare_forward_infra": None,
    "_prepare_backward_infra": None,
})
#: the keyword names torch gives the micro-batch argument
_CHUNK_KEYWORDS = ("fwd_chunk_id", "bwd_chunk_id")
#: the schedule method every ``step`` / ``eval`` runs its split micro-batches through (Note [Binding ...])
_SCHEDULE_INPUTS = "_step_microbatches"


@dataclass(frozen=True)
class PipelineSteps:
    """The steps of one schedule step's micro-batches, in order: ``train_ctxs[k]`` is micro-batch ``k``'s.

    ``PipelineSteps(ctxs)(schedule)`` is the context manager of one ``schedule.step(...)`` (or ``eval``):
    run it on every rank of the pipeline, around the call (Note [Binding a schedule's stages ...]). Each
    ``TrainCtx`` comes from `make_cp_blockdiag_batch_and_ctx` (or `make_cp_pipeline_batch_and_ctx`, which
    makes them all).
    """

    train_ctxs: tuple[TrainCtx, ...]

    def __post_init__(self) -> None:
        ctxs = tuple(self.train_ctxs)
        for i, ctx in enumerate(ctxs):
            if not isinstance(ctx, TrainCtx):
                raise CPTypeError(f"train_ctxs[{i}] must be the train_ctx a blockdiag-cp step entry returned, "
                                  f"got {type(ctx).__name__}")
        if not ctxs:
            raise ValueError("PipelineSteps needs one step per micro-batch, got none")
        object.__setattr__(self, "train_ctxs", ctxs)

    @property
    def states(self) -> tuple[StepState, ...]:
        return tuple(ctx.state for ctx in self.train_ctxs)

    def __call__(self, schedule: Any) -> "contextlib.AbstractContextManager[tuple[StepState, ...]]":
        return _bound(self.states, schedule)


def make_cp_pipeline_batch_and_ctx(
    cp_mesh, tp_mesh, rows: Sequence[dict[str, Any]], *, padding_token_id: int = 0,
    config: Optional[CPConfig] = None, seq_dims: Optional[Mapping[str, int]] = None,
) -> tuple[PipelineSteps, dict[str, Any]]:
    """The rows of one pipeline schedule step, each a micro-batch: ``(steps, batch)``.

    Args:
        cp_mesh, tp_mesh, padding_token_id, seq_dims: as `make_cp_blockdiag_batch_and_ctx`.
        config: every micro-batch's `CPConfig`; None: ``CPConfig(layout=ENTRY_LAYOUT)`` (balanced, as the
            library's other own entries; the rule: `CPConfig.layout`).
        rows: ``M`` packed rows (``M`` = the schedule's ``n_microbatches``), each a batch as
            `make_cp_blockdiag_batch_and_ctx` takes it (``input_ids [1, S]`` or ``inputs_embeds [1, S, E]``,
            ``_packed_seq_ids``, ``labels``, ...), all of one length ``S``. Not mutated.

    Returns:
        ``(steps, batch)``: `PipelineSteps` of the rows' steps; ``batch`` every key of the sharded rows,
        tensors stacked along dimension 0 (``input_ids [M, L]``, ``labels [M, L]``, ``position_ids [M, L]``,
        ``padding_mask [M, L]``, ...): torch's schedule splits them back into one row per micro-batch.

    Raises:
        ValueError: no rows, rows of different lengths, or ``layout="grouped"`` (whose ranks own lengths that
            change with the row; torch's stages take one shape): before any work.
    """
    rows = list(rows)
    config = CPConfig(layout=ENTRY_LAYOUT) if config is None else config
    _refuse_rows(rows, config)
    ctxs, shards = [], []
    for row in rows:
        ctx, shard = make_cp_blockdiag_batch_and_ctx(cp_mesh, tp_mesh, dict(row), padding_token_id=padding_token_id,
                                                     config=config, seq_dims=seq_dims)
        ctxs.append(ctx)
        shards.append(shard)
    return PipelineSteps(tuple(ctxs)), _stack(shards)


def _refuse_rows(rows: list, config: CPConfig) -> None:
    """`ValueError` for rows no pipeline step can take (the same on every rank: every rank holds the rows)."""
    if not rows:
        raise ValueError("make_cp_pipeline_batch_and_ctx needs at least one row (one per micro-batch)")
    if config.layout == "grouped":
        raise ValueError("layout='grouped' is refused under pipeline parallelism: its ranks own lengths that change "
                         "with the row, and torch's pipeline stages take one shape for every micro-batch; use "
                         "layout='contiguous' or 'balanced'")
    lengths = []
    for row in rows:
        primary = row.get("input_ids") if row.get("input_ids") is not None else row.get("inputs_embeds")
        lengths.append(primary.shape[1] if isinstance(primary, torch.Tensor) and primary.dim() >= 2 else None)
    if len(set(lengths)) > 1:
        raise ValueError(f"the micro-batches' rows must have one length (torch's pipeline stages take one shape for "
                         f"every micro-batch); got lengths {lengths}: pack them to one length")


def _stack(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """Every key of the sharded rows: tensors ``[1, ...]`` stacked along dimension 0; other values must agree."""
    keys = set(shards[0])
    if any(set(shard) != keys for shard in shards):
        raise ValueError(f"the rows hold different keys: {[sorted(shard) for shard in shards]}")
    batch: dict[str, Any] = {}
    for key in sorted(keys):
        values = [shard[key] for shard in shards]
        if not isinstance(values[0], torch.Tensor):
            if any(v != values[0] for v in values):
                raise ValueError(f"the rows' {key!r} differ ({values}); only tensors may differ between micro-batches")
            batch[key] = values[0]
            continue
        shapes = {tuple(v.shape) for v in values}
        if len(shapes) > 1 or values[0].dim() == 0 or values[0].shape[0] != 1:
            raise ValueError(f"the rows' {key!r} must be [1, ...] of one shape to stack one row per micro-batch, "
                             f"got {sorted(shapes)} (position_ids [3, 1, S] (mRoPE) has no pipeline form)")
        batch[key] = torch.cat(values, dim=0)
    return batch


@contextlib.contextmanager
def _bound(states: tuple[StepState, ...], schedule: Any) -> Iterator[tuple[StepState, ...]]:
    """Bind `schedule`'s local stages to the steps of `states` for the block (Note [Binding a schedule's stages
    ...]); the steps end when it exits."""
    stages, problem = _schedule_stages(schedule), None
    try:
        _check_schedule(schedule, stages, states)
    except ValueError as exc:
        problem = exc
    _agree_on_micro_batches(stages, states, problem)
    tickets = [STEP_SLOT.begin(state) for state in states]
    bound: list = []
    try:
        for stage in stages:
            bound.append(stage)
            _bind_stage(stage, tickets)
        bound.append(schedule)
        setattr(schedule, _SCHEDULE_INPUTS, _checking_inputs(stages, states, getattr(schedule, _SCHEDULE_INPUTS)))
        yield states
    except BaseException:
        _unbind(bound)
        STEP_SLOT.end(tickets, check_reached=False)
        raise
    _unbind(bound)
    _refuse_unreached(stages, STEP_SLOT.end(tickets, check_reached=False))


def _refuse_unreached(stages: list, reached: tuple[bool, ...]) -> None:
    """`ModelRefusal` on every rank of the pipeline if some micro-batch's step no rank of it reached (Note [A step
    the model never reached]; a rank whose stages hold no token mixer, only embeddings or the head, reaches none)."""
    reached_M = torch.tensor(reached, dtype=torch.long, device=stages[0].device)
    group = getattr(stages[0], "group", None)
    if dist.is_initialized():
        dist.all_reduce(reached_M, op=dist.ReduceOp.MAX, group=group)
    if not bool(reached_M.all()):
        raise never_reached_refusal()


def _schedule_stages(schedule: Any) -> list:
    """This rank's stages of a torch pipeline schedule (``_stages`` of a multi-stage schedule, ``_stage`` of a
    single-stage one)."""
    stages = getattr(schedule, "_stages", None)
    if stages is None and getattr(schedule, "_stage", None) is not None:
        stages = [schedule._stage]
    if not stages or not hasattr(schedule, "_n_microbatches"):
        raise CPTypeError(f"PipelineSteps(...)(schedule) takes a torch.distributed.pipelining schedule, got "
                          f"{type(schedule).__name__}")
    return list(stages)


def _check_schedule(schedule: Any, stages: list, states: tuple[StepState, ...]) -> None:
    """`ValueError` for a schedule the steps cannot run exactly (Note [Binding a schedule's stages ...])."""
    if schedule._n_microbatches != len(states):
        raise ValueError(f"the schedule runs {schedule._n_microbatches} micro-batches but {len(states)} steps were "
                         "given: one step per micro-batch")
    for name in ("_args_chunk_spec", "_kwargs_chunk_spec"):
        dims = sorted({spec.split_dim for spec in tree_leaves(getattr(schedule, name, None))
                       if hasattr(spec, "split_dim")} - {0})
        if dims:
            raise ValueError(f"the schedule's {name.strip('_')} splits micro-batches along dimension(s) {dims}: a "
                             "micro-batch must be whole packed rows (a split along the sequence cuts documents "
                             "apart); split every input along dimension 0, one row per micro-batch")
    lengths = sorted({state.local_len for state in states})
    if len(lengths) > 1:
        raise ValueError(f"the micro-batches' shards have different lengths {lengths} on this rank; torch's pipeline "
                         "stages take one shape: pack every micro-batch to one length (layout 'contiguous' or "
                         "'balanced')")
    for stage in stages:
        if any(name in vars(stage) for name in STAGE_ACTIONS):
            raise ValueError(f"stage {stage.stage_index} is already bound to micro-batch steps (a PipelineSteps "
                             "context inside another on the same schedule)")


def _pipeline_group(stages: list, states: tuple[StepState, ...], problem: Optional[Exception]) -> Any:
    """The pipeline's process group to agree over (Note [Ranks agree]); None where ranks do not agree (no
    process group, or ``check_ranks_agree=False``), after raising this rank's `problem` there."""
    if not dist.is_initialized() or not all(s.config.check_ranks_agree for s in states):
        if problem is not None:
            raise problem
        return None
    group = getattr(stages[0], "group", None)
    return dist.group.WORLD if group is None else group


def _agree_on_micro_batches(stages: list, states: tuple[StepState, ...], problem: Optional[Exception]) -> None:
    """Every rank of the pipeline group holds the same micro-batches (rows, documents, CP rank, local length),
    or every rank raises (Note [Ranks agree]): the documents reached every stage alike."""
    group = _pipeline_group(stages, states, problem)
    if group is None:
        return
    docs = zlib.crc32(b"".join(s.geometry.doc_ids.to(torch.long).cpu().numpy().tobytes() for s in states))
    fingerprint = [len(states), states[0].local_len, states[0].rank, states[0].world, docs,
                   zlib.crc32(repr(states[0].config).encode())]
    rows = gather_fingerprints(group, stages[0].device, fingerprint, problem, "pipeline micro-batches",
                               ranks="pipeline rank(s) {}")
    if any(row != rows[0] for row in rows):
        raise ValueError(
            "the stages of one pipeline disagree on their micro-batches: every stage must get the same rows "
            "(documents) and be the same CP rank (pass the pipeline sub-group, e.g. mesh['pp'], to PipelineStage). "
            f"[invalid, micro-batches, local length, CP rank, CP world, documents crc, config crc] per rank: {rows}")


def _bind_stage(stage: Any, tickets: list[StepTicket]) -> None:
    """Each of `stage`'s `STAGE_ACTIONS` becomes, on the instance, a turn of its micro-batch's step."""
    for name, where in STAGE_ACTIONS.items():
        method = getattr(stage, name, None)
        if method is not None:
            setattr(stage, name, _as_turn(stage, where, method, tickets))


def _unbind(bound: list) -> None:
    """The stages' and the schedule's methods are their classes' again."""
    for obj in bound:
        for name in (*STAGE_ACTIONS, _SCHEDULE_INPUTS):
            vars(obj).pop(name, None)


def _as_turn(stage: Any, where: Optional[int], method, tickets: list[StepTicket]):
    """`method` (one of a stage's `STAGE_ACTIONS`) run as a turn of its micro-batch's step."""
    @functools.wraps(method)
    def turn(*args, **kwargs):
        index = _micro_batch(where, args, kwargs)
        if not 0 <= index < len(tickets):
            raise ValueError(f"stage {stage.stage_index} ran micro-batch {index} of {len(tickets)}")
        with STEP_SLOT.turn(tickets[index]):
            return method(*args, **kwargs)
    return turn


def _checking_inputs(stages: list, states: tuple[StepState, ...], method):
    """The schedule's `_SCHEDULE_INPUTS` method (``(arg_mbs, kwarg_mbs, target_mbs, ...)``, the split
    micro-batches), run after every rank of the pipeline agreed that they are one packed row each (Note
    [Binding ...]: before any stage work, so no rank waits for a stage that refused)."""
    signature = inspect.signature(method)

    @functools.wraps(method)
    def step_microbatches(*args, **kwargs):
        given = signature.bind_partial(*args, **kwargs).arguments
        problem = _inputs_problem(stages, len(states), states[0].local_len, given.get("arg_mbs"),
                                  given.get("kwarg_mbs"), given.get("target_mbs"))
        group = _pipeline_group(stages, states, problem)
        if group is not None:
            gather_fingerprints(group, stages[0].device, (), problem, "micro-batch inputs",
                                ranks="pipeline rank(s) {}")
        return method(*args, **kwargs)
    return step_microbatches


def _micro_batch(where: Optional[int], args: tuple, kwargs: dict) -> int:
    """The micro-batch a stage method's call serves (`STAGE_ACTIONS`): its positional argument `where`, or that
    argument by torch's keyword; micro-batch 0 for `where` None."""
    if where is None:
        return 0
    if len(args) > where:
        return int(args[where])
    named = [kwargs[k] for k in _CHUNK_KEYWORDS if k in kwargs]
    ensure(len(named) == 1, f"a stage action called without its micro-batch: {sorted(kwargs)}")
    return int(named[0])


def _inputs_problem(stages: list, count: int, local_len: int, arg_mbs: Any, kwarg_mbs: Any,
                    target_mbs: Any) -> Optional[ValueError]:
    """This rank's objection to a schedule step's micro-batches (None if they are one packed row each): `count`
    of each list given; the first stage's inputs ``[1, L, ...]`` (only a rank holding it has them: the other
    stages get the previous stage's output), every keyword tensor and target ``[1, ...]``."""
    lists = {"arg_mbs": arg_mbs, "kwarg_mbs": kwarg_mbs, "target_mbs": target_mbs}
    miscounted = {name: len(mbs) for name, mbs in lists.items() if mbs is not None and len(mbs) != count}
    if miscounted:
        return ValueError(f"the schedule step was given {miscounted} micro-batches, not {count}: one step per "
                          "micro-batch")
    first = any(stage.is_first for stage in stages)
    for k in range(count):
        inputs = [t for t in tree_leaves(arg_mbs[k]) if isinstance(t, torch.Tensor)] if first and arg_mbs else []
        bad = [tuple(t.shape) for t in inputs if t.dim() < 2 or t.shape[0] != 1 or t.shape[1] != local_len]
        rest = (kwarg_mbs[k] if kwarg_mbs else None, target_mbs[k] if target_mbs else None)
        bad += [tuple(t.shape) for t in tree_leaves(rest) if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] != 1]
        if bad:
            return ValueError(
                f"micro-batch {k} of stage(s) {[s.stage_index for s in stages]} is shaped {bad}: each micro-batch "
                f"must be one packed row of this rank's {local_len} positions ([1, {local_len}, ...]); stack one "
                "row per micro-batch along dimension 0 (make_cp_pipeline_batch_and_ctx's batch)")
    return None
