"""Train with transformers' Trainer and block-diagonal CP: a tiny Llama (or Nemotron-H hybrid) on packed rows, no downloads.

    torchrun --standalone --nproc-per-node 4 examples/train_trainer.py --cp 2            # dp=2 x cp=2
    torchrun --standalone --nproc-per-node 2 examples/train_trainer.py --cp 2 --bf16     # autocast
    python examples/train_trainer.py --cp 0 --dp 2                                       # the run without CP
    torchrun --standalone --nproc-per-node 2 examples/train_trainer.py --cp 0            # without CP, plain DDP
    torchrun --standalone --nproc-per-node 2 examples/train_trainer.py --cp 2 --model nemotron_h   # a hybrid
    torchrun --standalone --nproc-per-node 4 examples/train_trainer.py --cp 2 --zero 3 --output-dir runs/a --save-steps 2
    # 2 nodes x 8 GPUs, FSDP2 + CP 2 + the linear-CE loss (docs/trainer.md, "A real run"):
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $HEAD:29500 --max-restarts 3 \
        examples/train_trainer.py --cp 2 --fsdp2 --bf16 --linear-ce --output-dir /shared/run --save-steps 200

`--cp 0` is transformers' own Trainer (no blockdiag-cp): in one process with the batches
of `--dp` replicas, or under torchrun as plain DDP (`--dp 1`: each process one replica):
the run the CP run must equal. `--epochs` trains whole epochs of `--train-docs`
documents, so the last batch may be short (the Trainer's defaults keep it:
`dataloader_drop_last=False`, accelerate's `even_batches=True`). Each step packs `--batch` documents
(Python standard-library docstrings, byte-tokenized) per replica: `--collator flatten`
gives one padding-free row (DataCollatorWithFlattening), `--collator pad` padded rows.
Prints one JSON line per logged step; `--save PATH` writes the final parameters (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile

import torch
from launch import one_line_errors, require_torchrun

VOCAB = 257


def documents(count: int = 96, seed: int = 0) -> list[dict[str, list[int]]]:
    """Byte-tokenized excerpts of Python's standard-library docstrings, 24 to 160 tokens each."""
    from blockdiag_cp.tools.demo import stdlib_documents

    rng = random.Random(seed)
    texts = stdlib_documents()
    out = []
    for _ in range(count):
        text = texts[rng.randrange(len(texts))]
        n = rng.randint(24, 160)
        start = rng.randrange(max(1, len(text) - n))
        ids = list(text[start : start + n])
        out.append({"input_ids": ids, "labels": ids})
    return out


class IterableDocuments(torch.utils.data.IterableDataset):
    """The same documents as a stream (an iterable dataset)."""

    def __init__(self, docs: list[dict]) -> None:
        self.docs = docs

    def __iter__(self):
        return iter(self.docs)


def tiny_llama():
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    return transformers.LlamaForCausalLM(config)


