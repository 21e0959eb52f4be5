"""`te`: TransformerEngine's ``DotProductAttention`` in THD format (GPU, fp16/bf16).

Causal calls use ``attn_mask_type="padding_causal_bottom_right"``, full ones
``"padding"``. Values of another width than the queries (MLA) arrive zero-padded to one head
dim (`packed_attention`, Note [Unequal head dims] in base.py): TransformerEngine's support
for unequal dims depends on its backend. The import is lazy: a CPU install never needs
TransformerEngine.
"""

from __future__ import annotations

from .base import CallOptions
from .varlen import VarlenKernel


class TEKernel(VarlenKernel):
    name = "te"
    supports_dropout = False
    package = "transformer_engine.pytorch"
    install_name = "TransformerEngine"

    def __init__(self) -> None:
        super().__init__()
        self._modules: dict[tuple, object] = {}  # one DotProductAttention per head layout, for this step

    def _dot_product_attention(self, heads: int, head_dim: int, kv_heads: int, scale: float):
        key = (heads, head_dim, kv_heads, scale)
        if key not in self._modules:
            self._modules[key] = self.module.DotProductAttention(
                num_attention_heads=heads, kv_channels=head_dim, num_gqa_groups=kv_heads, attention_dropout=0.0,
                qkv_format="thd", softmax_scale=scale,
            )
        return self._modules[key]

    def attend_packed(self, call, q_THD, k_THD, v_THD, options: CallOptions):
        T, H, D = q_THD.shape
        attention = self._dot_product_attention(H, D, k_THD.shape[1], options.scale)
        out = attention(
            q_THD, k_THD, v_THD, qkv_format="thd",
            attn_mask_type="padding_causal_bottom_right" if call.causal else "padding",
            cu_seqlens_q=call.cu_seqlens_q, cu_seqlens_kv=call.cu_seqlens_k,
            max_seqlen_q=call.max_seqlen_q, max_seqlen_kv=call.max_seqlen_k,
            **({} if call.window is None else {"window_size": (call.window - 1, 0)}),
        )
        return out.reshape(T, H, D)
