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


class AllGatherRows(torch.autograd.Function):
    """``[L, ...]`` on each rank -> ``[world * L, ...]`` in rank order.

    Backward: reduce-scatter (sum), so each rank receives the summed gradient of the
    rows it contributed from every rank that used them.
    """

    @staticmethod
    def forward(ctx, x_LX: torch.Tensor, group) -> torch.Tensor:
        world = dist.get_world_size(group)
        out = x_LX.new_empty((world * x_LX.shape[0], *x_LX.shape[1:]))
        all_gather_flat(out, x_LX.contiguous(), group)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, grad_WLX: torch.Tensor):
        world = dist.get_world_size(ctx.group)
        out = grad_WLX.new_empty((grad_WLX.shape[0] // world, *grad_WLX.shape[1:]))
        _reduce_scatter_flat(out, grad_WLX.contiguous(), op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None


class AllToAllRows(torch.autograd.Function):
    """All-to-all-v of rows: ``send_splits[j]`` rows of ``x`` go to rank ``j``.

    Returns ``[sum(recv_splits), ...]``, grouped by source rank. Backward sends each
    received row's gradient back to its source (the same exchange, reversed).
    """

    @staticmethod
    def forward(ctx, x_TX: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
        out = x_TX.new_empty((sum(recv_splits), *x_TX.shape[1:]))
        dist.all_to_all_single(out, x_TX.contiguous(), recv_splits, send_splits, group=group)
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        return out

    @staticmethod
    def backward(ctx, grad_RX: torch.Tensor):
        send_splits, recv_splits = ctx.splits
        out = grad_RX.new_empty((sum(send_splits), *grad_RX.shape[1:]))
        dist.all_to_all_single(out, grad_RX.contiguous(), send_splits, recv_splits, group=ctx.group)
        return out, None, None, None


def p2p_rows(x_TX: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    """Point-to-point exchange of rows with only the peers that have a nonzero split.

    Same contract as `AllToAllRows.forward`; both sides derive the splits from the
    same replicated routing, so every posted send has its matching receive.
    """
    out = x_TX.new_empty((sum(recv_splits), *x_TX.shape[1:]))
    send_chunks = torch.split(x_TX.contiguous(), send_splits)
    recv_chunks = torch.split(out, recv_splits)
    ops = [
        dist.P2POp(dist.isend, send_chunks[j].contiguous(), dist.get_global_rank(group, j), group)
        for j, n in enumerate(send_splits) if n
    ] + [
        dist.P2POp(dist.irecv, recv_chunks[j], dist.get_global_rank(group, j), group)
        for j, n in enumerate(recv_splits) if n
    ]
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return out


class P2PRows(torch.autograd.Function):
    """`p2p_rows` forward; backward returns each row's gradient to its source."""

    @staticmethod
    def forward(ctx, x_TX: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        return p2p_rows(x_TX, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad_RX: torch.Tensor):
        send_splits, recv_splits = ctx.splits
        return p2p_rows(grad_RX, recv_splits, send_splits, ctx.group), None, None, None
