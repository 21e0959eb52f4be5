"""What a loss needs across shard boundaries: next-token targets and a CP-correct mean.

The same per-token cross-entropy from the final hidden states, never holding the logits:
`blockdiag_cp.step.linear_ce` (and `blockdiag_cp.hf.linear_ce` for transformers' causal LMs).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from .step.doc_ids import resolve_doc_ids
from .step.rows import IGNORE_INDEX


def next_token_labels(labels_1S: torch.Tensor, doc_ids_1S: torch.Tensor) -> torch.Tensor:
    """``[1, S]`` targets: position g predicts ``labels[g + 1]`` if g + 1 is in g's document, else -100.

    Computed on the full row before sharding, so the last token of a shard still
    predicts the first token of the next shard, and no token predicts across a
    document boundary or into padding.
    """
    targets = torch.full_like(labels_1S, IGNORE_INDEX)
    same_doc = (doc_ids_1S[:, 1:] == doc_ids_1S[:, :-1]) & (doc_ids_1S[:, 1:] != 0)
    targets[:, :-1] = torch.where(same_doc, labels_1S[:, 1:], IGNORE_INDEX)
    return targets


def add_shift_labels(batch: dict[str, Any]) -> dict[str, Any]:
    """Add ``batch["shift_labels"]`` from ``labels`` (or ``input_ids``); call before sharding.

    transformers' causal-LM losses use ``shift_labels`` instead of shifting each shard
    locally (which would drop the target at every shard boundary).
    """
    labels = batch.get("labels", batch.get("input_ids"))
    if labels is None:
        raise ValueError("add_shift_labels needs batch['labels'] or batch['input_ids']")
    doc_ids = resolve_doc_ids(batch, labels.shape[1], labels.device, labels.shape[0])
    batch["shift_labels"] = next_token_labels(labels, doc_ids)
    return batch


def token_mean_loss(
    loss_sum: torch.Tensor, num_tokens: torch.Tensor | int, group: Optional[Any] = None, *, grads_averaged_over: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduce a token-sum loss to the token mean over every rank of `group` (CP, or DP x CP).

    Args:
        loss_sum: this rank's summed per-token loss (differentiable scalar).
        num_tokens: this rank's count of tokens in that sum.
        group: the process group spanning all ranks whose tokens form the mean
            (None: the default group; ignored when torch.distributed is not initialized).
        grads_averaged_over: how many ranks your gradient reduction averages over
            (1 if you all-reduce with SUM; ``dp * cp`` under DDP/FSDP averaging).

    Returns:
        ``(loss_to_backward, loss_value)``: backpropagate the first on every rank
        and reduce gradients as stated; the second is the global token mean
        (detached, identical on every rank), for logging.
    """
    count = torch.as_tensor(num_tokens, dtype=torch.float64, device=loss_sum.device).reshape(())
    total = torch.stack([loss_sum.detach().to(torch.float64), count])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total, group=group)
    global_tokens = total[1].clamp_min(1.0)
    loss_to_backward = loss_sum * (grads_averaged_over / global_tokens).to(loss_sum.dtype)
    return loss_to_backward, (total[0] / global_tokens).to(loss_sum.dtype)


def token_log_probs(
    logits_1LV: torch.Tensor, targets_1L: torch.Tensor, *, temperature: float = 1.0, with_entropy: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per-token log-probabilities of the next-token targets, from this rank's own logits (no gather).

    Args:
        logits_1LV: this rank's ``[1, L, V]`` logits (any float dtype; computed in float32 or wider).
        targets_1L: ``[1, L]`` next-token targets of the unsharded row, sharded (``shift_labels``
            from `add_shift_labels`: a shard's last token predicts the next shard's first);
            -100 where a token predicts nothing.
        temperature: the logits are divided by it first (as RL trainers sample).
        with_entropy: also return each token's entropy of the predicted distribution.

    Returns:
        ``(log_probs [1, L], entropy [1, L] or None)``, differentiable, 0 where the target is -100
        (entropy: 0 there too). What moves between ranks afterwards is per token or per
        document (`sum_per_document`): O(tokens), never O(tokens x vocab).
    """
    if logits_1LV.shape[:2] != targets_1L.shape:
        raise ValueError(f"logits {tuple(logits_1LV.shape)} and targets {tuple(targets_1L.shape)} must be [1, L, V] "
                         "and [1, L] of the same shard")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature!r}")
    dtype = torch.promote_types(logits_1LV.dtype, torch.float32)
    logp_1LV = torch.log_softmax(logits_1LV.to(dtype) / temperature, dim=-1)
    valid = targets_1L != IGNORE_INDEX
    picked = logp_1LV.gather(-1, targets_1L.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    log_probs = torch.where(valid, picked, torch.zeros((), dtype=dtype, device=picked.device))
    if not with_entropy:
        return log_probs, None
    entropy = -(logp_1LV.exp() * logp_1LV).sum(-1)
    return log_probs, torch.where(valid, entropy, torch.zeros((), dtype=dtype, device=entropy.device))


def sum_per_document(values_1L: torch.Tensor, state: Optional[Any] = None) -> torch.Tensor:
    """``[D]``: per-token values of this rank's shard summed by document over the whole CP group.

    Args:
        values_1L: ``[1, L]`` per-token values of this rank's positions (e.g. `token_log_probs`).
        state: the step (`StepState`); default the active one.

    Returns:
        ``[D]`` (``D`` = the row's documents, in document-id order), the same on every rank of
        the CP group: one all-reduce of ``D`` numbers. Its backward is the identity on each
        rank: every CP rank computes the same loss from these sums, and gradients summed over
        the CP group (`parallel.reduce_gradients`, or DDP/FSDP over dp x cp with the loss scaled
        as `token_mean_loss` says) are the exact gradient. Padding counts nowhere.
    """
    from .step.slot import current_step

    state = current_step() if state is None else state
    if state is None:
        raise ValueError("sum_per_document needs a CP step: call it inside train_ctx() or pass state=")
    if values_1L.shape != (1, state.local_len):
        raise ValueError(f"values must be this rank's [1, {state.local_len}] shard, got {tuple(values_1L.shape)}")
    ids = state.geometry.doc_ids.to(values_1L.device)
    docs = int(ids.max())
    local_ids = ids[state.positions.to(values_1L.device)]
    sums = values_1L.new_zeros(docs + 1).index_add(0, local_ids, values_1L[0])[1:]
    return _SumOverGroup.apply(sums, state.group) if state.group is not None and state.world > 1 else sums


def replicated_sum(x: torch.Tensor, group: Any) -> torch.Tensor:
    """`x` summed over `group`, as a value every rank then uses in its *own* copy of a loss.

    Forward: an all-reduce (sum). Backward: an all-reduce (sum) of the gradients too, the
    adjoint of the forward when each rank's loss depends on the sum: every rank's `x` gets
    the gradient of the sum of all ranks' losses. So when each of the ``n`` ranks adds the
    same ``f(sum)`` to its loss, the gradients summed over the ranks are ``n`` times the
    gradient of one ``f(sum)`` (compare `sum_per_document`, whose identity backward gives
    the gradient of one copy). Every rank of `group` must run the backward.
    """
    if group is None or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return x
    return _ReplicatedSum.apply(x, group)


class _ReplicatedSum(torch.autograd.Function):
    """All-reduce (sum) over `group` forward and backward (see `replicated_sum`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) over `group` forward; identity backward (see `sum_per_document`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None
