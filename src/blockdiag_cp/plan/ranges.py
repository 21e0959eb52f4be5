"""Host-side index helpers shared by the step planners (geometry, exchanges, kernels)."""

from __future__ import annotations

import torch


def concat_ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenated ``arange(start, start + length)`` for every pair (int64, CPU)."""
    total = int(lengths.sum()) if lengths.numel() else 0
    item = torch.repeat_interleave(torch.arange(lengths.numel()), lengths, output_size=total)
    first = torch.cumsum(lengths, dim=0) - lengths
    return starts[item] + torch.arange(total) - first[item]


def intersect_ranges(lo: torch.Tensor, hi: torch.Tensor, start: torch.Tensor, end: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The non-empty overlaps of ranges ``[lo, hi)`` ``[n]`` with disjoint ranges ``[start, end)`` ``[m]``
    sorted by position: ``(i [k], j [k], a [k], b [k])``, overlap ``[a, b)`` of range ``i`` and range ``j``,
    ordered by ``i`` then position (``O(n log m + k)``)."""
    first = torch.searchsorted(end, lo, right=True)  # the first range ending after lo
    count = (torch.searchsorted(start, hi) - first).clamp(min=0)  # ... up to the first starting at or after hi
    i = torch.repeat_interleave(torch.arange(lo.numel()), count)
    j = concat_ranges(first, count)
    a = torch.maximum(lo.index_select(0, i), start.index_select(0, j))
    b = torch.minimum(hi.index_select(0, i), end.index_select(0, j))
    keep = b > a
    return i[keep], j[keep], a[keep], b[keep]
