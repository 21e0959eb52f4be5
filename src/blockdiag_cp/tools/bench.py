"""``blockdiag-cp bench``: time, peak memory, bytes sent and balance of one configuration.

Each configuration runs in fresh gloo processes (one thread per rank), so peak RSS
is that configuration's. Time is forward+backward of one attention call, between
barriers, median of ``repeats`` after one warm-up: the call's inputs are this rank's
q/k/v shards as leaves (token-major views, as a model's projections hand them
over), like the limit's per-document q/k/v; sharding the batch, done once per step
for every layer, is not timed. Bytes sent are the ``wchar``
delta of ``/proc/self/io`` (sockets count there): what the rank really wrote.
The *limit* is one process running the same per-document attention alone, divided
by the world size. Both sides run with `keep_cpu_heap` (Note [Fresh pages on CPU]): the CP
ranks and the limit's process alike serve large tensors from a heap that keeps freed blocks.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import time
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F

from ..parallel import keep_cpu_heap
from ..testing import ParityCase


@dataclass(frozen=True)
class BenchSpec(ParityCase):
    """One benchmarked configuration: a `ParityCase` row and settings, run on `world` ranks."""

    heads: int = 8
    kv_heads: int = 8
    head_dim: int = 64
    dtype: str = "float32"
    impl: str = "blockdiag_cp"  # or "seed" (nemo-automodel's reference)
    world: int = 2
    repeats: int = 3
    layers: int = 1  # > 1: a step of that many attention layers, the batch's sharding and planning timed too

    @property
    def seq_len(self) -> int:
        return sum(abs(n) for n in self.segments)


@dataclass
class BenchResult:
    spec: BenchSpec
    seconds: float  # max over ranks of the median fwd+bwd time
    peak_rss_gb: list  # per rank, whole process
    step_peak_gb: list  # per rank, peak RSS above the RSS before the first step
    sent_mb: list  # per rank per fwd+bwd
    work: list  # per rank
    exchange: str = ""
    kernel: str = ""


def doc_lengths(spec: str, seq_len: int, seed: int = 0) -> tuple[int, ...]:
    """Document lengths filling `seq_len`: explicit ``"a,b,c"`` (rest padded), ``one``,
    ``uniform:N`` (N equal documents), ``powerlaw:N`` (N Pareto-distributed lengths, shape
    1.2; ``powerlaw:N:A`` for shape A: the smaller, the heavier the tail), ``mixed`` (one
    quarter-row document plus many short ones)."""
    rng = random.Random(seed)
    if spec == "one":
        return (seq_len,)
    if spec == "mixed":
        big = seq_len // 4
        rest, out = seq_len - big, [big]
        while rest > 0:
            n = min(rest, rng.randint(16, 512))
            out.append(n)
            rest -= n
        return tuple(out)
    kind, sep, rest = spec.partition(":")
    if sep:
        count, _, shape = rest.partition(":")
        if kind not in ("uniform", "powerlaw") or not count.isdigit() or (shape and kind != "powerlaw"):
            raise ValueError(f"--docs {spec!r}: use 'a,b,c', 'one', 'mixed', 'uniform:N' or 'powerlaw:N[:A]'")
        alpha = _positive_float(shape, spec) if shape else 1.2
        n = int(count)
        if not 0 < n <= seq_len:
            raise ValueError(f"--docs {spec!r}: N must be between 1 and --seq-len {seq_len} (one token each at least)")
        weights = [1.0] * n if kind == "uniform" else [rng.paretovariate(alpha) for _ in range(n)]
        return _split_tokens(seq_len, weights)
    try:
        lengths = tuple(int(v) for v in spec.split(","))
    except ValueError:
        raise ValueError(f"--docs {spec!r}: use 'a,b,c', 'one', 'mixed', 'uniform:N' or 'powerlaw:N[:A]'") from None
    if any(n <= 0 for n in lengths) or sum(lengths) > seq_len:
        raise ValueError(f"--docs {spec!r}: lengths must be positive and sum to at most --seq-len {seq_len}")
    return lengths + ((sum(lengths) - seq_len,) if sum(lengths) < seq_len else ())


def _positive_float(text: str, spec: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(f"--docs {spec!r}: the power-law shape A must be a positive number, got {text!r}")
    return value


def _split_tokens(seq_len: int, weights: list[float]) -> tuple[int, ...]:
    """Positive lengths proportional to `weights` that sum to exactly `seq_len` (len(weights) <= seq_len)."""
    spare = seq_len - len(weights)
    lengths = [1 + int(spare * w / sum(weights)) for w in weights]
    for i in range(seq_len - sum(lengths)):  # the rounding remainder, one token each
        lengths[i % len(lengths)] += 1
    return tuple(lengths)


def rss_bytes() -> int:
    """This process's resident set size now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def bytes_written() -> int:
    """Bytes this process has written so far (``wchar`` of /proc/self/io; sockets count)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar"))


def _inputs(spec: BenchSpec) -> tuple[torch.Tensor, torch.Tensor]:
    from ..testing import doc_ids_from_lengths

    gen = torch.Generator().manual_seed(0)
    width = (spec.heads + 2 * spec.kv_heads) * spec.head_dim
    x = torch.randn(1, spec.seq_len, width, generator=gen, dtype=getattr(torch, spec.dtype))
    return x, doc_ids_from_lengths(spec.segments).unsqueeze(0)


def attention_leaves(x_1LX: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> list[torch.Tensor]:
    """This rank's q ``[1, H, L, D]`` and k/v ``[1, Hk, L, D]`` from a projected row ``[1, L, (H + 2Hk) D]``:
    token-major views (as a model's projections hand them over), made leaves, like the limit's q/k/v."""
    q, k, v = torch.split(x_1LX.detach(), [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return [t.reshape(1, t.shape[1], -1, head_dim).transpose(1, 2).requires_grad_(True) for t in (q, k, v)]


def _make_step(spec: BenchSpec, mesh, inputs: tuple[torch.Tensor, torch.Tensor]):
    """Return ``(train_ctx, local x, sdpa fn, exchange, kernel, work)`` for the implementation,
    from the row's ``(x, doc ids)`` (made before any timer starts: drawing them is not the step)."""
    x, doc_ids = inputs
    batch = {"inputs_embeds": x, "_packed_seq_ids": doc_ids}
    if spec.impl == "seed":
        from nemo_automodel.components.distributed.blockdiag_cp import batch as seed_batch
        from nemo_automodel.components.distributed.blockdiag_cp.runtime import cp_blockdiag_sdpa as seed_sdpa

        made = seed_batch.make_cp_blockdiag_batch_and_ctx(mesh, None, batch)
        return made[0], made[1]["inputs_embeds"], seed_sdpa, "allgather (seed)", "dense mask (seed)", None
    from .. import CPConfig, cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx

    config = CPConfig(kv_exchange=spec.kv_exchange, layout=spec.layout, kernel=spec.kernel)
    train_ctx, batch = make_cp_blockdiag_batch_and_ctx(mesh, None, batch, config=config)
    with train_ctx() as state:
        names = (state.exchange.name, state.kernel.name, state.work_per_rank().tolist())
    return train_ctx, batch["inputs_embeds"], cp_blockdiag_sdpa, *names


def bench_worker(rank: int, world: int, spec: BenchSpec) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    keep_cpu_heap()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"]
    base_rss = rss_bytes()
    times, sent = [], []
    for i in range(spec.repeats + 1):
        inputs = _inputs(spec)
        dist.barrier()
        t_step = time.perf_counter()  # a step of several layers counts its sharding and planning too
        train_ctx, x_local, sdpa, exchange, kernel, work = _make_step(spec, mesh, inputs)
        layers = [attention_leaves(x_local, spec.heads, spec.kv_heads, spec.head_dim) for _ in range(spec.layers)]
        if spec.layers == 1:
            dist.barrier()
        t0, w0 = (time.perf_counter() if spec.layers == 1 else t_step), bytes_written()
        with train_ctx():
            loss = sum(sdpa(q, k, v, enable_gqa=spec.heads != spec.kv_heads).float().square().mean()
                       for q, k, v in layers)
            loss.backward()
        dist.barrier()
        if i:  # the first round warms up
            times.append(time.perf_counter() - t0)
            sent.append(bytes_written() - w0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"time": statistics.median(times), "peak": peak, "step_peak": max(0, peak - base_rss),
            "sent": statistics.median(sent), "exchange": exchange, "kernel": kernel, "work": work}


def run_spec(spec: BenchSpec, timeout: float = 900) -> BenchResult:
    from ..testing import spawn

    per_rank = spawn(bench_worker, spec.world, spec, timeout=timeout)
    work = per_rank[0]["work"]
    return BenchResult(
        spec,
        seconds=max(r["time"] for r in per_rank),
        peak_rss_gb=[r["peak"] / 1e9 for r in per_rank],
        step_peak_gb=[r["step_peak"] / 1e9 for r in per_rank],
        sent_mb=[r["sent"] / 1e6 for r in per_rank],
        work=work if work is not None else [],
        exchange=per_rank[0]["exchange"],
        kernel=per_rank[0]["kernel"],
    )


def limit_seconds(spec: BenchSpec, repeats: int = 3, loaded: bool = False) -> float:
    """One process, one thread: per-document causal SDPA forward+backward over the row, / world
    (x ``spec.layers``: the limit has no sharding or planning to do).

    With ``loaded=True`` the same measurement runs in `world` processes at once (each
    doing the whole row), so the machine is as busy as during the CP run; on a machine
    with no more cores than ranks this is the fair side-by-side limit.
    """
    if loaded:
        from ..testing import spawn

        per_process = spawn(_limit_worker, spec.world, spec, repeats)
        return statistics.median(per_process)
    keep_cpu_heap()
    torch.set_num_threads(1)
    dtype = getattr(torch, spec.dtype)
    docs = [n for n in spec.segments if n > 0]
    runs = []
    for _ in range(repeats):
        total = 0.0
        for n in docs:
            q = torch.randn(1, spec.heads, n, spec.head_dim, dtype=dtype, requires_grad=True)
            k, v = (torch.randn(1, spec.kv_heads, n, spec.head_dim, dtype=dtype, requires_grad=True) for _ in range(2))
            t0 = time.perf_counter()
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=spec.heads != spec.kv_heads)
            out.float().square().mean().backward()
            total += time.perf_counter() - t0
        runs.append(total)
    return statistics.median(runs) / spec.world * spec.layers


