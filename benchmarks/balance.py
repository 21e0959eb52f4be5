"""Balanced layout benchmark: work balance and bytes per rank, and time against the limit.

Part 1 (analytic, from the plans): for document-length distributions at cp 2, 4, 8 (S=65536),
max/mean causal attention work and the largest per-rank K/V bytes of a needed-only exchange
(rows x 2 x 8 heads x 64 x 4 bytes, forward + backward) for the contiguous layout, the balanced
layout, and the field's zigzag (2*cp chunks of the whole row, rank r holding chunks r and
2cp-1-r), plus the planning time of the balanced planner at S=1M.
Part 2 (measured, gloo, side by side in one run): one 8192-token document, cp=2, 8 heads of
64, fp32, forward+backward: contiguous and balanced against the limit (one process doing all
the attention alone, halved). Writes docs/bench_balance.md.

    python benchmarks/balance.py
"""

from __future__ import annotations

import pathlib
import random
import sys
import time

import torch

from blockdiag_cp.tools.bench import BenchSpec, limit_seconds, run_spec
from blockdiag_cp.plan.geometry import StepGeometry
from blockdiag_cp.plan import ShardPlan, attention_work, plan_shards
from blockdiag_cp.testing import doc_ids_from_lengths

S = 65536
ROW_BYTES = 2 * 8 * 64 * 4


def distributions(seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)

    def fill(draw, total=S):
        out = []
        while total > 0:
            n = min(total, draw())
            out.append(n)
            total -= n
        return out

    return {
        "one document": [S],
        "two giants": [S // 2, S // 2],
        "giant + many small": [S // 2] + fill(lambda: rng.randint(16, 600), S // 2),
        "power-law": fill(lambda: max(1, int(rng.paretovariate(1.1) * 60))),
        "uniform short": fill(lambda: 100),
        "interior padding": [n if i % 3 else -n // 8 for i, n in enumerate(fill(lambda: rng.randint(200, 4000)))],
    }


def zigzag_plan(doc_ids: torch.Tensor, world: int) -> ShardPlan:
    """2*world equal chunks of the padded row; rank r owns chunks r and 2*world-1-r."""
    chunk = -(-doc_ids.numel() // (2 * world))
    padded = chunk * 2 * world
    chunks = torch.arange(padded).reshape(2 * world, chunk)
    positions = torch.stack([torch.cat([chunks[r], chunks[2 * world - 1 - r]]) for r in range(world)])
    return ShardPlan.from_rows("zigzag", doc_ids.numel(), positions)


def needed_bytes(plan: ShardPlan, doc_ids: torch.Tensor) -> int:
    """Largest per-rank bytes sent by a needed-only exchange, forward + backward."""
    geometry = StepGeometry.build(plan, doc_ids)
    transfer = geometry.transfer  # [dst, src]
    sent = transfer.sum(dim=0) + transfer.sum(dim=1)  # rows owned and sent + gradients returned
    return int(sent.max()) * ROW_BYTES


def balance_table() -> str:
    lines = ["| distribution | cp | contiguous max/mean work | balanced | zigzag | contiguous MB/rank | balanced | zigzag |",
             "|---|---|---|---|---|---|---|---|"]
    for name, segments in distributions().items():
        ids = doc_ids_from_lengths(segments)
        for world in (2, 4, 8):
            plans = [plan_shards(ids, world, "contiguous"), plan_shards(ids, world, "balanced"), zigzag_plan(ids, world)]
            ratios = []
            for plan in plans:
                work = attention_work(plan, ids).double()
                ratios.append(float(work.max() / work.mean()))
            mb = [needed_bytes(plan, ids) / 1e6 for plan in plans]
            lines.append(f"| {name} | {world} | " + " | ".join(f"{r:.3f}" for r in ratios) + " | "
                         + " | ".join(f"{m:.1f}" for m in mb) + " |")
    return "\n".join(lines)


def planning_time() -> str:
    rng = random.Random(1)
    segments, rest = [], 1_000_000
    while rest > 0:
        n = min(rest, max(1, int(rng.paretovariate(1.1) * 60)))
        segments.append(n)
        rest -= n
    ids = doc_ids_from_lengths(segments)
    rows = []
    for world in (8, 16):
        t0 = time.perf_counter()
        plan_shards(ids, world, "balanced")
        rows.append(f"cp={world}: {time.perf_counter() - t0:.2f} s")
    return f"planning 1M tokens ({len(segments)} power-law documents), balanced: " + ", ".join(rows)


def timing_table() -> str:
    """Side by side: limit (idle), contiguous, balanced, limit (both cores busy), twice."""
    one_doc = BenchSpec((8192,), world=2, repeats=5)
    rows: dict[str, list[float]] = {"limit": [], "limit, cores busy": [], "contiguous": [], "balanced": []}
    exchange, balance = {}, {}
    for _ in range(2):
        rows["limit"].append(limit_seconds(one_doc))
        for layout in ("contiguous", "balanced"):
            r = run_spec(BenchSpec((8192,), world=2, repeats=5, layout=layout))
            rows[layout].append(r.seconds)
            exchange[layout], balance[layout] = r.exchange, max(r.work) / (sum(r.work) / len(r.work))
        rows["limit, cores busy"].append(limit_seconds(one_doc, loaded=True))
    best = {k: min(v) for k, v in rows.items()}
    lines = ["| layout | exchange | fwd+bwd s (best of 2 runs of 5) | x limit (idle machine) | x limit (cores busy) | max/mean work |",
             "|---|---|---|---|---|---|"]
    for layout in ("contiguous", "balanced"):
        lines.append(f"| {layout} | {exchange[layout]} | {best[layout]:.3f} | {best[layout] / best['limit']:.2f} | "
                     f"{best[layout] / best['limit, cores busy']:.2f} | {balance[layout]:.3f} |")
    return "\n".join(lines) + (
        f"\n\nlimit: one process doing the whole row's attention alone, halved: {best['limit']:.3f} s on an idle "
        f"machine, {best['limit, cores busy']:.3f} s while a second copy runs on the other core (the CP run keeps both "
        "cores busy). Target for balanced: <= 1.30x."
    )


def main() -> int:
    text = "\n\n".join([balance_table(), planning_time(), timing_table()])
    print(text)
    out = pathlib.Path(__file__).resolve().parent.parent / "docs" / "bench_balance.md"
    out.write_text("# Balanced layout (S=65536 plans; timing: one 8192-token document, cp=2, fp32, 8x64)\n\n" + text + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
