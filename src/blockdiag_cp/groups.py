"""Process sub-groups of a CP group for head-parallel CP, made once per process.

Note [Sub-groups made once]
---------------------------
``ulysses_degree = u`` splits a CP group of ``W`` ranks (group-local ranks ``0..W-1``)
into head-parallel groups of ``u`` consecutive ranks (under torchrun's rank order,
consecutive ranks share a node) and cross groups of the ``W / u`` ranks with the same
place in their head-parallel group. Creating a process group is expensive (a
rendezvous, an NCCL communicator), so each is made on first use and kept for the
life of the process in `SUBGROUPS`, keyed by its global ranks: the one mutable
module-level object besides the step slot. Only the members take part in making a
group (``use_local_synchronization``), and every rank makes its head-parallel group
before its cross group, so no two ranks wait on each other in a cycle.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist


@dataclass(frozen=True)
class HeadGroups:
    """This rank's place under ``ulysses_degree``.

    Attributes:
        degree: ``u``, ranks per head-parallel group.
        member: this rank's place in its head-parallel group (which slice of heads it keeps).
        index: which head-parallel group (this rank's rank in its cross group).
        heads_group: the process group of the ``u`` consecutive ranks (None: not made, e.g. planning).
        cross_group: the process group of the ``W / u`` ranks with the same `member` (None when ``u == W``).
        reason: why this degree (``"requested"``, or the byte model's comparison under ``"auto"``).
    """

    degree: int
    member: int
    index: int
    heads_group: Any = None
    cross_group: Any = None
    reason: str = "requested"

    @staticmethod
    def place(rank: int, degree: int) -> "HeadGroups":
        """The place of `rank` without process groups (planning, tools)."""
        index, member = divmod(rank, degree)
        return HeadGroups(degree, member, index)


class SubgroupCache:
    """Process groups keyed by their global ranks, made on first use (Note [Sub-groups made once])."""

    def __init__(self) -> None:
        self._groups: dict[tuple[int, ...], Any] = {}
        self._lock = threading.Lock()

    def get(self, global_ranks: tuple[int, ...], backend: Optional[str]) -> Any:
        with self._lock:
            if global_ranks not in self._groups:
                self._groups[global_ranks] = dist.new_group(
                    list(global_ranks), backend=backend, use_local_synchronization=True
                )
            return self._groups[global_ranks]


SUBGROUPS = SubgroupCache()


def head_groups(group: Any, world: int, rank: int, degree: int, reason: str = "requested") -> HeadGroups:
    """This rank's head-parallel and cross groups inside the CP `group` (made once; see the Note)."""
    place = HeadGroups.place(rank, degree)
    if degree == 1:
        return HeadGroups(1, 0, rank, None, group, reason)
    if group is None:
        return HeadGroups(degree, place.member, place.index, reason=reason)
    global_ranks = [dist.get_global_rank(group, r) for r in range(world)]
    backend = dist.get_backend(group)
    heads = tuple(global_ranks[place.index * degree + m] for m in range(degree))
    cross = tuple(global_ranks[g * degree + place.member] for g in range(world // degree))
    heads_group = SUBGROUPS.get(heads, backend)
    cross_group = SUBGROUPS.get(cross, backend) if len(cross) > 1 else None
    return HeadGroups(degree, place.member, place.index, heads_group, cross_group, reason)
