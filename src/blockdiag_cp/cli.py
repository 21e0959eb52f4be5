"""Old name of `blockdiag_cp.tools.cli` (kept so existing imports keep working)."""

from .tools.cli import build_parser, main  # noqa: F401
