"""``blockdiag-cp demo``: train a tiny Llama on packed real text under CP, beside the reference.

The documents are the docstrings of Python's standard library (no downloads), one
module per document, byte-tokenized. Each step packs documents of mixed length into
one row. The reference run is transformers' own: the unsharded row in one process
with ``attn_implementation="sdpa"`` (which masks packed rows by their restarting
``position_ids``). The CP run shards the same row over ``--world`` gloo processes
with ``attn_implementation="blockdiag_cp"``. Same initial weights, same batches,
same optimizer: the per-step losses must agree.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import random
import time
from typing import Any, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch

STDLIB_MODULES = (
    "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "collections", "contextlib", "copy", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "doctest", "enum", "fnmatch", "fractions", "functools",
    "glob", "gzip", "hashlib", "heapq", "hmac", "inspect", "io", "itertools", "json", "logging", "operator",
    "pathlib", "pickle", "pprint", "queue", "random", "re", "sched", "secrets", "shlex", "shutil", "socket",
    "statistics", "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit",
    "tokenize", "traceback", "typing", "unittest", "uuid", "weakref", "zipfile",
)
VOCAB = 257  # bytes + one separator
PNG_NAME = "demo.png"  # written into --out
LOSS_TOL = MappingProxyType({"float64": 1e-9, "float32": 2e-4})


def stdlib_documents() -> list[bytes]:
    """One document per module: its docstring and its public members' docstrings."""
    docs = []
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        parts = [inspect.getdoc(module) or ""]
        for attr in sorted(vars(module)):
            obj = getattr(module, attr)
            if not attr.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj)):
                parts.append(inspect.getdoc(obj) or "")
        text = "\n\n".join(p for p in parts if p)
        if len(text) > 200:
            docs.append(text.encode("utf-8", "replace"))
    return docs


@dataclass(frozen=True)
class PackedRow:
    """One packed training row: ``input_ids``, restarting ``position_ids``, per-document next-token targets."""

    input_ids: torch.Tensor  # [1, S]
    position_ids: torch.Tensor  # [1, S]
    targets: torch.Tensor  # [1, S], -100 where no next token in the document
    lengths: tuple[int, ...]


