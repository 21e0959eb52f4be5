"""Head parallelism (Ulysses) in one place: the process sub-groups, each rank's head split,
the step's head-parallel view and the byte formulas of the head all-to-alls.

The exchange that runs the all-to-alls is `exchange.ulysses.UlyssesExchange` (Note
[Head-parallel groups]); the cost model and the step state read the formulas here.

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
before its cross group, so no two ranks wait on each other in a cycle. Under
``ulysses_degree="auto"`` the degree depends on the row, so the first step makes the
groups of every candidate degree, in a fixed order: every rank of every data-parallel
replica then makes the same number of groups at the same time (torch names a group
made this way after the count of groups its process made before). A new NCCL cross
group runs one all-reduce when made, so that the first operation on it is a
collective, not a point-to-point send of a windowed layer. When ``u`` is the whole CP
group, the head-parallel group is the CP group itself.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist

from ..plan import ShardPlan, merge_consecutive_ranks
from ..plan.geometry import StepGeometry


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
        self._groups: dict[tuple[tuple[int, ...], str], Any] = {}  # (global ranks, backend) -> group
        self._lock = threading.Lock()

    def get(self, global_ranks: tuple[int, ...], backend: Optional[str]) -> Any:
        key = (global_ranks, str(backend))
        with self._lock:
            if key not in self._groups:
                made = dist.new_group(list(global_ranks), backend=backend, use_local_synchronization=True)
                if "nccl" in str(backend):  # the first operation on a new NCCL communicator: a collective
                    dist.all_reduce(torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device())),
                                    group=made)
                self._groups[key] = made
            return self._groups[key]


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
    heads_group = group if degree == world else SUBGROUPS.get(heads, backend)
    cross_group = SUBGROUPS.get(cross, backend) if len(cross) > 1 else None
    return HeadGroups(degree, place.member, place.index, heads_group, cross_group, reason)


def make_head_groups(group: Any, world: int, rank: int, degrees: Iterable[int]) -> None:
    """Make the groups of every degree in `degrees` now, in that order (Note [Sub-groups made once])."""
    for degree in sorted(set(degrees)):
        head_groups(group, world, rank, degree)


@dataclass(frozen=True)
class HeadSplit:
    """One rank's head-parallel step facts (Note [Head-parallel groups]).

    Attributes:
        degree: ``u``; member: this rank's slice of heads; group: the head-parallel process group.
        order: ``[u L]`` on the device: the member-major row of each ascending group row (None: identity).
        inverse: ``[u L]``: the ascending row of each member-major row (None: identity).
    """

    degree: int
    member: int
    group: Any
    order: Optional[torch.Tensor]
    inverse: Optional[torch.Tensor]

    @staticmethod
    def build(degree: int, member: int, group: Any, order_uL: torch.Tensor, device: torch.device) -> "HeadSplit":
        if torch.equal(order_uL, torch.arange(order_uL.numel())):
            return HeadSplit(degree, member, group, None, None)
        inverse = torch.empty_like(order_uL).scatter_(0, order_uL, torch.arange(order_uL.numel()))
        return HeadSplit(degree, member, group, order_uL.to(device), inverse.to(device))

    def kv_repeats(self, kv_heads: int) -> int:
        """How often each K/V head is repeated so that the ``u`` members split them evenly."""
        return self.degree // math.gcd(kv_heads, self.degree)

    def problem(self, heads: int) -> Optional[ValueError]:
        if heads % self.degree:
            return ValueError(f"ulysses_degree={self.degree} splits the query heads among its ranks: "
                              f"{heads} heads are not divisible by {self.degree}")
        return None


@dataclass(frozen=True)
class HeadParallel:
    """A step's head-parallel view (Note [Head-parallel groups]): the plan of the head-parallel
    groups (``W / u`` ranks of ``u L`` positions), this rank's groups and its head split."""

    groups: HeadGroups
    geometry: StepGeometry
    split: HeadSplit

    @staticmethod
    def build(plan: ShardPlan, doc_ids_S: torch.Tensor, groups: HeadGroups, device: torch.device) -> "HeadParallel":
        group_plan, order_per_group = merge_consecutive_ranks(plan, groups.degree)
        split = HeadSplit.build(groups.degree, groups.member, groups.heads_group, order_per_group[groups.index], device)
        return HeadParallel(groups, StepGeometry.build(group_plan, doc_ids_S), split)
