"""`CPConfig`: the user-facing knobs of one block-diagonal CP step, validated once.

Note [One spelling per knob]
----------------------------
`CPConfig` names the step's three strategies flat, as the seed does (``kv_exchange``,
``kernel``, ``layout``), plus ``check_ranks_agree``; each component's own knobs sit in
that component's config, nested as torchtitan nests its component configs:

    CPConfig(layout="grouped", plan=PlanOptions(ranks_per_node=8, token_cap=1.25, costs=...))
    CPConfig(layout="balanced", heads=HeadsConfig(ulysses_degree=2))

    plan=PlanOptions(...)    the layout's work model and the grouped planner (plan/options.py):
                             window, ranks_per_node, token_cap, costs
    heads=HeadsConfig(...)   head parallelism: ulysses_degree, attention_heads

The same `PlanOptions` goes to ``plan_shards(..., options=...)``. The flat keywords of
0.10 (``balance_window``, ``ranks_per_node``, ``token_cap``, ``step_costs``,
``ulysses_degree``, ``attention_heads`` on `CPConfig`; ``window``, ``ranks_per_node``,
``token_cap``, ``costs`` on `plan_shards`), and reading them back as attributes, keep
working until 0.14 with a `DeprecationWarning` that names the new spelling (`MOVED`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Optional, Union

from .errors import CPTypeError, check_choice, warn_moved
from .plan.options import PlanOptions
from .registry import EXCHANGES, KERNELS, LAYOUTS


#: the layout of the library's own entries when they are given no config (the rule: `CPConfig.layout`)
ENTRY_LAYOUT = "balanced"


#: the flat keywords of 0.10 -> (the component, its field) where each knob lives now (Note [One spelling per knob])
MOVED = MappingProxyType({
    "balance_window": ("plan", "window"),
    "ranks_per_node": ("plan", "ranks_per_node"),
    "token_cap": ("plan", "token_cap"),
    "step_costs": ("plan", "costs"),
    "ulysses_degree": ("heads", "ulysses_degree"),
    "attention_heads": ("heads", "attention_heads"),
})


@dataclass(frozen=True, kw_only=True)
class HeadsConfig:
    """Head parallelism inside the CP group (Note [Head-parallel groups] in ``exchange/ulysses.py``).

    Attributes:
        ulysses_degree: the CP group of ``cp`` ranks splits into ``cp / u`` groups of ``u``
            consecutive ranks; inside a group an all-to-all swaps sequence shards for head
            shards, across groups `kv_exchange` moves the K/V the group's documents need.
            1 (default): no head parallelism; ``cp``: pure Ulysses; ``"auto"``: the degree with
            the fewest bytes per rank (needs `attention_heads`).
        attention_heads: ``(query heads, K/V heads)`` of the model's attention, for the byte
            model of ``ulysses_degree="auto"``.
    """

    ulysses_degree: Union[int, str] = 1
    attention_heads: Optional[tuple[int, int]] = None

    def __post_init__(self) -> None:
        _check_ulysses(self.ulysses_degree, self.attention_heads)
        heads, degree = self.attention_heads, self.ulysses_degree
        if heads is not None and isinstance(degree, int) and heads[0] % degree:
            raise ValueError(f"ulysses_degree={degree} splits the query heads: attention_heads={heads} has "
                             f"{heads[0]} query heads, not divisible by {degree}")

    def problem(self, world: int) -> Optional[ValueError]:
        """Why `ulysses_degree` cannot split a CP group of `world` ranks (None if it can)."""
        u = self.ulysses_degree
        if isinstance(u, int) and world % u:
            return ValueError(f"ulysses_degree={u} must divide the CP group size {world} "
                              f"(groups of {u} consecutive ranks)")
        return None


@dataclass(frozen=True, init=False)
class CPConfig:
    """How a block-diagonal CP step exchanges K/V, computes attention and lays out tokens (keywords only).

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
            `make_cp_pipeline_batch_and_ctx`,
            ``blockdiag-cp demo``, the examples), except the whole-batch step
            (`make_cp_world_batch_and_ctx`, the mixin's ``whole_batch=True``): ``"grouped"``.
        check_ranks_agree: at step start, verify with one small collective that
            every rank of the CP group holds the same document ids (a mismatch
            raises the same error everywhere instead of hanging). Turn off for speed.
        plan: the layout's knobs (`PlanOptions`): ``window``, the work model's sliding window
            (every layer windowed; None, the default, balances full causal attention, right for
            any model with a global layer); the grouped layout's ``ranks_per_node`` (ranks
            ``r // ranks_per_node`` share a node; None: one node), ``token_cap`` (a rank's tokens
            at most this times the mean, >= 1) and ``costs`` (`StepCosts`, e.g.
            ``StepCosts.from_config(model.config)``; None: a 1B-class Llama's).
        heads: head parallelism (`HeadsConfig`: ``ulysses_degree``, ``attention_heads``).

    The flat keywords of 0.10 still work, with a `DeprecationWarning` (Note [One spelling per knob]).
    """

    kv_exchange: str = "auto"
    kernel: str = "auto"
    layout: str = "contiguous"
    check_ranks_agree: bool = True
    plan: PlanOptions = field(default_factory=PlanOptions)
    heads: HeadsConfig = field(default_factory=HeadsConfig)

    def __init__(self, *, kv_exchange: str = "auto", kernel: str = "auto", layout: str = "contiguous",
                 check_ranks_agree: bool = True, plan: Optional[PlanOptions] = None,
                 heads: Optional[HeadsConfig] = None, **moved: Any) -> None:
        components = _with_moved({"plan": plan, "heads": heads}, moved)
        for name, value in (("kv_exchange", kv_exchange), ("kernel", kernel), ("layout", layout),
                            ("check_ranks_agree", check_ranks_agree), *components.items()):
            object.__setattr__(self, name, value)
        self.__post_init__()

    def __post_init__(self) -> None:
        check_choice("kv_exchange", self.kv_exchange, EXCHANGES.choices)
        check_choice("kernel", self.kernel, KERNELS.choices)
        check_choice("layout", self.layout, LAYOUTS.choices)
        if not isinstance(self.check_ranks_agree, bool):
            raise CPTypeError(f"check_ranks_agree must be a bool, got {self.check_ranks_agree!r}")
        if self.layout == "grouped" and self.heads.ulysses_degree != 1:
            raise ValueError(f"ulysses_degree={self.heads.ulysses_degree!r} needs equal shards (head all-to-alls of "
                             "equal chunks); the grouped layout gives ranks different lengths: use layout='balanced'")

    def ulysses_problem(self, world: int) -> Optional[ValueError]:
        """Why ``heads.ulysses_degree`` cannot split a CP group of `world` ranks (None if it can)."""
        return self.heads.problem(world)

    def plan_options(self) -> PlanOptions:
        """Deprecated: `plan`."""
        warn_moved("CPConfig.plan_options()", "CPConfig.plan")
        return self.plan

    def __getattr__(self, name: str) -> Any:
        """The flat attributes of 0.10, read from their component with a `DeprecationWarning`."""
        if name in MOVED:
            component, knob = MOVED[name]
            warn_moved(f"CPConfig.{name}", f"CPConfig.{component}.{knob}")
            return getattr(object.__getattribute__(self, component), knob)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def _with_moved(components: dict[str, Any], moved: dict[str, Any]) -> dict[str, Any]:
    """The component configs, with the flat keywords of 0.10 folded in (each warns, naming its new spelling)."""
    classes = {"plan": PlanOptions, "heads": HeadsConfig}
    for name, value in components.items():
        if value is not None and not isinstance(value, classes[name]):
            raise CPTypeError(f"{name} must be a {classes[name].__name__}, got {type(value).__name__}")
    unknown = sorted(set(moved) - set(MOVED))
    if unknown:
        raise TypeError(f"CPConfig got unexpected keyword argument(s) {', '.join(unknown)}")
    folded: dict[str, dict[str, Any]] = {name: {} for name in classes}
    for old, value in moved.items():
        component, knob = MOVED[old]
        if components[component] is not None:
            raise ValueError(f"CPConfig got both {component}= and the deprecated {old}=: put {knob} in {component}")
        warn_moved(f"CPConfig({old}=...)", f"CPConfig({component}={classes[component].__name__}({knob}=...))", 2)
        folded[component][knob] = value
    return {name: (components[name] if components[name] is not None else classes[name](**folded[name]))
            for name in classes}


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
