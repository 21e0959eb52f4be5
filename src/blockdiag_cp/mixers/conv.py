"""Short causal convolutions per document, across CP ranks: each output sees only its document's inputs.

Note [A causal convolution per document, with a halo]
-----------------------------------------------------
A depthwise causal convolution of width ``k`` (LFM2, and the convolution before a Gated
DeltaNet or Mamba2 recurrence) computes ``y[t] = b + sum_j w[j] x[t - (k - 1) + j]``. On
a packed row the window must not reach into the previous document: inputs before the
document's first token are zero, as if the document ran alone. Under CP, the first
``k - 1`` inputs a piece's window needs may live on another rank (or, in the balanced
layout, on the same rank in an earlier piece of the same document). These are exactly
the keys a sliding window of ``k`` needs (`StepGeometry.needs(window=k)`), so the plan
reads them from the step's geometry:

    piece rows        [ p0  p1  p2 ...]          (one document's run of local rows)
    conv input        [h0 h1 h2 | p0 p1 p2 ...]  h: the k - 1 inputs before p0 in its
                                                 document (zero rows before its start)

Every piece of the local row is laid out as ``[halo | piece]`` in one concatenation, one
``F.conv1d`` runs over it (no padding), and each row's output is read where its window
ends; windows that straddle two segments are never read. The halo rows other ranks own
travel as the entries of an `EntryRoute` (Note [Entry routes]): one all-gather of the rows
any rank needs (``k - 1`` per straddling piece: a few rows, whatever the document's
length), or, under the grouped layout, point-to-point to the ranks that need them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from ..errors import ensure
from ..parallel.routes import EntryRoute
from ..plan.geometry import StepGeometry
from ..plan.ranges import concat_ranges


@dataclass(frozen=True)
class ConvPlan:
    """One rank's per-document convolution of width `width` for a step (Note [A causal convolution ...]).

    Attributes:
        width: the kernel size ``k``.
        send_rows: ``[E]`` local rows other ranks' windows need (this rank's entries of `route`,
            ascending); None: nothing crosses ranks.
        route: how those rows reach the ranks that need them (Note [Entry routes]).
        cat_index: ``[T]`` rows of ``[local (L) | delivered | zero row]`` laid out
            as ``[halo | piece]`` per piece.
        out_index: ``[L]`` each local row's output in the conv result (padding rows: a zero row).
    """

    width: int
    route: EntryRoute
    send_rows: Optional[torch.Tensor]
    delivered: int
    cat_index: torch.Tensor
    out_index: torch.Tensor

    @staticmethod
    def build(geometry: StepGeometry, rank: int, group: Any, width: int, device: torch.device,
              peers: bool = False) -> "ConvPlan":
        """`peers`: route the halo point-to-point (the grouped layout), else one all-gather."""
        W, L = geometry.world, geometry.plan.local_len_of(rank)
        reads = HaloReads.of(geometry, width)
        sends = [reads.rows_of(r) for r in range(W)]
        counts = [s.numel() for s in sends]
        route = (_peer_route(reads, rank, group, sends) if peers and max(counts) else
                 EntryRoute.gather(group, rank, counts))
        slot_of = _halo_slots(geometry, rank, sends, route, L)
        delivered = route.own + sum(route.recv_splits) if route.peers else W * route.pad
        cat, out = _layout(geometry.pieces(rank), slot_of, width, L, L + delivered)
        send = sends[rank].to(device) if route.moves_anything else None
        return ConvPlan(width, route, send, delivered, cat.to(device), out.to(device))

    def __call__(self, x_LC: torch.Tensor, weight_CK: torch.Tensor, bias_C: Optional[torch.Tensor]) -> torch.Tensor:
        """``x [L, C]`` -> ``[L, C]``: each local row's convolution over its own document's inputs
        (padding rows: 0). Differentiable; runs the plan's all-gather (forward and backward)."""
        C = x_LC.shape[1]
        parts = [x_LC]
        if self.send_rows is not None:
            parts.append(self.route.deliver(x_LC.index_select(0, self.send_rows)))
        parts.append(x_LC.new_zeros(1, C))
        rows = torch.cat(parts)
        if self.cat_index.numel() == 0:  # only padding here: zeros that still depend on the gathered rows,
            return x_LC.new_zeros(x_LC.shape) + 0.0 * rows.sum()  # so this rank's backward joins the transport
        x_TC = rows.index_select(0, self.cat_index)
        y_CT = F.conv1d(x_TC.t().unsqueeze(0), weight_CK.unsqueeze(1), bias_C, groups=C)[0]
        y_TC = torch.cat([y_CT.t(), y_CT.new_zeros(1, C)])
        return y_TC.index_select(0, self.out_index)


def conv_plan(state: Any, width: int) -> ConvPlan:
    """The step's per-document causal convolution of `width` (`state`: the active `StepState`; built on first
    use, then kept for the step)."""
    return state.derived(("conv", width), lambda: ConvPlan.build(state.geometry, state.rank, state.group, width,
                                                                 state.device, state.peer_routes))


