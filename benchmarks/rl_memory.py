"""Peak memory per rank of a GRPO training step's scoring on long completions, cp = 1 vs cp = 2.

    python benchmarks/rl_memory.py [--completion 4096] [--group 4] [--vocab 32000]

What a GRPO step runs under CP, as `BlockDiagCPMixin` runs it (`hf.scoring.ScoringSession`,
TRL's fused LM head): the old-policy log-probs (no gradient), then the policy's forward
and backward on the same rows, a group of `--group` completions of `--completion` tokens
after a 64-token prompt. Generation stays outside CP (each replica generates as without
CP), so its memory is the same at every cp and is not part of this step.

Prints, per cp: the step's peak RSS above the RSS before it (per rank; one fresh process
per rank and setting, so the peaks are not shared), the bytes a rank sends during the
step, and what one all-gather of the ``[S, vocab]`` float32 logits would send instead.
Results: docs/rl.md.
"""

from __future__ import annotations

import argparse
import resource

import torch

PROMPT = 64


def rss_bytes() -> int:
    """This process's resident set size now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def scoring_worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from trl.trainer.utils import add_fused_lm_head

    import blockdiag_cp.hf  # noqa: F401  (registers the attention)
    from blockdiag_cp import CPConfig
    from blockdiag_cp.hf.scoring import ScoringSession
    from blockdiag_cp.tools.bench import bytes_written

    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1 << 16,
                                      attn_implementation="blockdiag_cp")
    model = transformers.LlamaForCausalLM(config)
    model.gradient_checkpointing_enable({"use_reentrant": False})
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
    p.add_argument("--completion", type=int, default=4096)
    p.add_argument("--group", type=int, default=4, help="completions per prompt (the rows of the step)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--cps", default="1,2")
    return p.parse_args(argv)


def main() -> None:
    from blockdiag_cp.testing import spawn

    args = parse_args()
    S = args.group * (PROMPT + args.completion)
    print(f"GRPO scoring step: {args.group} completions x {args.completion} tokens (+{PROMPT} prompt), S = {S}, "
          f"vocab {args.vocab}, Llama hidden 256 x 2 layers, fp32, activation checkpointing, gloo on CPU")
    print("| cp | tokens/rank | step peak RSS GB/rank (max) | MB sent/rank | a [S, vocab] fp32 logits all-gather, MB/rank |")
    print("|---|---|---|---|---|")
    for cp in (int(c) for c in args.cps.split(",")):
        per_rank = spawn(scoring_worker, cp, args, timeout=1800)
        logits_mb = (cp - 1) / cp * S * args.vocab * 4 / 1e6
        print(f"| {cp} | {per_rank[0]['tokens_per_rank']} | {max(r['step_peak_gb'] for r in per_rank):.2f} "
              f"| {max(r['sent_mb'] for r in per_rank):.1f} | {logits_mb:.0f} |", flush=True)


if __name__ == "__main__":
    main()