def tiny_nemotron_h():
    """A tiny Nemotron-H hybrid: a Mamba2 layer, an attention layer, an MLP layer (`--model nemotron_h`)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=4096, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=2,
        conv_kernel=4, chunk_size=16, layers_block_type=["linear_attention", "full_attention", "mlp"])
    return transformers.NemotronHForCausalLM(config)


MODELS = {"llama": tiny_llama, "nemotron_h": tiny_nemotron_h}


def pad_collator(features: list[dict]) -> dict[str, torch.Tensor]:
    """Right-padded rows: input_ids, attention_mask, labels (-100 on padding)."""
    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), longest, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for i, f in enumerate(features):
        n = len(f["input_ids"])
        ids[i, :n] = torch.tensor(f["input_ids"])
        labels[i, :n] = torch.tensor(f["labels"])
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def training_arguments(args: argparse.Namespace, output_dir: str, replicas: int = 1):
    import transformers

    import dataclasses

    names = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    prefix = "activation" if "activation_checkpointing" in names else "gradient"  # transformers 5.x renamed it
    checkpointing = {f"{prefix}_checkpointing": args.checkpointing, f"{prefix}_checkpointing_kwargs": {"use_reentrant": False}}
    length = {"max_steps": args.steps} if args.epochs is None else {"num_train_epochs": args.epochs}
    return transformers.TrainingArguments(**sharding_arguments(args), **saving_arguments(args),
        output_dir=output_dir, per_device_train_batch_size=args.batch * replicas,
        per_device_eval_batch_size=(args.eval_batch or args.batch) * replicas, gradient_accumulation_steps=args.accum,
        learning_rate=3e-3, logging_steps=1, report_to="none", bf16=args.bf16, seed=0, data_seed=0,
        dataloader_drop_last=args.drop_last, use_cpu=not torch.cuda.is_available(), disable_tqdm=True,
        include_num_input_tokens_seen="non_padding", accelerator_config={"even_batches": not args.uneven_batches},
        torch_compile=args.compile is not None, torch_compile_backend=args.compile, **length, **checkpointing,
    )


def sharding_arguments(args: argparse.Namespace) -> dict:
    """``--zero N``: DeepSpeed ZeRO stage N (a config of "auto"s, the Trainer's own values); ``--fsdp2``:
    accelerate's FSDP2 over every rank (GPUs: accelerate runs FSDP on accelerators only)."""
    if args.zero and args.fsdp2:
        raise SystemExit("--zero and --fsdp2 are two sharded stacks: pick one")
    if args.fsdp2 and not torch.cuda.is_available():
        raise SystemExit("--fsdp2 runs on GPUs (accelerate drops its FSDP plugin on CPU); on CPU use --zero 2 or 3")
    if args.zero:
        return {"deepspeed": {"zero_optimization": {"stage": args.zero}, "train_micro_batch_size_per_gpu": "auto",
                              "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
                              "gradient_clipping": "auto", "bf16": {"enabled": "auto"}}}
    if args.fsdp2:
        return {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2, "state_dict_type": "SHARDED_STATE_DICT"}}
    return {}


def saving_arguments(args: argparse.Namespace) -> dict:
    """``--save-steps N``: a checkpoint every N optimizer steps under ``--output-dir`` (sharded under ZeRO / FSDP2)."""
    if not args.save_steps:
        return {"save_strategy": "no"}
    return {"save_strategy": "steps", "save_steps": args.save_steps}


def build_trainer(args: argparse.Namespace, output_dir: str):
    """The CP trainer (`--cp >= 1`) or transformers' own Trainer on the dp replicas' batches (`--cp 0`)."""
    import transformers

    collator = transformers.DataCollatorWithFlattening() if args.collator == "flatten" else pad_collator
    train = IterableDocuments(documents(args.train_docs)) if args.iterable else documents(args.train_docs)
    common = dict(model=MODELS[args.model](), train_dataset=train, eval_dataset=documents(args.eval_docs, seed=1),
                  data_collator=collator)
    if args.cp == 0:
        common["model"].set_attn_implementation("sdpa")
        return transformers.Trainer(args=training_arguments(args, output_dir, replicas=args.dp), **common)
    from blockdiag_cp import CPConfig, HeadsConfig
    from blockdiag_cp.trainer import BlockDiagCPTrainer

    config = None if args.whole_batch else CPConfig(layout=args.layout, heads=HeadsConfig(ulysses_degree=args.ulysses_degree))
    return BlockDiagCPTrainer(args=training_arguments(args, output_dir), cp_size=args.cp, whole_batch=args.whole_batch,
                              cp_config=config, linear_ce=args.linear_ce, **common)  # whole batches: grouped layout


def run(args: argparse.Namespace) -> dict:
    """Train, evaluate, predict; return the logged losses, grad norms and token counts, the eval loss,
    the final parameters and (with `--predict`) the predicted logits of the eval documents."""
    from blockdiag_cp.hf.parallelism import full_parameters

    with tempfile.TemporaryDirectory() as tmp:
        output_dir = args.output_dir or tmp
        trainer = build_trainer(args, output_dir)
        trainer.train(resume_from_checkpoint=last_checkpoint(output_dir) if args.output_dir else None)
        metrics = trainer.evaluate() if args.evaluate else {}
        predicted = trainer.predict(trainer.eval_dataset).predictions if args.predict else None
    logs = [e for e in trainer.state.log_history if "loss" in e and "train_loss" not in e]
    params = torch.cat([p.detach().float().reshape(-1) for p in full_parameters(trainer)])  # whole under ZeRO-3, FSDP2
    return {"loss": [e["loss"] for e in logs], "grad_norm": [e.get("grad_norm") for e in logs],
            "tokens_seen": [e.get("num_input_tokens_seen") for e in logs], "eval_loss": metrics.get("eval_loss"),
            "params": params, "predictions": None if predicted is None else torch.as_tensor(predicted),
            "total_flos": trainer.state.total_flos}


