"""Old name of `blockdiag_cp.attention` (kept so existing imports keep working)."""

from .attention import attend_in_step, cp_blockdiag_sdpa  # noqa: F401
