"""`ShardPlan` (which padded-row positions each CP rank owns) and the attention work model.

A plan pads the packed row to ``padded_len`` (a multiple of ``world``) and gives each
rank ``local_len = padded_len // world`` positions, listed in ascending order. Every
position belongs to exactly one rank, so shapes are equal on every rank.

The work model: a real query at position ``g`` of a document starting at ``s`` sees
``g - s + 1`` keys (``min(g - s + 1, w)`` under a sliding window ``w``: a windowed
document's work is linear in its length), so the attention work of a rank is the sum
of that over the real positions it owns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..step.doc_ids import doc_starts


@dataclass(frozen=True)
class ShardPlan:
    """Which padded-sequence positions each CP rank owns.

    Attributes:
        layout: the planner that made it (``"contiguous"`` or ``"balanced"``).
        seq_len: ``S``, the unpadded length.
        padded_len: ``S_pad``, a multiple of ``world``; positions ``>= S`` are padding.
        positions_WL: ``[W, L]`` int64 (CPU): rank ``r``'s positions, ascending.
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

    def contiguous_start(self, rank: int) -> Optional[int]:
        """First position of `rank` if it owns one contiguous range, else None."""
        pos = self.positions_WL[rank]
        first = int(pos[0])
        expected = torch.arange(first, first + self.local_len)
        return first if torch.equal(pos, expected) else None

    def owner(self) -> torch.Tensor:
        """``[S_pad]`` int64: the rank owning each position."""
        ranks = torch.arange(self.world).repeat_interleave(self.local_len)
        return torch.empty(self.padded_len, dtype=torch.long).scatter_(0, self.positions_WL.reshape(-1), ranks)

    def local_index(self) -> torch.Tensor:
        """``[S_pad]`` int64: each position's index in its owner's local order."""
        local = torch.arange(self.local_len).repeat(self.world)
        return torch.empty(self.padded_len, dtype=torch.long).scatter_(0, self.positions_WL.reshape(-1), local)


def pad_doc_ids(doc_ids_S: torch.Tensor, padded_len: int) -> torch.Tensor:
    """``[S_pad]``: `doc_ids_S` with padding (0) appended up to `padded_len`."""
    return torch.cat([doc_ids_S, doc_ids_S.new_zeros(padded_len - doc_ids_S.numel())])


def query_work(doc_ids_S: torch.Tensor, window: Optional[int] = None) -> torch.Tensor:
    """``[S]`` int64: keys each position's query sees (0 for padding), at most `window`."""
    index = torch.arange(doc_ids_S.numel(), device=doc_ids_S.device)
    seen = index - doc_starts(doc_ids_S) + 1
    if window is not None:
        seen = seen.clamp(max=window)
    return torch.where(doc_ids_S != 0, seen, 0)


def attention_work(plan: ShardPlan, doc_ids_S: torch.Tensor, window: Optional[int] = None) -> torch.Tensor:
    """``[W]`` int64: causal attention work (query-key pairs) per rank under `plan` (and `window`)."""
    work_S = query_work(pad_doc_ids(doc_ids_S.cpu(), plan.padded_len), window)
    return work_S[plan.positions_WL].sum(dim=1)


def merge_consecutive_ranks(plan: ShardPlan, degree: int) -> tuple[ShardPlan, torch.Tensor]:
    """The plan of ``W / degree`` groups of `degree` consecutive ranks, each group owning its
    members' positions (ascending), and ``order [W / degree, degree * L]``: for each sorted row of a
    group, its row in the members' concatenation (member after member, each in local order).
    """
    W, L = plan.positions_WL.shape
    member_major = plan.positions_WL.reshape(W // degree, degree * L)
    positions, order = member_major.sort(dim=1)
    return ShardPlan(plan.layout, plan.seq_len, plan.padded_len, positions), order
