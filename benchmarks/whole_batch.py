"""The whole-batch step on this machine: dp 2 x cp 2 fixed rows against one grouped plan over the 4 ranks.

    python benchmarks/whole_batch.py              # a tiny Llama and a hybrid, 3 measured steps each
    python benchmarks/whole_batch.py --model llama --steps 2

One global batch with a heavy tail: replica 0's row holds a 14,336-token document beside a few
short ones, replica 1's row only short ones (16,384 tokens each; best-fit-decreasing packing puts
them like this). Both
plans train the same 4-layer model on it, on 4 gloo processes of one thread each:

- fixed rows: each replica's row on its own CP group of 2 (`make_cp_blockdiag_batch_and_ctx`,
  the balanced layout);
- grouped: every document of both rows over all 4 ranks (`make_cp_world_batch_and_ctx`).

Each rank's busy seconds per step are its process CPU time over the step (sharding, forward,
backward; a rank waiting in a collective is not busy), the median of the measured steps after a
warm-up; bytes per rank are what it wrote (``wchar``, sockets included). The planner's costs are
measured here first, forward + backward on one thread: rows of 256, 16 and 1 documents of 4096
tokens in one process give this model's seconds per token, per attention pair and per document
piece on this CPU; one document at cp 2 gives the extra of a piece that continues a document on
another rank (a hybrid's recurrences rerun it from an identity state).

Goals (issue #36): grouped max <= 0.75 x fixed rows' max, and <= 1.10 x its own mean.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time
import warnings

import torch

from blockdiag_cp.testing import spawn

ROWS = (
    (14336, 1024, 512, 256, 128, 64, 64),  # the long document's row (16,384 tokens), as the 30k against 1k
    (1024, 1024, 1024, 1024, 1024, 896, 768, 640, 512, 512, 448, 448, 384, 384, 384, 320, 320, 256, 256, 256, 256, 256,
     256, 256, 192,
     192, 192, 192, 192, 160, 160, 160, 128, 128, 128, 128, 128, 128, 128, 96, 96, 96, 96, 64, 64, 64, 64, 64, 64,
     64, 32, 32, 32, 32, 32, 32, 16, 16, 16, 16, 8, 8, 8, 8),
)
VOCAB = 512
LLAMA = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=16384)
HYBRID = dict(LLAMA, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
              linear_value_head_dim=64, linear_conv_kernel_dim=4,
              layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
GOAL_MAX, GOAL_SPREAD = 0.75, 1.10


def build(kind: str):
    import transformers

    import blockdiag_cp.hf  # noqa: F401

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "llama":
            config = transformers.LlamaConfig(**LLAMA)
            config._attn_implementation = "blockdiag_cp"
            return transformers.LlamaForCausalLM(config)
        config = transformers.Qwen3_5TextConfig(**HYBRID)
        config._attn_implementation = "blockdiag_cp"
        model = transformers.Qwen3_5ForCausalLM(config)
        blockdiag_cp.hf.prepare_model(model)
        return model


def row_batch(lengths, seed: int):
    from blockdiag_cp.loss import add_shift_labels
    from blockdiag_cp.testing import doc_ids_from_lengths

    g = torch.Generator().manual_seed(seed)
    ids = doc_ids_from_lengths(lengths).unsqueeze(0)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    return add_shift_labels({"input_ids": torch.randint(0, VOCAB, ids.shape, generator=g), "position_ids": positions,
                             "_packed_seq_ids": ids})


def one_step(model, batch, make):
    """Shard, forward, backward (the loss: the row's token sum; its scale does not change the time)."""
    ctx, shard = make(dict(batch))
    with ctx():
        logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[0], shard["shift_labels"][0], reduction="sum")
        loss.backward()
    model.zero_grad(set_to_none=True)


N = 4096  # tokens of each calibration row


def timed_steps(model, batch, make, repeats: int = 3) -> float:
    """Median process seconds of `repeats` steps after a warm-up."""
    one_step(model, batch, make)
    runs = []
    for _ in range(repeats):
        t0 = time.process_time()
        one_step(model, batch, make)
        runs.append(time.process_time() - t0)
    return statistics.median(runs)


