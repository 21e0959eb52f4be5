"""`gather_sequence`: differentiable unshard of per-rank tensors back to global order."""

from __future__ import annotations

from typing import Optional

import torch

from ..parallel.collectives import AllGatherRows
from .slot import STEP_SLOT
from .state import StepState


def gather_sequence(local: torch.Tensor, seq_dim: int = 1, state: Optional[StepState] = None) -> torch.Tensor:
    """Gather every rank's shard of a sequence-aligned tensor into the full row.

    Args:
        local: this rank's shard, ``L`` long on `seq_dim` (e.g. logits ``[1, L, V]``).
        seq_dim: the sequence dimension of `local`.
        state: the step (default: the active one).

    Returns:
        The tensor at the unpadded length ``S`` on `seq_dim`, positions in global
        order, identical on every rank. Differentiable: each rank's gradient with
        respect to its shard is the sum of every rank's gradient for those rows.
    """
    state = STEP_SLOT.current() if state is None else state
    if state is None:
        raise ValueError("gather_sequence needs a block-diagonal CP step: call it inside train_ctx() or pass state=")
    plan = state.plan
    if local.shape[seq_dim] != state.local_len:
        raise ValueError(f"local has length {local.shape[seq_dim]} on dim {seq_dim}, the shard length is {state.local_len}")
    rows = local.movedim(seq_dim, 0)
    if state.world > 1:
        missing = plan.max_local_len - rows.shape[0]  # a shorter shard of a grouped plan: padded for the collective
        if missing:
            rows = torch.cat([rows, rows.new_zeros((missing, *rows.shape[1:]))])
        rows = AllGatherRows.apply(rows, state.group)
    full = rows.index_select(0, state.geometry.gathered_row[: plan.seq_len].to(rows.device))
    return full.movedim(0, seq_dim)
