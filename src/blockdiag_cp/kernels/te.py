"""`te`: TransformerEngine's ``DotProductAttention`` in THD format (GPU, fp16/bf16).

Causal segments use ``attn_mask_type="padding_causal_bottom_right"``, full ones
``"padding"``. The import is lazy: a CPU install never needs TransformerEngine.
"""

from __future__ import annotations

import importlib

import torch

from .base import AttentionKernel, ItemTable
from .flash import HALF
from .varlen import build_varlen_segments, packed_attention


def import_te_pytorch():
    try:
        return importlib.import_module("transformer_engine.pytorch")
    except ImportError as exc:
        raise ValueError("kernel='te' needs TransformerEngine: pip install 'blockdiag-cp[gpu]'") from exc


class TEKernel(AttentionKernel):
    name = "te"
    supports_dropout = False
    supports_lse = False

    def __init__(self) -> None:
        self._te = import_te_pytorch()
        self._modules: dict[tuple, object] = {}  # one DotProductAttention per head layout, for this step

    def _module(self, heads: int, head_dim: int, kv_heads: int, scale: float):
        key = (heads, head_dim, kv_heads, scale)
        if key not in self._modules:
            self._modules[key] = self._te.DotProductAttention(
                num_attention_heads=heads, kv_channels=head_dim, num_gqa_groups=kv_heads, attention_dropout=0.0,
                qkv_format="thd", softmax_scale=scale,
            )
        return self._modules[key]

    def prepare(self, items: ItemTable, device: torch.device):
        return build_varlen_segments(items, device)

    def check(self, q_HLD: torch.Tensor, dropout_p: float) -> None:
        if q_HLD.dtype not in HALF:
            raise ValueError(f"kernel='te' runs in float16/bfloat16, got {q_HLD.dtype}; use kernel='sdpa' or autocast")

    def attend(self, plan, q_HLD, k_HND, v_HND, scale, dropout_p):
        H, _, D = q_HLD.shape
        attention = self._module(H, D, k_HND.shape[0], scale)

        def call(seg, q, k, v):
            out = attention(
                q, k, v, qkv_format="thd",
                attn_mask_type="padding_causal_bottom_right" if seg.causal else "padding",
                cu_seqlens_q=seg.cu_seqlens_q, cu_seqlens_kv=seg.cu_seqlens_k,
                max_seqlen_q=seg.max_seqlen_q, max_seqlen_kv=seg.max_seqlen_k,
            )
            return out.reshape(q.shape[0], H, D)

        return packed_attention(plan, q_HLD, k_HND, v_HND, call)