def measure_costs(kind: str):
    """`StepCosts` of `kind` on this CPU (one thread, forward + backward): token, pair and piece seconds from
    three rows in this process, the continuing piece's extra from one document at cp 2."""
    import numpy as np

    from blockdiag_cp import make_cp_blockdiag_batch_and_ctx
    from blockdiag_cp.parallel import keep_cpu_heap
    from blockdiag_cp.plan import StepCosts

    torch.set_num_threads(1)
    keep_cpu_heap()
    model = build(kind)
    rows = [(16,) * (N // 16), (256,) * (N // 256), (N,)]
    seconds = [timed_steps(model, row_batch(r, 0), lambda b: make_cp_blockdiag_batch_and_ctx(None, None, b))
               for r in rows]
    terms = np.array([[N, sum(m * (m + 1) / 2 for m in r), len(r)] for r in rows], dtype=np.float64)
    token, pair, piece = np.maximum(np.linalg.solve(terms, np.array(seconds)), 0.0)
    t0, t1 = spawn(carry_worker, 2, kind)
    h = N // 2  # rank 1 holds the continuing half: its rectangle (0.88 a pair) and its rerun recurrences
    carry = max(0.0, (t1 - t0 - pair * 0.88 * h * h) / h)
    attention_layers = 4 if kind == "llama" else 2
    kv_bytes = 4 * 2 * 64 * 2 * attention_layers  # fp32, 2 K/V heads of 64, K and V
    return StepCosts(token_seconds=float(token), pair_seconds=float(pair), piece_seconds=float(piece),
                     carry_seconds=carry, kv_bytes_per_token=float(kv_bytes), intra_gbps=1.0, inter_gbps=1.0)


def carry_worker(rank: int, world: int, kind: str) -> float:
    """Process seconds of this rank's half of one document at cp 2 (contiguous: rank 1 continues it)."""
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp import CPConfig, make_cp_blockdiag_batch_and_ctx
    from blockdiag_cp.parallel import keep_cpu_heap

    torch.set_num_threads(1)
    keep_cpu_heap()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    return timed_steps(build(kind), row_batch((N,), 0), lambda b: make_cp_blockdiag_batch_and_ctx(
        mesh["cp"], None, b, config=CPConfig(layout="contiguous")))


def worker(rank: int, world: int, kind: str, costs, steps: int):
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp import CPConfig, PlanOptions, make_cp_blockdiag_batch_and_ctx, make_cp_world_batch_and_ctx
    from blockdiag_cp.parallel import keep_cpu_heap
    from blockdiag_cp.tools.bench import bytes_written

    torch.set_num_threads(1)
    keep_cpu_heap()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    model = build(kind)
    batch = row_batch(ROWS[mesh.get_local_rank("dp")], seed=mesh.get_local_rank("dp"))
    plans = {
        "fixed rows (dp 2 x cp 2, balanced)": lambda b: make_cp_blockdiag_batch_and_ctx(
            mesh["cp"], None, b, config=CPConfig(layout="balanced")),
        "grouped over the 4 ranks": lambda b: make_cp_world_batch_and_ctx(
            mesh, b, config=CPConfig(layout="grouped", plan=PlanOptions(costs=costs))),
    }
    out = {}
    for name, make in plans.items():
        one_step(model, batch, make)  # warm-up
        runs, sent = [], []
        for _ in range(steps):
            torch.distributed.barrier()
            t0, b0 = time.process_time(), bytes_written()
            one_step(model, batch, make)
            runs.append(time.process_time() - t0)
            sent.append(bytes_written() - b0)
        out[name] = (statistics.median(runs), statistics.median(sent))
    return out


def run(kind: str, steps: int) -> list[str]:
    costs = measure_costs(kind)
    print(f"{kind}: measured {costs.token_seconds * 1e6:.1f} us per token, {costs.pair_seconds * 1e9:.2f} ns per "
          f"pair (a token costs {costs.pairs_per_token:.0f} pairs), {costs.piece_seconds * 1e3:.2f} ms per piece, "
          f"{costs.carry_seconds * 1e6:.1f} us per continuing token", flush=True)
    per_rank = spawn(worker, 4, kind, costs, steps, timeout=3600)
    lines, maxima = [], {}
    for name in per_rank[0]:
        busy = [r[name][0] for r in per_rank]
        sent = [r[name][1] for r in per_rank]
        maxima[name] = max(busy)
        lines.append(f"| {kind} | {name} | {' / '.join(f'{b:.2f}' for b in busy)} | {max(busy):.2f} | "
                     f"{max(busy) / statistics.mean(busy):.3f} | {max(sent) / 1e6:.1f} |")
    fixed, grouped = maxima.values()
    spread = float(lines[-1].split("|")[5])
    verdict = "ok" if grouped <= GOAL_MAX * fixed and spread <= GOAL_SPREAD else "OVER"
    lines.append(f"| {kind} | grouped max / fixed max | | {grouped / fixed:.3f} | | | {verdict} |")
    for line in lines:
        print(line, flush=True)
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("llama", "hybrid", "both"), default="both")
    p.add_argument("--steps", type=int, default=3, help="measured steps per plan (after one warm-up)")
    args = p.parse_args()
    header = ["| model | plan | busy s per step, ranks 0-3 | max | max/mean | MB sent/rank (max) |",
              "|---|---|---|---|---|---|"]
    print("\n".join(header), flush=True)
    kinds = ("llama", "hybrid") if args.model == "both" else (args.model,)
    lines = [line for kind in kinds for line in run(kind, args.steps)]
    if args.model == "both":
        out = pathlib.Path(__file__).resolve().parent.parent / "docs" / "bench_whole_batch.md"
        out.write_text("# The whole-batch step: fixed rows against the grouped plan (world 4, fp32, gloo, one thread "
                       "per rank)\n\n`python benchmarks/whole_batch.py`\n\n" + "\n".join(header + lines) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
