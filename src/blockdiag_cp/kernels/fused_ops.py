"""PyTorch's fused attention ops behind two calls: ``fwd`` returns the log-sum-exp, ``bwd`` takes it.

Shapes: queries ``[G, H, l, D]``, keys and values ``[G, Hk, m, D]`` (any strides with
a unit-stride last dimension); the output ``[G, H, l, D]`` and the log-sum-exp
``[G, H, l]`` (float32, or float64 for float64 inputs). Ops with `equal_head_dims` take one
``D`` for all three (the caller pads: Note [Unequal head dims] in base.py); the others also
take values of their own width ``Dv`` and return ``[G, H, l, Dv]``.
"""

from __future__ import annotations

import torch

from .base import accumulate_dtype, expand_heads, fold_heads


def cpu_fused_ops():
    """The CPU fused attention ops (forward returns the log-sum-exp), or None."""
    fwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    return (fwd, bwd) if fwd is not None and bwd is not None else None


class CpuFusedOps:
    """``fwd(q, k, v, causal, scale) -> (o, lse)`` and ``bwd(...)`` on PyTorch's CPU flash kernel.

    Shapes ``[n, H, l, D]`` (queries) and ``[n, Hk, m, D]`` (keys); GQA native. One head dim for
    q, k and v ("Q/K/V should have the same head size", torch 2.13).
    """

    equal_head_dims = True

    def __init__(self) -> None:
        ops = cpu_fused_ops()
        if ops is None:
            raise ValueError("kernel='sdpa' needs torch's CPU fused attention ops (torch >= 2.3)")
        self._fwd, self._bwd = ops

    def fwd(self, q, k, v, causal: bool, scale: float):
        return self._fwd(q, k, v, 0.0, causal, scale=scale)

    def bwd(self, do, q, k, v, o, lse, causal: bool, scale: float):
        return self._bwd(do, q, k, v, o, lse, 0.0, causal, scale=scale)


class CudaFusedOps:
    """The same two calls on PyTorch's CUDA memory-efficient attention (fp32/fp16/bf16).

    That kernel wants equal head counts (K/V heads are expanded, their gradients
    summed in float32) and pads the log-sum-exp to a multiple of 32 queries. Values of another
    width than the queries are padded by the caller (the kernel may take them as they are; not
    verified on a GPU yet).
    """

    equal_head_dims = True

    def __init__(self) -> None:
        self._fwd = torch.ops.aten._scaled_dot_product_efficient_attention
        self._bwd = torch.ops.aten._scaled_dot_product_efficient_attention_backward

    def fwd(self, q, k, v, causal: bool, scale: float):
        k, v = (expand_heads(t, q.shape[1], 1) for t in (k, v))
        o, lse, _, _ = self._fwd(q, k, v, None, True, 0.0, causal, scale=scale)
        return o, lse[..., : q.shape[2]]

    def bwd(self, do, q, k, v, o, lse, causal: bool, scale: float):
        kv_heads = k.shape[1]
        k, v = (expand_heads(t, q.shape[1], 1) for t in (k, v))
        pad = -q.shape[2] % 32
        lse = torch.nn.functional.pad(lse, (0, pad)) if pad else lse
        zero = torch.zeros((), dtype=torch.long, device=q.device)
        dq, dk, dv, _ = self._bwd(do, q, k, v, None, o, lse, zero, zero, 0.0, [True, True, True, False], causal, scale=scale)
        groups = q.shape[1] // kv_heads
        if groups > 1:
            dk, dv = (fold_heads(t.float(), groups, 1).to(t.dtype) for t in (dk, dv))
        return dq, dk, dv


class MathOps:
    """The same two calls in plain tensor math, for score functions the fused kernels lack
    (logit softcapping ``cap * tanh(s / cap)``). Causal is top-left, like the fused ops.

    Memory: the scores ``[G, H, l, m]`` of one call (one document piece, or one bucket of
    short ones), never a row's ``[S, S]``. Values of any width.
    """

    equal_head_dims = False

    def __init__(self, softcap: float) -> None:
        self.softcap = softcap

    def _scores(self, q, k, causal: bool, scale: float):
        acc = accumulate_dtype(q.dtype)
        k = expand_heads(k, q.shape[1], 1).to(acc)
        raw = torch.matmul(q.to(acc), k.transpose(-1, -2)) * scale
        capped = torch.tanh(raw / self.softcap)
        scores = capped * self.softcap
        if causal:
            l, m = scores.shape[-2:]
            hidden = torch.ones(l, m, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(hidden, float("-inf"))
        return scores, capped

    def fwd(self, q, k, v, causal: bool, scale: float):
        scores, _ = self._scores(q, k, causal, scale)
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse.unsqueeze(-1))
        o = torch.matmul(probs, expand_heads(v, q.shape[1], 1).to(probs.dtype))
        return o.to(q.dtype), lse

    def bwd(self, do, q, k, v, o, lse, causal: bool, scale: float):
        scores, capped = self._scores(q, k, causal, scale)
        probs = torch.exp(scores - lse.unsqueeze(-1))  # lse = +inf (pads): exactly 0
        acc, groups = probs.dtype, q.shape[1] // k.shape[1]
        do = do.to(acc)
        dv = torch.matmul(probs.transpose(-1, -2), do)
        dp = torch.matmul(do, expand_heads(v, q.shape[1], 1).to(acc).transpose(-1, -2))
        ds = probs * (dp - (do * o.to(acc)).sum(dim=-1, keepdim=True)) * (1.0 - capped * capped) * scale
        dq = torch.matmul(ds, expand_heads(k, q.shape[1], 1).to(acc))
        dk = torch.matmul(ds.transpose(-1, -2), q.to(acc))
        if groups > 1:
            dk, dv = fold_heads(dk, groups, 1), fold_heads(dv, groups, 1)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def fused_ops_for(device: torch.device):
    """The fused ops for `device`; ``meta`` (shape-only dry runs) uses the CPU ops' meta kernels."""
    if device.type in ("cpu", "meta"):
        return CpuFusedOps()
    if device.type == "cuda":
        return CudaFusedOps()
    raise ValueError(f"kernel='sdpa' supports cpu and cuda devices, got {device.type}")
