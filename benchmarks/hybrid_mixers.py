"""Hybrid-model token mixers under CP against the per-document limit: a Gated DeltaNet layer and a
Mamba2 layer (the sequence part: conv, then the recurrence), forward+backward.

    python benchmarks/hybrid_mixers.py            # both rows, both mixers, cp 2 and 4, both layouts
    python benchmarks/hybrid_mixers.py --quick    # cp 2, balanced

Each case runs on gloo processes (one thread each, median of the repeats after a warm-up;
the slowest rank counts) and, in the same run, the limit: one process running each document
alone through the same torch kernels (`mixers.chunked`), divided by cp, measured on an idle
machine and again with a copy on every rank's process (on a machine with fewer cores than
ranks, the fair side-by-side number). Printed per case: seconds, x limit (idle, busy), and
the bytes per rank and layer of the state hand-off and halo (`StepState.mixer_bytes_per_layer`)
beside what head parallelism around the mixer would move.

Goals (issue #23): a 32,768-token power-law row (300 documents) at cp 2 and 4: <= 1.3x; one
32,768-token document: Mamba2 <= 1.3x, the delta rule <= 1.6x (its hand-off reruns the
continuing piece and computes its d_k x d_k transition).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from blockdiag_cp.tools.bench import doc_lengths
from blockdiag_cp.mixers.conv import conv_plan
from blockdiag_cp.mixers.recurrence import piece_schedule

SEQ_LEN = 32768
CONV_WIDTH = 4
#: the delta rule: key heads, value heads, key and value sizes (Qwen3-Next-like proportions, scaled down)
DELTA = dict(key_heads=2, heads=4, key_dim=64, value_dim=64)
#: Mamba2: heads, head size, groups, state size
MAMBA = dict(heads=8, head_dim=32, groups=1, state=64)
A_MAMBA = -torch.linspace(0.5, 4.0, MAMBA["heads"], dtype=torch.float64)


def channels(mixer: str) -> int:
    if mixer == "gated_delta":
        return 2 * DELTA["key_heads"] * DELTA["key_dim"] + DELTA["heads"] * DELTA["value_dim"]
    return MAMBA["heads"] * MAMBA["head_dim"] + 2 * MAMBA["groups"] * MAMBA["state"]


def row_inputs(mixer: str, S: int, seed: int = 0) -> list[torch.Tensor]:
    """The row's mixer inputs ``[S, ...]`` in float32: conv input and weight, then the gates."""
    g = torch.Generator().manual_seed(seed)
    C = channels(mixer)
    heads = DELTA["heads"] if mixer == "gated_delta" else MAMBA["heads"]
    x = torch.randn(S, C, generator=g)
    weight = torch.randn(C, CONV_WIDTH, generator=g) * 0.5
    gate_a = torch.randn(S, heads, generator=g)
    gate_b = torch.rand(S, heads, generator=g) if mixer == "gated_delta" else torch.zeros(S, 0)
    return [x, weight, gate_a, gate_b]


def layer(mixer: str, conv, recur, x, weight, gate_a, gate_b) -> torch.Tensor:
    """The mixer's sequence part: `conv(x, weight)` (per document), SiLU, then `recur(...)`."""
    h = torch.nn.functional.silu(conv(x, weight))
    L = h.shape[0]
    if mixer == "gated_delta":
        Hk, Hv, dk, dv = DELTA["key_heads"], DELTA["heads"], DELTA["key_dim"], DELTA["value_dim"]
        q, k, v = torch.split(h, [Hk * dk, Hk * dk, Hv * dv], dim=-1)
        g = -torch.nn.functional.softplus(gate_a) * 0.1
        return recur("delta", q.reshape(L, Hk, dk), k.reshape(L, Hk, dk), v.reshape(L, Hv, dv), g, gate_b)
    H, P, G, N = MAMBA["heads"], MAMBA["head_dim"], MAMBA["groups"], MAMBA["state"]
    xs, B, C = torch.split(h, [H * P, G * N, G * N], dim=-1)
    dt = torch.nn.functional.softplus(gate_a)
    return recur("scan", xs.reshape(L, H, P), dt, A_MAMBA.float(), B.reshape(L, G, N), C.reshape(L, G, N))


def alone(kind, *rows):
    """One document through the library's chunked kernels (the limit's recurrence)."""
    from blockdiag_cp.mixers.chunked import chunked_gated_delta_rule, chunked_ssd

    if kind == "delta":
        return chunked_gated_delta_rule(*(t[None] for t in rows))[0][0]
    x, dt, A, B, C = rows
    return chunked_ssd(x[None], dt[None], A, B[None], C[None])[0][0]


def causal_conv(x, weight):
    """One document's causal depthwise conv (zeros before its start)."""
    padded = torch.nn.functional.pad(x.t().unsqueeze(0), (CONV_WIDTH - 1, 0))
    return torch.nn.functional.conv1d(padded, weight.unsqueeze(1), groups=x.shape[1])[0].t()


