"""Old name of `blockdiag_cp.tools.bench` (kept so existing imports keep working)."""

from .tools.bench import (  # noqa: F401
    BenchResult,
    BenchSpec,
    bench_worker,
    bytes_written,
    doc_lengths,
    format_table,
    limit_seconds,
    run_bench,
    run_spec,
    seed_available,
)
