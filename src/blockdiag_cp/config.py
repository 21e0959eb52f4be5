"""`CPConfig`: the user-facing knobs of one block-diagonal CP step, validated once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from .errors import CPTypeError, check_choice
from .plan.options import DEFAULT_TOKEN_CAP, PlanOptions
from .plan.step_costs import StepCosts
from .registry import EXCHANGES, KERNELS, LAYOUTS


#: the layout of the library's own entries when they are given no config (the rule: `CPConfig.layout`)
ENTRY_LAYOUT = "balanced"


@dataclass(frozen=True, kw_only=True)
class CPConfig:
    """How a block-diagonal CP step exchanges K/V, computes attention and lays out tokens.

    Attributes:
        kv_exchange: how each rank obtains the keys/values its queries need.
            ``"auto"`` (default) picks the cheapest exact exchange for the step's
            layout; ``"allgather"`` gathers every rank's K/V; ``"halo"``,
            ``"a2a"``, ``"p2p"`` and ``"ring"`` move only what the queries need (``"p2p"``:
            point-to-point with the ranks that share documents, auto's choice under ``"grouped"``).
        kernel: the local attention kernel. ``"auto"`` picks the fastest correct
            kernel available; ``"dense"`` is the masked reference; ``"sdpa"`` is
            PyTorch's fused attention called per document piece; ``"flash"``,
            ``"te"``, ``"flex"`` are the GPU kernels.
        layout: the token-to-rank assignment: ``"contiguous"`` (the seed's equal
            contiguous chunks), ``"balanced"`` (equal attention work per rank) or
            ``"grouped"`` (each document on the fewest nearby ranks its work needs, modeled
            time balanced; ranks may hold different numbers of tokens: the layout of
            `make_cp_world_batch_and_ctx`, Note [Grouped planner]). The defaults, in one
            place: ``CPConfig()`` and the seed's entry `make_cp_blockdiag_batch_and_ctx`
            (and `make_cp_batch_and_ctx`) with ``config=None`` keep the seed's
            ``"contiguous"`` (its callers may shard their own tensors the same way); the
            library's own entries given no config use `ENTRY_LAYOUT` (``"balanced"``: the
            Trainer mixin and its DPO/GRPO scoring forwards, `make_cp_vlm_batch_and_ctx`,
            ``blockdiag-cp demo``, the examples), except the whole-batch step
            (`make_cp_world_batch_and_ctx`, the mixin's ``whole_batch=True``): ``"grouped"``.
        check_ranks_agree: at step start, verify with one small collective that
            every rank of the CP group holds the same document ids (a mismatch
            raises the same error everywhere instead of hanging). Turn off for speed.
        balance_window: the balanced layout's work model assumes every layer attends
            through this sliding window (a windowed document's work is linear in its
            length); None (default) balances full causal attention, right for any
            model with a global layer.
        ulysses_degree: head-parallel CP (Note [Head-parallel groups] in
            ``exchange/ulysses.py``): the CP group of ``cp`` ranks splits into ``cp / u``
            groups of ``u`` consecutive ranks; inside a group an all-to-all swaps sequence
            shards for head shards, across groups `kv_exchange` moves the K/V the group's
            documents need. 1 (default): no head parallelism; ``cp``: pure Ulysses;
            ``"auto"``: the degree with the fewest bytes per rank (needs `attention_heads`).
        attention_heads: ``(query heads, K/V heads)`` of the model's attention, for the
            byte model of ``ulysses_degree="auto"``.
        ranks_per_node: (grouped) ranks ``r // ranks_per_node`` share a node; a document's
            group crosses nodes only when its work needs more ranks. None: one node.
        token_cap: (grouped) a rank's tokens at most this times the mean (memory), >= 1.
        step_costs: (grouped) the step's cost model (`blockdiag_cp.plan.StepCosts`, e.g.
            ``StepCosts.from_config(model.config)``); None: a 1B-class Llama's.
    """

    kv_exchange: str = "auto"
    kernel: str = "auto"
    layout: str = "contiguous"
    check_ranks_agree: bool = True
    balance_window: Optional[int] = None
    ulysses_degree: Union[int, str] = 1
    attention_heads: Optional[tuple[int, int]] = None
    ranks_per_node: Optional[int] = None
    token_cap: float = DEFAULT_TOKEN_CAP
    step_costs: Optional[StepCosts] = None

    def __post_init__(self) -> None:
        check_choice("kv_exchange", self.kv_exchange, EXCHANGES.choices)
        check_choice("kernel", self.kernel, KERNELS.choices)
        check_choice("layout", self.layout, LAYOUTS.choices)
        if not isinstance(self.check_ranks_agree, bool):
            raise CPTypeError(f"check_ranks_agree must be a bool, got {self.check_ranks_agree!r}")
        window = self.balance_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
            raise CPTypeError(f"balance_window must be an int or None, got {type(window).__name__}")
        if window is not None and window < 1:
            raise ValueError(f"balance_window must be >= 1, got {window}")
        _check_ulysses(self.ulysses_degree, self.attention_heads)
        self.plan_options()  # validates the grouped knobs
        if self.layout == "grouped" and self.ulysses_degree != 1:
            raise ValueError(f"ulysses_degree={self.ulysses_degree!r} needs equal shards (head all-to-alls of equal "
                             "chunks); the grouped layout gives ranks different lengths: use layout='balanced'")
        heads, degree = self.attention_heads, self.ulysses_degree
        if heads is not None and isinstance(degree, int) and heads[0] % degree:
            raise ValueError(f"ulysses_degree={degree} splits the query heads: attention_heads={heads} has "
                             f"{heads[0]} query heads, not divisible by {degree}")

    def plan_options(self) -> PlanOptions:
        """The layout's knobs: the work model's window and the grouped layout's."""
        return PlanOptions(ranks_per_node=self.ranks_per_node, token_cap=self.token_cap, costs=self.step_costs,
                           window=self.balance_window)

    def ulysses_problem(self, world: int) -> Optional[ValueError]:
        """Why `ulysses_degree` cannot split a CP group of `world` ranks (None if it can)."""
        u = self.ulysses_degree
        if isinstance(u, int) and world % u:
            return ValueError(f"ulysses_degree={u} must divide the CP group size {world} "
                              f"(groups of {u} consecutive ranks)")
        return None


def _check_ulysses(degree: object, heads: object) -> None:
    if degree == "auto":
        if heads is None:
            raise ValueError("ulysses_degree='auto' needs attention_heads=(query heads, K/V heads) for its byte model")
    elif isinstance(degree, bool) or not isinstance(degree, int):
        raise CPTypeError(f"ulysses_degree must be an int >= 1 or 'auto', got {type(degree).__name__}")
    elif degree < 1:
        raise ValueError(f"ulysses_degree must be >= 1, got {degree}")
    if heads is None:
        return
    if (not isinstance(heads, tuple) or len(heads) != 2
            or not all(isinstance(h, int) and not isinstance(h, bool) for h in heads)):
        raise CPTypeError(f"attention_heads must be a tuple (query heads, K/V heads) of ints, got {heads!r}")
    if heads[0] < 1 or heads[1] < 1 or heads[0] % heads[1]:
        raise ValueError(f"attention_heads={heads}: head counts must be >= 1 and K/V heads divide the query heads")
