"""Attention kernels behind one interface (`AttentionKernel`), registered by name in
`blockdiag_cp.registry.KERNELS` and chosen per step by `select_kernel` (choose.py).

    base.py       the interface, item tables, the log-sum-exp merge
    dense.py      the masked reference           sdpa.py     PyTorch fused attention per piece
    fused_ops.py  the CPU fused ops sdpa calls   varlen.py   packed (varlen) calls: flash.py, te.py
    flex.py       FlexAttention over a block mask
"""

from .base import AttentionKernel, CallOptions, ItemAttention, ItemTable, LseKernel, merge_partial
from .choose import build_kernel, fallback_kernels, select_kernel
from .dense import DenseKernel
from .flash import FlashKernel
from .flex import FlexKernel
from .sdpa import SdpaKernel
from .te import TEKernel

__all__ = (
    "AttentionKernel",
    "CallOptions",
    "DenseKernel",
    "FlashKernel",
    "FlexKernel",
    "ItemAttention",
    "ItemTable",
    "LseKernel",
    "SdpaKernel",
    "TEKernel",
    "build_kernel",
    "fallback_kernels",
    "merge_partial",
    "select_kernel",
)
