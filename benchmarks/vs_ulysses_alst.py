"""Side by side through transformers' Trainer: DeepSpeed's ALST (Ulysses SP) against the mixin, on packed rows.

    python benchmarks/vs_ulysses_alst.py                      # the issue's cases: ~10 min on 2 shared CPU cores
    python benchmarks/vs_ulysses_alst.py --rows uniform:16 powerlaw:20 --heads 8,12 --sp 2,4 --tokens 4096

The same tiny Llama (2 layers, heads of 16, hidden = 16 x heads, float32 by default, from its config) and the same
packed row (documents flattened by ``DataCollatorWithFlattening``: restarting ``position_ids``) train `--steps`
optimizer steps, one row a step, under DeepSpeed ZeRO (`--zero`, default 3: the same config for every run with
more than one rank) on `sp` CPU gloo ranks:

- *ALST*: ``TrainingArguments(parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=sp,
  sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation=ATTN)))``
  as transformers' "Ulysses sequence parallelism" page configures it, with `--attn` for ATTN (``sdpa``: the flash
  kernels it recommends need CUDA; accelerate refuses ``eager`` and ``flex_attention``). On CPU,
  ``deepspeed.init_distributed("gloo")`` must run before the Trainer (accelerate sets CPU runs up as MULTI_CPU,
  and DeepSpeed's SP groups need its comm). A fresh set of ranks per run: DeepSpeed makes its SP groups once a
  process.
- *balanced*: ``BlockDiagCPMixin`` with ``cp_size=sp``, ``CPConfig(layout="balanced")``;
- *ulysses*: the mixin with ``CPConfig(layout="balanced", heads=HeadsConfig(ulysses_degree=u))``, u = sp where
  the heads divide, else the largest u dividing both (a hybrid).

Per case (row x heads x sp) and method: **exact** = every logged loss and grad norm within the dtype's tolerance
(`TOLERANCES`: 1e-5 relative in float32) of the run without CP (plain Trainer, one process, sdpa with
transformers' packed-row mask), the gathered logits at the method's final parameters within 1e-4 (float32) of the
run without CP at those parameters, and the **leak** <= 1e-6 (float32): the largest change of any other document's
per-token loss when the first document's tokens are replaced (``-`` on a row of one document). **Bytes**: what a
rank sends (the ``wchar`` delta of /proc/self/io) inside the attention calls of one training step, forward and
backward (an identity autograd function brackets each call's q/k/v and output), divided by the layers; the busiest
rank, the last step. Outside the attention both pay the same ZeRO gradient traffic (not counted). **Step ms**:
median over steps after the first, slowest rank (**CPU ms**: the same of the rank's CPU time, all its threads:
less moved by other load on the machine). **Peak MiB**: the peak RSS of the last step above its start (``VmHWM``
reset at the step's beginning; the ranks return freed tensors of 64 KiB and more to the system), largest rank.

Last line: ``vs ALST: exact ours N/N, ALST M/N; bytes ours/ALST <range>; time ours/ALST <range>``: N counts the
cases (a case is exact for ours when both of our variants are); a case ALST refuses counts as not exact for it;
the ratios (step ms) range over every case ALST ran and each of our variants.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch

LAYERS, HEAD_DIM, VOCAB, LR = 2, 16, 257, 1e-3
ROWS = ("uniform:64", "uniform:3", "one")  # many short documents; a few long ones; one long document
METHODS = ("alst", "balanced", "ulysses")
#: exact: (logged loss / grad norm relative, logits absolute, leak absolute) per dtype
TOLERANCES = {"float32": (1e-5, 1e-4, 1e-6), "float64": (1e-6, 1e-8, 1e-12)}
TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests")


# ---- the row, its targets and the measures (no process group: tests/unit/test_vs_alst_bench.py) ----

def row_documents(spec: str, tokens: int, seed: int = 0) -> list[list[int]]:
    """Token ids of the documents of `spec` (``doc_lengths``' format), `tokens` in all; a padding tail (a negative
    length there) becomes one more document."""
    from blockdiag_cp.tools.bench import doc_lengths

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB - 1, (abs(n),), generator=g).tolist() for n in doc_lengths(spec, tokens, seed)]


def perturbed(docs: list[list[int]], victim: int = 0) -> list[list[int]]:
    """`docs` with every token of document `victim` replaced by another id (the leak probe's edit)."""
    out = [list(d) for d in docs]
    out[victim] = [(7 * t + 3) % (VOCAB - 2) + 1 for t in docs[victim]]
    return out


def next_token_targets(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """``[S]`` target of every position of a flattened row ``[S]``: the next token inside its document, -100 at a
    document's last position (where ``position_ids`` restarts at 0) and at the row's end."""
    targets = torch.full_like(input_ids, -100)
    same_doc = position_ids[1:] != 0
    targets[:-1] = torch.where(same_doc, input_ids[1:], -100)
    return targets


def token_losses(logits_SV: torch.Tensor, targets_S: torch.Tensor) -> torch.Tensor:
    """``[S]`` cross entropy of each position's logits against its target (0 where the target is -100)."""
    return torch.nn.functional.cross_entropy(logits_SV.double(), targets_S, ignore_index=-100, reduction="none")


def leak(before_S: torch.Tensor, after_S: torch.Tensor, lengths: list[int], victim: int = 0) -> float | None:
    """Largest |change| of a per-token loss outside document `victim` (its positions ``[start, start + n)``) when
    that document alone was edited; None when the row has no other document."""
    if len(lengths) < 2:
        return None
    start = sum(lengths[:victim])
    outside = torch.ones_like(before_S, dtype=torch.bool)
    outside[start:start + lengths[victim]] = False
    return float((after_S - before_S).abs()[outside].max())


def ratio_range(ratios: list[float]) -> str:
    """``"lo-hix"`` of positive ratios (3 significant digits), ``"n/a"`` if none."""
    return f"{min(ratios):.3g}-{max(ratios):.3g}x" if ratios else "n/a"


def summary_line(cases: list[dict]) -> str:
    """The last line (module docstring) of `cases`: each ``{"alst": result, "balanced": result, "ulysses": result}``,
    a result ``{"refused": msg}`` or ``{"exact": bool, "bytes": float, "ms": float}``."""
    ours_exact = sum(all(c[m].get("exact", False) for m in METHODS[1:]) for c in cases)
    alst_exact = sum(c["alst"].get("exact", False) for c in cases)
    ran = [c for c in cases if "refused" not in c["alst"]]
    bytes_ratios = [c[m]["bytes"] / c["alst"]["bytes"] for c in ran for m in METHODS[1:] if c["alst"]["bytes"] > 0]
    time_ratios = [c[m]["ms"] / c["alst"]["ms"] for c in ran for m in METHODS[1:]]
    n = len(cases)
    return (f"vs ALST: exact ours {ours_exact}/{n}, ALST {alst_exact}/{n}; bytes ours/ALST {ratio_range(bytes_ratios)}; "
            f"time ours/ALST {ratio_range(time_ratios)}")


def ulysses_degree(heads: int, sp: int) -> int:
    """Our Ulysses degree at `sp` ranks: sp where it divides the heads, else the largest degree dividing both."""
    return math.gcd(heads, sp)


# ---- one Trainer run ----

def tiny_llama(heads: int, kv_heads: int, tokens: int, dtype: str = "float64"):
    import transformers

    torch.manual_seed(0)
    hidden = heads * HEAD_DIM  # transformers' config check: the hidden size a multiple of the heads
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=LAYERS, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                      head_dim=HEAD_DIM, max_position_embeddings=tokens)
    model = transformers.LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.set_attn_implementation("sdpa")
    return model


def collate(items: list[dict]) -> dict:
    """One flattened row of the items' documents (input_ids, labels, position_ids ``[1, S]``)."""
    import transformers

    return transformers.DataCollatorWithFlattening()(
        [{"input_ids": d, "labels": d} for item in items for d in item["documents"]])


class _Bracket(torch.autograd.Function):
    """Identity on tensors; marks where an attention call begins and ends, forward and backward."""

    @staticmethod
    def forward(ctx, meter, opens, *tensors):
        ctx.meter, ctx.opens = meter, opens
        meter.begin() if opens else meter.end()
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.meter.end() if ctx.opens else ctx.meter.begin()  # backward runs the call's end first
        return (None, None, *grads)


class AttentionBytes:
    """Bytes this rank writes inside attention calls (forward and backward), summed since `reset`."""

    def __init__(self):
        self.total, self.start = 0, None

    def begin(self):
        from blockdiag_cp.tools.bench import bytes_written

        self.start = bytes_written()

    def end(self):
        from blockdiag_cp.tools.bench import bytes_written

        self.total += bytes_written() - self.start

    def wrap(self, fn):
        def metered(module, query, key, value, attention_mask, *args, **kwargs):
            query, key, value = _Bracket.apply(self, True, query, key, value)
            out, weights = fn(module, query, key, value, attention_mask, *args, **kwargs)
            (out,) = _Bracket.apply(self, False, out)
            return out, weights

        return metered


def _callback(records: dict):
    """A TrainerCallback: meters the attention (installed once the model is prepared), each step's time, bytes
    and peak RSS into `records`."""
    import transformers
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from linear_ce_memory import peak_kib

    meter = AttentionBytes()

    class Meter(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.impl = model.config._attn_implementation  # ALST has put its wrapper under this name by now
            self.original = ALL_ATTENTION_FUNCTIONS[self.impl]
            ALL_ATTENTION_FUNCTIONS[self.impl] = meter.wrap(self.original)

        def on_train_end(self, args, state, control, **kwargs):
            ALL_ATTENTION_FUNCTIONS[self.impl] = self.original  # the next run in this process wraps its own

        def on_step_begin(self, args, state, control, **kwargs):
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := the RSS now
            self.base, meter.total, self.t0, self.cpu0 = peak_kib(), 0, time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            records["ms"].append((time.perf_counter() - self.t0) * 1e3)
            records["cpu_ms"].append((time.process_time() - self.cpu0) * 1e3)
            records["bytes"].append(meter.total / LAYERS)
            records["mib"].append((peak_kib() - self.base) / 1024)

    return Meter()


def build_trainer(case: dict, method: str, output_dir: str, callbacks: list):
    """The Trainer of `method` ("reference": no CP, one process) on `case`'s row."""
    import transformers

    sys.path.insert(0, TESTS)
    from trainer_runs import zero

    model = tiny_llama(case["heads"], case["kv_heads"], case["tokens"], case["dtype"])
    options = dict(output_dir=output_dir, per_device_train_batch_size=1, gradient_accumulation_steps=1,
                   max_steps=case["steps"], learning_rate=LR, logging_steps=1, save_strategy="no", report_to="none",
                   use_cpu=True, disable_tqdm=True, seed=0, data_seed=0, remove_unused_columns=False)
    if method != "reference":
        options["deepspeed"] = zero(case["zero"])
    kw = dict(model=model, train_dataset=[{"documents": case["docs"]}] * (4 * case["steps"]), data_collator=collate,
              callbacks=callbacks)
    if method == "alst":
        import deepspeed
        from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig

        deepspeed.init_distributed(dist_backend="gloo")  # on CPU accelerate leaves DeepSpeed's comm uninitialized
        model.set_attn_implementation(case["attn"])
        options["parallelism_config"] = ParallelismConfig(
            sp_backend="deepspeed", sp_size=case["sp"], dp_replicate_size=1, sp_handler=DeepSpeedSequenceParallelConfig(
                sp_seq_length_is_variable=True, sp_attn_implementation=case["attn"]))
        return transformers.Trainer(args=transformers.TrainingArguments(**options), **kw)
    if method == "reference":
        return transformers.Trainer(args=transformers.TrainingArguments(**options), **kw)
    from blockdiag_cp import CPConfig, HeadsConfig
    from blockdiag_cp.trainer import BlockDiagCPTrainer

    heads = HeadsConfig(ulysses_degree=ulysses_degree(case["heads"], case["sp"]) if method == "ulysses" else 1)
    return BlockDiagCPTrainer(args=transformers.TrainingArguments(**options), cp_size=case["sp"],
                              cp_config=CPConfig(layout="balanced", heads=heads), **kw)


def row_logits(trainer, method: str, docs: list[list[int]]) -> torch.Tensor:
    """``[S, V]`` logits of the row under `method`'s forward (training mode: ALST turns itself off in eval), on
    every rank."""
    import torch.distributed as dist

    batch = collate([{"documents": docs}])
    model = trainer.model
    model.train()
    with torch.no_grad():
        if method == "reference":
            return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        if method == "alst":  # the shard UlyssesSPDataLoaderAdapter hands this rank: a contiguous chunk
            world, rank = dist.get_world_size(), dist.get_rank()
            chunk = batch["input_ids"].shape[1] // world
            part = slice(rank * chunk, (rank + 1) * chunk)
            local = model(input_ids=batch["input_ids"][:, part], position_ids=batch["position_ids"][:, part]).logits
            pieces = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(pieces, local.contiguous())
            return torch.cat(pieces, dim=1)[0]
        from blockdiag_cp import gather_sequence

        train_ctx, inputs = trainer._prepare_context_parallel_inputs(model, batch)
        with train_ctx():
            local = model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"]).logits
            return gather_sequence(local)[0]


def run_method(rank: int, world: int, case: dict, method: str) -> dict:
    """One rank of `method` on `case`: train, then the row's and the edited row's logits; or ALST's refusal."""
    import transformers

    from blockdiag_cp.hf.parallelism import full_parameters

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    records = {"ms": [], "cpu_ms": [], "bytes": [], "mib": []}
    quiet = contextlib.redirect_stdout(io.StringIO())  # DeepSpeed's notes as it sets up (the table is the output)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings(), quiet:
        warnings.simplefilter("ignore")
        trainer = build_trainer(case, method, tmp, [_callback(records)])
        trainer.remove_callback(transformers.PrinterCallback)
        try:
            trainer.train()
        except ValueError as refusal:  # ALST's check of the head count, raised as the Trainer prepares the model
            return {"refused": str(refusal).splitlines()[0]}
    out = {"steps": [(e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "grad_norm" in e],
           "ms": statistics.median(records["ms"][1:] or records["ms"]),
           "cpu_ms": statistics.median(records["cpu_ms"][1:] or records["cpu_ms"]), "bytes": records["bytes"][-1],
           "mib": records["mib"][-1], "attn": trainer.model.config._attn_implementation}
    logits = [row_logits(trainer, method, docs) for docs in (case["docs"], perturbed(case["docs"]))]
    params = torch.nn.utils.parameters_to_vector(full_parameters(trainer)).double()
    return {**out, "logits": logits, "params": params} if rank == 0 else out


# ---- the cases ----

def reference(case: dict) -> tuple[list, "torch.nn.Module"]:
    """The run without CP (here, one process): its logged (loss, grad norm) and a model to score parameters with."""
    import transformers

    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = build_trainer(case, "reference", tmp, [])
        trainer.remove_callback(transformers.PrinterCallback)
        trainer.train()
    return [(e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "grad_norm" in e], trainer


def judge(ranks: list[dict], want_steps: list, scorer, case: dict) -> dict:
    """One method's row of the table from its ranks' results, against the run without CP."""
    if "refused" in ranks[0]:
        return ranks[0]
    got = ranks[0]
    step_err = max(abs(a - b) / max(1.0, abs(b)) for g, w in zip(got["steps"], want_steps) for a, b in zip(g, w))
    torch.nn.utils.vector_to_parameters(got["params"], scorer.model.parameters())
    want = row_logits(scorer, "reference", case["docs"])
    logit_err = float((got["logits"][0] - want).abs().max())
    ids = collate([{"documents": case["docs"]}])
    targets = next_token_targets(ids["input_ids"][0], ids["position_ids"][0])
    leaked = leak(token_losses(got["logits"][0], targets), token_losses(got["logits"][1], targets),
                  [len(d) for d in case["docs"]])
    step_tol, logit_tol, leak_tol = TOLERANCES[case["dtype"]]
    exact = (len(got["steps"]) == len(want_steps) and step_err <= step_tol and logit_err <= logit_tol
             and (leaked is None or leaked <= leak_tol))
    return {"exact": exact, "step_err": step_err, "logit_err": logit_err, "leak": leaked, "attn": got["attn"],
            "bytes": max(r["bytes"] for r in ranks), "ms": max(r["ms"] for r in ranks),
            "cpu_ms": max(r["cpu_ms"] for r in ranks),
            "mib": max(r["mib"] for r in ranks)}


def table_row(case: dict, method: str, r: dict) -> str:
    label = {"alst": f"ALST ({case['attn']})", "balanced": "ours balanced",
             "ulysses": f"ours ulysses u={ulysses_degree(case['heads'], case['sp'])}"}[method]
    head = f"| {case['row']} | {case['heads']} | {case['sp']} | {label} |"
    if "refused" in r:
        return f"{head} refused: {r['refused']} | | | | | | | |"
    leaked = "-" if r["leak"] is None else f"{r['leak']:.2e}"
    return (f"{head} {'yes' if r['exact'] else 'NO'} | {r['step_err']:.1e} | {r['logit_err']:.1e} | {leaked} | "
            f"{r['bytes'] / 1024:.1f} | {r['ms']:.0f} | {r['cpu_ms']:.0f} | {r['mib']:.0f} |")


def main(argv=None) -> int:
    from blockdiag_cp.testing import RankPool, spawn

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", default=list(ROWS), help="document lengths of each row (blockdiag-cp bench "
                   "--docs format: one, uniform:N, powerlaw:N[:A], mixed, a,b,c)")
    p.add_argument("--heads", default="4,6", help="attention head counts, comma-separated")
    p.add_argument("--kv-heads", type=int, default=0, help="K/V heads (0: as many as the query heads)")
    p.add_argument("--sp", default="2,4", help="sp = cp sizes (ranks), comma-separated")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per row (a multiple of every sp)")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps (one row each; the first is not timed)")
    p.add_argument("--zero", type=int, default=3, choices=(1, 2, 3), help="DeepSpeed ZeRO stage of every sharded run "
                   "(3: ALST's recipe; at 1 and 2 ALST logs and clips a gradient norm sp times too large)")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64"), help="float64 needs --zero 1 or 2")
    p.add_argument("--attn", default="sdpa", help="ALST's sp_attn_implementation (flash kernels need a GPU)")
    args = p.parse_args(argv)
    heads, sps = [int(v) for v in args.heads.split(",")], [int(v) for v in args.sp.split(",")]
    if any(args.tokens % sp for sp in sps):
        p.error(f"--tokens {args.tokens} must be a multiple of every --sp (ALST shards rows into equal chunks)")
    torch.set_num_threads(1)
    # the ranks' allocator hands every tensor of 64 KiB or more back to the system when it is freed, so that a step's
    # peak RSS is its own, in a pool's process as in a fresh one (glibc otherwise keeps freed blocks for reuse)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # what DeepSpeed detects here anyway, without its warning
    t0 = time.perf_counter()
    print(f"Trainer, tiny Llama ({LAYERS} layers, heads of {HEAD_DIM}, hidden = heads x {HEAD_DIM}, {args.dtype}), "
          f"one packed row of {args.tokens} tokens a step, {args.steps} steps, DeepSpeed ZeRO-{args.zero}, CPU gloo")
    print("| row | heads | sp | method | exact | step Δ (rel) | logits Δ | leak | KiB/rank/layer | step ms | CPU ms | "
          "peak MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    cases, refusals = [], {}
    pools = {sp: RankPool(sp, timeout=1800) for sp in sps}  # ours: many runs a pool; ALST: fresh ranks a run
    try:
        for spec in args.rows:
            docs = row_documents(spec, args.tokens)
            for h in heads:
                base = dict(row=spec, docs=docs, heads=h, kv_heads=args.kv_heads or h, tokens=args.tokens,
                            steps=args.steps, zero=args.zero, attn=args.attn, dtype=args.dtype)
                want_steps, scorer = reference(base)
                for sp in sps:
                    case, results = {**base, "sp": sp}, {}
                    for method in METHODS:
                        if method == "alst" and (h, sp) in refusals:  # its head check does not read the row
                            results[method] = refusals[(h, sp)]
                        elif method == "alst":  # DeepSpeed's SP groups are process-wide, made once: fresh ranks
                            ranks = spawn(run_method, sp, case, method, timeout=1800)
                            results[method] = judge(ranks, want_steps, scorer, case)
                            if "refused" in results[method]:
                                refusals[(h, sp)] = results[method]
                        else:
                            results[method] = judge(pools[sp].run(run_method, case, method), want_steps, scorer, case)
                        print(table_row(case, method, results[method]), flush=True)
                        print(f"{method} {spec} {h} {sp}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
                    cases.append(results)
    finally:
        for pool in pools.values():
            pool.close()
    print(f"{time.perf_counter() - t0:.0f} s")
    print(summary_line(cases))
    return 0


if __name__ == "__main__":
    sys.exit(main())
