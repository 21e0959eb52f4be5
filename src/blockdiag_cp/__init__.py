"""blockdiag-cp: block-diagonal (per-document) context parallelism for packed sequences.

The flow, once per training step, then once per attention layer; each stage is a folder::

    batch                 make_cp_blockdiag_batch_and_ctx              step/batch.py
      -> doc ids          who is in which document (0 = padding)      step/doc_ids.py
      -> shard plan       which positions each rank owns              plan/ (layouts)
      -> step state       geometry (who needs which keys), the        plan/geometry.py,
                          exchange's routing, the kernel's call       step/state.py
                          tables: all built once, frozen
    per attention layer   cp_blockdiag_sdpa(q, k, v)                   attention.py
      -> dispatch         compiled op or eager path (one choice)      step/dispatch.py
      -> exchange         deliver the K/V rows the local queries see  exchange/
                          (with ulysses_degree > 1: inside head        exchange/ulysses.py,
                          all-to-alls, between head-parallel groups)  parallel/heads.py
      -> kernel           attention over them, fused, no mask         kernels/

Around it: `parallel/` (the collectives every stage uses, head-parallel groups),
`gather_sequence` (unshard logits, step/gather.py), `loss` (next-token targets across
shard boundaries, the token mean over DP x CP), `hf/` (transformers registration and
VLM rows), `trainer` (the Trainer / TRL mixin), `mixers/` (token mixers outside
attention: detection and refusal), `testing/` (the float64 oracle and gloo spawn
harness), `tools/` (what a person runs: the CLI). Errors follow Note [Error policy]
(errors.py).

Words: a *shard plan* (`ShardPlan`) assigns positions to ranks; an exchange's
*routing* says which rows go where; a kernel's *call table* is what `prepare` builds
once per step for its fused calls. A *piece* is a run of one rank's queries at
consecutive positions of one document; an *item* is one piece against one
contiguous run of keys. *Segments* are the runs a row is described by in tests and
the CLI (n > 0: a document of n tokens, -n: n padding tokens).

Shape letters in name suffixes (``q_HLD`` is ``[H, L, D]``)::

    B  batch (1 inside a CP step)        S  tokens of the packed row (S_pad: padded)
    W  ranks of the CP group (world)     L  tokens of one rank's shard, S_pad / W
    H  heads of that tensor (query heads for q/o, K/V heads for k/v)
    D  head dimension                    E  embedding width
    N  rows of a rank's key buffer (the keys its queries may see)
    T  rows packed for one transfer or one varlen kernel call
    R  rows of whichever tensor a helper gets (L or N)
    G  equal-shaped items batched into one fused kernel call
    X  any trailing dimensions           2  K and V stacked (one token's K/V row)
    1  a dimension of size 1
"""

from . import registry as _registry
import types as _types
import typing as _typing

if _typing.TYPE_CHECKING:  # what type checkers and IDEs see; at run time each name is imported on first use
    from .attention import cp_blockdiag_sdpa
    from .config import CPConfig, HeadsConfig
    from .plan import PlanOptions, ShardPlan, StepCosts, plan_shards
    from .step.batch import make_cp_batch_and_ctx, make_cp_blockdiag_batch_and_ctx
    from .step.doc_ids import _cp_blockdiag_doc_ids, resolve_doc_ids
    from .step.gather import gather_sequence
    from .step.micro_batches import PipelineSteps, make_cp_pipeline_batch_and_ctx
    from .step.slot import current_step
    from .step.state import StepState
    from .step.prefetch import prefetched_world_steps
    from .step.world import make_cp_world_batch_and_ctx
    from .step.world_plan import plan_rank_state

__version__ = "0.13.0"

__all__ = (
    "CPConfig",
    "HeadsConfig",
    "PipelineSteps",
    "PlanOptions",
    "ShardPlan",
    "StepCosts",
    "StepState",
    "_cp_blockdiag_doc_ids",
    "cp_blockdiag_sdpa",
    "current_step",
    "gather_sequence",
    "make_cp_batch_and_ctx",
    "make_cp_blockdiag_batch_and_ctx",
    "make_cp_pipeline_batch_and_ctx",
    "make_cp_world_batch_and_ctx",
    "plan_rank_state",
    "plan_shards",
    "prefetched_world_steps",
    "resolve_doc_ids",
)

#: public name -> the module (relative to this package) that defines it. The root is lazy
#: (PEP 562): ``import blockdiag_cp`` imports no torch, so ``blockdiag-cp --help`` is fast;
#: ``from blockdiag_cp import CPConfig`` imports that name's module on first use.
_HOMES = _types.MappingProxyType({
    "CPConfig": ".config",
    "HeadsConfig": ".config",
    "PipelineSteps": ".step.micro_batches",
    "PlanOptions": ".plan.options",
    "ShardPlan": ".plan",
    "StepCosts": ".plan.step_costs",
    "StepState": ".step.state",
    "_cp_blockdiag_doc_ids": ".step.doc_ids",
    "cp_blockdiag_sdpa": ".attention",
    "current_step": ".step.slot",
    "gather_sequence": ".step.gather",
    "make_cp_batch_and_ctx": ".step.batch",
    "make_cp_blockdiag_batch_and_ctx": ".step.batch",
    "make_cp_pipeline_batch_and_ctx": ".step.micro_batches",
    "make_cp_world_batch_and_ctx": ".step.world",
    "plan_rank_state": ".step.world_plan",
    "plan_shards": ".plan",
    "prefetched_world_steps": ".step.prefetch",
    "resolve_doc_ids": ".step.doc_ids",
})


def __getattr__(name: str) -> object:
    """A public name, imported from its module on first access (then cached in this module)."""
    value = _registry.lazy_attribute(__name__, _HOMES, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
