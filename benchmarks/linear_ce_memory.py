"""Peak memory per rank of one training step (forward + backward): the plain loss vs the linear-CE loss.

    python benchmarks/linear_ce_memory.py [--tokens 8192] [--vocab 131072] [--quick]

A tiny Llama built from its config (random weights, float32, documents of a packed row masked per
document as in a CP step: `make_cp_blockdiag_batch_and_ctx` on one process, which is what one rank of a
CP group holds), one step of `--tokens` tokens per rank, in two shapes:

- *narrow*: hidden 64, 2 layers, the `--vocab` vocabulary: the logits are nearly all of the memory;
- *wide*: hidden 1024, 4 layers, a 32,000 vocabulary: the activations weigh more than the logits.

Per shape and loss, a fresh process: the model built and warmed up (one short step, so kernels are
loaded), then the peak RSS (``VmHWM``, reset through ``/proc/self/clear_refs``) of one step above the RSS
before it. *plain* is the model's own loss (`ForCausalLMLoss` on the logits, as the mixin's plain path
computes it: ``shift_labels`` and the global target count); *linear-CE* is
`blockdiag_cp.hf.linear_ce.linear_ce_loss` (torch's chunked ``linear_cross_entropy``: no logits).
The last line is the narrow shape's ratio against the goal (<= 0.2). Results: docs/memory.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

SHAPES = {  # name -> (hidden, intermediate, layers, heads, vocabulary; None = --vocab)
    "narrow": (64, 128, 2, 4, None),
    "wide": (1024, 2816, 4, 16, 32000),
}
DOCUMENTS = 4  # the packed row's documents, of equal length
#: the plain loss's step peak over its float32 logits, measured here (a guard against runs that cannot fit)
PLAIN_PER_LOGITS = 3.3


def peak_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))


def step(model, inputs: dict, count: int, loss: str) -> float:
    """One forward + backward of `loss` on one rank's step inputs; the loss value."""
    from blockdiag_cp.hf.linear_ce import linear_ce_loss

    if loss == "plain":
        value = model(**inputs, num_items_in_batch=count).loss
    else:
        value = linear_ce_loss(model, inputs, num_items_in_batch=count)
    value.backward()
    return float(value.detach())


def measure(shape: str, loss: str, tokens: int, vocab: int) -> dict:
    """In this (fresh) process: the step's peak above its baseline, in GiB, and its time."""
    import torch
    import transformers

    import blockdiag_cp.hf  # noqa: F401  registers the attention
    from blockdiag_cp import make_cp_blockdiag_batch_and_ctx
    from blockdiag_cp.loss import add_shift_labels

    hidden, inter, layers, heads, shape_vocab = SHAPES[shape]
    vocab = shape_vocab or vocab
    torch.manual_seed(0)
    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                                      max_position_embeddings=tokens, attn_implementation="blockdiag_cp")
    model = transformers.LlamaForCausalLM(config).train()

    def row(n: int):
        ids = torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(n))
        docs = torch.arange(n) * DOCUMENTS // n + 1
        batch = add_shift_labels({"input_ids": ids, "labels": ids.clone(), "_packed_seq_ids": docs[None]})
        count = int((batch["shift_labels"] != -100).sum())
        train_ctx, batch = make_cp_blockdiag_batch_and_ctx(None, None, batch)
        inputs = {k: batch[k] for k in ("input_ids", "position_ids", "labels", "shift_labels")}
        return train_ctx, inputs, count

    train_ctx, inputs, count = row(256)
    with train_ctx():  # warm-up: kernels loaded
        step(model, inputs, count, loss)
    model.zero_grad(set_to_none=True)  # as an optimizer step leaves them: the step allocates its gradients
    train_ctx, inputs, count = row(tokens)
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := the RSS now
    base = peak_kib()
    start = time.perf_counter()
    with train_ctx():
        value = step(model, inputs, count, loss)
    seconds = time.perf_counter() - start
    return {"peak_gib": (peak_kib() - base) / 2**20, "seconds": seconds, "loss": value, "vocab": vocab}


def available_gib() -> float:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable")) / 2**20


def run_fresh(shape: str, loss: str, tokens: int, vocab: int) -> dict:
    code = (f"import json, sys; sys.path.insert(0, {repr(sys.path[0])}); import linear_ce_memory as m; "
            f"print(json.dumps(m.measure({shape!r}, {loss!r}, {tokens}, {vocab})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    p.add_argument("--vocab", type=int, default=131072, help="the narrow shape's vocabulary")
    p.add_argument("--quick", action="store_true", help="1,024 tokens and a 32,768 vocabulary (a smoke run)")
    args = p.parse_args(argv)
    tokens, vocab = (1024, 32768) if args.quick else (args.tokens, args.vocab)
    print(f"one training step (forward + backward) per rank, {tokens} tokens in {DOCUMENTS} documents, float32, "
          "one thread, tiny Llama from its config; peak RSS above the step's start, fresh process each")
    print("| shape | hidden x layers | vocab | logits GiB | plain GiB | linear-CE GiB | ratio | plain s | linear-CE s "
          "| loss difference |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    ratios = {}
    for shape, (hidden, _, layers, _, shape_vocab) in SHAPES.items():
        logits = tokens * (shape_vocab or vocab) * 4 / 2**30
        if PLAIN_PER_LOGITS * logits > 0.8 * available_gib():
            raise SystemExit(f"the plain loss of the {shape} shape needs about {PLAIN_PER_LOGITS * logits:.0f} GiB "
                             f"({PLAIN_PER_LOGITS} x its {logits:.1f} GiB of logits), more than this machine has free "
                             f"({available_gib():.0f} GiB): take fewer --tokens or a smaller --vocab")
        plain = run_fresh(shape, "plain", tokens, vocab)
        lean = run_fresh(shape, "linear", tokens, vocab)
        ratios[shape] = lean["peak_gib"] / plain["peak_gib"]
        print(f"| {shape} | {hidden} x {layers} | {plain['vocab']} | {logits:.2f} | {plain['peak_gib']:.3f} "
              f"| {lean['peak_gib']:.3f} | {ratios[shape]:.3f} | {plain['seconds']:.1f} | {lean['seconds']:.1f} "
              f"| {abs(plain['loss'] - lean['loss']) / plain['loss']:.1e} |", flush=True)
    print(f"wide shape: linear-CE peak / plain peak: {ratios['wide']:.3f} (never above 1)")
    print(f"linear-CE peak / plain peak: {ratios['narrow']:.3f} (goal <= 0.2)")


if __name__ == "__main__":
    main()
