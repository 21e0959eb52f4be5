"""``blockdiag-cp demo``: train a tiny Llama on packed real text under CP, beside the reference.

The documents are the docstrings of Python's standard library (no downloads), one
module per document, byte-tokenized. Each step packs documents of mixed length into
one row. The reference run is transformers' own: the unsharded row in one process
with ``attn_implementation="sdpa"`` (which masks packed rows by their restarting
``position_ids``). The CP run shards the same row over ``--world`` gloo processes
with ``attn_implementation="blockdiag_cp"``. Same initial weights, same batches,
same optimizer: the per-step losses must agree.

The CP ranks train two models side by side on the same rows: one under ``--layout``
(default ``balanced``: equal attention work per rank) and one under the layout it is
compared with (the seed's ``contiguous``; ``balanced`` when ``--layout contiguous``),
taking turns step by step. Both must match the reference; the report shows each
layout's attention work and bytes per rank and its measured step time.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import random
import statistics
import time
from typing import TYPE_CHECKING, Any, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch

if TYPE_CHECKING:
    from ..config import CPConfig

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


def make_model(attn_implementation: str, dtype: torch.dtype, layers: int = 2):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=layers, num_attention_heads=4,
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
    layers: int = 2,
) -> dict[str, Any]:
    """The run without any parallelism, in one process: transformers' SDPA on the unsharded rows.

    Step ``t`` takes row ``t`` of every stream (the rows the dp replicas train on together) and
    their token mean; AdamW; a Llama of `layers` decoder layers. Returns ``{"losses": [...], "grads": {name: the last step's},
    "params": {name: final}}``: what the examples' parallel runs are compared with.
    """
    model = make_model("sdpa", dtype, layers)
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


def compared_layouts(layout: str) -> tuple[str, ...]:
    """The layouts the demo trains on the same rows: `layout` (the verdict's run), then the one it is
    compared with: the seed's ``contiguous``, or ``balanced`` when `layout` is the seed's."""
    return (layout, "balanced" if layout == "contiguous" else "contiguous")


@dataclass
class _LayoutRun:
    """One CP training run of the demo on one rank: its layout's config, model and optimizer."""

    config: "CPConfig"
    model: torch.nn.Module
    opt: torch.optim.Optimizer


def cp_worker(rank: int, world: int, rows, dtype_name, layouts, exchange, kernel, reference):
    """One CP rank: train one model per layout on the same rows (the layouts in turns, each step
    starting with the other one), sharding each row, summing gradients over CP; each step timed."""
    from torch.distributed.device_mesh import init_device_mesh

    from .. import CPConfig
    from .. import hf  # noqa: F401  (registers attn_implementation="blockdiag_cp")

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    dtype = getattr(torch, dtype_name)
    runs = {}
    for layout in layouts:
        model = make_model("blockdiag_cp", dtype)
        runs[layout] = _LayoutRun(CPConfig(layout=layout, kv_exchange=exchange, kernel=kernel), model, _optimizer(model))
    log: dict[str, list[dict[str, Any]]] = {layout: [] for layout in layouts}
    for step, row in enumerate(rows):
        for layout in (layouts if step % 2 == 0 else layouts[::-1]):
            log[layout].append(_train_step(runs[layout], row, mesh["cp"], dtype))
        if rank == 0:
            losses = {layout: log[layout][-1]["loss"] for layout in layouts}
            print(_step_line(step, len(rows), losses, reference[step], LOSS_TOL[dtype_name]), flush=True)
    return log


def _train_step(run: _LayoutRun, row: PackedRow, cp_mesh, dtype: torch.dtype) -> dict[str, Any]:
    """One training step of `run` on `row`; what the report reads. The step time runs from a barrier
    to a barrier: the CP group's step (batch, forward, backward, gradient all-reduce, optimizer)."""
    import torch.distributed as dist

    from .. import make_cp_blockdiag_batch_and_ctx
    from ..loss import add_shift_labels, token_mean_loss
    from ..parallel import reduce_gradients
    from .bench import bytes_written

    group, model = cp_mesh.get_group(), run.model
    batch = add_shift_labels({"input_ids": row.input_ids.clone(), "position_ids": row.position_ids.clone()})
    dist.barrier(group=group)
    start, before = time.perf_counter(), bytes_written()
    train_ctx, batch = make_cp_blockdiag_batch_and_ctx(cp_mesh, None, batch, config=run.config)
    with train_ctx() as state:
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        targets = batch["shift_labels"][0]
        loss_sum = torch.nn.functional.cross_entropy(logits[0].float(), targets, ignore_index=-100, reduction="sum")
        loss, value = token_mean_loss(loss_sum, (targets != -100).sum(), group)
        run.opt.zero_grad()
        loss.backward()
    sent = bytes_written() - before  # forward + backward: K/V exchange and the loss reduction
    reduce_gradients(model.parameters(), cp_mesh)
    run.opt.step()
    dist.barrier(group=group)
    seconds = time.perf_counter() - start
    kv = state.traffic.bytes(model.config.num_key_value_heads, model.config.head_dim, dtype)
    return {"loss": value.item(), "sent_bytes": sent, "work": state.work_per_rank().tolist(),
            "kv_bytes_planned": model.config.num_hidden_layers * kv.sent, "seconds": seconds,
            "exchange": state.exchange.name, "kernel": state.kernel.name}


def _step_line(step: int, steps: int, losses: dict[str, float], reference: float, tol: float) -> str:
    """One step's losses beside the reference's, and one verdict for all of them."""
    diffs = {layout: abs(value - reference) for layout, value in losses.items()}
    ok = all(diff <= tol * max(1.0, abs(reference)) for diff in diffs.values())
    cells = "   ".join(f"{layout} {value:.6f} (|diff| {diffs[layout]:.1e})" for layout, value in losses.items())
    return f"  step {step + 1:>3}/{steps}  reference {reference:.6f}   {cells}   {'match' if ok else 'MISMATCH'}"


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
    layouts = compared_layouts(args.layout)
    print(f"CP: {args.world} gloo processes, layout={layouts[0]} (and beside it, on the same rows, "
          f"layout={layouts[1]}), exchange={args.exchange}, kernel={args.kernel}, attn_implementation='blockdiag_cp'",
          flush=True)
    logs = spawn(cp_worker, args.world, rows, dtype_name, layouts, args.exchange, args.kernel, reference, timeout=900)
    tol = LOSS_TOL[dtype_name]
    cp = {layout: [entry["loss"] for entry in logs[0][layout]] for layout in layouts}
    worst = max(abs(a - b) / max(1.0, abs(b)) for losses in cp.values() for a, b in zip(losses, reference))
    ok = worst <= tol
    _summary(logs, rows, layouts)
    print(_plot(os.path.join(args.out, PNG_NAME), cp, reference, logs, layouts))
    print(f"verdict: {'MATCH' if ok else 'MISMATCH'} ({' and '.join(layouts)}; largest relative loss difference "
          f"{worst:.1e}, tolerance {tol:.0e}); {time.perf_counter() - start:.0f}s")
    return 0 if ok else 1


def step_seconds(logs, layout: str) -> list[float]:
    """Each step's time of `layout`: the slowest rank's (the CP group waits for it)."""
    return [max(logs[r][layout][i]["seconds"] for r in range(len(logs))) for i in range(len(logs[0][layout]))]


def _sent_kB(logs, layout: str) -> list[float]:
    """Per rank: measured bytes sent per step (forward + backward), in kB."""
    return [sum(e["sent_bytes"] for e in logs[r][layout]) / len(logs[r][layout]) / 1e3 for r in range(len(logs))]


def _summary(logs, rows, layouts: tuple[str, ...]) -> None:
    """The verdict's layout rank by rank (the last step), then the compared layout, then both step times."""
    world, main, other = len(logs), layouts[0], layouts[1]
    last = logs[0][main][-1]
    work = last["work"]
    mean = sum(work) / len(work)
    print(f"last step: documents {list(rows[-1].lengths)}; layout={main} exchange={last['exchange']} "
          f"kernel={last['kernel']}")
    sent = _sent_kB(logs, main)
    for r in range(world):
        planned = sum(e["kv_bytes_planned"] for e in logs[r][main]) / len(logs[r][main])
        print(f"  rank {r}: attention work {work[r]} ({work[r] / mean:.2f}x mean); per step, forward+backward: "
              f"K/V exchange planned {planned / 1e3:.1f} kB, measured sent {sent[r]:.1f} kB")
    other_last = logs[0][other][-1]
    other_work = other_last["work"]
    other_mean = sum(other_work) / len(other_work)
    print(f"the same rows, layout={other} (exchange={other_last['exchange']}): attention work per rank "
          f"{' / '.join(f'{w / other_mean:.2f}' for w in other_work)} of the mean; sent per step "
          f"{' / '.join(f'{kB:.1f}' for kB in _sent_kB(logs, other))} kB")
    print(f"busiest rank's attention work over the mean, averaged over the {len(rows)} steps: "
          + ", ".join(f"{layout} {_busiest(logs, layout):.2f}" for layout in layouts))
    times = {layout: statistics.median(step_seconds(logs, layout)) for layout in layouts}
    print("measured step time (batch, forward, backward, gradient all-reduce, optimizer; median over the steps, "
          "slowest rank): " + ", ".join(f"{layout} {1e3 * t:.1f} ms" for layout, t in times.items())
          + f"; {other} takes {times[other] / times[main]:.2f}x {main}'s")


def _busiest(logs, layout: str) -> float:
    """The busiest rank's attention work over the mean, averaged over the steps."""
    ratios = [max(e["work"]) * len(e["work"]) / sum(e["work"]) for e in logs[0][layout]]
    return sum(ratios) / len(ratios)


def _plot(path: str, cp: dict[str, list[float]], reference: list[float], logs, layouts: tuple[str, ...]) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return "no plot written (pip install matplotlib)"
    world = len(logs)
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    (loss_ax, work_ax), (sent_ax, time_ax) = axes
    steps = range(1, len(reference) + 1)
    loss_ax.plot(steps, reference, "o-", label="reference (transformers, 1 process)")
    for layout, marker in zip(layouts, ("x--", "+:")):
        loss_ax.plot(steps, cp[layout], marker, label=f"blockdiag-cp, {layout} ({world} ranks)")
    loss_ax.set(title="training loss", xlabel="step", ylabel="loss")
    loss_ax.legend()
    width = 0.8 / len(layouts)
    for i, layout in enumerate(layouts):
        ranks = [r + (i - (len(layouts) - 1) / 2) * width for r in range(world)]
        work_ax.bar(ranks, logs[0][layout][-1]["work"], width, label=layout)
        sent_ax.bar(ranks, _sent_kB(logs, layout), width, label=layout)
        time_ax.plot(steps, [1e3 * t for t in step_seconds(logs, layout)], ".-",
                     label=f"{layout} (median {1e3 * statistics.median(step_seconds(logs, layout)):.1f} ms)")
    work_ax.axhline(sum(logs[0][layouts[0]][-1]["work"]) / world, color="gray", linestyle="--", label="mean")
    work_ax.set(title="attention work per rank, same row (last step)", xlabel="rank", ylabel="query-key pairs")
    sent_ax.set(title="bytes sent per step, forward+backward", xlabel="rank", ylabel="kB")
    time_ax.set(title="measured step time (slowest rank)", xlabel="step", ylabel="ms")
    for ax in (work_ax, sent_ax):
        ax.set_xticks(range(world))
    for ax in (work_ax, sent_ax):
        ax.set_ylim(top=1.25 * ax.get_ylim()[1])  # room for the legend above the bars
        ax.legend(loc="upper center", ncol=3)
    time_ax.legend()
    for ax in (loss_ax, time_ax):
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"wrote {path}"
