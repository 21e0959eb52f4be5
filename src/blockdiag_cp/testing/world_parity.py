"""Whole-batch parity: every replica's row through `make_cp_world_batch_and_ctx`, against the oracle.

A `WorldCase` gives each dp replica its own packed row; every rank of the ``(dp, cp)`` mesh
passes its replica's row, attention runs on the whole-batch step, and each rank compares
its output rows with the float64 oracle of the row they came from (a document's attention
does not depend on the other documents of its row), and the input gradients, summed over a
replica's cp ranks, with the oracle's gradient of that replica's row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..plan.step_costs import StepCosts
from .oracle import doc_ids_from_lengths, oracle_attention

#: costs under which the rows of a test (tens of tokens) plan like real ones: a token costs about
#: as much as a few pairs, so long documents are cut over groups and short ones stay whole
TINY_ROW_COSTS = StepCosts(token_seconds=4.0, pair_seconds=1.0, kv_bytes_per_token=0.0)


@dataclass(frozen=True)
class WorldCase:
    """Each replica's row (`rows[d]`: segments, n > 0 a document, -n padding) and the step's knobs."""

    rows: tuple[tuple[int, ...], ...]
    cp: int
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    kv_exchange: str = "auto"
    kernel: str = "auto"
    layout: str = "grouped"
    window: Optional[int] = None
    checkpoint: Optional[str] = None
    sinks: bool = False
    ranks_per_node: Optional[int] = None
    costs: StepCosts = TINY_ROW_COSTS
    seed: int = 0

    @property
    def dp(self) -> int:
        return len(self.rows)


@dataclass
class WorldResult:
    case: WorldCase
    out_err: float
    grad_err: float
    exchange: str
    local_len: int
    tokens: int


def _row_tensors(case: WorldCase, replica: int):
    """Replica `replica`'s inputs ``[1, S, (H + 2 Hk) D]`` and upstream gradient ``[H, S, D]`` (float64)."""
    gen = torch.Generator().manual_seed(7000 + 31 * case.seed + replica)
    S = doc_ids_from_lengths(case.rows[replica]).numel()
    width = (case.heads + 2 * case.kv_heads) * case.head_dim
    x = torch.randn(1, S, width, generator=gen, dtype=torch.float64)
    return x, torch.randn(case.heads, S, case.head_dim, generator=gen, dtype=torch.float64)


def _qkv(x_1SX: torch.Tensor, case: WorldCase):
    H, Hk, D = case.heads, case.kv_heads, case.head_dim
    q, k, v = torch.split(x_1SX, [H * D, Hk * D, Hk * D], dim=-1)
    return tuple(t.reshape(1, t.shape[1], -1, D).transpose(1, 2) for t in (q, k, v))


def _sinks(case: WorldCase) -> Optional[torch.Tensor]:
    if not case.sinks:
        return None
    return torch.randn(case.heads, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


def _oracle(case: WorldCase, replica: int):
    """The replica row's oracle output ``[H, S, D]`` and input gradient ``[1, S, X]``."""
    x, grad = _row_tensors(case, replica)
    x.requires_grad_(True)
    q, k, v = _qkv(x, case)
    out = oracle_attention(q[0], k[0], v[0], doc_ids_from_lengths(case.rows[replica]), 1 / math.sqrt(case.head_dim),
                           case.window, None, _sinks(case))
    (out * grad).sum().backward()
    return out.detach(), x.grad


def run_world_case(case: WorldCase, mesh) -> WorldResult:
    """Run `case` on this rank of the ``(dp, cp)`` `mesh` and compare with the replicas' oracles."""
    from .. import CPConfig, PlanOptions, cp_blockdiag_sdpa, make_cp_world_batch_and_ctx
    from ..step.world import WorldView

    view = WorldView.of(mesh)
    d = view.replica
    x, _ = _row_tensors(case, d)
    x.requires_grad_(True)
    sinks = _sinks(case)
    config = CPConfig(kv_exchange=case.kv_exchange, kernel=case.kernel, layout=case.layout,
                      plan=PlanOptions(ranks_per_node=case.ranks_per_node, costs=case.costs,
                                       window=case.window if case.layout == "grouped" else None))
    batch = {"inputs_embeds": x, "_packed_seq_ids": doc_ids_from_lengths(case.rows[d]).unsqueeze(0)}
    train_ctx, batch = make_cp_world_batch_and_ctx(mesh, batch, config=config)
    with train_ctx() as state:
        q, k, v = _qkv(batch["inputs_embeds"], case)
        attend = lambda q, k, v: cp_blockdiag_sdpa(q, k, v, enable_gqa=True, sliding_window=case.window,  # noqa: E731
                                                   sinks=sinks)
        if case.checkpoint is None:
            out = attend(q, k, v)
        else:
            out = torch.utils.checkpoint.checkpoint(attend, q, k, v, use_reentrant=case.checkpoint == "reentrant")
        expected, upstream = _expected_rows(case, state, view)
        (out[0] * upstream).sum().backward()
    totals = _sum_over_replicas(x.grad, view, case)
    _, ref_grad = _oracle(case, d)
    return WorldResult(case, float((out[0].detach() - expected).abs().max()) if out.numel() else 0.0,
                       float((totals - ref_grad).abs().max()), state.exchange_for(case.window).name, state.local_len,
                       int((batch["_packed_seq_ids"] != 0).sum()))


def _expected_rows(case: WorldCase, state, view):
    """The oracle's rows ``[H, L, D]`` for this rank's positions and their upstream gradient (0 on padding),
    from first principles: the global row is the replicas' real tokens in dp order."""
    positions = state.positions
    H, D = case.heads, case.head_dim
    expected = torch.zeros(H, positions.numel(), D, dtype=torch.float64)
    upstream = torch.zeros_like(expected)
    first, at = [], 0
    for d in range(case.dp):  # where each replica's real tokens start on the global row
        first.append(at)
        at += int((doc_ids_from_lengths(case.rows[d]) != 0).sum())
    first.append(at)
    for d in range(case.dp):
        ids = doc_ids_from_lengths(case.rows[d])
        real = torch.nonzero(ids != 0).flatten()  # the replica row's position of each global position
        inside = (positions >= first[d]) & (positions < first[d + 1])
        if not bool(inside.any()):
            continue
        rows = real[positions[inside] - first[d]]
        out, _ = _oracle(case, d)
        _, grad = _row_tensors(case, d)
        expected[:, inside] = out[:, rows]
        upstream[:, inside] = grad[:, rows]
    return expected, upstream


def _sum_over_replicas(grad: torch.Tensor, view, case: WorldCase) -> torch.Tensor:
    """This replica's input gradient summed over its cp ranks (each sent a part of the row; rows differ in length)."""
    longest = max(doc_ids_from_lengths(row).numel() for row in case.rows)
    slots = grad.new_zeros((view.dp, longest, grad.shape[-1]))
    slots[view.replica, : grad.shape[1]] = grad[0]
    dist.all_reduce(slots, group=view.group)
    return slots[view.replica, : grad.shape[1]].unsqueeze(0)


def world_parity_worker(rank: int, world: int, cases: list[WorldCase]) -> list[WorldResult]:
    """Spawned entry: each case on a ``(dp, cp)`` mesh of the whole world (``dp * cp == world``)."""
    from torch.distributed.device_mesh import init_device_mesh

    results = []
    for case in cases:
        mesh = init_device_mesh("cpu", (case.dp, case.cp), mesh_dim_names=("dp", "cp"))
        results.append(run_world_case(case, mesh))
    return results
