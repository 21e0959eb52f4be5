"""`flash`: flash-attn's varlen kernel, one packed call per step's segments (GPU, fp16/bf16).

``flash_attn_varlen_func(..., causal=True)`` aligns causal masks bottom-right (flash-attn
>= 2.1), exactly what a piece whose document began on an earlier rank needs. The
import is lazy: a CPU install never needs flash-attn.
"""

from __future__ import annotations

import importlib

import torch

from .base import AttentionKernel, ItemTable
from .varlen import build_varlen_segments, packed_attention

HALF = (torch.float16, torch.bfloat16)


def import_flash_attn():
    """The flash_attn module, or a `ValueError` saying how to install it."""
    try:
        return importlib.import_module("flash_attn")
    except ImportError as exc:
        raise ValueError("kernel='flash' needs flash-attn: pip install 'blockdiag-cp[gpu]'") from exc


class FlashKernel(AttentionKernel):
    name = "flash"
    supports_dropout = True
    supports_lse = False

    def __init__(self) -> None:
        self._varlen = import_flash_attn().flash_attn_varlen_func

    def prepare(self, items: ItemTable, device: torch.device):
        return build_varlen_segments(items, device)

    def check(self, q_HLD: torch.Tensor, dropout_p: float) -> None:
        if q_HLD.dtype not in HALF:
            raise ValueError(f"kernel='flash' runs in float16/bfloat16, got {q_HLD.dtype}; use kernel='sdpa' or autocast")

    def attend(self, plan, q_HLD, k_HND, v_HND, scale, dropout_p):
        def call(seg, q, k, v):
            return self._varlen(
                q, k, v, seg.cu_seqlens_q, seg.cu_seqlens_k, seg.max_seqlen_q, seg.max_seqlen_k,
                dropout_p=dropout_p, softmax_scale=scale, causal=seg.causal,
            )

        return packed_attention(plan, q_HLD, k_HND, v_HND, call)
