"""Attention kernels behind one interface (`AttentionKernel`), chosen by name."""

from __future__ import annotations

import importlib.util

import torch

from ..errors import ensure
from .base import AttentionKernel, ItemAttention, ItemTable, LseKernel, merge_partial
from .dense import DenseKernel
from .flash import FlashKernel
from .flex import FlexKernel
from .sdpa import SdpaKernel, cpu_fused_ops
from .te import TEKernel

GPU_ONLY = ("flash", "te")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def select_kernel(requested: str, device: torch.device, need_lse: bool = False) -> tuple[AttentionKernel, str]:
    """Return the kernel for `requested` on `device` and why it was chosen.

    The decision depends only on the request, the device type and what is installed,
    so every rank of a CP group reaches the same one before any collective. With
    `need_lse` (the ring exchange), ``"auto"`` only considers `LseKernel` kernels.
    """
    if requested in GPU_ONLY and device.type != "cuda":
        raise ValueError(f"kernel={requested!r} is a GPU kernel and is not available on {device.type}; "
                         "use kernel='auto', 'sdpa' or 'dense'")
    named = {"dense": DenseKernel, "flash": FlashKernel, "te": TEKernel}
    if requested in named:
        return named[requested](), "requested"
    if requested in ("sdpa", "flex"):
        return (SdpaKernel if requested == "sdpa" else FlexKernel)(device), "requested"
    ensure(requested == "auto", f"unknown kernel {requested!r} passed CPConfig")
    if device.type == "cuda" and need_lse:
        return SdpaKernel(device), "auto: the ring merges by log-sum-exp; PyTorch fused attention per piece"
    if device.type == "cuda":
        if _installed("flash_attn"):
            return FlashKernel(), "auto: flash-attn varlen is installed (fp16/bf16; sdpa otherwise)"
        if _installed("transformer_engine"):
            return TEKernel(), "auto: TransformerEngine THD is installed (fp16/bf16; sdpa otherwise)"
        if _installed("triton"):
            return FlexKernel(device), "auto: FlexAttention compiled with Triton over the step's block mask"
        return SdpaKernel(device), "auto: PyTorch fused attention per document piece"
    if device.type == "cpu" and cpu_fused_ops() is not None:
        return SdpaKernel(device), "auto: CPU fused attention per document piece (no mask)"
    return DenseKernel(), f"auto: no fused per-piece kernel for {device.type}, using the dense reference"


def fallback_kernels(requested: str, chosen: AttentionKernel, device: torch.device) -> tuple[AttentionKernel, ...]:
    """With ``kernel="auto"``, the kernels to try (in order) when `chosen` refuses a call
    (a dtype it lacks, or attention dropout). Explicit requests get none: they refuse loudly."""
    if requested != "auto":
        return ()
    chain: list[AttentionKernel] = []
    if device.type == "cuda" and chosen.name != "sdpa":
        chain.append(SdpaKernel(device))
    if chosen.name != "dense":
        chain.append(DenseKernel())
    return tuple(chain)


__all__ = (
    "AttentionKernel",
    "DenseKernel",
    "FlashKernel",
    "FlexKernel",
    "ItemAttention",
    "ItemTable",
    "LseKernel",
    "SdpaKernel",
    "TEKernel",
    "fallback_kernels",
    "merge_partial",
    "select_kernel",
)
