"""`make_cp_blockdiag_batch_and_ctx`: pad and shard a packed batch, build the step state.

Once per step: batch -> document ids -> (ranks agree) -> shard plan -> sharded tensors and
a frozen `StepState`. ``train_ctx()`` activates that state so every
`cp_blockdiag_sdpa` call of the step attends per document across ranks.
"""

from __future__ import annotations

import warnings
import zlib
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, ContextManager, Mapping, Optional

import torch
import torch.distributed as dist

from ..config import CPConfig
from ..plan.cost import candidate_degrees, choose_ulysses_degree
from .doc_ids import resolve_doc_ids
from ..errors import CPTypeError
from ..parallel.heads import HeadGroups, head_groups, make_head_groups
from .agree import agree_across_ranks
from ..plan import ShardPlan
from .rows import ROW_METADATA
from .slot import STEP_SLOT
from .state import StepState, build_step_state

#: Sequence-aligned batch keys and the value their padding takes ("pad_token": the
#: caller's ``padding_token_id``). Floating tensors pad with 0.
SEQUENCE_KEYS: Mapping[str, Any] = MappingProxyType(
    {
        "inputs_embeds": 0,
        "input_ids": "pad_token",
        "labels": -100,
        "shift_labels": -100,
        "position_ids": 0,
        "_packed_seq_ids": 0,
        "loss_mask": 0,
        "padding_mask": True,
        "token_type_ids": 0,
        "visual_pos_masks": False,
    }
)

#: Keys that describe the unsharded row (flattening collators); consumed for the
#: document ids, then dropped because they are wrong for a shard.
UNSHARDED_ROW_KEYS = ROW_METADATA


