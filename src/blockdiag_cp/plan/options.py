"""`PlanOptions`: what a layout plans with besides the document ids and the world."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .step_costs import StepCosts

#: a rank's tokens at most this times the mean (the grouped layout's memory cap)
DEFAULT_TOKEN_CAP = 1.25


@dataclass(frozen=True)
class PlanOptions:
    """What a layout plans with besides the row and the world: the plan component's config (``CPConfig(plan=...)``
    holds it, ``plan_shards(..., options=...)`` takes it; Note [One spelling per knob] in config.py).

    Attributes:
        ranks_per_node: (grouped) ranks ``r // ranks_per_node`` share a node (fast links); None: one node.
        token_cap: (grouped) a rank's tokens at most this times the mean tokens per rank (>= 1).
        costs: (grouped) the step's cost model; None: `StepCosts()` (a 1B-class Llama).
        window: the work model's sliding window, every layer (None: full causal; all layouts).
    """

    ranks_per_node: Optional[int] = None
    token_cap: float = DEFAULT_TOKEN_CAP
    costs: Optional[StepCosts] = None
    window: Optional[int] = None

    def __post_init__(self) -> None:
        rpn = self.ranks_per_node
        if rpn is not None and (isinstance(rpn, bool) or not isinstance(rpn, int) or rpn < 1):
            raise ValueError(f"ranks_per_node must be a positive int or None, got {rpn!r}")
        cap = self.token_cap
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap >= 1.0 or math.isinf(cap):
            raise ValueError(f"token_cap must be a finite number >= 1 (a multiple of the mean tokens), got {cap!r}")
        window = self.window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be a positive int or None, got {window!r}")
        if self.costs is not None and not isinstance(self.costs, StepCosts):
            raise ValueError(f"costs must be a StepCosts, got {type(self.costs).__name__}")
