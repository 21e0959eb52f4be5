"""`reduce_gradients`: sum (or average) every gradient over the ranks that hold the same parameters.

Under CP the ranks of a CP group hold the same parameters and compute gradients from their
own shards of a row, so the gradients must be reduced over CP (and DP) before the optimizer
step; FSDP2 and DDP do that themselves, a plain loop or tensor parallelism does not. With
tensor parallelism a parameter is a DTensor whose local shard differs across the TP group:
its gradient is reduced over the *other* dimensions only (dp x cp), shard by shard.
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist

from ..errors import CPTypeError
from .agree import agree_across_ranks


def reduce_gradients(parameters: Iterable[torch.nn.Parameter], group: Any = None, *, average: bool = False) -> int:
    """All-reduce the gradients of `parameters` over `group`, in place; return how many were reduced.

    Args:
        parameters: e.g. ``model.parameters()``; plain tensors and DTensors (tensor parallel shards)
            alike; those without a gradient are skipped.
        group: the ranks holding the same parameters: a `DeviceMesh` (several dimensions are
            flattened, e.g. ``mesh["dp", "cp"]``), a process group, or None (the default group).
        average: divide by the group's size (for a loss that is a per-rank mean); SUM otherwise
            (for `loss.token_mean_loss` with ``grads_averaged_over=1``).

    Gradients of one dtype and device travel as one flat buffer (one all-reduce each). Every
    rank of `group` must hold gradients for the same parameters: one small all-gather checks
    it first, and a mismatch is a `ValueError` on every rank (not a hang). A DTensor gradient
    with a ``Partial`` placement is a `ValueError`: it is not reduced over its own mesh yet.
    """
    group = _process_group(group)
    buckets: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for param in parameters:
        grad = param.grad
        if grad is None:
            continue
        local = _local_gradient(grad)
        buckets[(local.device, local.dtype)].append(local)
    _agree_on_buckets(buckets, group)
    world = dist.get_world_size(group)
    for grads in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        if average:
            flat /= world
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    return sum(len(grads) for grads in buckets.values())


def _agree_on_buckets(buckets: dict[tuple, list[torch.Tensor]], group: Any) -> None:
    """`ValueError` on every rank unless all ranks reduce the same buckets (Note [Ranks agree] in parallel/agree.py)."""

    layout = [(str(dtype), device.type, len(grads), sum(g.numel() for g in grads))
              for (device, dtype), grads in buckets.items()]
    device = next(iter(buckets))[0] if buckets else torch.device("cpu")
    if dist.get_backend(group) == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    fingerprint = [sum(n for *_, n in layout), sum(c for _, _, c, _ in layout), zlib.crc32(repr(layout).encode())]
    agree_across_ranks(group, device, fingerprint, None, "gradients to reduce (every rank must hold the same ones)",
                       "elements, gradients, crc of their dtypes and devices")


def _local_gradient(grad: torch.Tensor) -> torch.Tensor:
    """This rank's part of `grad`: the tensor itself, or a DTensor's local shard."""
    placements = getattr(grad, "placements", None)
    if placements is None:
        return grad
    if any(p.is_partial() for p in placements):
        raise ValueError(
            f"a DTensor gradient has placements {placements}: a Partial one is not reduced over its own mesh "
            "yet; redistribute it (or let its parallel style do so) before reducing over dp x cp"
        )
    return grad.to_local()


def _process_group(group: Any) -> Optional[Any]:
    """`group` as a process group (None: the default group)."""
    from torch.distributed.device_mesh import DeviceMesh

    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    if not isinstance(group, DeviceMesh):
        raise CPTypeError(f"group must be a DeviceMesh, a ProcessGroup or None, got {type(group).__name__}")
    mesh = group if group.ndim == 1 else group._flatten()
    return mesh.get_group()
