"""`plan_shards`: the token-to-rank assignment, by the layout registry's planner.

Each planner is a strategy ``(doc_ids [S], world, options: PlanOptions) -> ShardPlan``
(`PlanOptions`: the work model's sliding window, and the grouped layout's knobs),
registered in `blockdiag_cp.registry.LAYOUTS`:

    contiguous   the seed's equal contiguous chunks                         (contiguous.py)
    balanced     equal tokens and equal causal attention work               (balanced.py)
    grouped      each document on the fewest nearby ranks its work needs,   (grouped.py)
                 modeled time balanced (a whole global batch over dp x cp)
"""

from __future__ import annotations

from typing import Optional

import torch

from ..errors import CPTypeError, check_choice
from ..registry import LAYOUTS
from .runs import validate_doc_ids
from .options import DEFAULT_TOKEN_CAP, PlanOptions
from .shard_plan import ShardPlan
from .step_costs import StepCosts


def plan_shards(
    doc_ids: torch.Tensor, world: int, layout: str = "contiguous", window: Optional[int] = None, *,
    ranks_per_node: Optional[int] = None, token_cap: float = DEFAULT_TOKEN_CAP, costs: Optional[StepCosts] = None,
) -> ShardPlan:
    """Assign the padded row's positions to `world` ranks.

    Args:
        doc_ids: ``[1, S]`` or ``[S]`` integer document ids, 0 = padding.
        world: number of CP ranks (>= 1).
        layout: ``"contiguous"``, ``"balanced"`` or ``"grouped"``.
        window: the balanced and grouped layouts' work model counts a sliding window of
            this size (every layer windowed); None: full causal attention.
        ranks_per_node, token_cap, costs: the grouped layout's knobs (`PlanOptions`):
            ranks ``r // ranks_per_node`` share a node (None: one node), a rank's tokens at
            most `token_cap` times the mean, the step's cost model (None: `StepCosts()`).

    Returns:
        The `ShardPlan`; `make_cp_blockdiag_batch_and_ctx` with the same layout
        produces exactly ``plan.rank_positions(rank)`` on each rank.
    """
    check_choice("layout", layout, LAYOUTS.choices)
    if isinstance(world, bool) or not isinstance(world, int):
        raise CPTypeError(f"world must be a positive int, got {type(world).__name__}")
    if world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    if not isinstance(doc_ids, torch.Tensor):
        raise CPTypeError(f"doc_ids must be a [1, S] or [S] tensor, got {type(doc_ids).__name__}")
    if doc_ids.dim() not in (1, 2):
        raise ValueError(f"doc_ids must be a [1, S] or [S] tensor, got shape {tuple(doc_ids.shape)}")
    ids_1S = doc_ids.reshape(1, -1) if doc_ids.dim() == 1 else doc_ids
    if ids_1S.shape[0] != 1:
        raise ValueError(f"doc_ids must hold one packed row, got batch size {ids_1S.shape[0]}")
    if ids_1S.shape[1] == 0:
        raise ValueError("doc_ids is empty: the sequence must hold at least one token")
    options = PlanOptions(ranks_per_node=ranks_per_node, token_cap=token_cap, costs=costs, window=window)
    ids_S = validate_doc_ids(ids_1S, ids_1S.shape[1], 1).reshape(-1).cpu()
    return make_plan(ids_S, world, layout, options)


def make_plan(doc_ids_S: torch.Tensor, world: int, layout: str, options: Optional[PlanOptions] = None) -> ShardPlan:
    """`plan_shards` for ids already validated: ``[S]`` int64 on the CPU."""
    return LAYOUTS[layout].load()(doc_ids_S, world, PlanOptions() if options is None else options)
