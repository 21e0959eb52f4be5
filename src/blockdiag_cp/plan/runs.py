"""Runs of a document id row: where each run (a document, or a padding run) starts, and the checks
that make a row valid. The lowest layer of planning: `plan/` and `step/` both build on it.

A document id row is ``[S]`` (or ``[B, S]``) int64; 0 marks padding, every other value names one
document, and each document is one contiguous run of positions.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CPTypeError

__all__ = ("doc_starts", "run_starts", "validate_doc_ids")


def validate_doc_ids(doc_ids: Any, seq_len: int, batch_size: int, *, source: str = "doc_ids") -> torch.Tensor:
    """Check document ids and return them as ``[B, S]`` int64.

    Raises `ValueError` unless `doc_ids` is an integer (or bool) tensor shaped
    ``[B, S]``, all values >= 0, and every nonzero id forms a single contiguous run.
    """
    if not isinstance(doc_ids, torch.Tensor):
        raise CPTypeError(f"{source}: document ids must be a tensor, got {type(doc_ids).__name__}")
    if doc_ids.device.type == "meta":
        raise ValueError(f"{source}: document ids are on the meta device (shapes only, no values)")
    if doc_ids.is_floating_point() or doc_ids.is_complex():
        raise ValueError(f"{source}: document ids must be integers, got dtype {doc_ids.dtype}")
    if tuple(doc_ids.shape) != (batch_size, seq_len):
        raise ValueError(
            f"{source}: document ids must be shaped like the sequence [B, S] = "
            f"[{batch_size}, {seq_len}], got {tuple(doc_ids.shape)}"
        )
    ids = doc_ids.to(torch.long)
    if bool((ids < 0).any()):
        raise ValueError(f"{source}: document ids must be >= 0 (0 marks padding), got {int(ids.min())}")
    for row in range(ids.shape[0]):
        _check_single_runs(ids[row], source)
    return ids


def _check_single_runs(ids_S: torch.Tensor, source: str) -> None:
    """Raise if any nonzero id of a 1-D row appears in more than one run."""
    starts = run_starts(ids_S)
    run_ids = ids_S[starts]
    real = run_ids[run_ids != 0]
    uniq, counts = torch.unique(real, return_counts=True)
    if bool((counts > 1).any()):
        bad = int(uniq[counts > 1][0])
        where = torch.nonzero(starts & (ids_S == bad)).flatten().tolist()
        raise ValueError(
            f"{source}: document id {bad} appears in {len(where)} separate runs (starting at "
            f"positions {where[:4]}); every document must be one contiguous run. Give each "
            f"run its own id."
        )


def run_starts(ids_S: torch.Tensor) -> torch.Tensor:
    """``[S]`` bool: True where a run of equal ids begins."""
    starts = torch.ones_like(ids_S, dtype=torch.bool)
    starts[1:] = ids_S[1:] != ids_S[:-1]
    return starts


def doc_starts(ids_S: torch.Tensor) -> torch.Tensor:
    """``[S]`` int64: for each position, the first position of its run (its document)."""
    index = torch.arange(ids_S.numel(), device=ids_S.device)
    marked = torch.where(run_starts(ids_S), index, torch.zeros_like(index))
    return torch.cummax(marked, dim=0).values
