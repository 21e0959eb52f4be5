"""TRL's SFTTrainer with packing under block-diagonal CP: a tiny Llama, a local byte tokenizer, no downloads.

    torchrun --standalone --nproc-per-node 2 examples/train_trl_sft.py --cp 2
    python examples/train_trl_sft.py --cp 0            # SFTTrainer(packing=True) without CP: the reference

`SFTTrainer(packing=True)` packs the dataset into rows of `--max-length` tokens (several
documents each, padding-free, position_ids restarting per document). TRL refuses packing
with accelerate's context parallelism; mixed into `BlockDiagCPMixin`, each packed row is
sharded per document over the CP ranks and the loss is the one without CP.
Prints one JSON line per logged step; `--save PATH` writes the final parameters (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from launch import one_line_errors, require_torchrun  # noqa: E402
from train_trainer import documents, tiny_llama  # noqa: E402  (the same tiny model and documents)


def byte_tokenizer():
    """A byte-level tokenizer built locally (256 bytes + an end-of-text token), for TRL's processing_class."""
    import tokenizers
    import transformers

    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"<eos>": 256}
    model = tokenizers.models.WordLevel(vocab=vocab, unk_token="<eos>")
    tok = tokenizers.Tokenizer(model)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


def build_trainer(args: argparse.Namespace, output_dir: str):
    import datasets
    import trl

    rows = [{"input_ids": d["input_ids"]} for d in documents()]
    replicas = args.dp if args.cp == 0 else 1  # without CP, one process takes every replica's rows
    config = trl.SFTConfig(
        output_dir=output_dir, packing=True, max_length=args.max_length, per_device_train_batch_size=args.batch * replicas,
        gradient_accumulation_steps=args.accum, learning_rate=3e-3, logging_steps=1,
        **({"max_steps": args.steps} if args.epochs is None else {"num_train_epochs": args.epochs}),
        save_strategy="no", report_to="none", bf16=args.bf16, seed=0, data_seed=0, use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
    )
    common = dict(model=tiny_llama(), args=config, train_dataset=datasets.Dataset.from_list(rows),
                  processing_class=byte_tokenizer())
    if args.cp == 0:
        common["model"].set_attn_implementation("sdpa")
        return trl.SFTTrainer(**common)
    from blockdiag_cp.trainer import BlockDiagCPMixin

    class CPSFTTrainer(BlockDiagCPMixin, trl.SFTTrainer):
        pass

    return CPSFTTrainer(cp_size=args.cp, whole_batch=args.whole_batch, **common)


def run(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(args, tmp)
        trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e and "train_loss" not in e]
    params = torch.cat([p.detach().float().reshape(-1) for p in trainer.model.parameters()])
    return {"loss": [e["loss"] for e in logs], "grad_norm": [e.get("grad_norm") for e in logs],
            "num_tokens": [e.get("num_tokens") for e in logs], "params": params}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cp", type=int, default=2, help="ranks per CP group; 0 = SFTTrainer without CP")
    p.add_argument("--dp", type=int, default=1, help="with --cp 0: how many dp replicas' batches one step takes")
    p.add_argument("--whole-batch", action="store_true",
                   help="plan every replica's documents over all dp x cp ranks (the grouped layout) each step")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--epochs", type=int, default=None, help="train whole epochs instead of --steps")
    p.add_argument("--batch", type=int, default=1, help="packed rows per replica per micro-batch")
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--max-length", type=int, default=512, help="tokens per packed row")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--save", default=None)
    return p.parse_args(argv)


@one_line_errors
def main() -> None:
    args = parse_args()
    if args.cp > 1:
        require_torchrun(args.cp)
    torch.set_num_threads(1)
    result = run(args)
    if int(os.environ.get("RANK", "0")) == 0:
        for step, (loss, norm, tokens) in enumerate(zip(result["loss"], result["grad_norm"], result["num_tokens"]), 1):
            print(json.dumps({"step": step, "loss": loss, "grad_norm": norm, "num_tokens": tokens}), flush=True)
        if args.save:
            torch.save(result["params"], args.save)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


if __name__ == "__main__":
    main()
