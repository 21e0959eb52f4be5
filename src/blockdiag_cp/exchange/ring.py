"""`ring`: K/V blocks travel around the ring, overlapped with attention on the block at hand.

Note [Trimmed ring with log-sum-exp merge]
------------------------------------------
At hop ``t`` rank ``r`` holds the block of owner ``o = r - t`` (mod world). While it
attends its queries to that block, it already sends the block on to ``r + 1`` and
receives the next one from ``r - 1`` (asynchronous point-to-point). Each hop's
partial output is merged exactly by log-sum-exp, so at most two K/V blocks are
resident, never the whole sequence.

A block is *trimmed* as it travels: it carries only the rows some rank still ahead
of it needs (``T[o, t]`` shrinks with ``t``), and is not sent at all once nobody
downstream needs it. Hops with no visible keys skip the kernel.

    hop:      0          1               2
    r0:    [B0]  -->  [B3 trimmed]  [B2 trimmed]
    r1:    [B1]  -->  [B0 trimmed]  [B3 trimmed]   ...

Backward re-circulates the K/V blocks the same way (memory stays bounded) and
sends each hop's K/V gradients straight back to the block's owner: only the rows
that rank used. The owner adds them to its own gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..errors import ensure
from ..kernels import AttentionKernel, CallOptions, ItemTable, merge_partial
from ..plan.traffic import travel_rows
from ..kernels.base import accumulate_dtype, add_sinks, save_for_backward, saved_for_backward, sinks_grad
from .base import ExchangeSetup, KVExchange, Traffic, fuse_rows, token_major, unfuse_rows


@dataclass(frozen=True)
class Hop:
    """One hop's routing for this rank (all index tensors on the device).

    Attributes:
        owner: the rank whose block is held at this hop.
        items: this rank's queries against the block held at this hop.
        kernel_calls: each kernel's call table for `items`.
        send_index: rows of the held block to send on (None: send nothing).
        recv_rows: rows of the next block arriving from the left (0: none).
        grad_send_index: rows of the held block whose gradients go to the owner.
        grad_recv_rows: own rows whose gradients arrive from the rank holding the
            own block at this hop (None: none).
    """

    owner: int
    items: ItemTable
    kernel_calls: Any
    send_index: Optional[torch.Tensor]
    recv_rows: int
    grad_send_index: Optional[torch.Tensor]
    grad_recv_rows: Optional[torch.Tensor]


class _P2P:
    """Posts sends and receives to ring peers at once; `wait` returns the received tensors."""

    def __init__(self, group, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]):
        ops = [dist.P2POp(dist.isend, t.contiguous(), dist.get_global_rank(group, p), group) for t, p in sends]
        ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(group, p), group) for t, p in recvs]
        self._recvs = [t for t, _ in recvs]
        self._works = dist.batch_isend_irecv(ops) if ops else []

    def wait(self) -> list[torch.Tensor]:
        for work in self._works:
            work.wait()
        return self._recvs


class RingExchange(KVExchange):
    name = "ring"
    uses_p2p = True

    def __init__(self, setup: ExchangeSetup) -> None:
        for kernel in setup.kernels:
            if not kernel.supports_lse:
                raise ValueError(
                    f"kv_exchange='ring' merges partial results by log-sum-exp, which kernel={kernel.name!r} does "
                    "not expose; use kernel='sdpa' or 'dense', or another exchange ('auto', 'a2a', 'halo')"
                )
        self.rank, self.world, self.group = setup.rank, setup.world, setup.group
        travel = travel_rows(setup.geometry)
        self.hops = tuple(_route_hop(setup, travel, t) for t in range(setup.world))

    @property
    def traffic(self) -> Traffic:
        kv_sent = sum(0 if h.send_index is None else h.send_index.numel() for h in self.hops)
        kv_recv = sum(h.recv_rows for h in self.hops)
        grad_sent = sum(0 if h.grad_send_index is None else h.grad_send_index.numel() for h in self.hops[1:])
        grad_recv = sum(0 if h.grad_recv_rows is None else h.grad_recv_rows.numel() for h in self.hops[1:])
        return Traffic(kv_sent, kv_recv, kv_sent + grad_sent, kv_recv + grad_recv)

    def attend(self, q_HLD, k_HLD, v_HLD, kernel, options: CallOptions, sinks=None):
        return _RingAttention.apply(q_HLD, k_HLD, v_HLD, sinks, self, kernel, options)

    def circulate(self, t: int, block: torch.Tensor) -> Optional[_P2P]:
        """Start sending hop t's block on and receiving hop t+1's (None on the last hop)."""
        if t == self.world - 1:
            return None
        hop = self.hops[t]
        right, left = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        sends = [] if hop.send_index is None else [(block.index_select(0, hop.send_index), right)]
        recvs = [] if hop.recv_rows == 0 else [(block.new_empty((hop.recv_rows, *block.shape[1:])), left)]
        return _P2P(self.group, sends, recvs)

    def next_block(self, pending: Optional[_P2P], block: torch.Tensor) -> torch.Tensor:
        """The block for the next hop (empty when nothing arrives)."""
        received = pending.wait() if pending is not None else []
        return received[0] if received else block[:0]


class _RingAttention(torch.autograd.Function):
    """Attention over all hops of a `RingExchange` (Note [Trimmed ring with log-sum-exp merge])."""

    @staticmethod
    def forward(ctx, q_HLD, k_HLD, v_HLD, sinks_H, ring: RingExchange, kernel: AttentionKernel, options: CallOptions):
        """The sinks join after every hop is merged."""
        block = fuse_rows(*token_major(k_HLD, v_HLD))  # [L, Hk, Dk + Dv] (Note [Fused K/V rows])
        if kernel.keeps_inputs:  # every hop's calls slice one head-major q (no copy per hop)
            q_HLD = q_HLD.contiguous()
        (H, L, Dk), Dv = q_HLD.shape, v_HLD.shape[-1]
        acc = accumulate_dtype(q_HLD.dtype)
        o = torch.zeros(H, L, Dv, dtype=acc, device=q_HLD.device)
        lse = torch.full((H, L), float("-inf"), dtype=acc, device=q_HLD.device)
        auxes = []
        for t, hop in enumerate(ring.hops):
            pending = ring.circulate(t, block)
            aux = None
            if hop.items.size:
                k, v = token_major(*unfuse_rows(block, Dk))
                o_t, lse_t, aux = kernel.forward(hop.kernel_calls[kernel.name], q_HLD, k, v, options)
                o, lse = merge_partial(o, lse, o_t, lse_t)
            auxes.append(aux)
            block = ring.next_block(pending, block)
        if sinks_H is not None:
            o, lse = add_sinks(o, lse, sinks_H)
        o = o.to(q_HLD.dtype)
        save_for_backward(ctx, kernel, (q_HLD,), (k_HLD, v_HLD, o, lse, sinks_H), auxes)
        ctx.ring, ctx.kernel, ctx.options = ring, kernel, options
        return o

    @staticmethod
    def backward(ctx, do_HLD):
        (q,), (k_own, v_own, o, lse, sinks_H), auxes = saved_for_backward(ctx)
        ring, kernel, Dk = ctx.ring, ctx.kernel, k_own.shape[-1]
        acc = accumulate_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        block = fuse_rows(*token_major(k_own, v_own))
        d_own = torch.zeros(block.shape, dtype=acc, device=q.device)
        for t, hop in enumerate(ring.hops):
            pending = ring.circulate(t, block)
            d_block = None
            if hop.items.size:
                k, v = token_major(*unfuse_rows(block, Dk))
                dq_t, dk_t, dv_t = kernel.backward(
                    hop.kernel_calls[kernel.name], do_HLD, q, k, v, o, lse, auxes[t], ctx.options
                )
                dq += dq_t
                d_block = fuse_rows(*token_major(dk_t, dv_t))
            _return_block_grads(ring, t, hop, d_block, d_own)
            block = ring.next_block(pending, block)
        dk, dv = token_major(*unfuse_rows(d_own, Dk))
        d_sinks = None if sinks_H is None else sinks_grad(do_HLD, o, lse, sinks_H).to(sinks_H.dtype)
        return dq.to(q.dtype), dk.to(k_own.dtype), dv.to(v_own.dtype), d_sinks, None, None, None


def _return_block_grads(ring: RingExchange, t: int, hop: Hop, d_block: Optional[torch.Tensor], d_own: torch.Tensor) -> None:
    """Add hop t's own-block gradients locally, or send them to the owner; receive ours."""
    if t == 0:
        if d_block is not None:
            d_own += d_block
        return
    sends, recvs = [], []
    if hop.grad_send_index is not None:
        grads = d_block.index_select(0, hop.grad_send_index).to(d_own.dtype)
        sends.append((grads, hop.owner))
    if hop.grad_recv_rows is not None:
        holder = (ring.rank + t) % ring.world
        recvs.append((d_own.new_empty((hop.grad_recv_rows.numel(), *d_own.shape[1:])), holder))
    received = _P2P(ring.group, sends, recvs).wait()
    if received:
        d_own.index_add_(0, hop.grad_recv_rows, received[0])


