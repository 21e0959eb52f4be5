"""TRL's GRPOTrainer under block-diagonal CP: a tiny Llama, a local byte-level tokenizer, no downloads.

    torchrun --standalone --nproc-per-node 2 examples/train_grpo.py --cp 2
    python examples/train_grpo.py --cp 0                                      # GRPOTrainer without CP
    torchrun --standalone --nproc-per-node 4 examples/train_grpo.py --cp 2    # dp 2 x cp 2
    torchrun --standalone --nproc-per-node 2 examples/train_grpo.py --cp 0    # its reference: plain DDP over 2

Generation stays outside CP: each dp replica generates as it would without CP (seeded as
that replica's process is), and the completions of its CP rank 0 are shared with the other
CP ranks. The rewards and advantages are computed once per replica; the scoring forwards
(old, reference and policy log-probabilities of prompt + completion) run as one packed row
per batch sharded over the CP ranks, gathering per-token log-probabilities and entropies
only. The logged loss, KL and rewards, and the final parameters, are those without CP.
Prints one JSON line per logged step; `--save PATH` writes the final parameters (rank 0).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from launch import one_line_errors  # noqa: E402
from train_dpo import launch, text_snippets, text_tokenizer, train_and_log  # noqa: E402
from train_trainer import tiny_llama  # noqa: E402

#: what one logged step reports
LOGGED = ("loss", "grad_norm", "kl", "reward", "reward_std", "entropy", "completions/mean_length", "num_tokens")


def letter_share(completions: list[str], **_: object) -> list[float]:
    """The reward: the share of ASCII letters among a completion's characters."""
    return [sum(ch.isascii() and ch.isalpha() for ch in c) / max(1, len(c)) for c in completions]


def build_trainer(args: argparse.Namespace, output_dir: str):
    import datasets
    import trl

    model_dir = os.path.join(output_dir, "tiny-llama")  # GRPO loads its reference model from the policy's path
    tiny_llama().save_pretrained(model_dir)
    text_tokenizer().save_pretrained(model_dir)
    dtype = torch.float64 if args.float64 else torch.float32
    config = trl.GRPOConfig(
        output_dir=output_dir, per_device_train_batch_size=args.batch, num_generations=args.generations,
        max_completion_length=args.completion_length, gradient_accumulation_steps=args.accum, learning_rate=1e-3,
        beta=0.05, logging_steps=1, max_steps=args.steps, save_strategy="no", report_to="none", seed=0, data_seed=0,
        use_cpu=not torch.cuda.is_available(), bf16=False, disable_tqdm=True,
        model_init_kwargs={"dtype": dtype, "attn_implementation": "sdpa"},
    )
    prompts = [{"prompt": text} for text in text_snippets(64, 3, (12, 40))]
    common = dict(model=model_dir, reward_funcs=letter_share, args=config, processing_class=text_tokenizer(),
                  train_dataset=datasets.Dataset.from_list(prompts))
    if args.cp == 0:
        return trl.GRPOTrainer(**common)
    from blockdiag_cp.trainer import BlockDiagCPMixin

    class CPGRPOTrainer(BlockDiagCPMixin, trl.GRPOTrainer):
        pass

    return CPGRPOTrainer(cp_size=args.cp, **common)


def run(args: argparse.Namespace) -> dict:
    return train_and_log(build_trainer, args, LOGGED)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cp", type=int, default=2, help="ranks per CP group; 0 = GRPOTrainer without CP")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=4, help="completions per process per micro-batch")
    p.add_argument("--generations", type=int, default=4, help="completions per prompt")
    p.add_argument("--completion-length", type=int, default=16)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--float64", action="store_true", help="the model in float64 (the exactness checks)")
    p.add_argument("--save", default=None)
    return p.parse_args(argv)


@one_line_errors
def main() -> None:
    launch(parse_args, run)


if __name__ == "__main__":
    main()
