"""Ranks agree before they communicate: one small all-gather instead of a hang or a crash.

Note [Ranks agree]
------------------
Every rank of a CP group must run the same collectives with the same sizes. When one
rank's input is bad (a rejected batch, a layer called with other head counts or
dtypes), raising on that rank alone leaves the others waiting in their next
collective (a hang) or sends mismatched sizes (gloo aborts the process). So the
check is itself collective: each rank contributes ``[problem?, fingerprint...]``
(a few int64s) to one all-gather, and then every rank raises, the same way:

- the rank that found a problem raises it;
- the others raise "rank(s) [r] rejected their ..." naming it;
- if no rank has a problem but the fingerprints differ, every rank raises with the
  table of fingerprints.

`gather_fingerprints` is the all-gather and the first two rules; `agree_across_ranks` adds
the third. The whole-batch step (world.py) compares in its own way: the config on every
rank, the row within each replica.

It runs once per step for the batch, and once per step for each distinct attention
call signature (the first layer, and the first layer of any other shape), never per
layer. ``CPConfig(check_ranks_agree=False)`` turns both off.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from ..parallel.collectives import all_gather_flat


def agree_across_ranks(
    group: Any, device: torch.device, fingerprint: Sequence[int], problem: Optional[Exception], what: str, columns: str
) -> None:
    """Raise on every rank of `group` if any rank has a `problem` or the fingerprints differ (Note [Ranks agree]).

    Args:
        group: the CP process group.
        device: where the small tensor lives (a CUDA device for NCCL).
        fingerprint: this rank's int64 summary of what must agree.
        problem: the error this rank found in its own input, or None.
        what: what is compared, for the messages ("batch", "attention call").
        columns: names of the fingerprint's entries, for the disagreement table.
    """
    rows = gather_fingerprints(group, device, fingerprint, problem, what)
    if any(row != rows[0] for row in rows):
        raise ValueError(
            f"ranks of one CP group disagree on the {what}; every CP rank must pass the same. "
            f"[invalid, {columns}] per rank: {rows}"
        )


def gather_fingerprints(
    group: Any, device: torch.device, fingerprint: Sequence[int], problem: Optional[Exception], what: str,
    ranks: str = "CP rank(s) {}",
) -> list[list[int]]:
    """Every rank's ``[invalid, *fingerprint]`` (one all-gather over `group`), after raising on every rank when
    any rank has a `problem` (Note [Ranks agree]): the rank that has one raises it, the others a `ValueError`
    naming them (`ranks`: how, ``{}`` the list). Comparing the rows is the caller's (`agree_across_ranks`: all
    equal)."""
    mine = torch.tensor([int(problem is not None), *fingerprint], dtype=torch.long, device=device)
    world = dist.get_world_size(group)
    gathered = mine.new_empty(world * mine.numel())
    all_gather_flat(gathered, mine, group)
    rows = gathered.reshape(world, -1).cpu().tolist()
    if problem is not None:
        raise problem
    rejected = [r for r, row in enumerate(rows) if row[0]]
    if rejected:
        raise ValueError(f"{ranks.format(rejected)} rejected their {what} (see the error on those ranks)")
    return rows
