"""blockdiag-cp: block-diagonal (per-document) context parallelism for packed sequences."""

from .batch import make_cp_batch_and_ctx, make_cp_blockdiag_batch_and_ctx
from .config import CPConfig
from .docs import _cp_blockdiag_doc_ids, resolve_doc_ids
from .gather import gather_sequence
from .layout import ShardPlan, plan_shards
from .sdpa import cp_blockdiag_sdpa
from .state import StepState, current_step

__version__ = "0.1.0"

__all__ = [
    "CPConfig",
    "ShardPlan",
    "StepState",
    "_cp_blockdiag_doc_ids",
    "cp_blockdiag_sdpa",
    "current_step",
    "gather_sequence",
    "make_cp_batch_and_ctx",
    "make_cp_blockdiag_batch_and_ctx",
    "plan_shards",
    "resolve_doc_ids",
]
