"""`sdpa`: PyTorch's fused attention called per document piece, no mask materialized.

Note [Bottom-right causal from two fused calls]
-----------------------------------------------
PyTorch's fused kernels align ``is_causal`` top-left, so a piece whose document
began on an earlier rank (``q_len < k_len``) is split into two calls whose partial
results are merged by log-sum-exp:

    keys:   [ prefix (k_len - q_len) | square (q_len) ]
    call 1: prefix, no mask      (every query sees every earlier key)
    call 2: square, is_causal    (top-left == bottom-right when square)

Backward runs the fused backward of each call with the *merged* output and
log-sum-exp, which yields exactly the gradients of the merged attention. Items of
equal shape are batched into one call, so many tiny documents cost a few calls.
Memory is ``O(L * D)``: no ``[L, N]`` score or mask tensor is ever built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import ensure
from .base import ItemTable, LseKernel, accumulate_dtype, expand_heads, fold_heads, merge_partial


def cpu_fused_ops():
    """The CPU fused attention ops (forward returns the log-sum-exp), or None."""
    fwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    return (fwd, bwd) if fwd is not None and bwd is not None else None


class CpuFusedOps:
    """``fwd(q, k, v, causal, scale) -> (o, lse)`` and ``bwd(...)`` on PyTorch's CPU flash kernel.

    Shapes ``[n, H, l, D]`` (queries) and ``[n, Hk, m, D]`` (keys); GQA native.
    """

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
    summed in float32) and pads the log-sum-exp to a multiple of 32 queries.
    """

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


def fused_ops_for(device: torch.device):
    """The fused ops for `device`; ``meta`` (shape-only dry runs) uses the CPU ops' meta kernels."""
    if device.type in ("cpu", "meta"):
        return CpuFusedOps()
    if device.type == "cuda":
        return CudaFusedOps()
    raise ValueError(f"kernel='sdpa' supports cpu and cuda devices, got {device.type}")


@dataclass(frozen=True)
class RowSelect:
    """``G`` equal-length runs of rows of a ``[H, R, D]`` tensor: one slice, or an index."""

    length: int
    start: Optional[int] = None
    index_GL: Optional[torch.Tensor] = None

    def take(self, t_HRD: torch.Tensor) -> torch.Tensor:
        """``[G, H, length, ...]`` view or copy of the selected rows."""
        if self.start is not None:
            return t_HRD[:, self.start : self.start + self.length].unsqueeze(0)
        n = self.index_GL.shape[0]
        picked = t_HRD.index_select(1, self.index_GL.reshape(-1))
        return picked.reshape(t_HRD.shape[0], n, self.length, *t_HRD.shape[2:]).transpose(0, 1)

    def put(self, t_HRD: torch.Tensor, value_GHL: torch.Tensor, accumulate: bool) -> None:
        """Write (or add) ``value [G, H, length, ...]`` into the selected rows, in place."""
        if self.start is not None:
            view = t_HRD[:, self.start : self.start + self.length]
            view.add_(value_GHL[0]) if accumulate else view.copy_(value_GHL[0])
            return
        flat = value_GHL.transpose(0, 1).reshape(t_HRD.shape[0], -1, *t_HRD.shape[2:])
        index = self.index_GL.reshape(-1)
        if accumulate:
            t_HRD.index_add_(1, index, flat.to(t_HRD.dtype))
        else:
            t_HRD.index_copy_(1, index, flat.to(t_HRD.dtype))


@dataclass(frozen=True)
class FusedCall:
    """One fused call: ``G`` items of equal shape; `merge` if rows hold a partial result."""

    causal: bool
    merge: bool
    q_rows: RowSelect
    k_rows: RowSelect


def _select(starts: list[int], length: int, device: torch.device) -> RowSelect:
    if len(starts) == 1:
        return RowSelect(length, start=starts[0])
    base = torch.tensor(starts, dtype=torch.long).unsqueeze(1)
    return RowSelect(length, index_GL=(base + torch.arange(length)).to(device))


