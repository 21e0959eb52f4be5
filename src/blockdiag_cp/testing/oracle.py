"""The float64 oracle: dense block-causal attention on the full row, and rows from segment lengths."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..step.doc_ids import block_causal_mask


def oracle_attention(
    q_HSD: torch.Tensor, k_HSD: torch.Tensor, v_HSD: torch.Tensor, doc_ids_S: torch.Tensor, scale: float,
    window: Optional[int] = None, softcap: Optional[float] = None, sinks_H: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Dense block-causal attention of the whole row: ``q [H, S, D]``, ``k [Hk, S, D]``, ``v [Hk, S, Dv]``
    -> ``[H, S, Dv]`` (GQA allowed; ``Dv`` may differ from ``D``); padding rows are 0.

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


def gated_delta_rule_oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            initial_state: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token, in the inputs' dtype (shapes as `mixers.recurrence.chunked_gated_delta_rule`):
    keys and queries L2-normalised (eps 1e-6), queries scaled by ``dk ** -0.5``; per token
    ``S <- exp(g) S``, ``S <- S + k (beta (v - S^T k))^T``, ``o = S^T q``."""
    B, T, Hk, dk = q.shape
    Hv = v.shape[2]
    q, k = (x.repeat_interleave(Hv // Hk, dim=2) for x in (q, k))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * dk ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    state = v.new_zeros((B, Hv, dk, v.shape[3])) if initial_state is None else initial_state.clone()
    out = []
    for t in range(T):
        state = state * g[:, t].exp()[..., None, None]
        remembered = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, t], (v[:, t] - remembered) * beta[:, t, :, None])
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(out, dim=1), state


def ssd_oracle(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               initial_state: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2's scan token by token, in the inputs' dtype (shapes as `mixers.chunked.chunked_ssd`):
    per head ``S <- exp(dt A) S + dt x B^T``, ``y = S C`` (no ``D x`` skip)."""
    Bt, T, H, P = x.shape
    B, C = (m.repeat_interleave(H // m.shape[2], dim=2) for m in (B, C))
    state = x.new_zeros((Bt, H, P, B.shape[-1])) if initial_state is None else initial_state.clone()
    out = []
    for t in range(T):
        decay = (dt[:, t] * A).exp()[..., None, None]
        state = state * decay + torch.einsum("bhp,bhn->bhpn", x[:, t] * dt[:, t, :, None], B[:, t])
        out.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
    return torch.stack(out, dim=1), state
