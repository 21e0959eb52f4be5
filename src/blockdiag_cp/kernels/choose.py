"""Which kernel a step uses: the request, the device and what is installed (the kernel registry's strategies)."""

from __future__ import annotations

import importlib.util

import torch

from ..errors import ensure
from ..registry import AUTO, KERNELS
from .base import AttentionKernel
from .sdpa import cpu_fused_ops


#: on CUDA, ``"auto"`` takes the first of these whose package is installed, else ``sdpa``
CUDA_PREFERENCE = (
    ("flash_attn", "flash", "flash-attn varlen is installed (fp16/bf16; sdpa otherwise)"),
    ("transformer_engine", "te", "TransformerEngine THD is installed (fp16/bf16; sdpa otherwise)"),
    ("triton", "flex", "FlexAttention compiled with Triton over the step's block mask"),
)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def build_kernel(name: str, device: torch.device) -> AttentionKernel:
    """The registered kernel `name` for `device`."""
    return KERNELS[name].load().build(device)


def select_kernel(requested: str, device: torch.device, need_lse: bool = False) -> tuple[AttentionKernel, str]:
    """Return the kernel for `requested` on `device` and why it was chosen.

    The decision depends only on the request, the device type and what is installed,
    so every rank of a CP group reaches the same one before any collective. With
    `need_lse` (the ring exchange), ``"auto"`` only considers `LseKernel` kernels.
    """
    if requested in KERNELS.gpu_only and device.type != "cuda":
        raise ValueError(f"kernel={requested!r} is a GPU kernel and is not available on {device.type}; "
                         "use kernel='auto', 'sdpa' or 'dense'")
    ensure(requested in KERNELS.choices, f"unknown kernel {requested!r} passed CPConfig")
    if requested != AUTO:
        return build_kernel(requested, device), "requested"
    return _auto(device, need_lse)


def _auto(device: torch.device, need_lse: bool) -> tuple[AttentionKernel, str]:
    """``kernel="auto"``: the fastest exact kernel for `device` and what is installed."""
    if device.type == "cuda" and need_lse:
        return build_kernel("sdpa", device), "auto: the ring merges by log-sum-exp; PyTorch fused attention per piece"
    if device.type == "cuda":
        for module, name, why in CUDA_PREFERENCE:
            if _installed(module):
                return build_kernel(name, device), f"auto: {why}"
        return build_kernel("sdpa", device), "auto: PyTorch fused attention per document piece"
    if device.type == "cpu" and cpu_fused_ops() is not None:
        return build_kernel("sdpa", device), "auto: CPU fused attention per document piece (no mask)"
    return build_kernel("dense", device), f"auto: no fused per-piece kernel for {device.type}, using the dense reference"


def fallback_kernels(requested: str, chosen: AttentionKernel, device: torch.device) -> tuple[AttentionKernel, ...]:
    """With ``kernel="auto"``, the kernels to try (in order) when `chosen` refuses a call
    (a dtype it lacks, or attention dropout). Explicit requests get none: they refuse loudly."""
    if requested != AUTO:
        return ()
    names = (["sdpa"] if device.type == "cuda" else []) + ["dense"]
    return tuple(build_kernel(name, device) for name in names if name != chosen.name)
