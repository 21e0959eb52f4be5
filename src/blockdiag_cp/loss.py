"""What a loss needs across shard boundaries: next-token targets and a CP-correct mean."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from .step.doc_ids import resolve_doc_ids

IGNORE_INDEX = -100


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
