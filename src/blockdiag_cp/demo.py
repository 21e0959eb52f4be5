"""Old name of `blockdiag_cp.tools.demo` (kept so existing imports keep working)."""

from .tools.demo import PackedRow, make_model, pack_rows, reference_losses, run_demo, stdlib_documents  # noqa: F401