def make_cp_blockdiag_batch_and_ctx(
    cp_mesh,
    tp_mesh,
    batch: dict[str, Any],
    *,
    loss_mask: Optional[torch.Tensor] = None,
    padding_token_id: int = 0,
    config: Optional[CPConfig] = None,
    seq_dims: Optional[Mapping[str, int]] = None,
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

    Returns:
        ``(train_ctx, batch)``: ``train_ctx()`` returns the context manager that
        activates this step; run forward *and* backward inside it.
    """
    config = CPConfig() if config is None else config
    if not isinstance(config, CPConfig):
        raise CPTypeError(f"config must be a CPConfig, got {type(config).__name__}")
    world, rank, group = _cp_group(cp_mesh)
    _check_tp_mesh(tp_mesh, cp_mesh)
    take_row_inputs(batch, loss_mask)
    seq_dims, S, doc_ids_1S, problem = read_row(batch, seq_dims, config, world)
    if group is not None and config.check_ranks_agree:
        _check_ranks_agree(doc_ids_1S, config, group, mesh_device(cp_mesh), problem)
    if problem is not None:
        raise problem
    warn_unsharded(batch, S, seq_dims)
    heads = step_head_groups(doc_ids_1S[0], world, rank, group, config)
    state = shard_step(batch, doc_ids_1S, world, rank, group, config, padding_token_id, seq_dims, heads)
    return TrainCtx(state), batch


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
        _, S, device = _check_batch(batch, seq_dims)
        return seq_dims, S, resolve_doc_ids(batch, S, device, 1), config.ulysses_problem(world)
    except ValueError as exc:
        return {}, 0, None, exc


def step_head_groups(doc_ids_S: torch.Tensor, world: int, rank: int, group: Any, config: CPConfig) -> HeadGroups:
    """This rank's head-parallel groups for the step: ``config.heads.ulysses_degree``, or under ``"auto"``
    the degree of the fewest bytes per rank (`cost.choose_ulysses_degree`), its groups made once."""
    if config.heads.ulysses_degree != "auto":
        return head_groups(group, world, rank, config.heads.ulysses_degree)
    # every candidate's groups first, whatever this row picks: the same groups on every dp replica
    make_head_groups(group, world, rank, candidate_degrees(world, config.heads.attention_heads[0]))
    choice = choose_ulysses_degree(doc_ids_S, world, config.heads.attention_heads, layout=config.layout,
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


def shard_step(
    batch: dict[str, Any], doc_ids_1S: torch.Tensor, world: int, rank: int, group: Any, config: CPConfig,
    padding_token_id: int = 0, seq_dims: Optional[Mapping[str, int]] = None, heads: Optional[HeadGroups] = None,
) -> StepState:
    """Plan the step and shard `batch` in place for `rank` of `world` (no collective).

    The part of `make_cp_blockdiag_batch_and_ctx` after the batch was validated and
    the ranks agreed: drop the unsharded-row keys, add ``position_ids`` (0..S-1 when
    absent) and ``padding_mask``, build the `StepState`, shard every sequence-aligned
    tensor. Also what the planning benchmark times for any rank of any world.
    """
    S = doc_ids_1S.shape[1]
    for key in UNSHARDED_ROW_KEYS:
        batch.pop(key, None)
    if batch.get("position_ids") is None:
        batch["position_ids"] = torch.arange(S, device=doc_ids_1S.device).unsqueeze(0)
    batch["padding_mask"] = doc_ids_1S == 0
    state = build_step_state(doc_ids_1S[0], world, rank, group, config, doc_ids_1S.device, heads)
    _shard_batch(batch, state.plan, rank, padding_token_id, seq_dims or {})
    return state


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


def seq_dim_of(key: str, tensor: torch.Tensor) -> int:
    return 2 if key == "position_ids" and tensor.dim() == 3 else 1


def check_seq_dims(seq_dims: Optional[Mapping[str, int]]) -> dict[str, int]:
    if seq_dims is None:
        return {}
    if not isinstance(seq_dims, Mapping) or not all(isinstance(k, str) for k in seq_dims):
        raise CPTypeError(f"seq_dims must map batch keys to their sequence dimension, got {seq_dims!r}")
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in seq_dims.values()):
        raise ValueError(f"seq_dims must give non-negative int dimensions, got {dict(seq_dims)!r}")
    return dict(seq_dims)


def warn_unsharded(batch: Mapping[str, Any], S: int, seq_dims: Mapping[str, int]) -> None:
    """Warn about tensors that look sequence-aligned but that no rule shards (they stay whole on every rank)."""
    known = {*SEQUENCE_KEYS, *seq_dims, *UNSHARDED_ROW_KEYS}
    for key, t in batch.items():
        if key not in known and isinstance(t, torch.Tensor) and t.dim() >= 1 and S in t.shape:
            warnings.warn(
                f"blockdiag-cp: batch[{key!r}] {tuple(t.shape)} has a dimension of the sequence length {S} but is not "
                f"sharded (every rank keeps it whole); if it is sequence-aligned, pass "
                f"seq_dims={{{key!r}: {list(t.shape).index(S)}}}"
            )


def _check_batch(batch: Mapping[str, Any], seq_dims: Mapping[str, int] = MappingProxyType({})) -> tuple[str, int, torch.device]:
    """Return ``(primary key, S, device)``; `ValueError` for a batch CP cannot shard."""
    has_embeds, has_ids = batch.get("inputs_embeds") is not None, batch.get("input_ids") is not None
    if has_embeds == has_ids:
        raise ValueError("the batch must hold exactly one of 'inputs_embeds' [1, S, E] or 'input_ids' [1, S]")
    key = "inputs_embeds" if has_embeds else "input_ids"
    primary = batch[key]
    shape = f"[B, S{', E' if has_embeds else ''}]"
    if not isinstance(primary, torch.Tensor):
        raise CPTypeError(f"batch[{key!r}] must be a tensor shaped {shape}, got {type(primary).__name__}")
    if primary.dim() != (3 if has_embeds else 2):
        raise ValueError(f"batch[{key!r}] must be a tensor shaped {shape}, got {tuple(primary.shape)}")
    for name, t in batch.items():
        if isinstance(t, torch.Tensor) and t.device.type == "meta":
            raise ValueError(
                f"batch[{name!r}] is on the meta device (shapes only, no values); CP needs the real tensor "
                "(materialize the model or embeddings on cpu/cuda, e.g. model.to_empty(...) and load the "
                "weights, before building the CP batch)"
            )
    B, S = primary.shape[:2]
    if B != 1:
        raise ValueError(
            f"block-diagonal CP shards one packed sequence per rank: local batch size must be 1, got {B}. "
            "Pack the samples into one row (set the local batch size to 1)."
        )
    if S == 0:
        raise ValueError(f"batch[{key!r}] is empty: the sequence must hold at least one token")
    for name in SEQUENCE_KEYS:
        t = batch.get(name)
        if isinstance(t, torch.Tensor):
            dim = seq_dim_of(name, t)
            batch_dim = 1 if dim == 2 else 0
            if t.dim() <= dim or t.shape[dim] != S or t.shape[batch_dim] != 1:
                raise ValueError(
                    f"batch[{name!r}] {tuple(t.shape)} is not aligned with the sequence: expected "
                    f"batch size 1 and length {S} on dim {dim}"
                )
    for name, dim in seq_dims.items():
        t = batch.get(name)
        if not isinstance(t, torch.Tensor) or t.dim() <= dim or t.shape[dim] != S:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"seq_dims[{name!r}] = {dim}: batch[{name!r}] {shape} has no length-{S} dimension {dim}")
    return key, S, primary.device


def mesh_device(cp_mesh) -> torch.device:
    if cp_mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(cp_mesh.device_type)


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


def pad_to(t: torch.Tensor, dim: int, length: int, value) -> torch.Tensor:
    missing = length - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t, torch.full(shape, value, dtype=t.dtype, device=t.device)], dim=dim)
