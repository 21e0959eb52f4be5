"""`make_cp_blockdiag_batch_and_ctx`: the seed's step of one packed row, padded and sharded over its CP group.

The step runs the pipeline both entries share (Note [One step pipeline] in pipeline.py) with `ReplicaRow` as
its row source: the row is this replica's batch, the ranks agree with one small collective, the move pads
every sequence-aligned tensor to the plan's length and keeps this rank's positions.
``train_ctx()`` activates the step's state so every `cp_blockdiag_sdpa` call of the step attends per
document across ranks.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Mapping, Optional

import torch
import torch.distributed as dist

from ..config import CPConfig
from ..errors import CPTypeError
from ..parallel.heads import HeadGroups
from ..parallel.agree import agree_across_ranks
from ..plan import ShardPlan
from .inputs import SEQUENCE_KEYS, UNSHARDED_ROW_KEYS, pad_to, seq_dim_of
from .pipeline import mesh_device, run_step, shard_agreed
from .state import StepState


def make_cp_blockdiag_batch_and_ctx(
    cp_mesh,
    tp_mesh,
    batch: dict[str, Any],
    *,
    loss_mask: Optional[torch.Tensor] = None,
    padding_token_id: int = 0,
    config: Optional[CPConfig] = None,
    seq_dims: Optional[Mapping[str, int]] = None,
    shard_primary: bool = True,
) -> tuple[Callable[[], ContextManager], dict[str, Any]]:
    """Shard a packed batch for block-diagonal CP and return ``(train_ctx, batch)``.

    Args:
        cp_mesh: the 1-D context-parallel `DeviceMesh` (e.g. ``mesh["cp"]``), or
            None for a single process (world 1: documents are still masked).
        tp_mesh: the tensor-parallel sub-mesh (e.g. ``mesh["tp"]``) or None. CP never
            splits heads over it: every TP rank of a CP rank passes the same row and
            gets the same shard, and its attention layers see their own heads. It must
            be 1-D and share no rank with the CP group but this one (a `ValueError`
            otherwise: the same dimension passed twice, or a mesh laid over CP).
        batch: exactly one of ``inputs_embeds [1, S, E]`` (sliced differentiably, so
            gradients reach the full tensor) or ``input_ids [1, S]``. Mutated in
            place: ``attention_mask`` and flattening metadata are dropped,
            ``padding_mask [1, L]`` (True = pad) is added (a caller's ``padding_mask``
            is replaced by the one the document ids give, as in the seed),
            ``position_ids`` are added when absent (0..S-1, as the unsharded model
            would use), and every sequence-aligned tensor (`SEQUENCE_KEYS`;
            ``position_ids`` may be ``[3, 1, S]`` mRoPE; ``_packed_seq_ids`` may be
            ``[S]``) is padded and reduced to this rank's ``L`` positions. Another
            tensor with a dimension of length ``S`` is left whole, with a warning
            naming it, unless `seq_dims` says how to shard it.
        loss_mask: optional ``[1, S]`` per-token loss mask, padded with 0, sharded and
            stored as ``batch["loss_mask"]``.
        padding_token_id: the fill of padded ``input_ids``.
        config: `CPConfig` (exchange, kernel, layout); default `CPConfig()`.
        seq_dims: extra sequence-aligned keys and their sequence dimension, e.g.
            Gemma 3n's ``{"per_layer_inputs": 1}`` for ``[1, S, layers, dim]``; they are
            padded with 0 (False for bool) and sharded like the others.
        shard_primary: NeMo AutoModel 0.7.0's flag of this function; True (the seed's behaviour) is the only
            value: a model that shards its own primary stream would not follow this step's plan (`ValueError`).
            AutoModel's three-output form is `blockdiag_cp.integrations.automodel.shard_batch`.

    Returns:
        ``(train_ctx, batch)``: ``train_ctx()`` returns the context manager that
        activates this step; run forward *and* backward inside it.
    """
    if shard_primary is not True:
        raise ValueError("make_cp_blockdiag_batch_and_ctx(shard_primary=False) (NeMo AutoModel 0.7.0's flag) is not "
                         "supported: the step shards the primary stream (input_ids / inputs_embeds) by its own plan; "
                         "for AutoModel's (train_ctx, batch, layout) form use "
                         "blockdiag_cp.integrations.automodel.shard_batch")
    config = CPConfig() if config is None else config
    if not isinstance(config, CPConfig):
        raise CPTypeError(f"config must be a CPConfig, got {type(config).__name__}")
    world, rank, group = _cp_group(cp_mesh)
    _check_tp_mesh(tp_mesh, cp_mesh)
    source = ReplicaRow(world, rank, group, mesh_device(cp_mesh) if cp_mesh is not None else None)
    return run_step(source, batch, config, loss_mask, padding_token_id, seq_dims)


@dataclass(frozen=True)
class ReplicaRow:
    """The row source of the seed's step (Note [One step pipeline]): this replica's packed row over its CP group.

    Attributes:
        world, rank, group: the CP group (``(1, 0, None)`` for one process); device: where its collective runs.
    """

    world: int
    rank: int
    group: Any
    device: Optional[torch.device] = None

    def agree(self, doc_ids_1S: Optional[torch.Tensor], config: CPConfig, problem: Optional[Exception]) -> "OwnRow":
        """Every rank holds a valid batch, the same row and config (Note [Ranks agree]), unless turned off."""
        if self.group is not None and config.check_ranks_agree:
            _check_ranks_agree(doc_ids_1S, config, self.group, self.device, problem)
        if problem is not None:
            raise problem
        return OwnRow(doc_ids_1S[0], self.rank)


@dataclass(frozen=True)
class OwnRow:
    """The agreed row of the seed's step: the batch's own; the layout plans it; the move pads and slices."""

    doc_ids: torch.Tensor
    rank: int
    runs = None  # the geometry reads them from doc_ids

    @property
    def device(self) -> torch.device:
        return self.doc_ids.device

    def plan(self, config: CPConfig) -> Optional[ShardPlan]:
        return None  # the state plans it with config.layout

    def move(self, batch: dict[str, Any], plan: ShardPlan, padding_token_id: int, seq_dims: Mapping[str, int]) -> None:
        """Drop the unsharded row's metadata, add ``padding_mask``, keep this rank's positions of every tensor."""
        for key in UNSHARDED_ROW_KEYS:
            batch.pop(key, None)
        batch["padding_mask"] = (self.doc_ids == 0).unsqueeze(0)
        _shard_batch(batch, plan, self.rank, padding_token_id, seq_dims)

    def replica_of_row(self, plan: ShardPlan) -> None:
        return None  # every row is this rank's replica's


def shard_step(
    batch: dict[str, Any], doc_ids_1S: torch.Tensor, world: int, rank: int, group: Any, config: CPConfig,
    padding_token_id: int = 0, seq_dims: Optional[Mapping[str, int]] = None, heads: Optional[HeadGroups] = None,
) -> StepState:
    """Plan the step and shard `batch` in place for `rank` of `world` (no collective).

    The seed step's pipeline after the batch was validated and the ranks agreed (`shard_agreed`):
    add ``position_ids`` (0..S-1 when absent), build the `StepState`, drop the unsharded-row keys, add
    ``padding_mask``, shard every sequence-aligned tensor. What the planning benchmark times for any
    rank of any world.
    """
    if batch.get("position_ids") is None:
        batch["position_ids"] = torch.arange(doc_ids_1S.shape[1], device=doc_ids_1S.device).unsqueeze(0)
    source = ReplicaRow(world, rank, group)
    return shard_agreed(source, OwnRow(doc_ids_1S[0], rank), batch, config, heads, padding_token_id, seq_dims).state


def make_cp_batch_and_ctx(cp_mesh, tp_mesh, batch: dict[str, Any], **kwargs):
    """Generic CP entry (seed): a model-owned ``batch["_cp_make_batch_fn"]`` wins.

    The hook is popped from the batch and called as ``fn(cp_mesh, tp_mesh, batch,
    **kwargs)``; without one, the block-diagonal path runs.
    """
    hook = batch.pop("_cp_make_batch_fn", None)
    if hook is not None:
        if not callable(hook):
            raise CPTypeError(f"batch['_cp_make_batch_fn'] must be callable, got {type(hook).__name__}")
        return hook(cp_mesh, tp_mesh, batch, **kwargs)
    return make_cp_blockdiag_batch_and_ctx(cp_mesh, tp_mesh, batch, **kwargs)


def _cp_group(cp_mesh) -> tuple[int, int, Any]:
    """``(world, rank, group)`` of the CP mesh; ``(1, 0, None)`` for None."""
    if cp_mesh is None:
        return 1, 0, None
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(cp_mesh, DeviceMesh):
        raise CPTypeError(f"cp_mesh must be a DeviceMesh (e.g. mesh['cp']) or None, got {type(cp_mesh).__name__}")
    if cp_mesh.ndim != 1:
        raise ValueError(f"cp_mesh must be 1-D; pass the CP sub-mesh, e.g. mesh['cp'] (got {cp_mesh.ndim}-D)")
    world, group = cp_mesh.size(), cp_mesh.get_group()
    group_size = dist.get_world_size(group)
    if group_size != world:
        raise ValueError(
            f"the CP process group has {group_size} ranks but cp_mesh has {world}; the sub-group is "
            "mis-resolved (build the mesh with init_device_mesh and pass mesh['cp'])"
        )
    return world, cp_mesh.get_local_rank(), group


def _check_tp_mesh(tp_mesh, cp_mesh) -> None:
    """`ValueError` unless `tp_mesh` is None or a 1-D mesh meeting the CP group in this rank alone
    (computed from the meshes, which every rank holds alike: every rank raises together)."""
    if tp_mesh is None:
        return
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(tp_mesh, DeviceMesh):
        raise CPTypeError(f"tp_mesh must be a DeviceMesh (e.g. mesh['tp']) or None, got {type(tp_mesh).__name__}")
    if tp_mesh.ndim != 1:
        raise ValueError(f"tp_mesh must be 1-D; pass the TP sub-mesh, e.g. mesh['tp'] (got {tp_mesh.ndim}-D)")
    if cp_mesh is None:
        return
    tp_ranks, cp_ranks = set(tp_mesh.mesh.flatten().tolist()), set(cp_mesh.mesh.flatten().tolist())
    shared = sorted(tp_ranks & cp_ranks)
    if len(shared) > 1:
        raise ValueError(
            f"tp_mesh and cp_mesh share the ranks {shared}: the TP group must cross the CP group in this rank "
            "alone (build one mesh, e.g. init_device_mesh(device, (dp, cp, tp), mesh_dim_names=('dp', 'cp', 'tp')), "
            "and pass mesh['cp'] and mesh['tp'])"
        )


def _check_ranks_agree(
    doc_ids_1S: Optional[torch.Tensor], config: CPConfig, group, device: torch.device, problem: Optional[ValueError]
) -> None:
    """Every rank must hold a valid batch, and the same row and config (Note [Ranks agree])."""
    fingerprint = [0, 0, 0]
    if doc_ids_1S is not None:
        ids = doc_ids_1S[0].to(torch.long).cpu().numpy()
        fingerprint = [ids.size, zlib.crc32(ids.tobytes()), zlib.crc32(repr(config).encode())]
    agree_across_ranks(
        group, device, fingerprint, problem, "batch (the packed row: sequence length, document ids or CPConfig)",
        "S, id crc, config crc",
    )


def _shard_batch(
    batch: dict[str, Any], plan: ShardPlan, rank: int, padding_token_id: int, seq_dims: Mapping[str, int]
) -> None:
    """Pad every sequence-aligned tensor to ``plan.padded_len`` and keep `rank`'s positions."""
    start = plan.contiguous_start(rank)
    positions = plan.rank_positions(rank)
    rules = [(key, fill, None) for key, fill in SEQUENCE_KEYS.items()] + [(key, 0, d) for key, d in seq_dims.items()]
    for key, fill, given_dim in rules:
        t = batch.get(key)
        if not isinstance(t, torch.Tensor):
            continue
        dim = seq_dim_of(key, t) if given_dim is None else given_dim
        pad_value = padding_token_id if fill == "pad_token" else fill
        padded = pad_to(t, dim, plan.padded_len, 0 if t.is_floating_point() else pad_value)
        if start is not None:  # a copy, as a gathered shard is: the same strides for every row (a compiled
            # model guards on strides, even of size-1 dimensions, which .contiguous() leaves as they are)
            batch[key] = padded.narrow(dim, start, positions.numel()).clone(memory_format=torch.contiguous_format)
        else:
            batch[key] = padded.index_select(dim, positions.to(t.device))


