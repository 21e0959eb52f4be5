"""Old name of `blockdiag_cp.layout.balanced` (kept so existing imports keep working)."""

from .layout.balanced import BALANCE_TOLERANCE, plan_balanced  # noqa: F401
