"""What a query-key pair costs the fused kernel, and what that does to the balanced plan.

    python benchmarks/pair_cost.py             # per-pair costs, then the rows below
    python benchmarks/pair_cost.py --rows-only

1. Per-pair time (forward + backward, 8 heads of 64, fp32, one thread) of causal squares
   and of rectangles (no mask) on torch's fused CPU attention: the measurement behind
   `RECTANGLE_PAIR_COST` (Note [Kernel-aware work] in blockdiag_cp/plan/balanced.py).
2. For rows of many documents (cp = 2, balanced), each rank's own fused calls timed one
   after another in this one process (the same conditions for every rank, no
   collectives; the fastest of 3 runs): the kernel seconds per rank under the pair-balanced
   plan and under the kernel-aware one, max / mean of each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from blockdiag_cp.exchange.base import ExchangeSetup
from blockdiag_cp.exchange.needed import AllToAllExchange
from blockdiag_cp.kernels import CallOptions, SdpaKernel
from blockdiag_cp.kernels.fused_ops import cpu_fused_ops
from blockdiag_cp.plan.balanced import RECTANGLE_PAIR_COST, plan_balanced
from blockdiag_cp.plan.geometry import StepGeometry
from blockdiag_cp.testing import doc_ids_from_lengths
from blockdiag_cp.tools.bench import doc_lengths

H, D = 8, 64
ROWS = ("powerlaw:300:1.3", "powerlaw:300", "powerlaw:300:1.1", "mixed", "one")


def _fused_seconds(groups: int, q_len: int, k_len: int, causal: bool, repeats: int = 3) -> float:
    fwd, bwd = cpu_fused_ops()
    q = torch.randn(groups, H, q_len, D)
    k, v = torch.randn(groups, H, k_len, D), torch.randn(groups, H, k_len, D)
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        o, lse = fwd(q, k, v, 0.0, causal, scale=D ** -0.5)
        bwd(torch.ones_like(o), q, k, v, o, lse, 0.0, causal, scale=D ** -0.5)
        runs.append(time.perf_counter() - t0)
    return min(runs)


def pair_costs() -> None:
    print("| call | queries x keys | ns per pair and head | vs the causal square of the queries' length |")
    print("|---|---|---|---|")
    for q_len, k_len in ((768, 4096), (1024, 4096), (2048, 4096), (2048, 8192), (4096, 4096)):
        square = _fused_seconds(1, q_len, q_len, True) / (q_len * (q_len + 1) / 2 * H)
        rect = _fused_seconds(1, q_len, k_len, False) / (q_len * k_len * H)
        print(f"| causal square | {q_len} x {q_len} | {square * 1e9:.2f} | 1 |")
        print(f"| rectangle | {q_len} x {k_len} | {rect * 1e9:.2f} | {rect / square:.2f} |")
    print(f"\nRECTANGLE_PAIR_COST in the planner: {RECTANGLE_PAIR_COST}\n")


def rank_kernel_seconds(ids: torch.Tensor, kernel_folds: int, repeats: int = 3) -> list[float]:
    """Each rank's fused calls (forward + backward) under the balanced plan, timed in this process."""
    plan = plan_balanced(ids, 2, kernel_folds=kernel_folds)
    geometry = StepGeometry.build(plan, ids)
    kernel, cpu = SdpaKernel(), torch.device("cpu")
    seconds = []
    for rank in range(2):
        items = AllToAllExchange(ExchangeSetup(geometry, rank, None, (kernel,), cpu)).items
        calls = kernel.prepare(items, cpu)
        q = torch.randn(H, items.num_q_rows, D)
        k, v = torch.randn(H, items.num_k_rows, D), torch.randn(H, items.num_k_rows, D)
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            o, lse, aux = kernel.forward(calls, q, k, v, CallOptions(D ** -0.5))
            kernel.backward(calls, torch.ones_like(o), q, k, v, o, lse, aux, CallOptions(D ** -0.5))
            runs.append(time.perf_counter() - t0)
        seconds.append(min(runs))  # the least disturbed run: other work on the machine only adds
    return seconds


def plan_rows() -> None:
    print("| row (S = 32,768, cp = 2) | plan | rank kernel s | max / mean |")
    print("|---|---|---|---|")
    for docs in ROWS:
        ids = doc_ids_from_lengths(doc_lengths(docs, 32768))
        for label, folds in (("pairs", 0), ("kernel-aware", 2)):
            secs = rank_kernel_seconds(ids, folds)
            print(f"| {docs} | {label} | {' / '.join(f'{s:.3f}' for s in secs)} | {max(secs) / statistics.mean(secs):.3f} |",
                  flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows-only", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    if not args.rows_only:
        pair_costs()
    plan_rows()
    return 0


if __name__ == "__main__":
    sys.exit(main())
