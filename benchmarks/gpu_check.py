"""GPU check (one H200, a few minutes): kernel parity and per-rank attention throughput.

Runs on what a stock CUDA PyTorch has (`sdpa`, `flex`, `dense`); flash-attn
(`flash`) and transformer-engine (`te`) are optional and reported as not installed
when missing.

1. Parity: every kernel against the float64 oracle, bf16 and fp16, forward and
   backward (world 1 on the GPU), tolerance 2x the dense reference's own error,
   then windows / softcap / sinks in bf16.
2. Throughput: the local attention each rank of a cp=8 run does for 128k packed
   tokens (mixed lengths; one long document), balanced layout, run rank by rank on
   this one GPU: the slowest rank's forward+backward, and TFLOP/s of causal attention
   actually computed (counted as 3.5 x 4 x pairs x heads x head_dim). The limit is the
   same documents unsharded, divided by 8: flash-attn varlen when installed, else
   PyTorch's own flash SDPA, one causal call per document.
3. A new row every step: a fresh call table plus fwd+bwd, per kernel.
4. A compiled step: a Llama's one-process CP step, eager beside every block compiled
   ``fullgraph=True`` (inductor, bf16), rows of changing documents.

    python benchmarks/gpu_check.py            # on a CUDA machine
    python benchmarks/gpu_check.py --smoke    # a small dry run on CPU (checks the script itself)
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from blockdiag_cp.exchange.base import items_over_buffer
from blockdiag_cp.plan.geometry import StepGeometry
from blockdiag_cp.kernels import CallOptions, select_kernel
from blockdiag_cp.plan import plan_shards
from blockdiag_cp.testing import ParityCase, doc_ids_from_lengths, reference_error, run_parity_case

KERNELS = ("sdpa", "flash", "te", "flex", "dense")
NEEDS = {"flash": "flash_attn", "te": "transformer_engine"}
SEGMENTS = (700, 1300, -40, 2100, 3, 5, 1, 1900)


@dataclass(frozen=True)
class Scale:
    """The throughput problem: a row of S tokens over `world` ranks, H query / HK key heads of D."""

    device: str
    S: int
    world: int
    H: int
    HK: int
    D: int
    dtype: torch.dtype
    parity_dtypes: tuple[str, ...]
    throughput_kernels: tuple[str, ...]
    parity_segments: tuple[int, ...]
    doc_scale: int  # mixed lengths: Pareto(1.1) x this many tokens, at least 64


FULL = Scale("cuda", 131072, 8, 32, 8, 128, torch.bfloat16, ("bfloat16", "float16"), ("flash", "te", "sdpa", "flex"),
             SEGMENTS, 900)
SMOKE = Scale("cpu", 4096, 4, 4, 2, 32, torch.float32, ("float32",), ("sdpa",), (70, 130, -4, 210, 3, 5, 1, 190), 90)


def available(kernel: str, device: str) -> bool:
    if kernel in NEEDS:
        return device == "cuda" and importlib.util.find_spec(NEEDS[kernel]) is not None
    return not (kernel == "flex" and device == "cpu")  # no FlexAttention backward on CPU


def missing(kernel: str, device: str) -> str:
    return f"{NEEDS[kernel]} not installed" if kernel in NEEDS else f"no training on {device}"


def emit(line: str) -> None:
    print(line, flush=True)


def parity_row(case: ParityCase, label: str) -> str:
    try:
        r = run_parity_case(case, None)
        ro, rg = reference_error(case)
    except Exception as exc:  # report and go on: one broken kernel must not hide the others
        return f"| {label} | {case.dtype} | FAILED: {type(exc).__name__}: {str(exc)[:160]} | | | | |"
    ok = r.out_err <= 2 * ro + 1e-3 and r.grad_err <= 2 * rg + 1e-3
    return (f"| {label} | {case.dtype} | {r.out_err:.2e} | {r.grad_err:.2e} | {ro:.2e} | {rg:.2e} | "
            f"{'ok' if ok else 'MISMATCH'} |")


def parity(scale: Scale) -> None:
    emit("| kernel | dtype | max abs err out | grad | dense ref err out | grad | verdict |")
    emit("|---|---|---|---|---|---|---|")
    for kernel in KERNELS:
        for dtype in scale.parity_dtypes:
            if not available(kernel, scale.device):
                emit(f"| {kernel} | {dtype} | skipped ({missing(kernel, scale.device)}) | | | | |")
                continue
            case = ParityCase(scale.parity_segments, heads=8, kv_heads=2, head_dim=64, kernel=kernel, dtype=dtype,
                              device=scale.device)
            emit(parity_row(case, kernel))
    window = max(scale.parity_segments) // 4
    features = {f"window {window}": {"window": window}, "softcap 30": {"softcap": 30.0}, "sinks": {"sinks": True}}
    for kernel in ("sdpa", "auto"):
        for name, extra in features.items():
            case = ParityCase(scale.parity_segments, heads=8, kv_heads=2, head_dim=64, kernel=kernel,
                              dtype=scale.parity_dtypes[0], device=scale.device, **extra)
            emit(parity_row(case, f"{kernel}, {name}"))


def mixed_lengths(scale: Scale, seed: int = 0) -> list[int]:
    rng, out, rest = random.Random(seed), [], scale.S
    while rest > 0:
        n = min(rest, max(64, int(rng.paretovariate(1.1) * scale.doc_scale)))
        out.append(n)
        rest -= n
    return out


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], None], device: str, repeats: int = 3) -> float:
    """Best wall time of `repeats` runs after one warm-up (compilation, caches)."""
    fn()
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def rank_tensors(items, scale: Scale, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Random leaf ``q [H, L, D]``, ``k``/``v`` ``[HK, N, D]`` for one rank's `items`."""
    q = torch.randn(scale.H, items.num_q_rows, scale.D, device=device, dtype=scale.dtype, requires_grad=True)
    k, v = (torch.randn(scale.HK, items.num_k_rows, scale.D, device=device, dtype=scale.dtype, requires_grad=True)
            for _ in range(2))
    return q, k, v