@dataclass(frozen=True)
class HaloReads:
    """Every key a window of `width` reads on another rank: ``owner`` ``[n]`` holds it at local row
    ``row``, and rank ``reader`` reads it (the ``width - 1`` positions of its document before each of
    the reader's pieces that the reader does not own). Built from every rank's pieces: ``O(pieces x
    width)``, never a ``[W, S]`` need matrix."""

    owner: torch.Tensor
    row: torch.Tensor
    reader: torch.Tensor

    @staticmethod
    def of(geometry: StepGeometry, width: int) -> "HaloReads":
        pieces, _ = geometry.every_rank_pieces
        piece_rank = geometry.piece_rank
        first = torch.maximum(pieces.doc_start, pieces.global_start - max(width - 1, 0))
        span = pieces.global_start - first
        position = concat_ranges(first, span)
        reader = torch.repeat_interleave(piece_rank, span)
        owner, row = geometry.plan.segments.locate(position)
        elsewhere = owner != reader
        return HaloReads(owner[elsewhere], row[elsewhere], reader[elsewhere])

    def rows_of(self, rank: int) -> torch.Tensor:
        """Local rows of `rank` another rank reads (ascending, once each)."""
        return torch.unique(self.row[self.owner == rank])

    def read_by(self, owner: int, reader: int) -> torch.Tensor:
        """Local rows of `owner` that `reader` reads (ascending, once each)."""
        return torch.unique(self.row[(self.owner == owner) & (self.reader == reader)])


def _peer_route(reads: HaloReads, rank: int, group: Any, sends: list[torch.Tensor]) -> EntryRoute:
    """The halo rows point-to-point: each rank's entries (`sends`) to the ranks whose windows read them."""
    W = len(sends)
    readers = torch.unique(reads.reader[reads.owner == rank]).tolist()
    owners = torch.unique(reads.owner[reads.reader == rank]).tolist()
    empty = torch.zeros(0, dtype=torch.long)
    wanted_by = [torch.searchsorted(sends[rank], reads.read_by(rank, d)) if d in readers else empty for d in range(W)]
    wanted_from = [torch.searchsorted(sends[s], reads.read_by(s, rank)) if s in owners else empty for s in range(W)]
    return EntryRoute.between_peers(group, rank, [s.numel() for s in sends], wanted_from, wanted_by)


@dataclass(frozen=True)
class _HaloSlots:
    """Where the positions `rank` holds sit in ``[local | delivered]``: ``positions`` ``[n]`` ascending and their
    ``rows`` ``[n]`` (its own and the delivered ones only: O(own share + halo), not a table over the row)."""

    positions: torch.Tensor
    rows: torch.Tensor

    def of(self, positions: torch.Tensor) -> torch.Tensor:
        """``[m]`` the row of each of `positions` ``[m]`` (-1: not here)."""
        if self.positions.numel() == 0:
            return torch.full_like(positions, -1)
        at = torch.searchsorted(self.positions, positions).clamp(max=self.positions.numel() - 1)
        return torch.where(self.positions.index_select(0, at) == positions, self.rows.index_select(0, at), -1)


def _halo_slots(geometry: StepGeometry, rank: int, sends: list[torch.Tensor], route: EntryRoute,
                L: int) -> _HaloSlots:
    """Each position's row in ``[local | delivered]`` as `rank` sees it."""
    positions, rows = [geometry.plan.rank_positions(rank)], [torch.arange(L)]
    for source, sent in enumerate(sends):
        if source == rank or sent.numel() == 0 or (route.peers and source not in route.recv_lookup):
            continue
        entries = torch.arange(sent.numel())
        if route.peers:
            entries = torch.nonzero(route.recv_lookup[source] >= 0).flatten()
        positions.append(geometry.plan.rank_positions(source)[sent[entries]])
        rows.append(L + route.rows(source, entries))
    positions_all, order = torch.sort(torch.cat(positions))
    return _HaloSlots(positions_all, torch.cat(rows).index_select(0, order))


def _layout(pieces, slot_of: _HaloSlots, width: int, L: int, zero: int):
    """``(cat_index [T], out_index [L])`` for the ``[halo | piece]`` segments of `pieces`."""
    cat, out, taken = [], torch.full((L,), -1, dtype=torch.long), 0
    for local0, length, g0, d0 in zip(*(t.tolist() for t in (pieces.local_start, pieces.length,
                                                               pieces.global_start, pieces.doc_start))):
        halo = torch.arange(g0 - (width - 1), g0)
        inside = halo >= d0
        rows = torch.full_like(halo, zero)
        rows[inside] = slot_of.of(halo[inside])
        ensure(not bool((rows < 0).any()), "a conv halo row is missing from the plan")
        cat += [rows, torch.arange(local0, local0 + length)]
        out[local0 : local0 + length] = taken + torch.arange(length)
        taken += width - 1 + length
    cat_index = torch.cat(cat) if cat else torch.zeros(0, dtype=torch.long)
    out[out < 0] = max(taken - (width - 1), 0)  # padding rows read the appended zero row
    return cat_index, out
