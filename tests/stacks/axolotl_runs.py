"""axolotl runs for tests/stacks/test_axolotl.py: a tiny Llama, a byte tokenizer and packed documents written to a
folder, axolotl's YAML for them, axolotl's own CLI launched on it, what the comparisons read back, and the leak
probe's gloo worker. Nothing is downloaded: the model has random weights, the data is random bytes.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import subprocess
import sys

import torch

VOCAB = 257  # 256 bytes and <eos> (also the padding)
PLUGIN = "blockdiag_cp.integrations.axolotl.BlockDiagCPPlugin"
#: environment of every launch: offline, no telemetry, one thread per process (2 shared cores)
ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "AXOLOTL_DO_NOT_TRACK": "1", "DO_NOT_TRACK": "1",
       "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def tiny_llama(dtype: torch.dtype = torch.float32):
    """A 2-layer Llama with random weights (GQA: 4 query heads, 2 key/value heads)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      bos_token_id=None, eos_token_id=VOCAB - 1, pad_token_id=VOCAB - 1)
    return transformers.LlamaForCausalLM(config).to(dtype)


def byte_tokenizer():
    import tokenizers
    import transformers

    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"<eos>": VOCAB - 1}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<eos>"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


def documents(count: int, seed: int) -> list[dict]:
    """Pre-tokenized documents (12 to 48 tokens), up to half of each a prompt (labels -100)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = rng.randint(12, 48)
        ids = [rng.randrange(1, 256) for _ in range(n)]
        cut = int(n * 0.5 * rng.random())
        out.append({"input_ids": ids, "attention_mask": [1] * n, "labels": [-100] * cut + ids[cut:]})
    return out


def write_inputs(root: pathlib.Path) -> dict:
    """The model, tokenizer and data under `root`; returns the YAML (a dict) of axolotl's run without CP."""
    tiny_llama().save_pretrained(root / "model")
    byte_tokenizer().save_pretrained(root / "model")
    for name, count, seed in (("train", 72, 0), ("eval", 12, 1)):
        with open(root / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(d) + "\n" for d in documents(count, seed))
    return dict(
        base_model=str(root / "model"), datasets=[dict(path=str(root / "train.jsonl"), ds_type="json")],
        test_datasets=[dict(path=str(root / "eval.jsonl"), ds_type="json", split="train")],
        dataset_prepared_path=str(root / "prepared"), dataset_num_proc=1, dataloader_num_workers=0,
        sequence_len=128, sample_packing=True, attn_implementation="sdpa", micro_batch_size=2,
        gradient_accumulation_steps=2, num_epochs=1, learning_rate=1e-2, optimizer="adamw_torch", lr_scheduler="cosine",
        gradient_checkpointing=True, bf16=False, fp16=False, tf32=False, seed=0, logging_steps=1,
        eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=1000, save_only_model=False,
    )


def with_cp(cfg: dict, output_dir: pathlib.Path, cp: int = 2) -> dict:
    """`cfg` under the plugin at ``context_parallel_size: cp``."""
    return {**cfg, "plugins": [PLUGIN], "context_parallel_size": cp, "output_dir": str(output_dir)}


