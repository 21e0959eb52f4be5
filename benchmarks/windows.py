"""Sliding-window layers: K/V bytes each rank sends, beside full-causal layers, and x limit.

    python benchmarks/windows.py

One attention call forward+backward (fp32, 8 query / 8 K/V heads of 64) with the
`auto` exchange, on one document of 32768 tokens and on 300 power-law documents,
cp = 2 and 4, both layouts, full causal and windows of 4096 and 512. Bytes are the
`wchar` delta (what the rank wrote to its sockets); the needed-only minimum counts the
rows a rank owns that others' windowed queries see plus the gradients of the rows it
received. Writes docs/bench_windows.md.
"""

from __future__ import annotations

import pathlib
import sys
import time

import torch

from blockdiag_cp.testing import doc_ids_from_lengths, spawn
from blockdiag_cp.tools.bench import attention_leaves, bytes_written, doc_lengths

S, H, D = 32768, 8, 64
ROWS = {"one document": doc_lengths("one", S), "300 power-law docs": doc_lengths("powerlaw:300", S)}
WINDOWS = (None, 4096, 512)


def worker(rank, world, segments, layout):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp import CPConfig, cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"]
    ids = doc_ids_from_lengths(segments).unsqueeze(0)
    out = {}
    for window in WINDOWS:
        x = torch.randn(1, S, 3 * H * D, generator=torch.Generator().manual_seed(0))
        ctx, batch = make_cp_blockdiag_batch_and_ctx(mesh, None, {"inputs_embeds": x, "_packed_seq_ids": ids},
                                                     config=CPConfig(layout=layout))
        q, k, v = attention_leaves(batch["inputs_embeds"], H, H, D)
        dist.barrier()
        with ctx() as state:
            t0, w0 = time.perf_counter(), bytes_written()
            cp_blockdiag_sdpa(q, k, v, sliding_window=window).square().mean().backward()
            sent = bytes_written() - w0
            dist.barrier()
            seconds = time.perf_counter() - t0
        geometry, mine = state.geometry, state.geometry.owner == rank
        need = geometry.need_at(torch.arange(mine.numel()), window)
        minimum = sum(int((need[j] & mine).sum()) for j in range(world) if j != rank) + int((need[rank] & ~mine).sum())
        out[window] = {"sent": sent, "min": minimum * 2 * H * D * 4, "seconds": seconds,
                       "ran": state.exchange_for(window).name}
    return out


def main() -> int:
    lines = ["| row | layout | cp | window | exchange | MB sent, max rank | needed-only minimum MB | x minimum | fwd+bwd s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (name, segments), layout, world in ((r, lay, w) for r in ROWS.items() for lay in ("contiguous", "balanced")
                                            for w in (2, 4)):
        per_rank = spawn(worker, world, segments, layout, timeout=1800)
        for window in WINDOWS:
            rows = [r[window] for r in per_rank]
            sent, minimum = max(r["sent"] for r in rows) / 1e6, max(r["min"] for r in rows) / 1e6
            ratio = f"{sent / minimum:.3f}" if minimum else "-"
            lines.append(f"| {name} | {layout} | {world} | {window or 'full causal'} | {rows[0]['ran']} | {sent:.2f} | "
                         f"{minimum:.2f} | {ratio} | {max(r['seconds'] for r in rows):.3f} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines)
    out = pathlib.Path(__file__).resolve().parent.parent / "docs" / "bench_windows.md"
    out.write_text(f"# Sliding-window layers (CPU, gloo, S={S}, fp32, 8 heads of 64, auto exchange)\n\n{text}\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
