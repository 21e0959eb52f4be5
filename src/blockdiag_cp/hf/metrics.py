"""TRL's logged token metrics under CP, as the replicas' processes log them without CP.

Note [TRL's token metrics under CP]
-----------------------------------
TRL's ``SFTTrainer`` logs each micro-batch's ``entropy`` and ``mean_token_accuracy`` from three
sums per process (valid targets, their entropies, top-1 hits), gathered with accelerate's
``gather_for_metrics`` and added. Without CP a process holds its replica's batch, and at the end
of the dataloader ``gather_for_metrics`` keeps only the first ``remainder`` processes' values (it
trims what it gathered to the dataset's remainder, per process here). Under CP a rank holds a
shard: part of its replica's row, or, in the whole-batch step, parts of several replicas' rows;
the same gather over ``dp x cp`` ranks then keeps other values than the run without CP. So the
mixin recomputes both metrics from the per-token outputs the fused head returns (kept by a forward
hook on the model, `FusedOutputs`: TRL's ``return_outputs=True`` would run another forward): the sums per
replica (each local row's replica: `TrainCtx.replica_of_row`, else this rank's), one all-reduce
of ``3 x dp`` numbers over the world, the first ``remainder`` replicas kept as accelerate keeps
the replicas' processes, and the values TRL appended are replaced. The mixin counts TRL's logged
``num_tokens`` the same way (each replica's real tokens, the kept replicas').
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

#: the fused head's per-token outputs TRL sums, in the order of `replica_sums`' rows
TOKEN_FIELDS = ("label_mask", "entropy", "is_top1")


class FusedOutputs:
    """The last output of the model's fused LM head (``fused_lm_head=True``: it has `TOKEN_FIELDS`), kept by a
    forward hook; `outputs` is reset by the caller before each loss."""

    def __init__(self) -> None:
        self.outputs: Any = None

    @staticmethod
    def install(model: torch.nn.Module) -> "FusedOutputs":
        kept = FusedOutputs()

        def keep(module, args, output) -> None:
            if all(isinstance(getattr(output, name, None), torch.Tensor) for name in TOKEN_FIELDS):
                kept.outputs = output

        model.register_forward_hook(keep)
        return kept


def token_fields(outputs: Any) -> Optional[torch.Tensor]:
    """``[3, L]`` float64: the fused head's `TOKEN_FIELDS` of this rank's rows (None when the outputs lack them)."""
    fields = [getattr(outputs, name, None) for name in TOKEN_FIELDS]
    if any(not isinstance(f, torch.Tensor) for f in fields):
        return None
    return torch.stack([f.detach().reshape(-1).double() for f in fields])


def kept_totals(rows_XL: torch.Tensor, replica_of_row: torch.Tensor, dp: int, gradient_state: Any) -> torch.Tensor:
    """``[X]``: each row of `rows_XL` (per-token values of this rank's ``L`` rows) summed over the replicas
    accelerate's ``gather_for_metrics`` keeps now (all, or the first ``remainder`` at the end of the dataloader):
    per-replica sums (`replica_of_row` ``[L]``, -1 for padding), one all-reduce over the world."""
    real = replica_of_row >= 0
    sums = rows_XL.new_zeros((rows_XL.shape[0], dp)).index_add_(1, replica_of_row[real], rows_XL[:, real])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(sums)
    kept = kept_replicas(gradient_state)
    return (sums if kept is None else sums[:, :kept]).sum(dim=1)


def logged_metrics(totals: torch.Tensor) -> tuple[float, float]:
    """``(entropy, mean_token_accuracy)`` as TRL logs them from the kept totals of `TOKEN_FIELDS`."""
    valid, entropy, correct = totals.tolist()
    return (entropy / valid, correct / valid) if valid > 0 else (0.0, 0.0)


def kept_replicas(gradient_state: Any) -> Optional[int]:
    """How many gathered values accelerate's ``gather_for_metrics`` keeps now (None: all of them)."""
    if getattr(gradient_state, "end_of_dataloader", False) and getattr(gradient_state, "remainder", -1) > 0:
        return int(gradient_state.remainder)
    return None
