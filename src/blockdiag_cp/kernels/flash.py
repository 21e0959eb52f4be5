"""`flash`: flash-attn's varlen kernel, one packed call per alignment (GPU, fp16/bf16).

``flash_attn_varlen_func(..., causal=True)`` aligns causal masks bottom-right (flash-attn
>= 2.1), exactly what a piece whose document began on an earlier rank needs. flash-attn 2
wants one head dim for q, k and v: values of another width (MLA) arrive zero-padded
(`packed_attention`, Note [Unequal head dims] in base.py). The import is lazy: a CPU
install never needs flash-attn.
"""

from __future__ import annotations

from .base import CallOptions
from .varlen import VarlenKernel


class FlashKernel(VarlenKernel):
    name = "flash"
    supports_dropout = True
    supports_softcap = True
    package = "flash_attn"
    install_name = "flash-attn"

    def attend_packed(self, call, q_THD, k_THD, v_THD, options: CallOptions):
        extra = {}
        if call.window is not None:  # keys (q - w, q]: w - 1 to the left, none to the right
            extra["window_size"] = (call.window - 1, 0)
        if options.softcap is not None:
            extra["softcap"] = options.softcap
        return self.module.flash_attn_varlen_func(
            q_THD, k_THD, v_THD, call.cu_seqlens_q, call.cu_seqlens_k, call.max_seqlen_q, call.max_seqlen_k,
            dropout_p=options.dropout_p, softmax_scale=options.scale, causal=call.causal, **extra,
        )