def last_checkpoint(output_dir: str):
    """The newest ``checkpoint-N`` under `output_dir` (None: start afresh): a restarted job resumes there."""
    from transformers.trainer_utils import get_last_checkpoint

    return get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cp", type=int, default=2, help="ranks per CP group; 0 = transformers' Trainer without CP")
    p.add_argument("--dp", type=int, default=1, help="with --cp 0: how many dp replicas' batches one step takes")
    p.add_argument("--model", choices=sorted(MODELS), default="llama",
                   help="nemotron_h: a hybrid (Mamba2) model; its run without CP needs --collator pad")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--epochs", type=int, default=None, help="train whole epochs instead of --steps")
    p.add_argument("--train-docs", type=int, default=96, help="documents in the training set")
    p.add_argument("--eval-docs", type=int, default=24, help="documents in the evaluation set")
    p.add_argument("--batch", type=int, default=4, help="documents per replica per micro-batch")
    p.add_argument("--eval-batch", type=int, default=None, help="evaluation documents per replica (default --batch)")
    p.add_argument("--drop-last", action="store_true", help="dataloader_drop_last=True (drop a short last batch)")
    p.add_argument("--uneven-batches", action="store_true", help="accelerate's even_batches=False")
    p.add_argument("--accum", type=int, default=2, help="gradient accumulation steps")
    p.add_argument("--collator", choices=("flatten", "pad"), default="flatten")
    p.add_argument("--layout", choices=("contiguous", "balanced"), default="balanced")
    p.add_argument("--whole-batch", action="store_true",
                   help="plan every replica's documents over all dp x cp ranks (the grouped layout) each step")
    p.add_argument("--ulysses-degree", type=int, default=1, help="head-parallel ranks inside each CP group")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--compile", choices=("aot_eager", "inductor"), default=None,
                   help="TrainingArguments(torch_compile=True) with this backend")
    p.add_argument("--evaluate", action="store_true")
    p.add_argument("--predict", action="store_true", help="also predict the eval documents (logits kept)")
    p.add_argument("--iterable", action="store_true", help="stream the documents (an iterable dataset)")
    p.add_argument("--zero", type=int, choices=(1, 2, 3), default=None, help="DeepSpeed ZeRO stage (pip install deepspeed)")
    p.add_argument("--fsdp2", action="store_true", help="accelerate's FSDP2 over every rank (GPUs)")
    p.add_argument("--linear-ce", action="store_true", help="the loss from the hidden states, never the logits")
    p.add_argument("--output-dir", default=None, help="checkpoints go here; a run that finds one resumes from it")
    p.add_argument("--save-steps", type=int, default=0, help="a checkpoint every N optimizer steps (0: none)")
    p.add_argument("--save", default=None, help="write the final parameters here (rank 0; predictions beside them)")
    return p.parse_args(argv)


@one_line_errors
def main() -> None:
    args = parse_args()
    if args.cp > 1:
        require_torchrun(args.cp)
    torch.set_num_threads(1)
    result = run(args)
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        for step, (loss, norm, seen) in enumerate(zip(result["loss"], result["grad_norm"], result["tokens_seen"]), 1):
            print(json.dumps({"step": step, "loss": loss, "grad_norm": norm, "tokens_seen": seen}), flush=True)
        if result["eval_loss"] is not None:
            print(json.dumps({"eval_loss": result["eval_loss"]}), flush=True)
        print(json.dumps({"total_flos": result["total_flos"]}), flush=True)
        if args.save:
            torch.save(result["params"], args.save)
            if result["predictions"] is not None:
                torch.save(result["predictions"], f"{args.save}.predictions")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank is past its last collective before teardown


if __name__ == "__main__":
    main()
