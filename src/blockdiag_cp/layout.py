"""Token-to-rank assignment: `ShardPlan` and its planners, plus the attention work model.

A plan pads the packed row to ``padded_len`` (a multiple of ``world``) and gives each
rank ``local_len = padded_len // world`` positions, listed in ascending order. Every
position belongs to exactly one rank, so shapes are equal on every rank.

The work model: a real query at position ``g`` of a document starting at ``s`` sees
``g - s + 1`` keys, so the causal attention work of a rank is the sum of that over
the real positions it owns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping
from types import MappingProxyType

import torch

from .config import LAYOUTS, check_choice
from .docs import doc_starts, validate_doc_ids


@dataclass(frozen=True)
class ShardPlan:
    """Which padded-sequence positions each CP rank owns.

    Attributes:
        layout: the planner that made it (``"contiguous"`` or ``"balanced"``).
        seq_len: ``S``, the unpadded length.
        padded_len: ``S_pad``, a multiple of ``world``; positions ``>= S`` are padding.
        positions_WL: ``[world, L]`` int64 (CPU): rank ``r``'s positions, ascending.
    """

    layout: str
    seq_len: int
    padded_len: int
    positions_WL: torch.Tensor

    @property
    def world(self) -> int:
        return self.positions_WL.shape[0]

    @property
    def local_len(self) -> int:
        return self.positions_WL.shape[1]

    def rank_positions(self, rank: int) -> torch.Tensor:
        """``[L]`` LongTensor: the padded-sequence positions `rank` owns, in local order."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside the plan's world of {self.world}")
        return self.positions_WL[rank]

    def contiguous_start(self, rank: int) -> int | None:
        """First position of `rank` if it owns one contiguous range, else None."""
        pos = self.positions_WL[rank]
        first = int(pos[0])
        expected = torch.arange(first, first + self.local_len)
        return first if torch.equal(pos, expected) else None

    def owner(self) -> torch.Tensor:
        """``[S_pad]`` int64: the rank owning each position."""
        owner = torch.empty(self.padded_len, dtype=torch.long)
        ranks = torch.arange(self.world).unsqueeze(1).expand_as(self.positions_WL)
        owner[self.positions_WL.reshape(-1)] = ranks.reshape(-1)
        return owner

    def local_index(self) -> torch.Tensor:
        """``[S_pad]`` int64: each position's index in its owner's local order."""
        index = torch.empty(self.padded_len, dtype=torch.long)
        local = torch.arange(self.local_len).unsqueeze(0).expand_as(self.positions_WL)
        index[self.positions_WL.reshape(-1)] = local.reshape(-1)
        return index


def pad_doc_ids(doc_ids_S: torch.Tensor, padded_len: int) -> torch.Tensor:
    """``[S_pad]``: `doc_ids_S` with padding (0) appended up to `padded_len`."""
    return torch.cat([doc_ids_S, doc_ids_S.new_zeros(padded_len - doc_ids_S.numel())])


def query_work(doc_ids_S: torch.Tensor) -> torch.Tensor:
    """``[S]`` int64: keys each position's query sees (0 for padding)."""
    index = torch.arange(doc_ids_S.numel(), device=doc_ids_S.device)
    return torch.where(doc_ids_S != 0, index - doc_starts(doc_ids_S) + 1, 0)


def attention_work(plan: ShardPlan, doc_ids_S: torch.Tensor) -> torch.Tensor:
    """``[world]`` int64: causal attention work (query-key pairs) per rank under `plan`."""
    work_S = query_work(pad_doc_ids(doc_ids_S.cpu(), plan.padded_len))
    return work_S[plan.positions_WL].sum(dim=1)


def plan_contiguous(doc_ids_S: torch.Tensor, world: int) -> ShardPlan:
    """The seed's layout: pad to a multiple of `world`, rank r owns ``[r*L, (r+1)*L)``."""
    S = doc_ids_S.numel()
    local_len = -(-S // world)
    positions = torch.arange(local_len * world).reshape(world, local_len)
    return ShardPlan("contiguous", S, local_len * world, positions)


def _planners() -> Mapping[str, Callable[[torch.Tensor, int], ShardPlan]]:
    from .balance import plan_balanced  # local import: balance builds on this module

    return MappingProxyType({"contiguous": plan_contiguous, "balanced": plan_balanced})


def plan_shards(doc_ids: torch.Tensor, world: int, layout: str = "contiguous") -> ShardPlan:
    """Assign the padded row's positions to `world` ranks.

    Args:
        doc_ids: ``[1, S]`` or ``[S]`` integer document ids, 0 = padding.
        world: number of CP ranks (>= 1).
        layout: ``"contiguous"`` or ``"balanced"``.

    Returns:
        The `ShardPlan`; `make_cp_blockdiag_batch_and_ctx` with the same layout
        produces exactly ``plan.rank_positions(rank)`` on each rank.
    """
    check_choice("layout", layout, LAYOUTS)
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    if not isinstance(doc_ids, torch.Tensor) or doc_ids.dim() not in (1, 2):
        raise ValueError("doc_ids must be a [1, S] or [S] tensor")
    ids_1S = doc_ids.reshape(1, -1) if doc_ids.dim() == 1 else doc_ids
    if ids_1S.shape[0] != 1:
        raise ValueError(f"doc_ids must hold one packed row, got batch size {ids_1S.shape[0]}")
    if ids_1S.shape[1] == 0:
        raise ValueError("doc_ids is empty: the sequence must hold at least one token")
    ids_S = validate_doc_ids(ids_1S, ids_1S.shape[1], 1).reshape(-1).cpu()
    return make_plan(ids_S, world, layout)


def make_plan(doc_ids_S: torch.Tensor, world: int, layout: str) -> ShardPlan:
    """`plan_shards` for ids already validated: ``[S]`` int64 on the CPU."""
    return _planners()[layout](doc_ids_S, world)