def limit_seconds(mixer: str, segments, world: int, repeats: int) -> float:
    torch.set_num_threads(1)
    inputs = row_inputs(mixer, sum(segments))
    runs = []
    for _ in range(repeats + 1):
        total, start = 0.0, 0
        for n in segments:
            part = [t[start : start + n].clone().requires_grad_(True) if t.shape[0] == inputs[0].shape[0]
                    else t.clone().requires_grad_(True) for t in inputs]
            t0 = time.perf_counter()
            out = layer(mixer, causal_conv, alone, *part)
            out.square().mean().backward()
            total += time.perf_counter() - t0
            start += n
        runs.append(total)
    return statistics.median(runs[1:]) / world


def limit_worker(rank, world, mixer, segments, repeats):
    return limit_seconds(mixer, segments, world, repeats)


def cp_worker(rank, world, mixer, segments, layout, repeats):
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp import CPConfig, make_cp_blockdiag_batch_and_ctx
    from blockdiag_cp.mixers import MixerShape
    from blockdiag_cp.testing import doc_ids_from_lengths

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"]
    x, weight, gate_a, gate_b = row_inputs(mixer, sum(segments))
    flat = torch.cat([x, gate_a, gate_b], dim=1)
    batch = {"inputs_embeds": flat.unsqueeze(0), "_packed_seq_ids": doc_ids_from_lengths(segments).unsqueeze(0)}
    ctx, batch = make_cp_blockdiag_batch_and_ctx(mesh, None, batch, config=CPConfig(layout=layout))
    local = batch["inputs_embeds"][0]
    widths = [x.shape[1], gate_a.shape[1], gate_b.shape[1]]
    times = []
    state = ctx.state  # the kernels take the planned step itself (no model runs: no step entered)

    def recur(kind, *rows):
        schedule = piece_schedule(state)
        return schedule.gated_delta_rule(*rows) if kind == "delta" else schedule.ssd(*rows)

    def conv(rows, w):
        return conv_plan(state, CONV_WIDTH)(rows, w, None)

    for _ in range(repeats + 1):
        parts = [t.clone().requires_grad_(True) for t in torch.split(local, widths, dim=1)]
        w = weight.clone().requires_grad_(True)
        torch.distributed.barrier()
        t0 = time.perf_counter()
        out = layer(mixer, conv, recur, parts[0], w, parts[1], parts[2])
        out.square().mean().backward()
        times.append(time.perf_counter() - t0)
    if mixer == "gated_delta":
        shape = MixerShape("gated_delta", CONV_WIDTH, channels(mixer), **DELTA)
    else:
        shape = MixerShape("mamba2", CONV_WIDTH, channels(mixer), heads=MAMBA["heads"], key_heads=MAMBA["groups"],
                           key_dim=MAMBA["state"], value_dim=MAMBA["head_dim"])
    moved = state.mixer_bytes_per_layer(shape, torch.float32)
    return {"time": statistics.median(times[1:]), "library": moved.sent, "head_parallel": moved.head_parallel.sent}


def run_case(mixer: str, row: str, world: int, layout: str, repeats: int) -> str:
    from blockdiag_cp.testing import spawn

    segments = doc_lengths("powerlaw:300", SEQ_LEN) if row == "power-law" else (SEQ_LEN,)
    per_rank = spawn(cp_worker, world, mixer, segments, layout, repeats, timeout=1800)
    seconds = max(r["time"] for r in per_rank)
    idle = limit_seconds(mixer, segments, world, repeats)
    busy = statistics.median(spawn(limit_worker, world, mixer, segments, repeats, timeout=1800))
    goal = 1.6 if (mixer == "gated_delta" and row == "one document") else 1.3
    ok = "ok" if seconds / idle <= goal else ("ok with cores busy" if seconds / busy <= goal else "OVER")
    library = max(r["library"] for r in per_rank) / 1e6
    head_parallel = max(r["head_parallel"] for r in per_rank) / 1e6
    return (f"| {mixer} | {row} | {world} | {layout} | {seconds:.3f} | {idle:.3f} | {seconds / idle:.2f} | "
            f"{busy:.3f} | {seconds / busy:.2f} | {goal:.1f} | {ok} | {library:.3f} | {head_parallel:.2f} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="cp 2, balanced layout only")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    print("| mixer | row | cp | layout | s (slowest rank) | limit idle | x idle | limit busy | x busy | goal | | "
          "MB moved (halo + state) | MB head-parallel |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    worlds, layouts = ((2,), ("balanced",)) if args.quick else ((2, 4), ("balanced", "contiguous"))
    for mixer in ("gated_delta", "mamba2"):
        for row in ("power-law", "one document"):
            for world in worlds:
                for layout in layouts:
                    print(run_case(mixer, row, world, layout, args.repeats), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