def attend_backward(kernel, calls, q, k, v, scale: Scale) -> None:
    """One rank's local attention, forward and backward."""
    kernel.attend(calls, q, k, v, CallOptions(scale.D ** -0.5)).float().square().mean().backward()


def rank_seconds(kernel_name: str, segments: list[int], scale: Scale) -> tuple[float, int]:
    """The slowest rank's local attention fwd+bwd (seconds), and the pairs computed over all ranks."""
    device = torch.device(scale.device)
    ids = doc_ids_from_lengths(segments)
    geometry = StepGeometry.build(plan_shards(ids, scale.world, "balanced"), ids)
    kernel, _ = select_kernel(kernel_name, device)
    worst, pairs = 0.0, 0
    for rank in range(scale.world):
        items = items_over_buffer(geometry.pieces(rank), geometry.needed_positions(rank), geometry.plan.local_len)
        calls = kernel.prepare(items, device)
        pairs += items.pairs()
        q, k, v = rank_tensors(items, scale, device)

        def step():
            attend_backward(kernel, calls, q, k, v, scale)

        worst = max(worst, timed(step, scale.device))
    return worst, pairs


def limit_step(segments: list[int], scale: Scale) -> tuple[str, Callable[[], None]]:
    """The unsharded row's attention fwd+bwd on the best per-document kernel at hand."""
    device, (S, H, HK, D) = scale.device, (scale.S, scale.H, scale.HK, scale.D)
    q = torch.randn(S, H, D, device=device, dtype=scale.dtype, requires_grad=True)
    k, v = (torch.randn(S, HK, D, device=device, dtype=scale.dtype, requires_grad=True) for _ in range(2))
    if available("flash", device):
        from flash_attn import flash_attn_varlen_func

        lengths = torch.tensor(segments)
        cu = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)]).to(torch.int32).to(device)
        longest = int(lengths.max())
        return "flash-attn varlen", lambda: flash_attn_varlen_func(
            q, k, v, cu, cu, longest, longest, causal=True).float().square().mean().backward()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    bounds, start = [], 0
    for n in segments:
        bounds.append((start, start + n))
        start += n
    backend = SDPBackend.FLASH_ATTENTION  # on CPU: the CPU flash kernel

    def step():
        with sdpa_kernel(backend):
            outs = [F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
                                                   is_causal=True, enable_gqa=True) for a, b in bounds]
        torch.cat([o[0].transpose(0, 1) for o in outs]).float().square().mean().backward()

    return "torch flash SDPA per document", step


def throughput(scale: Scale) -> None:
    """Both limits first, then each kernel over both rows (the slow-to-compile ones last)."""
    emit(f"| row of {scale.S // 1024}k tokens | kernel | slowest rank fwd+bwd ms | TFLOP/s per rank | "
         f"limit ms (unsharded / {scale.world}) | x limit |")
    emit("|---|---|---|---|---|---|")
    rows = {"mixed lengths": mixed_lengths(scale), "one long document": [scale.S]}
    limits = {}
    for name, segments in rows.items():
        label, step = limit_step(segments, scale)
        limits[name] = timed(step, scale.device) / scale.world
        emit(f"| {name} ({len(segments)} docs) | limit: {label} | | | {limits[name] * 1e3:.2f} | 1.00 |")
    for kernel in scale.throughput_kernels:
        for name, segments in rows.items():
            if not available(kernel, scale.device):
                emit(f"| {name} | {kernel} | skipped ({missing(kernel, scale.device)}) | | | |")
                continue
            try:
                seconds, pairs = rank_seconds(kernel, segments, scale)
            except Exception as exc:  # report and go on to the next kernel
                emit(f"| {name} | {kernel} | FAILED: {type(exc).__name__}: {str(exc)[:160]} | | | |")
                continue
            flops = 3.5 * 4 * (pairs / scale.world) * scale.H * scale.D
            emit(f"| {name} | {kernel} | {seconds * 1e3:.2f} | {flops / seconds / 1e12:.1f} | "
                 f"{limits[name] * 1e3:.2f} | {seconds / limits[name]:.2f} |")


