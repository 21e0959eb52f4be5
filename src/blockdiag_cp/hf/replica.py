"""One dp replica's view of a run whose ``cp`` ranks all run the same trainer code on the same data.

Note [Trainer code runs per replica, the model per CP rank]
-----------------------------------------------------------
Under `BlockDiagCPMixin`, the ``cp`` ranks of a dp replica hold the same batches, and a
scoring trainer (TRL's DPO, GRPO) computes the same values on each of them from the
gathered per-token scores (Note [Scoring forwards under CP] in hf/scoring.py). Its own
collectives then must span the dp replicas only, as they do in the run without CP,
where the world *is* the replicas: a world-wide gather would hold every replica's values
``cp`` times (a prompt group split over processes would be read twice, a batch standard
deviation would count each sample ``cp`` times), and ``process_index`` would index past
them. `ReplicaAccelerator` is accelerate's ``Accelerator`` with ``num_processes = dp``,
``process_index = dp rank`` and ``gather`` / ``reduce`` over the ranks that share this
rank's CP index (one per replica: the ``dp`` dimension of the ``(dp, cp)`` mesh);
everything else is the accelerator itself. `first_cp_rank_rows` turns a world-wide
gather made elsewhere into the replicas' gather (`gather_over_replicas`: the mixin's
evaluation gather, for every trainer kind).

Sampling: each CP rank of a replica generates, seeded as that replica is without CP
(``seed + dp rank``), and the completions and RNG state of CP rank 0 are then broadcast
over the CP group (`share_from_cp_rank0`), so they are the same bit for bit even where
generation kernels are not deterministic.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from .metrics import kept_replicas


class ReplicaAccelerator:
    """accelerate's ``Accelerator`` as one dp replica sees it (Note [Trainer code runs per replica ...]).

    Args:
        accelerator: the trainer's ``Accelerator``.
        dp_group: the process group of this rank's CP index across the dp replicas.
        dp: the number of replicas; dp_rank: this rank's replica.
    """

    def __init__(self, accelerator: Any, dp_group: Any, dp: int, dp_rank: int) -> None:
        self._accelerator, self._group, self._dp, self._dp_rank = accelerator, dp_group, dp, dp_rank

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)

    @property
    def num_processes(self) -> int:
        return self._dp

    @property
    def process_index(self) -> int:
        return self._dp_rank

    def gather(self, tensor: Any) -> Any:
        """Every replica's tensors concatenated on dim 0, in replica order (0-d tensors become ``[dp]``)."""
        from accelerate.utils import recursively_apply

        return recursively_apply(self._gather_one, tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """`gather`, the last batch trimmed to the dataset's remainder as accelerate trims it."""
        from accelerate.utils import recursively_apply

        if use_gather_object:
            raise ValueError("gather_for_metrics(use_gather_object=True) is not supported per replica under CP")
        data = self.gather(input_data)
        kept = kept_replicas(self._accelerator.gradient_state)
        return data if kept is None else recursively_apply(lambda t: t[:kept], data)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Sum (or mean) over the replicas."""
        from accelerate.utils import recursively_apply

        def reduce_one(t: torch.Tensor) -> torch.Tensor:
            out = t.clone()
            if self._dp > 1:
                dist.all_reduce(out, group=self._group)
            return (out / self._dp if reduction == "mean" else out) * scale

        if reduction not in ("sum", "mean"):
            raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
        return recursively_apply(reduce_one, tensor)

    def _gather_one(self, t: torch.Tensor) -> torch.Tensor:
        t = t.reshape(1) if t.dim() == 0 else t.contiguous()
        if self._dp == 1:
            return t.clone()
        parts = [torch.empty_like(t) for _ in range(self._dp)]
        dist.all_gather(parts, t, group=self._group)
        return torch.cat(parts, dim=0)


def first_cp_rank_rows(gathered: torch.Tensor, dp: int, cp: int) -> torch.Tensor:
    """``[world * n, ...]`` gathered over the world in rank order -> ``[dp * n, ...]``: CP rank 0 of each replica."""
    by_rank = gathered.reshape(dp, cp, -1, *gathered.shape[1:])
    return by_rank[:, 0].reshape(-1, *gathered.shape[1:])


def gather_over_replicas(data: Any, accelerator: Any, dp: int, cp: int, use_gather_object: bool = False,
                         trim: bool = True) -> Any:
    """accelerate's ``gather_for_metrics`` over the dp replicas of a world of ``dp x cp`` ranks: the world's
    gather, one CP rank per replica, then (``trim``; without it: its plain ``gather``) the last batch trimmed to
    the dataset's remainder."""
    from accelerate.utils import recursively_apply

    if use_gather_object:
        data = _gather_objects_over_replicas(data, dp * cp, cp)
    else:
        keep = functools.partial(first_cp_rank_rows, dp=dp, cp=cp)
        data = recursively_apply(keep, accelerator.gather(data))
    kept = kept_replicas(accelerator.gradient_state) if trim else None
    if kept is None:
        return data
    return data[:kept] if use_gather_object else recursively_apply(lambda t: t[:kept], data)


def _gather_objects_over_replicas(data: Any, world: int, cp: int) -> Any:
    """accelerate's ``gather_object`` as the dp replicas' processes run it without CP: one replica (one
    process, nothing distributed) gets its object back; several get every replica's items, flattened."""
    objects: list[Any] = [None] * world
    dist.all_gather_object(objects, data)
    replicas = objects[::cp]
    return replicas[0] if len(replicas) == 1 else [item for obj in replicas for item in obj]


def share_from_cp_rank0(value: Any, cp_group: Any) -> Any:
    """`value` (any picklable object) and the torch RNG state of CP rank 0, on every rank of `cp_group`.

    The RNG state travels too, so the ranks keep drawing the same numbers afterwards (the
    trainer shuffles the generated batch with torch's generator).
    """
    if cp_group is None or dist.get_world_size(cp_group) == 1:
        return value
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    box = [(value, torch.get_rng_state(), torch.cuda.get_rng_state() if cuda else None)]
    dist.broadcast_object_list(box, src=dist.get_global_rank(cp_group, 0), group=cp_group)
    shared, rng, cuda_rng = box[0]
    torch.set_rng_state(rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state(cuda_rng)
    return shared
