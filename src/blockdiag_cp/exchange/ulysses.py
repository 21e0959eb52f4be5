"""Head-parallel (Ulysses) CP around any K/V exchange: sequence shards become head shards.

Note [Head-parallel groups]
---------------------------
With ``ulysses_degree = u`` the CP group's ``W`` ranks form ``W / u`` head-parallel
groups of ``u`` consecutive ranks (`parallel.heads.HeadGroups`). Group ``g`` owns the positions
of its members, ascending (`plan.merge_consecutive_ranks`): a plan of ``W / u`` ranks of
``u * L`` positions, with its own geometry. Per attention call, member ``j``:

1. sends every other member the rows of its ``L`` tokens for that member's slice of
   heads and receives its own slice of the group's ``u * L`` tokens (one all-to-all of
   q, k and v together: ``[u, L, (H/u + Hk'/u) Dk + Hk'/u Dv]``, each token's q, k and v
   side by side at their own head dims), rows reordered to the group's ascending positions;
2. runs the inner exchange (`kv_exchange`) over the cross group of the ``W / u`` ranks that
   hold the same heads, routed on the group plan: only the K/V that the group's
   documents need cross groups;
3. returns the output rows to their owners by the inverse all-to-all.

Backward mirrors both all-to-alls (the all-to-all of equal chunks is its own adjoint).
Traffic per rank and call: the all-to-alls send ``(u - 1) L (Dk + Dv) (H/u + Hk'/u)``
elements forward (q and k at ``Dk``, v and the output at ``Dv``; ``(u - 1) L D (2 H/u +
2 Hk'/u)`` when the widths are equal) and as many backward, whatever the documents; the
inner exchange moves only needed K/V rows of ``Hk'/u`` heads between groups.

Grouped-query attention: ``H % u == 0`` is required. K/V heads are split when
``Hk % u == 0``; otherwise each is repeated ``r = u / gcd(Hk, u)`` times first
(``Hk' = lcm(Hk, u)`` heads, still dividing ``H``), so that every member receives exactly
the K/V heads its query heads use (with ``Hk < u`` a K/V head goes to several members).
Attention sinks ``[H]`` are sliced the same way as the query heads.
"""

from __future__ import annotations


import torch

from ..errors import ensure
from ..kernels import CallOptions
from ..parallel.collectives import AllToAllChunks
from ..parallel.heads import HeadSplit
from .base import KVExchange, Traffic


class UlyssesExchange(KVExchange):
    """Head-parallel all-to-alls around an inner exchange over the cross group (Note [Head-parallel groups])."""

    name = "ulysses"

    def __init__(self, inner: KVExchange, split: HeadSplit) -> None:
        self.inner = inner
        self.split = split
        self.name = f"ulysses{split.degree}+{inner.name}" if inner.name != "local" else f"ulysses{split.degree}"
        self.uses_p2p = inner.uses_p2p

    @property
    def traffic(self) -> Traffic:
        """The inner exchange's K/V rows between groups (rows of ``Hk'/u`` heads)."""
        return self.inner.traffic

    def attend(self, q_HLD, k_HLD, v_HLD, kernel, options: CallOptions, sinks=None):
        split = self.split
        ensure(split.group is not None, "a head-parallel state planned without process groups cannot attend "
               "(build it through make_cp_blockdiag_batch_and_ctx)")
        repeats = split.kv_repeats(k_HLD.shape[0])
        if repeats > 1:
            k_HLD, v_HLD = (t.repeat_interleave(repeats, dim=0) for t in (k_HLD, v_HLD))
        q, k, v = self._to_heads(q_HLD, k_HLD, v_HLD)
        mine = None if sinks is None else sinks.reshape(split.degree, -1)[split.member]
        out = self.inner.attend(q, k, v, kernel, options, sinks=mine)
        return self._to_sequence(out)

    def _to_heads(self, q_HLD, k_HLD, v_HLD):
        """``[H, L, D]`` sequence shards -> ``[H/u, u L, D]`` head shards (group rows ascending); each
        tensor keeps its head dim (``Dk`` for q and k, ``Dv`` for v)."""
        u, (H, L, _), Hk = self.split.degree, q_HLD.shape, k_HLD.shape[0]
        parts = [t.transpose(0, 1).reshape(L, u, n, t.shape[-1]).transpose(0, 1) for t, n in
                 ((q_HLD, H // u), (k_HLD, Hk // u), (v_HLD, Hk // u))]  # [u (member), L, n, D] views
        received = AllToAllChunks.apply(PackLast.apply(*parts), self.split.group)  # [u (source), L, C]
        rows = received.reshape(u * L, -1)
        if self.split.order is not None:
            rows = rows.index_select(0, self.split.order)
        widths = [p.shape[2] * p.shape[3] for p in parts]
        return tuple(t.unflatten(1, p.shape[2:]).transpose(0, 1) for t, p in zip(rows.split(widths, dim=1), parts))

    def _to_sequence(self, o_HLD):
        """``[H/u, u L, D]`` -> ``[H, L, D]``: each token's rows back to its owner, heads in order."""
        u, (Hs, uL, D) = self.split.degree, o_HLD.shape
        rows = o_HLD.transpose(0, 1)
        if self.split.inverse is not None:
            rows = rows.index_select(0, self.split.inverse)
        received = AllToAllChunks.apply(rows.reshape(u, uL // u, Hs, D), self.split.group)  # [u (heads), L, Hs, D]
        return received.permute(1, 0, 2, 3).reshape(uL // u, u * Hs, D).transpose(0, 1)


class PackLast(torch.autograd.Function):
    """``[u, L, n, D]`` parts (any strides, each its own ``n`` and ``D``) -> ``[u, L, C]``, ``C`` the sum of
    their ``n D``: each part copied once into its run of the last dimension (as ``torch.cat`` along ``n``
    did for equal ``D``); backward hands each part its run of the gradient, a view (no copy)."""

    @staticmethod
    def forward(ctx, *parts_ULND: torch.Tensor) -> torch.Tensor:
        ctx.shapes = [p.shape[2:] for p in parts_ULND]
        u, L = parts_ULND[0].shape[:2]
        out = parts_ULND[0].new_empty((u, L, sum(n * d for n, d in ctx.shapes)))
        for part, run in zip(parts_ULND, out.split([n * d for n, d in ctx.shapes], dim=2)):
            run.unflatten(2, part.shape[2:]).copy_(part)
        return out

    @staticmethod
    def backward(ctx, grad_ULC: torch.Tensor):
        runs = grad_ULC.split([n * d for n, d in ctx.shapes], dim=2)
        return tuple(run.unflatten(2, shape) for run, shape in zip(runs, ctx.shapes))
