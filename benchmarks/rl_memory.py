"""Peak memory per rank of a GRPO training step's scoring on long completions, cp = 1 vs cp = 2.

    python benchmarks/rl_memory.py [--completion 4096] [--group 4] [--vocab 32000]

What a GRPO step runs under CP, as `BlockDiagCPMixin` runs it (`hf.scoring.ScoringSession`,
TRL's fused LM head): the old-policy log-probs (no gradient), then the policy's forward
and backward on the same rows, a group of `--group` completions of `--completion` tokens
after a 64-token prompt. Generation stays outside CP (each replica generates as without
CP), so its memory is the same at every cp and is not part of this step.

TRL's fused head works on tiles of 4096 tokens x the vocabulary (a fixed cost, not linear
in tokens; its buffer is 4096 x 32768 floats), so the default vocabulary is small enough
for the activations, which CP shards, to show.

Prints, for cp 1 at the full and at half the completion length and for cp 2 at the full
length: the step's peak RSS above the RSS before it (per rank; one fresh process per rank
and setting, so the peaks are not shared), the bytes a rank sends during the step, and
what one all-gather of the ``[S, vocab]`` float32 logits would send instead. A rank's
peak follows its tokens: cp 2 at the full length is cp 1 at half of it.
Results: docs/rl.md.
"""

from __future__ import annotations

import argparse
import resource

import torch

PROMPT = 64


def scoring_worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from trl.trainer.utils import add_fused_lm_head

    import blockdiag_cp.hf  # noqa: F401  (registers the attention)
    from blockdiag_cp import CPConfig
    from blockdiag_cp.hf.scoring import ScoringSession
    from blockdiag_cp.tools.bench import bytes_written, rss_bytes

    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1 << 16,
                                      attn_implementation="blockdiag_cp")
    model = transformers.LlamaForCausalLM(config)
    model.train()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)) if world > 1 else None
    session = ScoringSession(None if mesh is None else mesh["cp"], CPConfig())
    session.install(model)
    T = PROMPT + args.completion
    ids = torch.randint(0, args.vocab, (args.group, T), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :PROMPT] = -100
    rows = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    base, sent = rss_bytes(), bytes_written()
    with session():
        with torch.no_grad():
            old = model(**rows, fused_lm_head=True).log_probs
        out = model(**rows, fused_lm_head=True)
        ratio = torch.exp(out.log_probs - old)
        (-(ratio * labels[:, 1:].ne(-100)).sum() / args.group - 1e-3 * out.entropy.mean()).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"step_peak_gb": (peak - base) / 1e9, "sent_mb": (bytes_written() - sent) / 1e6,
            "tokens_per_rank": out.log_probs.numel() // world}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--completion", type=int, default=8192)
    p.add_argument("--group", type=int, default=4, help="completions per prompt (the rows of the step)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--cps", default="2", help="CP sizes beside cp 1 at the full and at half the completion length")
    return p.parse_args(argv)


def main() -> None:
    from blockdiag_cp.testing import spawn

    args = parse_args()
    print(f"GRPO scoring step: {args.group} completions (+{PROMPT}-token prompt) per row set, vocab {args.vocab}, "
          "Llama hidden 512 x 2 layers, fp32, no activation checkpointing, gloo on CPU")
    print("| cp | completion tokens | S | tokens/rank | step peak RSS GB/rank (max) | MB sent/rank "
          "| a [S, vocab] fp32 logits all-gather, MB/rank |")
    print("|---|---|---|---|---|---|---|")
    half = argparse.Namespace(**{**vars(args), "completion": args.completion // 2})
    for cp, setting in [(1, args), (1, half)] + [(int(c), args) for c in args.cps.split(",") if int(c) > 1]:
        S = setting.group * (PROMPT + setting.completion)
        per_rank = spawn(scoring_worker, cp, setting, timeout=1800)
        logits_mb = (cp - 1) / cp * S * setting.vocab * 4 / 1e6
        print(f"| {cp} | {setting.completion} | {S} | {per_rank[0]['tokens_per_rank']} "
              f"| {max(r['step_peak_gb'] for r in per_rank):.2f} | {max(r['sent_mb'] for r in per_rank):.1f} "
              f"| {logits_mb:.0f} |", flush=True)


if __name__ == "__main__":
    main()
