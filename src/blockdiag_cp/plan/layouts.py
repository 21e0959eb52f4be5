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

from dataclasses import fields
from typing import Any, Optional

import torch

from ..errors import CPTypeError, check_choice, warn_moved
from ..registry import LAYOUTS
from .runs import validate_doc_ids
from .options import PlanOptions
from .shard_plan import ShardPlan


def plan_shards(
    doc_ids: torch.Tensor, world: int, layout: str = "contiguous", *, options: Optional[PlanOptions] = None,
    **moved: Any,
) -> ShardPlan:
    """Assign the padded row's positions to `world` ranks.

    Args:
        doc_ids: ``[1, S]`` or ``[S]`` integer document ids, 0 = padding.
        world: number of CP ranks (>= 1).
        layout: ``"contiguous"``, ``"balanced"`` or ``"grouped"``.
        options: the layout's knobs (`PlanOptions`, the same that ``CPConfig(plan=...)`` takes): the work model's
            sliding window (balanced, grouped; None: full causal attention), and the grouped layout's
            ``ranks_per_node`` (None: one node), ``token_cap`` (a rank's tokens at most this times the mean)
            and ``costs`` (the step's cost model; None: `StepCosts()`). None: ``PlanOptions()``.
        moved: the keywords of 0.10 (``window``, ``ranks_per_node``, ``token_cap``, ``costs``): deprecated, they
            keep working until 0.14 (Note [One spelling per knob] in config.py).

    Returns:
        The `ShardPlan`; `make_cp_blockdiag_batch_and_ctx` with the same layout
        produces exactly ``plan.rank_positions(rank)`` on each rank.
    """
    options = _options_with_moved(options, moved)
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
    ids_S = validate_doc_ids(ids_1S, ids_1S.shape[1], 1).reshape(-1).cpu()
    return make_plan(ids_S, world, layout, options)


def _options_with_moved(options: Optional[PlanOptions], moved: dict[str, Any]) -> PlanOptions:
    """`options`, or one made from the deprecated keywords of 0.10 (each warns, naming ``options=``)."""
    if options is not None and not isinstance(options, PlanOptions):
        raise CPTypeError(f"options must be a PlanOptions, got {type(options).__name__}")
    unknown = sorted(set(moved) - {f.name for f in fields(PlanOptions)})
    if unknown:
        raise TypeError(f"plan_shards got unexpected keyword argument(s) {', '.join(unknown)}")
    if moved and options is not None:
        raise ValueError(f"plan_shards got both options= and the deprecated {', '.join(sorted(moved))}=: put them in "
                         "options")
    for name in moved:
        warn_moved(f"plan_shards({name}=...)", f"plan_shards(..., options=PlanOptions({name}=...))", 2)
    return PlanOptions(**moved) if options is None else options


def make_plan(doc_ids_S: torch.Tensor, world: int, layout: str, options: Optional[PlanOptions] = None) -> ShardPlan:
    """`plan_shards` for ids already validated: ``[S]`` int64 on the CPU."""
    return LAYOUTS[layout].load()(doc_ids_S, world, PlanOptions() if options is None else options)
