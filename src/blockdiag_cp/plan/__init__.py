"""Where each token goes: layouts, the step's geometry, the cost models.

    runs.py         a document id row's runs (the lowest layer; plan/ imports nothing above it, config.py included)
    shard_plan.py   ShardPlan (positions per rank) and the attention work model
    layouts.py      plan_shards / make_plan: the layout registry's planner for a row
    options.py      PlanOptions: the work model's window and the grouped layout's knobs
    contiguous.py   the seed's equal contiguous chunks
    balanced.py     equal tokens and equal causal attention work per rank
    grouped.py      each document on the fewest nearby ranks its work needs (whole batches): the planner
    groups.py       the grouped layout's groups: a document cut over nearby ranks, its members' costs and links
    loads.py        the ranks' loads while a grouped plan is built, and the planner's moves on them
    whole_batch.py  whole batches from document lengths: rows packed as trainers pack them, fixed rows vs grouped
    step_costs.py   StepCosts: seconds per token, per pair, per byte; every cost formula, as its methods
    geometry.py     StepGeometry: who needs which keys (replicated, built once per step)
    ranges.py       host-side index helpers the planners share
    cost.py         bytes and time per exchange scheme (ulysses_degree="auto", `blockdiag-cp plan`)

The package is lazy (PEP 562), as the root is: `CPConfig` reads `PlanOptions` and `StepCosts`
(plain Python) without importing torch.
"""

import types as _types
import typing as _typing

from ..registry import lazy_attribute

if _typing.TYPE_CHECKING:
    from .layouts import make_plan, plan_shards
    from .options import PlanOptions
    from .shard_plan import ShardPlan, attention_work, merge_consecutive_ranks, pad_doc_ids, query_work
    from .step_costs import StepCosts

__all__ = ("PlanOptions", "ShardPlan", "StepCosts", "attention_work", "make_plan", "merge_consecutive_ranks",
           "pad_doc_ids", "plan_shards", "query_work")

_HOMES = _types.MappingProxyType({
    "PlanOptions": ".options",
    "ShardPlan": ".shard_plan",
    "StepCosts": ".step_costs",
    "attention_work": ".shard_plan",
    "make_plan": ".layouts",
    "merge_consecutive_ranks": ".shard_plan",
    "pad_doc_ids": ".shard_plan",
    "plan_shards": ".layouts",
    "query_work": ".shard_plan",
})


def __getattr__(name: str) -> object:
    value = lazy_attribute(__name__, _HOMES, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
