"""What torch.compile buys a CP training step on CPU, and that changing rows do not recompile.

    python benchmarks/compile_step.py                      # cp 2, inductor and aot_eager
    python benchmarks/compile_step.py --backends aot_eager # the quick one (no C++ build)

On 2 gloo processes (one thread each) a tiny Llama (4 layers, hidden 256, 8 query and 4 K/V
heads) trains on packed rows of 2,048 tokens (power-law documents, a new cut every step),
forward and backward, in two copies with the same weights in the same run: one eager, one
with every decoder layer compiled ``fullgraph=True`` (torchtitan's pattern). Steps alternate
between the two, so both see the same machine noise; the median of the timed steps counts,
the slowest rank's. Printed per backend: eager and compiled seconds per step, their ratio,
the largest loss difference between the two copies, and the compiled graphs counted after
the warm-up, after the timed steps (rows of the same length, other documents: no new graph),
and after rows of changing lengths (the length becomes dynamic: one recompile, then none).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from blockdiag_cp.tools.bench import doc_lengths

SEQ_LEN, WARMUP, TIMED, CHANGING = 2048, 2, 8, 5


def make_model(hidden: int = 256, heads: int = 8, layers: int = 4, dtype: torch.dtype = torch.float32,
               device: str = "cpu"):
    """A Llama of `layers` blocks, `heads` query heads (half as many K/V heads) of 32, MLP 2.75x."""
    import transformers

    import blockdiag_cp.hf  # noqa: F401

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=heads // 2, max_position_embeddings=1 << 17,
                                      attn_implementation="blockdiag_cp")
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype)


def row(step: int, seq_len: int = SEQ_LEN, device: str = "cpu") -> dict:
    lengths = doc_lengths("powerlaw:12", seq_len, seed=step)
    ids = torch.randint(0, 512, (1, seq_len), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids.to(device),
            "position_ids": torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).to(device)}


def train_step(model, cp_mesh, batch: dict) -> tuple[float, float]:
    """``(seconds, loss)`` of one forward and backward under CP (`cp_mesh` None: a one-process step)."""
    from blockdiag_cp import make_cp_blockdiag_batch_and_ctx
    from blockdiag_cp.loss import add_shift_labels

    batch = add_shift_labels({k: v.clone() for k, v in batch.items()})
    if batch["input_ids"].is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    train_ctx, batch = make_cp_blockdiag_batch_and_ctx(cp_mesh, None, batch)
    with train_ctx():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[0].float(), batch["shift_labels"][0], ignore_index=-100,
                                                 reduction="sum")
        model.zero_grad(set_to_none=True)
        loss.backward()
    value = loss.item()  # a host sync: the step is done
    return time.perf_counter() - start, value


def rank_main(rank: int, world: int, backend: str) -> dict:
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    counters.clear()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    eager, compiled = make_model(), make_model()
    for layer in compiled.model.layers:
        layer.compile(backend=backend, fullgraph=True)
    compile_start = time.perf_counter()
    for step in range(WARMUP):
        train_step(compiled, mesh["cp"], row(step))
        train_step(eager, mesh["cp"], row(step))
    compile_seconds = time.perf_counter() - compile_start
    graphs = [counters["stats"]["unique_graphs"]]
    times, diffs = {"eager": [], "compiled": []}, []
    for step in range(WARMUP, WARMUP + TIMED):
        batch = row(step)
        t_eager, loss_eager = train_step(eager, mesh["cp"], batch)
        t_compiled, loss_compiled = train_step(compiled, mesh["cp"], batch)
        times["eager"].append(t_eager)
        times["compiled"].append(t_compiled)
        diffs.append(abs(loss_eager - loss_compiled) / abs(loss_eager))
    graphs.append(counters["stats"]["unique_graphs"])
    for step in range(CHANGING):
        train_step(compiled, mesh["cp"], row(100 + step, SEQ_LEN - 64 * (step + 1)))
    graphs.append(counters["stats"]["unique_graphs"])
    return {"eager": statistics.median(times["eager"]), "compiled": statistics.median(times["compiled"]),
            "loss_rel_diff": max(diffs), "graphs": graphs, "compile_s": compile_seconds,
            "breaks": sum(counters["graph_break"].values())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", nargs="+", default=["inductor", "aot_eager"])
    p.add_argument("--cp", type=int, default=2)
    args = p.parse_args()
    from blockdiag_cp.testing import spawn

    print(f"cp={args.cp}, rows of {SEQ_LEN} tokens (power-law documents), {TIMED} timed steps after {WARMUP} warm-up")
    print("| backend | eager s/step | compiled s/step | eager / compiled | loss rel. diff | graphs: warm, timed, "
          "changing lengths | graph breaks | warm-up s |")
    print("|---|---|---|---|---|---|---|---|")
    failed = False
    for backend in args.backends:
        ranks = spawn(rank_main, args.cp, backend, timeout=1800)
        eager = max(r["eager"] for r in ranks)
        compiled = max(r["compiled"] for r in ranks)
        graphs = ranks[0]["graphs"]
        ok = graphs[0] == graphs[1] and graphs[2] <= graphs[1] + 1 and all(r["breaks"] == 0 for r in ranks)
        failed |= not ok
        print(f"| {backend} | {eager:.3f} | {compiled:.3f} | {eager / compiled:.2f}x | "
              f"{max(r['loss_rel_diff'] for r in ranks):.1e} | {', '.join(map(str, graphs))} | "
              f"{max(r['breaks'] for r in ranks)} | {max(r['compile_s'] for r in ranks):.0f} |", flush=True)
    if failed:
        print("FAIL: a new row recompiled, or a graph broke")
    return int(failed)


if __name__ == "__main__":
    raise SystemExit(main())
