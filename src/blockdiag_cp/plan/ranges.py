"""Host-side index helpers shared by the step planners (geometry, exchanges, kernels)."""

from __future__ import annotations

import torch


def concat_ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenated ``arange(start, start + length)`` for every pair (int64, CPU)."""
    total = int(lengths.sum()) if lengths.numel() else 0
    item = torch.repeat_interleave(torch.arange(lengths.numel()), lengths, output_size=total)
    first = torch.cumsum(lengths, dim=0) - lengths
    return starts[item] + torch.arange(total) - first[item]