def pack_rows(docs: list[bytes], steps: int, seq_len: int, seed: int = 0) -> list[PackedRow]:
    """Fill each row with document excerpts of random length (16 .. seq_len / 2)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(steps):
        ids, pos, tgt, lengths = [], [], [], []
        while len(ids) < seq_len:
            doc = docs[rng.randrange(len(docs))]
            n = min(rng.randint(16, max(16, seq_len // 2)), seq_len - len(ids), len(doc))
            start = rng.randrange(len(doc) - n + 1)
            piece = list(doc[start : start + n])
            ids += piece
            pos += list(range(n))
            tgt += piece[1:] + [-100]
            lengths.append(n)
        rows.append(PackedRow(*(torch.tensor([x]) for x in (ids, pos, tgt)), tuple(lengths)))
    return rows


def make_model(attn_implementation: str, dtype: torch.dtype):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, attn_implementation=attn_implementation,
    )
    return transformers.LlamaForCausalLM(config).to(dtype)


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)


def reference_losses(rows: list[PackedRow], dtype: torch.dtype) -> list[float]:
    """transformers alone: the unsharded packed row, SDPA, masks from position_ids."""
    return train_unsharded([rows], dtype, weight_decay=0.0)["losses"]


def train_unsharded(
    streams: Sequence[Sequence[PackedRow]], dtype: torch.dtype, lr: float = 3e-3, weight_decay: float = 0.01,
) -> dict[str, Any]:
    """The run without any parallelism, in one process: transformers' SDPA on the unsharded rows.

    Step ``t`` takes row ``t`` of every stream (the rows the dp replicas train on together) and
    their token mean; AdamW. Returns ``{"losses": [...], "grads": {name: the last step's},
    "params": {name: final}}``: what the examples' parallel runs are compared with.
    """
    model = make_model("sdpa", dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    losses = []
    for rows in zip(*streams):
        loss_sum, tokens = 0.0, 0
        for row in rows:
            logits = model(input_ids=row.input_ids, position_ids=row.position_ids, use_cache=False).logits
            loss_sum = loss_sum + torch.nn.functional.cross_entropy(
                logits[0].to(torch.promote_types(dtype, torch.float32)), row.targets[0], ignore_index=-100,
                reduction="sum")
            tokens += int((row.targets != -100).sum())
        loss = loss_sum / tokens
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def cp_worker(rank: int, world: int, rows, dtype_name, layout, exchange, kernel, reference):
    """One CP rank: shard each row, forward/backward through blockdiag_cp, sum gradients over CP."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from .. import CPConfig, make_cp_blockdiag_batch_and_ctx
    from .. import hf  # noqa: F401  (registers attn_implementation="blockdiag_cp")
    from ..loss import add_shift_labels, token_mean_loss
    from .bench import bytes_written

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    group = mesh["cp"].get_group()
    dtype = getattr(torch, dtype_name)
    model = make_model("blockdiag_cp", dtype)
    opt = _optimizer(model)
    config = CPConfig(layout=layout, kv_exchange=exchange, kernel=kernel)
    tol = LOSS_TOL[dtype_name]
    log = []
    for step, row in enumerate(rows):
        batch = add_shift_labels({"input_ids": row.input_ids.clone(), "position_ids": row.position_ids.clone()})
        before = bytes_written()
        train_ctx, batch = make_cp_blockdiag_batch_and_ctx(mesh["cp"], None, batch, config=config)
        with train_ctx() as state:
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
            targets = batch["shift_labels"][0]
            loss_sum = torch.nn.functional.cross_entropy(logits[0].float(), targets, ignore_index=-100, reduction="sum")
            loss, value = token_mean_loss(loss_sum, (targets != -100).sum(), group)
            opt.zero_grad()
            loss.backward()
        sent = bytes_written() - before  # forward + backward: K/V exchange and the loss reduction
        for p in model.parameters():
            dist.all_reduce(p.grad, group=group)
        opt.step()
        kv = state.traffic.bytes(model.config.num_key_value_heads, model.config.head_dim, dtype)
        layers = model.config.num_hidden_layers
        log.append({"loss": value.item(), "sent_bytes": sent, "work": state.work_per_rank().tolist(),
                    "kv_bytes_planned": layers * kv.sent,
                    "exchange": state.exchange.name, "kernel": state.kernel.name})
        if rank == 0:
            diff = abs(value.item() - reference[step])
            verdict = "match" if diff <= tol * max(1.0, abs(reference[step])) else "MISMATCH"
            print(f"  step {step + 1:>3}/{len(rows)}  cp loss {value.item():.6f}   reference {reference[step]:.6f}   "
                  f"|diff| {diff:.1e}  {verdict}", flush=True)
    return log


def run_demo(args: argparse.Namespace) -> int:
    from ..testing import spawn

    dtype_name = getattr(args, "dtype", "float32")
    start = time.perf_counter()
    docs = stdlib_documents()
    rows = pack_rows(docs, args.steps, args.seq_len)
    print(f"blockdiag-cp demo: tiny Llama (2 layers, 4 heads / 2 K/V heads), {args.steps} steps of one packed row "
          f"of {args.seq_len} tokens from {len(docs)} Python stdlib docstrings, {dtype_name}")
    print("reference: transformers alone, unsharded, attn_implementation='sdpa' ...", flush=True)
    dtype = getattr(torch, dtype_name)
    reference = reference_losses(rows, dtype)
    print(f"CP: {args.world} gloo processes, layout={args.layout}, exchange={args.exchange}, kernel={args.kernel}, "
          f"attn_implementation='blockdiag_cp'", flush=True)
    logs = spawn(cp_worker, args.world, rows, dtype_name, args.layout, args.exchange, args.kernel, reference, timeout=900)
    tol = LOSS_TOL[dtype_name]
    cp = [entry["loss"] for entry in logs[0]]
    worst = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(cp, reference))
    ok = worst <= tol
    _summary(logs, rows)
    print(_plot(os.path.join(args.out, PNG_NAME), cp, reference, logs))
    print(f"verdict: {'MATCH' if ok else 'MISMATCH'} (largest relative loss difference {worst:.1e}, tolerance {tol:.0e}); "
          f"{time.perf_counter() - start:.0f}s")
    return 0 if ok else 1


def _summary(logs, rows) -> None:
    world = len(logs)
    last = [logs[r][-1] for r in range(world)]
    work = last[0]["work"]
    mean = sum(work) / len(work)
    print(f"last step: documents {list(rows[-1].lengths)}; exchange={last[0]['exchange']} kernel={last[0]['kernel']}")
    for r in range(world):
        avg_sent = sum(e["sent_bytes"] for e in logs[r]) / len(logs[r])
        planned = sum(e["kv_bytes_planned"] for e in logs[r]) / len(logs[r])
        print(f"  rank {r}: attention work {work[r]} ({work[r] / mean:.2f}x mean); per step, forward+backward: "
              f"K/V exchange planned {planned / 1e3:.1f} kB, measured sent {avg_sent / 1e3:.1f} kB")


def _plot(path: str, cp: list[float], reference: list[float], logs) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot written (pip install matplotlib)"
    world = len(logs)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    steps = range(1, len(cp) + 1)
    axes[0].plot(steps, reference, "o-", label="reference (transformers, 1 process)")
    axes[0].plot(steps, cp, "x--", label=f"blockdiag-cp ({world} ranks)")
    axes[0].set(title="training loss", xlabel="step", ylabel="loss")
    axes[0].legend()
    axes[1].bar(range(world), logs[0][-1]["work"])
    axes[1].set(title="attention work per rank (last step)", xlabel="rank", ylabel="query-key pairs")
    sent = [sum(e["sent_bytes"] for e in logs[r]) / len(logs[r]) / 1e3 for r in range(world)]
    axes[2].bar(range(world), sent)
    axes[2].set(title="bytes sent per step, forward+backward", xlabel="rank", ylabel="kB")
    for ax in axes[1:]:
        ax.set_xticks(range(world))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"wrote {path}"