def changing_rows(scale: Scale, steps: int = 6) -> None:
    """Training steps see a new row each time: rank 0's per-step cost of a fresh call table
    (block mask, index tables) plus its fwd+bwd, row after row, compilation included."""
    emit("| kernel | per-step ms, each step a new mixed-lengths row (rank 0 of the balanced layout) |")
    emit("|---|---|")
    device = torch.device(scale.device)
    for kernel_name in scale.throughput_kernels:
        if not available(kernel_name, scale.device):
            continue
        kernel, _ = select_kernel(kernel_name, device)
        times = []
        for seed in range(1, steps + 1):
            ids = doc_ids_from_lengths(mixed_lengths(scale, seed))
            geometry = StepGeometry.build(plan_shards(ids, scale.world, "balanced"), ids)
            synchronize(scale.device)
            t0 = time.perf_counter()
            items = items_over_buffer(geometry.pieces(0), geometry.needed_positions(0), geometry.plan.local_len)
            calls = kernel.prepare(items, device)
            attend_backward(kernel, calls, *rank_tensors(items, scale, device), scale)
            synchronize(scale.device)
            times.append(time.perf_counter() - t0)
        emit(f"| {kernel_name} | {' / '.join(f'{t * 1e3:.0f}' for t in times)} |")


def compiled_step(scale: Scale, steps: int = 6) -> None:
    """A one-process CP step of a Llama (bf16 on the GPU) on packed rows of changing documents: eager,
    and with every decoder block compiled ``fullgraph=True`` (inductor; ``aot_eager`` in the smoke
    run, which builds no C++). Steps alternate; the median after one warm-up step of each."""
    import statistics

    import torch._dynamo
    from compile_step import make_model, row, train_step
    from torch._dynamo.utils import counters

    backend = "inductor" if scale.device == "cuda" else "aot_eager"
    seq_len, hidden, heads, layers = (16384, 1024, 16, 4) if scale.device == "cuda" else (1024, 128, 4, 2)
    torch._dynamo.reset()
    counters.clear()
    eager = make_model(hidden, heads, layers, scale.dtype, scale.device)
    compiled = make_model(hidden, heads, layers, scale.dtype, scale.device)
    for layer in compiled.model.layers:
        layer.compile(backend=backend, fullgraph=True)
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    worst = 0.0
    for step in range(steps + 1):
        batch = row(step, seq_len, scale.device)
        t_eager, loss_eager = train_step(eager, None, batch)
        t_compiled, loss_compiled = train_step(compiled, None, batch)
        worst = max(worst, abs(loss_eager - loss_compiled) / abs(loss_eager))
        if step:  # the first step compiles
            times["eager"].append(t_eager)
            times["compiled"].append(t_compiled)
    eager_s, compiled_s = (statistics.median(times[k]) for k in ("eager", "compiled"))
    emit(f"| compiled step: {layers} layers, hidden {hidden}, {seq_len // 1024}k tokens, {backend} | eager ms | "
         f"compiled ms | eager / compiled | loss rel. diff | graphs |")
    emit("|---|---|---|---|---|---|")
    emit(f"| {str(scale.dtype).removeprefix('torch.')} | {eager_s * 1e3:.1f} | {compiled_s * 1e3:.1f} | "
         f"{eager_s / compiled_s:.2f}x | {worst:.1e} | {counters['stats']['unique_graphs']} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a small CPU dry run of this script")
    args = parser.parse_args()
    scale = SMOKE if args.smoke else FULL
    if scale.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --smoke for a CPU dry run)", file=sys.stderr)
        return 2
    where = torch.cuda.get_device_name() if scale.device == "cuda" else "cpu (smoke)"
    emit(f"gpu_check on {where}, torch {torch.__version__}; flash-attn "
         f"{'installed' if available('flash', scale.device) else 'not installed'}, transformer-engine "
         f"{'installed' if available('te', scale.device) else 'not installed'}\n")
    t0 = time.perf_counter()
    parity(scale)
    emit(f"\nparity: {time.perf_counter() - t0:.0f}s\n")
    throughput(scale)
    emit("")
    changing_rows(scale)
    emit("")
    try:
        compiled_step(scale)
    except Exception as exc:  # report it with the rest
        emit(f"compiled step FAILED: {type(exc).__name__}: {str(exc)[:300]}")
    emit(f"\ntotal: {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
