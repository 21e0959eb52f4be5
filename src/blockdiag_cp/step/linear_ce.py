"""A shard's per-token cross-entropy from its final hidden states and the LM head, never holding the logits.

Note [A loss that never holds the logits]
-----------------------------------------
One rank's ``L`` tokens x a vocabulary ``V`` of logits (32k x 152k: 20 GB in float32) is most
of a long row's memory. `linear_ce_sum` / `linear_token_log_probs` get the same per-token
cross-entropy from the hidden states ``[1, L, H]`` and the head ``[V, H]`` with torch's chunked
``linear_cross_entropy`` (one chunk of tokens' logits at a time). Whatever would send torch to
its reference path (which builds the logits) is refused before the call; torch's chunked path
has no label smoothing, so it comes from the identity (z logits, t target, eps the factor)::

    (1 - eps) * (lse - z_t) + eps * mean_v (lse - z_v)  =  (lse - z_t) + eps * (z_t - mean_v z_v)

whose second term is ``h . (W[t] - mean_v W) + b[t] - mean_v b``: ``O(L x H)``. Entropy needs each
token's whole distribution, which the chunked path never returns: refused.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .rows import IGNORE_INDEX

__all__ = ("linear_ce_sum", "linear_token_log_probs")

#: the default chunk's logits hold at least this many bytes (chunks of a few tokens are slow: each one
#: updates the whole ``[V, H]`` weight gradient)
CHUNK_LOGITS_BYTES = 32 << 20


def linear_ce_sum(
    hidden_1LH: torch.Tensor, weight_VH: torch.Tensor, targets_1L: torch.Tensor, *,
    bias_V: Optional[torch.Tensor] = None, label_smoothing: float = 0.0,
    options: Optional[torch.nn.LinearCrossEntropyOptions] = None,
) -> torch.Tensor:
    """0-d: this shard's next-token cross-entropy summed over its tokens with a target, never holding the logits.

    Args:
        hidden_1LH: this rank's ``[1, L, H]`` final hidden states (what the LM head gets).
        weight_VH: the head's ``[V, H]`` weight (tied or not), the same dtype as `hidden_1LH`.
        targets_1L: ``[1, L]`` next-token targets of the unsharded row, sharded (``shift_labels``
            from `add_shift_labels`); -100 where a token predicts nothing.
        bias_V: the head's ``[V]`` bias, if any.
        label_smoothing: transformers' ``LabelSmoother`` factor ``eps`` (Note [A loss that never
            holds the logits]): each token adds ``(1 - eps) * nll + eps * mean_v(-log p_v)``.
        options: torch's chunking (default: chunks of tokens whose logits are as large as the hidden
            states, as torch's ``chunking_method="aspect_ratio"``, and at least `CHUNK_LOGITS_BYTES`).

    Returns:
        The sum (dtype of `hidden_1LH`; float32 or wider once smoothed), to divide by the global count as
        ``cross_entropy(logits, targets, reduction="sum")`` is, e.g. with `token_mean_loss`. Its backward
        runs once (torch computes the gradients in forward and hands them over).
    """
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
    hidden_NH, targets_N = _chunked_inputs(hidden_1LH, weight_VH, targets_1L, bias_V)
    total = F.linear_cross_entropy(hidden_NH, weight_VH, targets_N, linear_bias=bias_V, reduction="sum",
                                   ignore_index=IGNORE_INDEX, options=options or _default_options(hidden_NH, weight_VH))
    if not label_smoothing:
        return total
    return total + label_smoothing * _target_minus_mean_logit(hidden_NH, weight_VH, targets_N, bias_V).sum()


def linear_token_log_probs(
    hidden_1LH: torch.Tensor, weight_VH: torch.Tensor, targets_1L: torch.Tensor, *,
    bias_V: Optional[torch.Tensor] = None, temperature: float = 1.0, with_entropy: bool = False,
    options: Optional[torch.nn.LinearCrossEntropyOptions] = None,
) -> tuple[torch.Tensor, None]:
    """`token_log_probs` from the hidden states and the head, never holding the logits (arguments as in
    `linear_ce_sum`; `temperature` divides the logits, as in `token_log_probs`).

    Returns:
        ``(log_probs [1, L], None)``, differentiable, 0 where the target is -100. ``with_entropy=True`` is
        refused: the chunked path returns each token's target term only, never its whole distribution.
    """
    if with_entropy:
        raise ValueError("linear_token_log_probs cannot give entropies: torch's chunked linear_cross_entropy "
                         "returns each token's target term, never its whole distribution; compute them from "
                         "logits with token_log_probs(..., with_entropy=True)")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature!r}")
    hidden_NH, targets_N = _chunked_inputs(hidden_1LH, weight_VH, targets_1L, bias_V)
    if temperature != 1.0:  # logits / T = (h / T) W^T + b / T
        hidden_NH, bias_V = hidden_NH / temperature, None if bias_V is None else bias_V / temperature
    ce_N = F.linear_cross_entropy(hidden_NH, weight_VH, targets_N, linear_bias=bias_V, reduction="none",
                                  ignore_index=IGNORE_INDEX, options=options or _default_options(hidden_NH, weight_VH))
    return (-ce_N).reshape(targets_1L.shape), None


def _default_options(hidden_NH: torch.Tensor, weight_VH: torch.Tensor) -> torch.nn.LinearCrossEntropyOptions:
    """Chunks of ``max(N H / V, CHUNK_LOGITS_BYTES / (V x itemsize))`` tokens (at most ``N``, at least 1)."""
    (N, H), V = hidden_NH.shape, weight_VH.shape[0]
    tokens = max(-(-N * H // V), CHUNK_LOGITS_BYTES // (V * hidden_NH.element_size()))
    return torch.nn.LinearCrossEntropyOptions(chunking_method=None, batch_chunk_size=max(1, min(N, tokens)))


def _chunked_inputs(hidden_1LH: torch.Tensor, weight_VH: torch.Tensor, targets_1L: torch.Tensor,
                    bias_V: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden [L, H], targets [L] int64)``; `ValueError` for what would take torch's reference path (Note)."""
    if hidden_1LH.dim() != 3 or hidden_1LH.shape[0] != 1 or targets_1L.shape != hidden_1LH.shape[:2]:
        raise ValueError(f"hidden {tuple(hidden_1LH.shape)} and targets {tuple(targets_1L.shape)} must be [1, L, H] "
                         "and [1, L] of the same shard")
    if weight_VH.dim() != 2 or weight_VH.shape[1] != hidden_1LH.shape[2] or weight_VH.dtype != hidden_1LH.dtype:
        raise ValueError(f"the head weight {tuple(weight_VH.shape)} {weight_VH.dtype} must be [V, H] with H = "
                         f"{hidden_1LH.shape[2]}, in the hidden states' dtype {hidden_1LH.dtype}")
    if bias_V is not None and bias_V.shape != weight_VH.shape[:1]:
        raise ValueError(f"the head bias {tuple(bias_V.shape)} must be [V] = [{weight_VH.shape[0]}]")
    tensors = (hidden_1LH, weight_VH, targets_1L) + (() if bias_V is None else (bias_V,))
    if torch.overrides.has_torch_function(tensors):
        raise ValueError(f"linear-CE on {', '.join(sorted({type(t).__name__ for t in tensors}))}: torch would leave "
                         "its chunked path for tensor subclasses (DTensor: gather the head first)")
    if torch.jit.is_tracing():
        raise ValueError("linear-CE under torch.jit.trace: torch would build the logits (its reference path)")
    return hidden_1LH[0], targets_1L[0].to(torch.int64)


def _target_minus_mean_logit(hidden_NH: torch.Tensor, weight_VH: torch.Tensor, targets_N: torch.Tensor,
                             bias_V: Optional[torch.Tensor]) -> torch.Tensor:
    """``[N]``: ``z_t - mean_v z_v`` per token with a target, 0 elsewhere; float32 or wider, ``O(N x H)``."""
    dtype = torch.promote_types(hidden_NH.dtype, torch.float32)
    valid = targets_N != IGNORE_INDEX
    picked = targets_N.clamp_min(0)
    rows_NH = weight_VH.index_select(0, picked).to(dtype) - weight_VH.mean(0, dtype=dtype)
    z = (hidden_NH.to(dtype) * rows_NH).sum(-1)
    if bias_V is not None:
        z = z + (bias_V.index_select(0, picked).to(dtype) - bias_V.mean(dtype=dtype))
    return torch.where(valid, z, torch.zeros((), dtype=dtype, device=z.device))
