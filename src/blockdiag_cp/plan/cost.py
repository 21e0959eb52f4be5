"""What a step costs each rank under each CP scheme, from the plan alone (no tensors of size S x S).

Note [Scheme costs]
-------------------
For a row, a layout and ``W`` ranks, `scheme_cost` gives per rank and per attention
layer (forward + backward) the bytes it sends and its attention work, for a
head-parallel degree ``u`` (1: the needed-only / all-gather / ring exchange alone;
``W``: pure Ulysses; between: hybrid, Note [Head-parallel groups]):

- head all-to-alls (``u > 1``): ``2 (u - 1) L (Dk + Dv) (H/u + Hk'/u)`` elements, whatever the
  documents (`plan.traffic.ulysses_elements`, forward and backward alike; q and k at the
  query/key head dim ``Dk``, v and the output at the value head dim ``Dv``);
- K/V between groups, on the plan of the ``W / u`` groups: for the needed-only
  exchanges (``auto``, ``a2a``, ``halo``) the rows the group owns that others need
  (forward) plus the gradients of the rows it received (backward), ``Hk'/u (Dk + Dv)``
  elements a row; ``allgather`` and ``ring`` move ``(W/u - 1) u L`` rows each way
  (an upper bound for the ring, which stops early when nothing further is needed);
- work: the query-key pairs of the rank's queries times its heads (``H`` at ``u = 1``;
  the group's pairs times ``H / u`` otherwise: a group's members split its work evenly).

``Dv = Dk`` unless a model's values are narrower (MLA). Both byte terms scale with ``Dk + Dv``,
so the degree `choose_ulysses_degree` takes does not depend on the head dims: it plans at
``Dk + Dv = 2`` (one element a head dim).

Bytes are what one rank writes (what `/proc/self/io` ``wchar`` meters on gloo), split
into intra- and inter-node links by ``gpus_per_node`` (ranks ``r // gpus_per_node``
share a node). `choose_ulysses_degree` takes the degree with the fewest bytes on the
busiest rank (ties: the least work on the busiest rank, then the smaller degree).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .traffic import kv_row_elements, split_kv_heads, travel_rows, ulysses_peer_elements
from .geometry import StepGeometry
from .options import PlanOptions
from .step_costs import StepCosts
from . import ShardPlan, attention_work, make_plan, merge_consecutive_ranks

NEEDED_ONLY = ("auto", "a2a", "halo", "p2p")


@dataclass(frozen=True)
class SchemeCost:
    """One scheme's per-rank cost for one attention layer, forward + backward (Note [Scheme costs]).

    ``[W]`` float64 tensors: bytes sent on intra- and inter-node links by the head
    all-to-alls (`ulysses_*`) and by the K/V exchange (`kv_*`); `work` in query-key
    pairs x heads.
    """

    degree: int
    exchange: str
    ulysses_intra: torch.Tensor
    ulysses_inter: torch.Tensor
    kv_intra: torch.Tensor
    kv_inter: torch.Tensor
    work: torch.Tensor

    @property
    def sent(self) -> torch.Tensor:
        return self.ulysses_intra + self.ulysses_inter + self.kv_intra + self.kv_inter

    @property
    def max_sent(self) -> float:
        return float(self.sent.max())

    def seconds(self, costs: StepCosts) -> torch.Tensor:
        """``[W]`` predicted seconds per layer under `costs` (`StepCosts.for_attention`: one pair of one head at
        its FLOPs, links at their speeds): the links, then the attention (`work` pair-heads); no overlap."""
        links = costs.link_seconds(self.ulysses_intra + self.kv_intra, self.ulysses_inter + self.kv_inter)
        return links + costs.seconds(0, self.work, pieces=0)


@dataclass(frozen=True)
class DegreeChoice:
    degree: int
    reason: str
    costs: tuple[SchemeCost, ...]


def candidate_degrees(world: int, heads: int) -> list[int]:
    """Degrees that divide both the CP group and the query heads."""
    return [u for u in range(1, world + 1) if world % u == 0 and heads % u == 0]


def scheme_cost(
    plan: ShardPlan, doc_ids_S: torch.Tensor, degree: int, heads: tuple[int, int], head_dim: int = 1,
    element_size: int = 1, exchange: str = "auto", gpus_per_node: Optional[int] = None,
    v_head_dim: Optional[int] = None,
) -> SchemeCost:
    """Per-rank bytes and work of `plan` under head-parallel `degree` (Note [Scheme costs]); queries and
    keys of `head_dim`, values of `v_head_dim` (None: `head_dim`)."""
    H, Hk = heads
    if degree > 1 and not plan.equal_shards:
        raise ValueError(f"head parallelism (degree {degree}) needs equal shards; the {plan.layout} plan's ranks "
                         "own different numbers of positions")
    W, L = plan.world, plan.max_local_len
    node = torch.arange(W) // (gpus_per_node or W)
    row_bytes = kv_row_elements(split_kv_heads(Hk, degree), head_dim, v_head_dim) * element_size
    group_plan = plan if degree == 1 else merge_consecutive_ranks(plan, degree)[0]
    geometry = StepGeometry.build(group_plan, doc_ids_S)
    kv_intra, kv_inter = torch.zeros(W, dtype=torch.float64), torch.zeros(W, dtype=torch.float64)
    for rank in range(W):
        g, member = divmod(rank, degree)
        peers = [h * degree + member for h in range(geometry.world)]
        rows = _kv_rows_to(geometry, g, exchange)  # [W/u] rows group g sends each group, forward + backward
        crosses = torch.tensor([bool(node[p] != node[rank]) for p in peers])
        kv_inter[rank] = float(rows[crosses].sum()) * row_bytes
        kv_intra[rank] = float(rows[~crosses].sum()) * row_bytes
    per_peer = 2 * ulysses_peer_elements(degree, L, H, Hk, head_dim, v_head_dim) * element_size  # fwd + bwd
    u_intra, u_inter = _ulysses_bytes(W, degree, per_peer, node)
    real = geometry.doc_ids[: plan.seq_len]
    group_work = attention_work(group_plan, real).double() * H / degree
    work = group_work.repeat_interleave(degree)
    return SchemeCost(degree, exchange, u_intra, u_inter, kv_intra, kv_inter, work)


def _kv_rows_to(geometry: StepGeometry, g: int, exchange: str) -> torch.Tensor:
    """``[W/u]``: K/V rows group `g` sends to each other group per layer, forward + backward."""
    groups = geometry.world
    if groups == 1:
        return torch.zeros(1)
    transfer = geometry.transfer  # [dst, src]: rows dst needs from src
    if exchange in NEEDED_ONLY:
        return (transfer[:, g] + transfer[g, :]).double()  # K/V rows out, gradients of received rows back
    if exchange == "ring":
        # blocks go on to the right neighbour, trimmed (Note [Trimmed ring with log-sum-exp merge]), in
        # forward and again in backward; each hop's gradients go straight back to the block's owner
        travel = travel_rows(geometry)
        rows = transfer[g, :].double()
        rows[g] = 0.0
        rows[(g + 1) % groups] += 2 * sum(travel[(g - t) % groups][t + 1].numel() for t in range(groups - 1))
        return rows
    rows = torch.full((groups,), 2.0 * geometry.plan.max_local_len)  # an all-gather and its reduce-scatter: one
    # (padded) shard
    rows[g] = 0.0  # per other group each way
    return rows


def _ulysses_bytes(W: int, degree: int, per_peer: int, node: torch.Tensor):
    """``[W]`` intra- and inter-node bytes of the head all-to-alls: `per_peer` bytes (forward + backward) to
    each other member of the rank's head-parallel group."""
    intra, inter = torch.zeros(W, dtype=torch.float64), torch.zeros(W, dtype=torch.float64)
    if degree == 1:
        return intra, inter
    for rank in range(W):
        first = rank - rank % degree
        for peer in range(first, first + degree):
            if peer != rank:
                if node[peer] == node[rank]:
                    intra[rank] += per_peer
                else:
                    inter[rank] += per_peer
    return intra, inter


