"""The float64 oracle: dense block-causal attention on the full row, and rows from segment lengths."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..step.doc_ids import block_causal_mask


def oracle_attention(
    q_HSD: torch.Tensor, k_HSD: torch.Tensor, v_HSD: torch.Tensor, doc_ids_S: torch.Tensor, scale: float,
    window: Optional[int] = None, softcap: Optional[float] = None, sinks_H: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Dense block-causal attention of the whole row (``[H, S, D]``, GQA allowed); padding rows are 0.

    Optionally with a sliding `window` (keys ``(q - w, q]``), logit `softcap`, and `sinks_H`
    (one extra logit per head in every row's softmax denominator), written the plain way.
    """
    mask_SS = block_causal_mask(doc_ids_S.reshape(1, -1))[0]
    if window is not None:
        S = mask_SS.shape[0]
        mask_SS = mask_SS & torch.ones(S, S, dtype=torch.bool, device=mask_SS.device).triu(-(window - 1))
    groups = q_HSD.shape[0] // k_HSD.shape[0]
    k = k_HSD.repeat_interleave(groups, dim=0)
    v = v_HSD.repeat_interleave(groups, dim=0)
    scores = torch.matmul(q_HSD, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask_SS, float("-inf"))
    if sinks_H is not None:
        sink = sinks_H.to(scores.dtype).reshape(-1, 1, 1).expand(-1, scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        probs = probs.masked_fill(~mask_SS, 0.0)
    else:
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.matmul(probs, v)


def doc_ids_from_lengths(segments: Sequence[int]) -> torch.Tensor:
    """``[S]`` ids from segment lengths: a positive n is a document of n tokens, -n is n padding tokens."""
    ids, doc = [], 0
    for n in segments:
        if n > 0:
            doc += 1
            ids += [doc] * n
        else:
            ids += [0] * (-n)
    return torch.tensor(ids, dtype=torch.long)