def _route_hop(setup: ExchangeSetup, travel: list[list[torch.Tensor]], t: int) -> Hop:
    rank, W, device = setup.rank, setup.world, setup.device
    owner = (rank - t) % W
    held = travel[owner][t]
    items = _hop_items(setup, owner, held)
    calls = {k.name: k.prepare(items, device) for k in setup.kernels}
    send_index = recv_rows = None
    if t < W - 1:
        onward = travel[owner][t + 1]
        send_index = torch.searchsorted(held, onward).to(device) if onward.numel() else None
        recv_rows = travel[(rank - 1 - t) % W][t + 1].numel()
    used = torch.nonzero(setup.geometry.need_at(setup.geometry.plan.rank_positions(owner))[rank]).flatten()
    grad_send = torch.searchsorted(held, used).to(device) if (t > 0 and used.numel()) else None
    holder = (rank + t) % W
    mine_used = torch.nonzero(setup.geometry.need_at(setup.geometry.plan.rank_positions(rank))[holder]).flatten()
    grad_recv = mine_used.to(device) if (t > 0 and mine_used.numel()) else None
    return Hop(owner, items, calls, send_index, recv_rows or 0, grad_send, grad_recv)


def _hop_items(setup: ExchangeSetup, owner: int, held: torch.Tensor) -> ItemTable:
    """Items of this rank's pieces over the rows `held` of `owner`'s block.

    Own block: each piece sees its document's own rows up to its end, bottom-right
    causal in local order (local order is ascending position). Another rank's block:
    a piece sees that rank's rows of its document that precede it, all of them.
    """
    pieces = setup.pieces()
    owner_pos = setup.geometry.plan.rank_positions(owner)
    first = torch.searchsorted(owner_pos, pieces.doc_start)
    if owner == setup.rank:
        k_start, k_end, causal = first, pieces.local_start + pieces.length, True
    else:
        k_start, k_end, causal = first, torch.searchsorted(owner_pos, pieces.global_start), False
    keep = k_end > k_start
    k_len = (k_end - k_start)[keep]
    k_held = torch.searchsorted(held, k_start[keep])
    if keep.any():
        ensure(torch.equal(held[k_held + k_len - 1], k_end[keep] - 1), "ring block lacks a needed row")
    return ItemTable(
        pieces.local_start[keep], pieces.length[keep], k_held, k_len,
        torch.full((int(keep.sum()),), causal, dtype=torch.bool), setup.local_len, held.numel(),
    )
