"""Where each token goes: layouts, the step's geometry, the cost model.

    shard_plan.py   ShardPlan (positions per rank) and the attention work model
    layouts.py      plan_shards / make_plan: the layout registry's planner for a row
    contiguous.py   the seed's equal contiguous chunks
    balanced.py     equal tokens and equal causal attention work per rank
    geometry.py     StepGeometry: who needs which keys (replicated, built once per step)
    ranges.py       host-side index helpers the planners share
    cost.py         bytes and time per exchange scheme (ulysses_degree="auto", `blockdiag-cp plan`)
"""

from .layouts import make_plan, plan_shards
from .shard_plan import ShardPlan, attention_work, merge_consecutive_ranks, pad_doc_ids, query_work

__all__ = ("ShardPlan", "attention_work", "make_plan", "merge_consecutive_ranks", "pad_doc_ids", "plan_shards",
           "query_work")
