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


#: the model families the tests train (the plugin knows none of them by name)
FAMILIES = ("llama", "qwen3", "gemma2")


def tiny_model(family: str = "llama", dtype: torch.dtype = torch.float32, hidden: int = 32):
    """A 2-layer causal LM of `family` with random weights (GQA: 4 query heads, 2 key/value heads; Qwen3: q/k norms
    and its own head size; Gemma 2: a sliding layer and a global one, softcaps, its own query scale), `hidden`
    wide."""
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None,
                  eos_token_id=VOCAB - 1, pad_token_id=VOCAB - 1)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=16, tie_word_embeddings=False, **common))
    elif family == "gemma2":  # sliding-window and global layers, a logit softcap that bites, tied embeddings
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            head_dim=16, sliding_window=24, attn_logit_softcapping=2.0, final_logit_softcapping=10.0,
            query_pre_attn_scalar=12, **common))
    else:
        raise ValueError(f"unknown family {family!r}: one of {FAMILIES}")
    return model.to(dtype)


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


def write_inputs(root: pathlib.Path, family: str = "llama", hidden: int = 32) -> dict:
    """The model (of `family`, `hidden` wide), tokenizer and data under `root`; returns the YAML (a dict) of
    axolotl's run without CP."""
    tiny_model(family, hidden=hidden).save_pretrained(root / "model")
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


#: LoRA on every attention and MLP projection, the embeddings and the head trained whole beside it
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_SAVED = ["embed_tokens", "lm_head"]


def lora(root: pathlib.Path, family: str = "llama", hidden: int = 32, saved: tuple = tuple(LORA_SAVED)) -> dict:
    """The YAML lines of LoRA (`LORA_TARGETS`, and the modules in `saved` trained whole), starting from an adapter
    written under `root`.

    axolotl draws new LoRA weights from torch's global RNG, which no setting seeds before the model loads (torch
    seeds it at random per process: two runs of one YAML start from different adapters, CP or not); so both runs
    start from this adapter (``lora_model_dir``, axolotl's way to continue training one), its B matrices random
    too, so the first step's loss already goes through them. axolotl's fused LoRA kernels (CUDA / triton, on by
    default) are off, as they must be on any CPU."""
    import peft

    model = tiny_model(family, hidden=hidden)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS,
                             modules_to_save=list(saved) or None)
    model = peft.get_peft_model(model, config)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
    model.save_pretrained(root / "adapter")
    return dict(adapter="lora", lora_model_dir=str(root / "adapter"), lora_r=4, lora_alpha=8, lora_dropout=0.0,
                lora_target_modules=LORA_TARGETS, lora_modules_to_save=list(saved) or None, lora_mlp_kernel=False,
                lora_qkv_kernel=False, lora_o_kernel=False, lora_embedding_kernel=False)


#: axolotl's own DeepSpeed configs (``deepspeed_configs/zero2.json`` and ``zero3.json`` of its repository, unchanged
#: from 2024-03 and 2025-07 to 0.19.0; ``axolotl fetch deepspeed_configs`` downloads them): ZeRO-2 offloads the
#: optimizer to the CPU
_FP16_AUTO = {"enabled": "auto", "auto_cast": False, "loss_scale": 0, "initial_scale_power": 32,
              "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
_BATCH_AUTO = {"gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
               "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False}
ZERO2 = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "contiguous_gradients": True,
                               "overlap_comm": True},
         "bf16": {"enabled": "auto"}, "fp16": _FP16_AUTO, **_BATCH_AUTO}
ZERO3 = {"zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 0,
                               "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                               "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 0,
                               "stage3_max_reuse_distance": 0, "stage3_gather_16bit_weights_on_model_save": True},
         "bf16": {"enabled": "auto"}, "fp16": _FP16_AUTO, **_BATCH_AUTO}


def deepspeed(root: pathlib.Path, config: dict, name: str) -> dict:
    """The YAML line of DeepSpeed: `config` written as ``root / name`` (a JSON file, as axolotl's are used)."""
    path = root / name
    path.write_text(json.dumps(config, indent=2))
    return {"deepspeed": str(path)}


