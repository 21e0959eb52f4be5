"""Differentiable collectives over a CP group (small autograd Functions)."""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch 2.13 renamed the flat-tensor collectives (the old names warn); torch 2.9 has only the old.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_flat(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """Concatenate every rank's `x` along dim 0 into `out` (rank order)."""
    _all_gather_flat(out, x, group=group)


def all_gather_rows(x_LX: torch.Tensor, group) -> torch.Tensor:
    """``[L, ...]`` on each rank -> ``[W * L, ...]`` in rank order."""
    out = x_LX.new_empty((dist.get_world_size(group) * x_LX.shape[0], *x_LX.shape[1:]))
    all_gather_flat(out, x_LX.contiguous(), group)
    return out


def reduce_scatter_rows(x_WLX: torch.Tensor, group) -> torch.Tensor:
    """``[W * L, ...]`` on each rank -> this rank's ``[L, ...]`` block, summed over ranks."""
    out = x_WLX.new_empty((x_WLX.shape[0] // dist.get_world_size(group), *x_WLX.shape[1:]))
    _reduce_scatter_flat(out, x_WLX.contiguous(), op=dist.ReduceOp.SUM, group=group)
    return out


def all_to_all_rows(x_TX: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    """All-to-all-v of rows: ``send_splits[j]`` rows of `x` go to rank ``j``; the result is
    ``[sum(recv_splits), ...]``, grouped by source rank."""
    out = x_TX.new_empty((sum(recv_splits), *x_TX.shape[1:]))
    dist.all_to_all_single(out, x_TX.contiguous(), recv_splits, send_splits, group=group)
    return out


class AllGatherRows(torch.autograd.Function):
    """`all_gather_rows`; backward: `reduce_scatter_rows`, so each rank receives the summed
    gradient of the rows it contributed from every rank that used them."""

    @staticmethod
    def forward(ctx, x_LX: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return all_gather_rows(x_LX, group)

    @staticmethod
    def backward(ctx, grad_WLX: torch.Tensor):
        return reduce_scatter_rows(grad_WLX, ctx.group), None


def p2p_rows(x_TX: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    """Point-to-point exchange of rows with only the peers that have a nonzero split.

    Same contract as `all_to_all_rows`; both sides derive the splits from the
    same replicated routing, so every posted send has its matching receive. Rows a
    rank sends itself are copied.
    """
    out = x_TX.new_empty((sum(recv_splits), *x_TX.shape[1:]))
    send_chunks = torch.split(x_TX.contiguous(), send_splits)
    recv_chunks = torch.split(out, recv_splits)
    me = dist.get_rank(group)
    if send_splits[me]:
        recv_chunks[me].copy_(send_chunks[me])
    ops = [
        dist.P2POp(dist.isend, send_chunks[j].contiguous(), dist.get_global_rank(group, j), group)
        for j, n in enumerate(send_splits) if n and j != me
    ] + [
        dist.P2POp(dist.irecv, recv_chunks[j], dist.get_global_rank(group, j), group)
        for j, n in enumerate(recv_splits) if n and j != me
    ]
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return out


class AllToAllChunks(torch.autograd.Function):
    """``x [W, ...]``: chunk ``j`` goes to rank ``j``; the result's chunk ``m`` came from rank ``m``.

    Equal chunks, so the operation is its own adjoint: backward runs it on the gradient.
    """

    @staticmethod
    def forward(ctx, x_WX: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return all_to_all_chunks(x_WX, group)

    @staticmethod
    def backward(ctx, grad_WX: torch.Tensor):
        return all_to_all_chunks(grad_WX, ctx.group), None


def all_to_all_chunks(x_WX: torch.Tensor, group) -> torch.Tensor:
    out = torch.empty_like(x_WX, memory_format=torch.contiguous_format)
    dist.all_to_all_single(out, x_WX.contiguous(), group=group)
    return out