def _limit_worker(rank: int, world: int, spec: BenchSpec, repeats: int) -> float:
    return limit_seconds(spec, repeats)


def seed_available() -> bool:
    try:
        import nemo_automodel.components.distributed.blockdiag_cp.batch  # noqa: F401
    except ImportError:
        return False
    return True


def format_table(results: list[BenchResult], limit: Optional[float]) -> str:
    lines = [
        "| impl | S | docs | world | exchange | kernel | fwd+bwd s | x limit | peak RSS GB/rank "
        "| step peak GB/rank | MB sent/rank | max/mean work |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s = r.spec
        balance = f"{max(r.work) / (sum(r.work) / len(r.work)):.2f}" if r.work and sum(r.work) else "-"
        ratio = f"{r.seconds / limit:.2f}" if limit else "-"
        lines.append(
            f"| {s.impl} | {s.seq_len} | {len([n for n in s.segments if n > 0])} | {s.world} | {r.exchange} | {r.kernel} "
            f"| {r.seconds:.3f} | {ratio} | {max(r.peak_rss_gb):.2f} | {max(r.step_peak_gb):.2f} "
            f"| {max(r.sent_mb):.1f} | {balance} |"
        )
    return "\n".join(lines)


#: with --reference auto, the seed's dense all-gather reference runs only up to this length
SEED_MAX_AUTO = 8192
#: the table and the plot ``blockdiag-cp bench`` writes into --out
OUT_NAMES = ("bench.md", "bench.png")


def run_bench(args: argparse.Namespace) -> int:
    segments = doc_lengths(args.docs, args.seq_len)
    spec = BenchSpec(segments, world=args.world, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                     kv_exchange=args.exchange, layout=args.layout, kernel=args.kernel, repeats=args.repeats)
    specs = [spec]
    if args.reference == "auto" and spec.seq_len > SEED_MAX_AUTO:
        print(f"(the seed's reference is skipped above S={SEED_MAX_AUTO}: it materializes S x S masks; --reference yes runs it)")
    elif args.reference != "no":
        if seed_available():
            specs.append(replace(spec, impl="seed"))
        elif args.reference == "yes":
            print("--reference yes: nemo-automodel is not importable (pip install --no-deps nemo-automodel==0.7.0)")
            return 2
        else:
            print("(the seed's reference is skipped: nemo-automodel is not importable)")
    results = [run_spec(s) for s in specs]
    limit = limit_seconds(spec)
    table = format_table(results, limit)
    print(table)
    print(f"limit (one process alone / world): {limit:.3f} s")
    md, png = (os.path.join(args.out, name) for name in OUT_NAMES)
    with open(md, "w") as f:
        f.write(table + f"\n\nlimit (one process alone / world): {limit:.3f} s\n")
    print(f"wrote {md}{_plot_bench(results, png)}")
    return 0


def _plot_bench(results: list[BenchResult], path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return " (no plot written: pip install matplotlib)"
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for i, r in enumerate(results):
        ranks = range(len(r.sent_mb))
        offset = [x + 0.4 * i for x in ranks]
        axes[0].bar(offset, r.sent_mb, width=0.4, label=r.spec.impl)
        axes[1].bar(offset, r.peak_rss_gb, width=0.4, label=r.spec.impl)
        if r.work:
            axes[2].bar(offset, r.work, width=0.4, label=r.spec.impl)
    for ax, title in zip(axes, ("MB sent per rank (fwd+bwd)", "peak RSS per rank (GB)", "attention work per rank")):
        ax.set(title=title, xlabel="rank")
        ax.set_xticks(range(len(results[0].sent_mb)))
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f" and {path}"
