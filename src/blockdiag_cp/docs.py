"""Old name of `blockdiag_cp.doc_ids` (kept so existing imports keep working)."""

from .doc_ids import (  # noqa: F401
    _cp_blockdiag_doc_ids,
    block_causal_mask,
    doc_starts,
    resolve_doc_ids,
    run_starts,
    validate_doc_ids,
)
