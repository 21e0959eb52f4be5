"""GPU check (one H200, under 5 minutes): kernel parity and per-rank attention throughput.

Needs, beyond torch (CUDA build): flash-attn (the limit and kernel="flash");
optional: transformer-engine (kernel="te"). Missing optional kernels are reported
as skipped, not failed.

1. Parity: every kernel against the float64 oracle, bf16 and fp16, forward and
   backward (world 1 on the GPU), tolerance 2x the dense reference's own error.
2. Throughput: the local attention each rank of a cp=8 run does for 128k packed
   tokens (mixed lengths; one long document), balanced layout, run rank by rank on
   this one GPU: TFLOP/s of causal attention actually computed (forward+backward,
   counted as 3.5 x 4 x pairs x heads x head_dim), against flash-attn varlen over the
   same documents unsharded, divided by 8 (the limit).

    python benchmarks/gpu_check.py
"""

from __future__ import annotations

import importlib.util
import random
import sys
import time

import torch

from blockdiag_cp.exchange.base import items_over_buffer
from blockdiag_cp.geometry import StepGeometry
from blockdiag_cp.kernels import select_kernel
from blockdiag_cp.layout import plan_shards
from blockdiag_cp.testing import ParityCase, doc_ids_from_lengths, reference_error, run_parity_case

KERNELS = ("sdpa", "flash", "te", "flex", "dense")
NEEDS = {"flash": "flash_attn", "te": "transformer_engine"}
S, WORLD, H, HK, D = 131072, 8, 32, 8, 128


def available(kernel: str) -> bool:
    return kernel not in NEEDS or importlib.util.find_spec(NEEDS[kernel]) is not None


def parity() -> list[str]:
    lines = ["| kernel | dtype | max abs err out | grad | dense ref err out | grad | verdict |", "|---|---|---|---|---|---|---|"]
    for kernel in KERNELS:
        for dtype in ("bfloat16", "float16"):
            if not available(kernel):
                lines.append(f"| {kernel} | {dtype} | - | - | - | - | skipped ({NEEDS[kernel]} not installed) |")
                continue
            case = ParityCase((700, 1300, -40, 2100, 3, 5, 1, 1900), heads=8, kv_heads=2, head_dim=64,
                              kernel=kernel, dtype=dtype, device="cuda")
            r = run_parity_case(case, None)
            ro, rg = reference_error(case)
            ok = r.out_err <= 2 * ro + 1e-3 and r.grad_err <= 2 * rg + 1e-3
            lines.append(f"| {kernel} | {dtype} | {r.out_err:.2e} | {r.grad_err:.2e} | {ro:.2e} | {rg:.2e} | "
                         f"{'ok' if ok else 'MISMATCH'} |")
    return lines


def mixed_lengths(seed: int = 0) -> list[int]:
    rng, out, rest = random.Random(seed), [], S
    while rest > 0:
        n = min(rest, max(64, int(rng.paretovariate(1.1) * 900)))
        out.append(n)
        rest -= n
    return out


def timed(fn, repeats: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def rank_seconds(kernel_name: str, segments: list[int]) -> tuple[float, int]:
    """Max over the 8 ranks of one rank's local attention fwd+bwd; and total pairs."""
    ids = doc_ids_from_lengths(segments)
    geometry = StepGeometry.build(plan_shards(ids, WORLD, "balanced"), ids)
    kernel, _ = select_kernel(kernel_name, torch.device("cuda"))
    worst, pairs = 0.0, 0
    for rank in range(WORLD):
        items = items_over_buffer(geometry.pieces(rank), geometry.needed_positions(rank), geometry.plan.local_len)
        plan = kernel.prepare(items, torch.device("cuda"))
        pairs += items.pairs()
        q = torch.randn(H, items.num_q_rows, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(HK, items.num_k_rows, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))

        def step():
            kernel.attend(plan, q, k, v, D ** -0.5, 0.0).float().square().mean().backward()

        worst = max(worst, timed(step))
    return worst, pairs


def limit_seconds(segments: list[int]) -> float:
    from flash_attn import flash_attn_varlen_func

    lengths = torch.tensor(segments)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)]).to(torch.int32).cuda()
    q = torch.randn(S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(S, HK, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))

    def step():
        flash_attn_varlen_func(q, k, v, cu, cu, int(lengths.max()), int(lengths.max()), causal=True).float().square().mean().backward()

    return timed(step) / WORLD


def throughput() -> list[str]:
    lines = ["| layout of 128k tokens | kernel | slowest rank fwd+bwd ms | TFLOP/s per rank | limit ms (flash alone / 8) | x limit |",
             "|---|---|---|---|---|---|"]
    for name, segments in (("mixed lengths", mixed_lengths()), ("one long document", [S])):
        limit = limit_seconds(segments) if available("flash") else float("nan")
        for kernel in ("flash", "te", "sdpa", "flex"):
            if not available(kernel):
                lines.append(f"| {name} | {kernel} | skipped ({NEEDS[kernel]} not installed) | | | |")
                continue
            seconds, pairs = rank_seconds(kernel, segments)
            flops = 3.5 * 4 * (pairs / WORLD) * H * D
            lines.append(f"| {name} | {kernel} | {seconds * 1e3:.1f} | {flops / seconds / 1e12:.1f} | "
                         f"{limit * 1e3:.1f} | {seconds / limit:.2f} |")
    return lines


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device", file=sys.stderr)
        return 2
    print(f"gpu_check on {torch.cuda.get_device_name()}, torch {torch.__version__}; needs flash-attn "
          f"({'found' if available('flash') else 'MISSING'}), optional transformer-engine "
          f"({'found' if available('te') else 'missing'})")
    t0 = time.perf_counter()
    print("\n".join(parity()))
    print()
    print("\n".join(throughput()))
    print(f"\n{time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
