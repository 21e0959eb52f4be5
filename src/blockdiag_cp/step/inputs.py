"""What a step takes from a batch: the sequence-aligned keys, their checks and their padding.

Shared by both step entries (`make_cp_blockdiag_batch_and_ctx`, `make_cp_world_batch_and_ctx`) through the
pipeline (pipeline.py): a batch is checked here before any collective, so a bad one becomes a problem that
every rank raises alike after the ranks agree.
"""

from __future__ import annotations

import warnings
from types import MappingProxyType
from typing import Any, Mapping, Optional

import torch

from ..errors import CPTypeError
from .rows import IGNORE_INDEX, ROW_METADATA

#: Sequence-aligned batch keys and the value their padding takes ("pad_token": the
#: caller's ``padding_token_id``). Floating tensors pad with 0.
SEQUENCE_KEYS: Mapping[str, Any] = MappingProxyType(
    {
        "inputs_embeds": 0,
        "input_ids": "pad_token",
        "labels": IGNORE_INDEX,
        "shift_labels": IGNORE_INDEX,
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


def check_batch(batch: Mapping[str, Any],
                seq_dims: Mapping[str, int] = MappingProxyType({})) -> tuple[str, int, torch.device]:
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


def pad_to(t: torch.Tensor, dim: int, length: int, value) -> torch.Tensor:
    missing = length - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t, torch.full(shape, value, dtype=t.dtype, device=t.device)], dim=dim)