def choose_ulysses_degree(doc_ids_S: torch.Tensor, world: int, heads: tuple[int, int], *, layout: str,
                          options: Optional[PlanOptions] = None, exchange: str = "auto") -> DegreeChoice:
    """``ulysses_degree="auto"``: the degree whose busiest rank sends the fewest bytes (Note [Scheme costs]), for
    `heads` ``(query heads, K/V heads)`` and the row planned with `layout` and `options` (a `CPConfig`'s
    ``attention_heads``, ``layout``, ``plan`` and ``kv_exchange``)."""
    plan = make_plan(doc_ids_S.cpu(), world, layout, options)
    return pick_degree([scheme_cost(plan, doc_ids_S, u, heads, exchange=exchange)
                        for u in candidate_degrees(world, heads[0])])


def pick_degree(costs: list[SchemeCost]) -> DegreeChoice:
    """The cheapest of `costs` in bytes on the busiest rank (ties: least work on the busiest rank,
    then the smaller degree)."""
    best = min(costs, key=lambda c: (round(c.max_sent), float(c.work.max()), c.degree))
    scale = max(c.max_sent for c in costs) or 1.0
    summary = ", ".join(f"u={c.degree}: {c.max_sent / scale:.3f}" for c in costs)
    return DegreeChoice(best.degree, f"auto: fewest bytes on the busiest rank ({summary} of the most)", tuple(costs))