def launch(yaml_path: pathlib.Path, nproc: int, log: pathlib.Path, timeout: float = 900.0) -> None:
    """axolotl's own CLI on `yaml_path`: ``python -m axolotl.cli.train`` in one process, or under
    ``torchrun --nproc-per-node nproc``; a failure raises with the log's tail."""
    if nproc == 1:
        cmd = [sys.executable, "-m", "axolotl.cli.train", str(yaml_path)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "axolotl.cli.train", str(yaml_path)]
    env = {**os.environ, **ENV, "PATH": f"{pathlib.Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    with open(log, "w") as out:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
    if code:
        raise AssertionError(f"{' '.join(cmd)} failed ({code}):\n" + log.read_text()[-6000:])


def results(output_dir: pathlib.Path, history: bool = True) -> dict:
    """What a finished run left: the logged steps and evaluations (the last checkpoint's trainer_state.json, full
    precision) and the final parameters (the saved model)."""
    from safetensors.torch import load_file

    params = load_file(str(output_dir / "model.safetensors"))
    if not history:
        return {"params": torch.cat([params[k].double().reshape(-1) for k in sorted(params)])}
    checkpoints = sorted(output_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    history = json.loads((checkpoints[-1] / "trainer_state.json").read_text())["log_history"]
    return {"steps": [e for e in history if "loss" in e and "train_loss" not in e],
            "evals": [e for e in history if "eval_loss" in e],
            "params": torch.cat([params[k].double().reshape(-1) for k in sorted(params)])}


# -- the leak probe (on gloo ranks: blockdiag_cp.testing.spawn) ------------------------------------------------------


def packed_row(docs: list[dict]) -> dict:
    """One bin of `docs` as axolotl's sample-packing collator makes it (``V2BatchSamplerDataCollatorForSeq2Seq``,
    each document's position_ids restarting at 0, the attention mask dropped as axolotl drops it for sdpa)."""
    from axolotl.utils.collators import V2BatchSamplerDataCollatorForSeq2Seq

    features = [{"input_ids": d["input_ids"], "labels": d["labels"], "position_ids": list(range(len(d["input_ids"])))}
                for d in docs]
    collator = V2BatchSamplerDataCollatorForSeq2Seq(byte_tokenizer(), padding=True, pad_to_multiple_of=64,
                                                    return_tensors="pt")
    return dict(collator([features]))


def per_token_losses(trainer, batch: dict) -> torch.Tensor:
    """``[S]`` loss of every next-token target of the packed row, the model run under CP by the trainer's own
    batch hook, the logits gathered over the CP ranks."""
    from blockdiag_cp import gather_sequence
    from blockdiag_cp.step.rows import shifted_labels

    targets = shifted_labels(batch["labels"])[0]
    train_ctx, inputs = trainer._prepare_context_parallel_inputs(trainer.model, dict(batch))
    with torch.no_grad(), train_ctx():
        logits = trainer.model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"]).logits
        full = gather_sequence(logits)[0]
    return torch.nn.functional.cross_entropy(full, targets, ignore_index=-100, reduction="none")


def leak_worker(rank: int, world: int, output_dir: str, victim: int) -> dict:
    """The plugin's trainer class (axolotl's ``AxolotlTrainer`` under the mixin, cp = world) on one packed row,
    then on the same row with document `victim`'s tokens changed: which targets' losses moved, inside and outside
    that document."""
    os.environ.update(ENV, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from axolotl.core.training_args import AxolotlTrainingArguments

    from blockdiag_cp.integrations.axolotl import BlockDiagCPPlugin

    plugin = BlockDiagCPPlugin()
    plugin.register({"plugins": [PLUGIN], "context_parallel_size": world, "sample_packing": True,
                     "attn_implementation": "sdpa"})
    args = AxolotlTrainingArguments(output_dir=output_dir, sample_packing=True, use_cpu=True, report_to="none",
                                    per_device_train_batch_size=1, max_steps=1)
    trainer = plugin.get_trainer_cls(None)(model=tiny_llama(torch.float64), args=args)
    docs = documents(6, seed=3)
    edited = [dict(d) for d in docs]
    ids = [(t * 7 + 3) % 256 for t in docs[victim]["input_ids"]]
    edited[victim] = {"input_ids": ids, "labels": ids}
    before, after = per_token_losses(trainer, packed_row(docs)), per_token_losses(trainer, packed_row(edited))
    lengths = [len(d["input_ids"]) for d in docs]
    start = sum(lengths[:victim])
    inside = torch.zeros_like(before, dtype=torch.bool)
    inside[max(0, start - 1): start + lengths[victim]] = True  # its targets (and the one before it, a -100 target)
    changed = (before - after).abs() > 1e-12
    return {"changed_inside": int((changed & inside).sum()), "changed_elsewhere": int((changed & ~inside).sum()),
            "max_elsewhere": float((before - after)[~inside].abs().max()), "targets": int((before > 0).sum()),
            "keys": sorted(packed_row(docs)), "trainer": type(trainer).__name__}