def with_cp(cfg: dict, output_dir: pathlib.Path, cp: int = 2, plugin: str = PLUGIN) -> dict:
    """`cfg` under the plugin at ``context_parallel_size: cp``."""
    return {**cfg, "plugins": [plugin], "context_parallel_size": cp, "output_dir": str(output_dir)}


def launch(yaml_path: pathlib.Path, nproc: int, log: pathlib.Path, timeout: float = 900.0) -> None:
    """axolotl's own CLI on `yaml_path`: ``python -m axolotl.cli.train`` in one process, or under
    ``torchrun --nproc-per-node nproc``; a failure raises with the log's tail."""
    if nproc == 1:
        cmd = [sys.executable, "-m", "axolotl.cli.train", str(yaml_path)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "axolotl.cli.train", str(yaml_path)]
    here = str(pathlib.Path(__file__).parent)  # axolotl_plugins (the CPU stand-ins) importable by axolotl
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    # DeepSpeed's JIT ops (its CPU shared-memory communication, CPU Adam) built once per venv: in the shared cache
    # another venv's DeepSpeed rebuilds them back and forth (3 minutes a launch measured)
    env = {**os.environ, **ENV, "PYTHONPATH": path,
           "PATH": f"{pathlib.Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", f"{sys.prefix}/torch_extensions")}
    with open(log, "w") as out:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
    if code:
        raise AssertionError(f"{' '.join(cmd)} failed ({code}):\n" + log.read_text()[-6000:])


def results(output_dir: pathlib.Path, history: bool = True) -> dict:
    """What a finished run left: the logged steps and evaluations (the last checkpoint's trainer_state.json, full
    precision) and the final parameters (the saved model, or the saved adapter: its LoRA weights and the modules
    it trains whole)."""
    from safetensors.torch import load_file

    saved = output_dir / "model.safetensors"
    params = load_file(str(saved if saved.exists() else output_dir / "adapter_model.safetensors"))
    # axolotl saves an FSDP2 adapter under the names of FSDP's activation-checkpoint wrappers: read them as the layers'
    params = {name.replace("_checkpoint_wrapped_module.", ""): value for name, value in params.items()}
    flat = torch.cat([params[k].double().reshape(-1) for k in sorted(params)])
    if not history:
        return {"params": flat, "names": sorted(params)}
    checkpoints = sorted(output_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    history = json.loads((checkpoints[-1] / "trainer_state.json").read_text())["log_history"]
    return {"steps": [e for e in history if "loss" in e and "train_loss" not in e],
            "evals": [e for e in history if "eval_loss" in e], "params": flat, "names": sorted(params)}


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


def leak_worker(rank: int, world: int, output_dir: str, victim: int, adapter: str) -> dict:
    """The plugin's trainer class (axolotl's ``AxolotlTrainer`` under the mixin, cp = world) on one packed row,
    then on the same row with document `victim`'s tokens changed: which targets' losses moved, inside and outside
    that document; ``"full"``: a Llama, ``"lora"``: a Qwen3 under the LoRA adapter saved in `adapter` (its
    embeddings and head trained whole beside it)."""
    os.environ.update(ENV, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import peft

    models = {"full": tiny_model("llama", torch.float64),
              "lora": peft.PeftModel.from_pretrained(tiny_model("qwen3", torch.float64), adapter, is_trainable=True)}
    return {name: _leak_probe(model, world, output_dir, victim) for name, model in models.items()}


def _leak_probe(model: torch.nn.Module, world: int, output_dir: str, victim: int) -> dict:
    from axolotl.core.training_args import AxolotlTrainingArguments

    from blockdiag_cp.integrations.axolotl import BlockDiagCPPlugin

    plugin = BlockDiagCPPlugin()
    plugin.register({"plugins": [PLUGIN], "context_parallel_size": world, "sample_packing": True,
                     "attn_implementation": "sdpa"})
    args = AxolotlTrainingArguments(output_dir=output_dir, sample_packing=True, use_cpu=True, report_to="none",
                                    per_device_train_batch_size=1, max_steps=1)
    trainer = plugin.get_trainer_cls(None)(model=model, args=args)
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
            "keys": sorted(packed_row(docs)), "trainer": type(trainer).__name__,
            "lora_layers": sum("lora_B" in name for name, _ in model.named_parameters())}
