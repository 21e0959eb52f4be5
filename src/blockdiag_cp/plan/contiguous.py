"""The contiguous layout (the seed's): equal contiguous chunks of the padded row."""

from __future__ import annotations

from typing import Optional

import torch

from .options import PlanOptions
from .shard_plan import ShardPlan


def plan_contiguous(doc_ids_S: torch.Tensor, world: int, options: Optional[PlanOptions] = None) -> ShardPlan:
    """Pad to a multiple of `world`; rank r owns ``[r*L, (r+1)*L)``."""
    S = doc_ids_S.numel()
    local_len = -(-S // world)
    positions = torch.arange(local_len * world).reshape(world, local_len)
    return ShardPlan.from_rows("contiguous", S, positions)
