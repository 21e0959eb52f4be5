"""TRL's DPOTrainer under block-diagonal CP: a tiny Llama, a local byte-level tokenizer, no downloads.

    torchrun --standalone --nproc-per-node 2 examples/train_dpo.py --cp 2
    python examples/train_dpo.py --cp 0            # DPOTrainer without CP: the reference

Mixed into `BlockDiagCPMixin`, every scoring forward of the policy and the reference model
(the chosen and rejected rows of a batch) runs as one packed row sharded over the CP ranks,
per document, so chosen and rejected never see each other; only per-token log-probabilities
(O(tokens)) are gathered, never logits. The logged loss, rewards and margins are those of the
trainer without CP. Prints one JSON line per logged step; `--save PATH` writes the final
parameters (rank 0).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import pathlib
import random
import sys
import tempfile

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from launch import one_line_errors, require_torchrun  # noqa: E402
from train_trainer import tiny_llama  # noqa: E402  (the same tiny model)

#: what one logged step reports (the JSON lines and the comparison in the tests)
LOGGED = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
          "logps/rejected", "entropy", "num_tokens")


def text_tokenizer():
    """A byte-level tokenizer built locally: one token per UTF-8 byte (ids 0..255) and ``<eos>`` = 256."""
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = tokenizers.Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)} | {"<eos>": 256}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


def text_snippets(count: int, seed: int, lengths: tuple[int, int]) -> list[str]:
    """`count` ASCII snippets of Python's standard-library docstrings, of `lengths` characters."""
    from blockdiag_cp.tools.demo import stdlib_documents

    rng = random.Random(seed)
    texts = [t.decode("ascii", "ignore") if isinstance(t, (bytes, bytearray)) else str(t) for t in stdlib_documents()]
    out = []
    for _ in range(count):
        text = texts[rng.randrange(len(texts))]
        n = rng.randint(*lengths)
        start = rng.randrange(max(1, len(text) - n))
        out.append(text[start : start + n])
    return out


def preference_rows(count: int = 64, seed: int = 0) -> list[dict[str, str]]:
    """``{"prompt", "chosen", "rejected"}``: a snippet's start, its continuation, another snippet's."""
    rng = random.Random(seed + 1)
    rows = []
    for text, other in zip(text_snippets(count, seed, (24, 90)), text_snippets(count, seed + 7, (8, 60))):
        cut = rng.randint(6, max(7, len(text) // 2))
        rows.append({"prompt": text[:cut], "chosen": text[cut:], "rejected": other})
    return rows


def build_trainer(args: argparse.Namespace, output_dir: str):
    import datasets
    import trl

    replicas = args.dp if args.cp == 0 else 1  # without CP, one process takes every replica's rows
    config = trl.DPOConfig(
        output_dir=output_dir, per_device_train_batch_size=args.batch * replicas, gradient_accumulation_steps=args.accum,
        learning_rate=1e-3, logging_steps=1, max_steps=args.steps, max_length=args.max_length, beta=0.1,
        save_strategy="no", report_to="none", seed=0, data_seed=0, use_cpu=not torch.cuda.is_available(),
        bf16=args.bf16, disable_tqdm=True,
    )
    model = tiny_llama().to(torch.float64 if args.float64 else torch.float32)
    common = dict(model=model, ref_model=copy.deepcopy(model), args=config, processing_class=text_tokenizer(),
                  train_dataset=datasets.Dataset.from_list(preference_rows()))
    if args.cp == 0:
        for m in (common["model"], common["ref_model"]):
            m.set_attn_implementation("sdpa")
        return trl.DPOTrainer(**common)
    from blockdiag_cp.trainer import BlockDiagCPMixin

    class CPDPOTrainer(BlockDiagCPMixin, trl.DPOTrainer):
        pass

    return CPDPOTrainer(cp_size=args.cp, **common)


def train_and_log(build, args: argparse.Namespace, keys: tuple[str, ...]) -> dict:
    """Train ``build(args, output_dir)``; ``{"steps": each logged step's `keys`, "params": the final parameters}``."""
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build(args, tmp)
        trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e and "train_loss" not in e]
    params = torch.cat([p.detach().double().reshape(-1) for p in trainer.model.parameters()])
    return {"steps": [{key: e.get(key) for key in keys} for e in logs], "params": params}


def run(args: argparse.Namespace) -> dict:
    return train_and_log(build_trainer, args, LOGGED)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cp", type=int, default=2, help="ranks per CP group; 0 = DPOTrainer without CP")
    p.add_argument("--dp", type=int, default=1, help="with --cp 0: how many dp replicas' batches one step takes")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=2, help="preference pairs per replica per micro-batch")
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--max-length", type=int, default=256, help="tokens per prompt + completion")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (TRL's default; off here for exactness)")
    p.add_argument("--float64", action="store_true", help="the model in float64 (the exactness checks)")
    p.add_argument("--save", default=None)
    return p.parse_args(argv)


def print_steps(result: dict, save: str | None) -> None:
    """Rank 0: one JSON line per logged step; the final parameters to `save`."""
    if int(os.environ.get("RANK", "0")) == 0:
        for step, values in enumerate(result["steps"], 1):
            print(json.dumps({"step": step, **values}), flush=True)
        if save:
            torch.save(result["params"], save)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def launch(parse, run_args) -> None:
    """An example's main: its arguments, torchrun when CP needs it, one thread, the steps printed."""
    args = parse()
    if args.cp > 1:
        require_torchrun(args.cp)
    torch.set_num_threads(1)
    print_steps(run_args(args), args.save)


@one_line_errors
def main() -> None:
    launch(parse_args, run)


if __name__ == "__main__":
    main()
