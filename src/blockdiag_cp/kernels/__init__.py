"""Attention kernels behind one interface (`AttentionKernel`), chosen by name."""

from __future__ import annotations

import torch

from .base import AttentionKernel, ItemAttention, ItemTable, merge_partial
from .dense import DenseKernel
from .sdpa import SdpaKernel, cpu_fused_ops

GPU_KERNELS = ("flash", "te", "flex")


def select_kernel(requested: str, device: torch.device) -> tuple[AttentionKernel, str]:
    """Return the kernel for `requested` on `device` and why it was chosen.

    The decision depends only on the request, the device type and the installed
    torch, so every rank of a CP group reaches the same one before any collective.
    """
    if requested == "dense":
        return DenseKernel(), "requested"
    if requested == "sdpa":
        return SdpaKernel(), "requested"
    if requested in GPU_KERNELS:
        raise ValueError(
            f"kernel={requested!r} is a GPU kernel and is not available on {device.type}; "
            "use kernel='auto', 'sdpa' or 'dense'"
        )
    assert requested == "auto", requested
    if device.type == "cpu" and cpu_fused_ops() is not None:
        return SdpaKernel(), "auto: CPU fused attention per document piece (no mask)"
    return DenseKernel(), f"auto: no fused per-piece kernel for {device.type}, using the dense reference"


__all__ = [
    "AttentionKernel",
    "DenseKernel",
    "ItemAttention",
    "ItemTable",
    "SdpaKernel",
    "merge_partial",
    "select_kernel",
]
