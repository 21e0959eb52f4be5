"""Byte formulas, in one home: what a K/V row, a head all-to-all and a ring block carry.

The exchanges, head parallelism, the step state and the cost model (cost.py) all count bytes
with these, from the plan's geometry alone; `plan/` imports nothing from `step/`, `exchange/`
or `parallel/`, which build on it.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .geometry import StepGeometry


def kv_row_elements(kv_heads: int, head_dim: int, v_head_dim: Optional[int] = None) -> int:
    """Elements of one token's K/V row: ``Hk (Dk + Dv)`` (`v_head_dim` None: ``Dv = Dk``)."""
    return kv_heads * (head_dim + (head_dim if v_head_dim is None else v_head_dim))


def split_kv_heads(kv_heads: int, degree: int) -> int:
    """K/V heads each rank holds after the head split: ``Hk' / u`` with ``Hk' = lcm(Hk, u)``."""
    return kv_heads * (degree // math.gcd(kv_heads, degree)) // degree


def ulysses_peer_elements(degree: int, local_len: int, heads: int, kv_heads: int, head_dim: int,
                          v_head_dim: Optional[int] = None) -> int:
    """Elements one rank sends each other member of its group per attention call, forward (as many
    backward): its ``L`` tokens' q and k (``head_dim`` each) and v (``v_head_dim``, None: ``head_dim``)
    for that member's heads, and that member's output rows back (``v_head_dim``):
    ``L (Dk + Dv) (H/u + Hk'/u)``."""
    widths = head_dim + (head_dim if v_head_dim is None else v_head_dim)
    return local_len * widths * (heads // degree + split_kv_heads(kv_heads, degree))


def ulysses_elements(degree: int, local_len: int, heads: int, kv_heads: int, head_dim: int,
                     v_head_dim: Optional[int] = None) -> int:
    """Elements one rank sends in the all-to-alls of one attention call, forward (the same backward)."""
    return (degree - 1) * ulysses_peer_elements(degree, local_len, heads, kv_heads, head_dim, v_head_dim)


def travel_rows(geometry: StepGeometry) -> list[list[torch.Tensor]]:
    """``travel[o][t]``: rows of owner o's block that arrive at rank o + t (ascending).

    ``travel[o][0]`` is the whole block; for t >= 1 the rows some rank among
    ``o + t, ..., o + world - 1`` needs. (The cost model counts the ring's bytes from it.)
    """
    W = geometry.world
    travel = []
    for o in range(W):
        owned = geometry.plan.rank_positions(o)
        used_by = geometry.need_at(owned)  # [W, L_o]: rank j needs row i of o
        rows = [torch.arange(owned.numel())]
        downstream = torch.zeros(owned.numel(), dtype=torch.bool)
        for t in range(W - 1, 0, -1):
            downstream |= used_by[(o + t) % W]
            rows.insert(1, torch.nonzero(downstream).flatten())
        travel.append(rows)
    return travel
