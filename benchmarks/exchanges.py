"""K/V exchange benchmark: bytes sent per rank and time, forward+backward, for every exchange.

Rows (S=8192 tokens, fp32, 8 query / 8 K/V heads of 64): 300 power-law documents (the
packed-SFT case), many short documents, one document spanning all ranks, documents of
mixed length; both layouts; at cp=2 and cp=4. "x limit" is the time over one process
running each document's causal SDPA alone, divided by cp, measured in the same run.
Bytes are the wchar delta of /proc/self/io around one attention forward+backward (what the
rank really wrote to its sockets). The needed-only minimum for a rank is the K/V rows it
owns that other ranks' queries see, plus the gradients of the rows it received.
Writes docs/bench_exchanges.md.

    python benchmarks/exchanges.py
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import time

import torch

from blockdiag_cp.tools.bench import BenchSpec, attention_leaves, bytes_written, doc_lengths, limit_seconds
from blockdiag_cp.testing import doc_ids_from_lengths, spawn

S, H, HK, D = 8192, 8, 8, 64
EXCHANGES = ("allgather", "halo", "a2a", "ring", "auto")
ROWS = {
    "300 power-law docs": doc_lengths("powerlaw:300", S),
    "many short docs": doc_lengths("uniform:61", S),  # ~134 tokens each, straddling rank boundaries
    "one doc over all ranks": doc_lengths("one", S),
    "mixed lengths": doc_lengths("mixed", S, seed=3),
}


def worker(rank, world, segments, layout, repeats=3):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp import CPConfig, cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"]
    ids = doc_ids_from_lengths(segments).unsqueeze(0)
    x = torch.randn(1, S, (H + 2 * HK) * D, generator=torch.Generator().manual_seed(0))
    out = {}
    for exchange in EXCHANGES:
        times, sent = [], []
        for i in range(repeats + 1):
            ctx, batch = make_cp_blockdiag_batch_and_ctx(mesh, None, {"inputs_embeds": x, "_packed_seq_ids": ids},
                                                         config=CPConfig(kv_exchange=exchange, layout=layout))
            q, k, v = attention_leaves(batch["inputs_embeds"], H, HK, D)
            dist.barrier()
            with ctx() as state:
                t0, w0 = time.perf_counter(), bytes_written()
                cp_blockdiag_sdpa(q, k, v).square().mean().backward()
                w1 = bytes_written()
                dist.barrier()
                t1 = time.perf_counter()
            if i:
                times.append(t1 - t0)
                sent.append(w1 - w0)
        geometry = state.geometry
        mine = geometry.owner == rank
        minimum = sum(int((geometry.need_WS[j] & mine).sum()) for j in range(world) if j != rank)
        minimum += int((geometry.need_WS[rank] & ~mine).sum())
        out[exchange] = {"time": statistics.median(times), "sent": statistics.median(sent),
                         "min": minimum * 2 * HK * D * 4, "ran": state.exchange.name}
    return out


def main() -> int:
    lines = ["| row | layout | cp | exchange (ran) | MB sent, max rank | needed-only minimum MB | x minimum | fwd+bwd s "
             "| x limit | x allgather time |", "|---|---|---|---|---|---|---|---|---|---|"]
    verdicts = []
    for (name, segments), layout, world in ((r, lay, w) for r in ROWS.items() for lay in ("contiguous", "balanced")
                                            for w in (2, 4)):
        limit = limit_seconds(BenchSpec(segments, world=world, heads=H, kv_heads=HK, head_dim=D))
        per_rank = spawn(worker, world, segments, layout, timeout=1200)
        base_time = max(r["allgather"]["time"] for r in per_rank)
        for exchange in EXCHANGES:
            rows = [r[exchange] for r in per_rank]
            sent = max(r["sent"] for r in rows) / 1e6
            minimum = max(r["min"] for r in rows) / 1e6
            seconds = max(r["time"] for r in rows)
            ratio = sent / minimum if minimum else float("nan") if sent else 1.0
            lines.append(f"| {name} | {layout} | {world} | {exchange} ({rows[0]['ran']}) | {sent:.2f} | {minimum:.2f} | "
                         f"{ratio:.3f} | {seconds:.3f} | {seconds / limit:.2f} | {seconds / base_time:.2f} |")
            if exchange == "auto":
                ok = (not minimum and sent < 0.05) or (minimum and sent <= 1.10 * minimum)
                verdicts.append(f"{name}, {layout}, cp={world}: auto {ratio:.3f}x minimum bytes, {seconds / limit:.2f}x "
                                f"limit, {seconds / base_time:.2f}x allgather time -> "
                                f"{'ok' if ok and seconds <= base_time * 1.05 else 'MISSED'}")
    text = "\n".join(lines) + "\n\n" + "\n".join(f"- {v}" for v in verdicts)
    print(text)
    out = pathlib.Path(__file__).resolve().parent.parent / "docs" / "bench_exchanges.md"
    out.write_text("# K/V exchanges (CPU, gloo, S=8192, fp32, 8 heads of 64)\n\n" + text + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
