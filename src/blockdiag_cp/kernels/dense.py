"""`dense`: the reference kernel, a fully materialized masked softmax attention.

Every query row sees one contiguous range of buffer keys (its item's), so the mask
is rebuilt from two ``[L]`` tensors. Memory is ``O(H * L * N)``: a reference and a
fallback (it is the only kernel with attention dropout), not the fast path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import CallOptions, ItemTable, LseKernel, accumulate_dtype, expand_heads, fold_heads


@dataclass(frozen=True)
class RowKeyRanges:
    """Per-row visible key range ``[k_lo, k_hi)`` (``[L]`` int64 on the device)."""

    k_lo: torch.Tensor
    k_hi: torch.Tensor


class DenseKernel(LseKernel):
    name = "dense"
    supports_dropout = True
    supports_softcap = True

    def prepare(self, items: ItemTable, device: torch.device) -> RowKeyRanges:
        k_lo, k_hi = items.row_key_ranges()
        return RowKeyRanges(k_lo.to(device), k_hi.to(device))

    @staticmethod
    def _probs(ranges: RowKeyRanges, q_HLD, k_HND, scale: float, lse_HL=None, softcap=None):
        """Masked scores and probabilities ``[H, L, N]`` (and lse if not given), and the softcap's
        ``tanh`` (for its derivative; None without softcap)."""
        ct = accumulate_dtype(q_HLD.dtype)
        k = expand_heads(k_HND, q_HLD.shape[0], 0).to(ct)
        scores = torch.matmul(q_HLD.to(ct), k.transpose(-1, -2)) * scale
        capped = None
        if softcap is not None:
            capped = torch.tanh(scores / softcap)
            scores = capped * softcap
        cols = torch.arange(k_HND.shape[1], device=q_HLD.device)
        visible_LN = (cols >= ranges.k_lo[:, None]) & (cols < ranges.k_hi[:, None])
        scores = scores.masked_fill(~visible_LN, float("-inf"))
        if lse_HL is None:
            lse_HL = torch.logsumexp(scores, dim=-1)
        safe = torch.where(torch.isinf(lse_HL), torch.zeros_like(lse_HL), lse_HL)
        probs = torch.exp(scores - safe.unsqueeze(-1)).masked_fill(~visible_LN, 0.0)
        return probs, lse_HL, capped

    def forward(self, calls, q_HLD, k_HND, v_HND, options: CallOptions):
        dropout_p = options.dropout_p
        probs, lse, _ = self._probs(calls, q_HLD, k_HND, options.scale, softcap=options.softcap)
        keep = None
        if dropout_p > 0.0:
            keep = torch.rand_like(probs) >= dropout_p
            probs = probs * keep / (1.0 - dropout_p)
        v = expand_heads(v_HND, q_HLD.shape[0], 0).to(probs.dtype)
        o = torch.matmul(probs, v).to(q_HLD.dtype)
        return o, lse, keep

    def backward(self, calls, do_HLD, q_HLD, k_HND, v_HND, o_HLD, lse_HL, aux, options: CallOptions):
        ct = accumulate_dtype(q_HLD.dtype)
        H, Hk = q_HLD.shape[0], k_HND.shape[0]
        scale, dropout_p = options.scale, options.dropout_p
        probs, _, capped = self._probs(calls, q_HLD, k_HND, scale, lse_HL, options.softcap)
        do = do_HLD.to(ct)
        kept = probs if aux is None else probs * aux / (1.0 - dropout_p)
        dv = torch.matmul(kept.transpose(-1, -2), do)
        dkept = torch.matmul(do, expand_heads(v_HND, H, 0).to(ct).transpose(-1, -2))
        dprobs = dkept if aux is None else dkept * aux / (1.0 - dropout_p)
        delta = (do * o_HLD.to(ct)).sum(dim=-1, keepdim=True)
        dscores = probs * (dprobs - delta) * scale
        if capped is not None:
            dscores = dscores * (1.0 - capped * capped)
        dq = torch.matmul(dscores, expand_heads(k_HND, H, 0).to(ct))
        dk = torch.matmul(dscores.transpose(-1, -2), q_HLD.to(ct))
        return (
            dq.to(q_HLD.dtype),
            fold_heads(dk, H // Hk, 0).to(k_HND.dtype),
            fold_heads(dv, H // Hk, 0).to(v_HND.dtype),
        )
