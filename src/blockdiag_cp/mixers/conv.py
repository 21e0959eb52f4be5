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
travel in one all-gather of the rows any rank needs (``k - 1`` per straddling piece:
a few rows, whatever the document's length); backward is its reduce-scatter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from ..errors import ensure
from ..parallel.collectives import AllGatherRows
from ..plan.geometry import StepGeometry


@dataclass(frozen=True)
class ConvPlan:
    """One rank's per-document convolution of width `width` for a step (Note [A causal convolution ...]).

    Attributes:
        width: the kernel size ``k``.
        send_rows: ``[pad]`` local rows this rank contributes to the all-gather (rows other
            ranks' windows need, ascending, repeated to `pad`); None: nothing crosses ranks.
        pad: rows per rank in the all-gather.
        cat_index: ``[T]`` rows of ``[local (L) | gathered (W * pad) | zero row]`` laid out
            as ``[halo | piece]`` per piece.
        out_index: ``[L]`` each local row's output in the conv result (padding rows: a zero row).
    """

    width: int
    world: int
    group: Any
    send_rows: Optional[torch.Tensor]
    pad: int
    cat_index: torch.Tensor
    out_index: torch.Tensor

    @staticmethod
    def build(geometry: StepGeometry, rank: int, group: Any, width: int, device: torch.device) -> "ConvPlan":
        W, L = geometry.world, geometry.plan.local_len
        sends = [_rows_others_need(geometry, r, width) for r in range(W)]
        pad = max(s.numel() for s in sends)
        slot_of = _halo_slots(geometry, rank, sends, pad, L)
        cat, out = _layout(geometry.pieces(rank), geometry.doc_start, slot_of, width, L, L + W * pad)
        send = None if pad == 0 else _padded(sends[rank], pad).to(device)
        return ConvPlan(width, W, group, send, pad, cat.to(device), out.to(device))

    def __call__(self, x_LC: torch.Tensor, weight_CK: torch.Tensor, bias_C: Optional[torch.Tensor]) -> torch.Tensor:
        """``x [L, C]`` -> ``[L, C]``: each local row's convolution over its own document's inputs
        (padding rows: 0). Differentiable; runs the plan's all-gather (forward and backward)."""
        C = x_LC.shape[1]
        parts = [x_LC]
        if self.send_rows is not None:
            parts.append(AllGatherRows.apply(x_LC.index_select(0, self.send_rows), self.group))
        parts.append(x_LC.new_zeros(1, C))
        rows = torch.cat(parts)
        if self.cat_index.numel() == 0:  # only padding here: zeros that still depend on the gathered rows,
            return x_LC.new_zeros(x_LC.shape) + 0.0 * rows.sum()  # so this rank's backward joins the collective
        x_TC = rows.index_select(0, self.cat_index)
        y_CT = F.conv1d(x_TC.t().unsqueeze(0), weight_CK.unsqueeze(1), bias_C, groups=C)[0]
        y_TC = torch.cat([y_CT.t(), y_CT.new_zeros(1, C)])
        return y_TC.index_select(0, self.out_index)


def _rows_others_need(geometry: StepGeometry, rank: int, width: int) -> torch.Tensor:
    """Local rows of `rank` that another rank's windows of `width` read (ascending)."""
    if width < 2:
        return torch.zeros(0, dtype=torch.long)
    needed_by = geometry.need_at(geometry.plan.positions_WL[rank], window=width)  # [W, L]
    needed_by[rank] = False
    return torch.nonzero(needed_by.any(dim=0)).flatten()


def _halo_slots(geometry: StepGeometry, rank: int, sends: list[torch.Tensor], pad: int, L: int) -> torch.Tensor:
    """``[S_pad]``: each position's row in ``[local | gathered]`` as `rank` sees it (-1: not here)."""
    slot = torch.full((geometry.plan.padded_len,), -1, dtype=torch.long)
    mine = geometry.plan.rank_positions(rank)
    slot[mine] = torch.arange(L)
    for source, rows in enumerate(sends):
        if source != rank and rows.numel():
            slot[geometry.plan.positions_WL[source][rows]] = L + source * pad + torch.arange(rows.numel())
    return slot


def _layout(pieces, doc_start: torch.Tensor, slot_of: torch.Tensor, width: int, L: int, zero: int):
    """``(cat_index [T], out_index [L])`` for the ``[halo | piece]`` segments of `pieces`."""
    cat, out, taken = [], torch.full((L,), -1, dtype=torch.long), 0
    for local0, length, g0, d0 in zip(*(t.tolist() for t in (pieces.local_start, pieces.length,
                                                               pieces.global_start, pieces.doc_start))):
        halo = torch.arange(g0 - (width - 1), g0)
        inside = halo >= d0
        rows = torch.full_like(halo, zero)
        rows[inside] = slot_of[halo[inside]]
        ensure(not bool((rows < 0).any()), "a conv halo row is missing from the plan")
        cat += [rows, torch.arange(local0, local0 + length)]
        out[local0 : local0 + length] = taken + torch.arange(length)
        taken += width - 1 + length
    cat_index = torch.cat(cat) if cat else torch.zeros(0, dtype=torch.long)
    out[out < 0] = max(taken - (width - 1), 0)  # padding rows read the appended zero row
    return cat_index, out


def _padded(rows: torch.Tensor, pad: int) -> torch.Tensor:
    """`rows` repeated with its first entry (or row 0) up to `pad` entries (the extra ones are never read)."""
    filler = rows[:1] if rows.numel() else torch.zeros(1, dtype=torch.long)
    return torch.cat([rows, filler.expand(pad - rows.numel())])
