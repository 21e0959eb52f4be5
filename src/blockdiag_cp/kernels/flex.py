"""`flex`: FlexAttention with a block mask built once per step from the items.

Each query row sees one contiguous range of buffer keys ``[lo, hi)``; the mask
function reads those two ``[L]`` tensors. Logit softcapping is a score modifier. Values may
have their own head dim (``Dv != Dk``): FlexAttention takes them as they are (its kernels
size the value dim apart, ``V_HEAD_DIM``; only query and key must match).
Forward and backward on GPU; torch 2.13 has no FlexAttention backward on CPU, so
training on CPU is refused (inference works).

Measured on one H200 (``benchmarks/gpu_check.py``, bf16, cp = 8 ranks' local work of a
128k row): 0.97-1.01x torch's flash SDPA run per document, against 2.4-2.5x for the
`sdpa` kernel's memory-efficient calls; so ``kernel="auto"`` takes it on CUDA when
flash-attn and TransformerEngine are absent and Triton is installed.

Compiled backward with donated buffers: ``backward(retain_graph=True)`` through a
compiled FlexAttention call raises in torch (2.11); train without retaining the graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .base import AttentionKernel, CallOptions, ItemTable


@dataclass(frozen=True)
class FlexCall:
    block_mask: Any
    has_keys: torch.Tensor  # [L] bool: rows that see at least one key


class FlexKernel(AttentionKernel):
    name = "flex"
    supports_dropout = False
    supports_lse = False
    supports_softcap = True  # a score modifier ``cap * tanh(score / cap)``
    dtypes = (torch.float16, torch.bfloat16, torch.float32)

    @classmethod
    def build(cls, device: torch.device) -> "FlexKernel":
        return cls(device)

    def __init__(self, device: torch.device = torch.device("cpu")) -> None:
        from torch.nn.attention.flex_attention import flex_attention

        # compiled on GPU (a fused kernel); eager on CPU, where only the forward exists
        self._flex = torch.compile(flex_attention) if device.type == "cuda" else flex_attention

    def prepare(self, items: ItemTable, device: torch.device) -> FlexCall:
        from torch.nn.attention.flex_attention import create_block_mask

        lo, hi = (t.to(device) for t in items.row_key_ranges())

        def visible(b, h, q_idx, kv_idx):
            return (kv_idx >= lo[q_idx]) & (kv_idx < hi[q_idx])

        # a zero-length key buffer is not a valid block mask; rows then see nothing
        kv_len = max(items.num_k_rows, 1)
        mask = create_block_mask(visible, B=None, H=None, Q_LEN=items.num_q_rows, KV_LEN=kv_len, device=device)
        return FlexCall(mask, hi > lo)

    def check(self, q_HLD: torch.Tensor, dropout_p: float) -> None:
        if q_HLD.dtype not in self.dtypes:
            raise ValueError(f"kernel='flex' runs in float16/bfloat16/float32, not {q_HLD.dtype}; use kernel='dense'")
        if q_HLD.device.type == "cpu" and torch.is_grad_enabled() and q_HLD.requires_grad:
            raise ValueError(
                "kernel='flex' cannot train on CPU: torch has no FlexAttention backward there; "
                "use kernel='sdpa' (or flex under torch.no_grad())"
            )

    def attend(self, call: FlexCall, q_HLD, k_HND, v_HND, options: CallOptions):
        if k_HND.shape[1] == 0:
            return q_HLD.new_zeros((*q_HLD.shape[:-1], v_HND.shape[-1]))
        out = self._flex(
            q_HLD.unsqueeze(0), k_HND.unsqueeze(0), v_HND.unsqueeze(0), block_mask=call.block_mask,
            score_mod=None if options.softcap is None else _softcapped(options.softcap),
            scale=options.scale, enable_gqa=q_HLD.shape[0] != k_HND.shape[0],
        )[0]
        return torch.where(call.has_keys[None, :, None], out, torch.zeros_like(out))



def _softcapped(cap: float):
    """The score modifier ``cap * tanh(score / cap)`` (Gemma 2's logit softcapping)."""

    def score_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return score_mod