def fused_calls(items: ItemTable, device: torch.device) -> tuple[FusedCall, ...]:
    """Split causal items into prefix + square, group equal shapes; first-touch calls first."""
    groups: dict[tuple[bool, bool, int, int], tuple[list[int], list[int]]] = {}

    def add(causal: bool, merge: bool, q0: int, ql: int, k0: int, kl: int) -> None:
        q_starts, k_starts = groups.setdefault((causal, merge, ql, kl), ([], []))
        q_starts.append(q0)
        k_starts.append(k0)

    rows = zip(*(t.tolist() for t in (items.q_start, items.q_len, items.k_start, items.k_len, items.causal)))
    for q0, ql, k0, kl, causal in rows:
        if not causal:
            add(False, False, q0, ql, k0, kl)
            continue
        add(True, False, q0, ql, k0 + kl - ql, ql)
        if kl > ql:
            add(False, True, q0, ql, k0, kl - ql)
    ordered = sorted(groups.items(), key=lambda kv: kv[0][1])  # merge=False first
    return tuple(
        FusedCall(causal, merge, _select(qs, ql, device), _select(ks, kl, device))
        for (causal, merge, ql, kl), (qs, ks) in ordered
    )


class SdpaKernel(LseKernel):
    name = "sdpa"
    supports_dropout = False

    def __init__(self, device: torch.device = torch.device("cpu")) -> None:
        self.device_type = device.type
        self._ops = fused_ops_for(device)

    def check(self, q_HLD: torch.Tensor, dropout_p: float) -> None:
        if self.device_type == "cuda" and q_HLD.dtype == torch.float64:
            raise ValueError("kernel='sdpa' on CUDA runs in float32/float16/bfloat16, not float64; use kernel='dense'")

    def prepare(self, items: ItemTable, device: torch.device) -> tuple[FusedCall, ...]:
        if device.type != self.device_type:
            raise ValueError(f"kernel='sdpa' was set up for {self.device_type}, got tensors on {device}")
        return fused_calls(items, device)

    def forward(self, calls, q_HLD, k_HND, v_HND, scale, dropout_p):
        ensure(dropout_p == 0.0, "callers route dropout to a kernel that supports it")
        H, L, _ = q_HLD.shape
        o = torch.zeros_like(q_HLD)
        lse = torch.full((H, L), float("-inf"), dtype=accumulate_dtype(q_HLD.dtype), device=q_HLD.device)
        for call in calls:
            q, k, v = call.q_rows.take(q_HLD), call.k_rows.take(k_HND), call.k_rows.take(v_HND)
            o_part, lse_part = self._ops.fwd(q, k, v, call.causal, scale)
            if call.merge:
                o_part, lse_part = merge_partial(call.q_rows.take(o), call.q_rows.take(lse), o_part, lse_part)
            call.q_rows.put(o, o_part, accumulate=False)
            call.q_rows.put(lse, lse_part, accumulate=False)
        return o, lse, None

    def backward(self, calls, do_HLD, q_HLD, k_HND, v_HND, o_HLD, lse_HL, aux, scale, dropout_p):
        acc = accumulate_dtype(q_HLD.dtype)
        dq = torch.zeros(q_HLD.shape, dtype=acc, device=q_HLD.device)
        dk = torch.zeros(k_HND.shape, dtype=acc, device=k_HND.device)
        dv = torch.zeros(v_HND.shape, dtype=acc, device=v_HND.device)
        # In half precision the CPU fused backward sums grouped-query heads in that
        # precision; expand K/V heads and sum their gradients in float32 instead.
        groups = q_HLD.shape[0] // k_HND.shape[0] if q_HLD.element_size() < 4 and self.device_type == "cpu" else 1
        for call in calls:
            q, k, v = call.q_rows.take(q_HLD), call.k_rows.take(k_HND), call.k_rows.take(v_HND)
            if groups > 1:
                k, v = expand_heads(k, q.shape[1], 1), expand_heads(v, q.shape[1], 1)
            do, o, lse = (call.q_rows.take(t) for t in (do_HLD, o_HLD, lse_HL))
            dq_p, dk_p, dv_p = self._ops.bwd(do.contiguous(), q, k, v, o.contiguous(), lse.contiguous(), call.causal, scale)
            if groups > 1:
                dk_p, dv_p = (fold_heads(t.to(acc), groups, 1) for t in (dk_p, dv_p))
            call.q_rows.put(dq, dq_p, accumulate=True)
            call.k_rows.put(dk, dk_p, accumulate=True)
            call.k_rows.put(dv, dv_p, accumulate=True)
        return dq.to(q_HLD.dtype), dk.to(k_HND.dtype), dv.to(v_HND.dtype)
