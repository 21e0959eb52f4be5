"""Old name of `blockdiag_cp.testing` (kept so existing imports keep working)."""

from .testing import (  # noqa: F401
    ParityCase,
    ParityResult,
    RankPool,
    doc_ids_from_lengths,
    oracle_attention,
    oracle_case,
    parity_worker,
    reference_error,
    run_parity_case,
    spawn,
)
