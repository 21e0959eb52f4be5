"""Trainer and SFTTrainer runs in-process, on the rank pool's gloo ranks (CP) or here (the run without CP).

A run is described by a plain dict (`spec`, picklable for the pool) and returns what the
comparisons read: the logged losses and grad norms, logged metrics, the eval loss and the
final parameters. ``spec["cp"] = 0`` is transformers' ``Trainer`` / TRL's ``SFTTrainer``
without blockdiag-cp (one process here, or plain DDP on pool ranks); ``cp >= 1`` mixes in
`BlockDiagCPMixin`. Tiny float64 models with a 257-token vocabulary (TRL's byte tokenizer of
examples/train_trl_sft.py pads with id 256), random documents with prompt tokens (-100 labels).
"""

from __future__ import annotations

import os
import random
import tempfile
import threading
import warnings

import torch

VOCAB = 257
BASE = dict(steps=2, batch=3, accum=2, docs=24, eval_docs=6, lr=1e-2, prompt=0.5, collator="pad", evaluate=True)


def spec(**changes) -> dict:
    """A run: `BASE` with `changes` (``trainer``: "trainer" or "sft"; ``cp``; ``model``; ``args``: option overrides;
    ``layout``: the mixin's ``cp_config=CPConfig(layout=...)``, None: no cp_config; ``output_dir``: where checkpoints
    go, the same path on every rank (None: a temporary directory); ``resume``: ``train(resume_from_checkpoint=...)``)."""
    out = {**BASE, "trainer": "trainer", "cp": 0, "model": "llama", "args": {}, "loss_func": None,
           "accepts_loss_kwargs": True, "sft": {}, "whole_batch": False, "layout": None, "output_dir": None,
           "resume": None, "dtype": None}
    out.update(changes)
    return out


def documents(count: int, seed: int, prompt: float) -> list[dict]:
    """Random byte documents (12 to 48 tokens); up to a `prompt` fraction of each is prompt (labels -100)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = rng.randint(12, 48)
        ids = [rng.randrange(1, 256) for _ in range(n)]
        cut = int(n * prompt * rng.random())
        out.append({"input_ids": ids, "labels": [-100] * cut + ids[cut:],
                    "completion_mask": [0] * cut + [1] * (n - cut)})
    return out


def model(name: str):
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name in ("llama", "llama_tied"):  # llama_tied: the LM head is the input embeddings' weight
            m = transformers.LlamaForCausalLM(transformers.LlamaConfig(
                intermediate_size=64, tie_word_embeddings=name == "llama_tied", **common))
        elif name == "mixtral":
            config = transformers.MixtralConfig(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                                output_router_logits=True, router_aux_loss_coef=0.5, **common)
            return transformers.MixtralForCausalLM(config)  # float32: the grouped expert matmul has no float64
        elif name == "qwen3_vl":  # text rows through a VLM whose class says accepts_loss_kwargs=False
            text = {**common, "intermediate_size": 64, "head_dim": 8, "rope_parameters": {
                "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2], "mrope_interleaved": True}}
            vision = dict(depth=1, hidden_size=16, num_heads=2, patch_size=2, spatial_merge_size=2, temporal_patch_size=2,
                          in_channels=3, intermediate_size=16, out_hidden_size=32, num_position_embeddings=16,
                          deepstack_visual_indexes=[0])
            m = transformers.Qwen3VLForConditionalGeneration(transformers.Qwen3VLConfig(
                text_config=text, vision_config=vision, image_token_id=VOCAB - 2, video_token_id=VOCAB - 3,
                vision_start_token_id=VOCAB - 4, vision_end_token_id=VOCAB - 5))
        else:
            raise ValueError(f"unknown model {name!r}")
    return m.to(torch.float64)


def pad_collator(features: list[dict]) -> dict:
    """Right-padded rows (pad id 256): input_ids, attention_mask, labels (-100 on padding)."""
    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.full((len(features), longest), VOCAB - 1, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for i, f in enumerate(features):
        n = len(f["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = torch.tensor(f["input_ids"]), torch.tensor(f["labels"]), 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def causal_lm_loss(outputs, labels, num_items_in_batch=None):
    """A ``compute_loss_func``: transformers' ``ForCausalLMLoss`` on the rows."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(outputs.logits, labels, VOCAB, num_items_in_batch=num_items_in_batch)


def row_mean_loss(outputs, labels, num_items_in_batch=None):
    """A ``compute_loss_func`` that is no token sum: the mean over rows of each row's squared mean token loss."""
    logits, targets = outputs.logits[:, :-1].float(), labels[:, 1:]
    per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    counts = (targets != -100).sum(1).clamp(min=1)
    return ((per_token.sum(1) / counts) ** 2).mean()


LOSS_FUNCS = {"causal_lm": causal_lm_loss, "row_mean": row_mean_loss}


def token_metrics(eval_pred, compute_result: bool = True) -> dict:
    """A ``compute_metrics``: next-token accuracy, and sums of the inputs and losses it is given (if any)."""
    import numpy as np

    logits, labels = np.asarray(eval_pred.predictions), np.asarray(eval_pred.label_ids)
    targets = labels[:, 1:]
    mask = targets != -100
    out = {"accuracy": float((logits.argmax(-1)[:, :-1] == targets)[mask].mean()), "targets": int(mask.sum())}
    if eval_pred.inputs is not None:
        inputs = np.asarray(eval_pred.inputs)
        out["inputs"] = int(inputs[inputs != -100].sum())
    if eval_pred.losses is not None:
        out["losses"] = float(np.asarray(eval_pred.losses, dtype=np.float64).sum())
    return out


def byte_tokenizer():
    import tokenizers
    import transformers

    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"<eos>": 256}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<eos>"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


def common_args(s: dict, output_dir: str) -> dict:
    return {**dict(output_dir=output_dir, per_device_train_batch_size=s["batch"], per_device_eval_batch_size=s["batch"],
                   gradient_accumulation_steps=s["accum"], learning_rate=s["lr"], max_steps=s["steps"], logging_steps=1,
                   save_strategy="no", report_to="none", seed=0, data_seed=0, use_cpu=True, disable_tqdm=True,
                   bf16=False, include_num_input_tokens_seen="non_padding"), **s["args"]}


def build(s: dict, output_dir: str):
    """The trainer of `s` (module docstring)."""
    import transformers

    m = model(s["model"])
    if s["dtype"] is not None:  # DeepSpeed ZeRO-3 partitions float32, bfloat16 and float16 parameters only
        m = m.to(getattr(torch, s["dtype"]))
    if not s["accepts_loss_kwargs"]:
        m.accepts_loss_kwargs = False
    train, evaluation = documents(s["docs"], 0, s["prompt"]), documents(s["eval_docs"], 1, s["prompt"])
    kw = dict(model=m, compute_loss_func=LOSS_FUNCS.get(s["loss_func"]),
              compute_metrics=token_metrics if s.get("metrics") else None)
    if s["trainer"] == "sft":
        import datasets
        import trl

        datasets.disable_progress_bars()
        config = trl.SFTConfig(**common_args(s, output_dir), **{"gradient_checkpointing": False, **s["sft"]})
        kw.update(args=config, processing_class=byte_tokenizer(),
                  train_dataset=datasets.Dataset.from_list(train), eval_dataset=datasets.Dataset.from_list(evaluation))
        base = trl.SFTTrainer
    else:
        collator = transformers.DataCollatorWithFlattening() if s["collator"] == "flatten" else pad_collator
        for d in train + evaluation:
            d.pop("completion_mask")
        kw.update(args=transformers.TrainingArguments(**common_args(s, output_dir)), train_dataset=train,
                  eval_dataset=evaluation, data_collator=collator)
        base = transformers.Trainer
    if kw["args"].fsdp:
        base = type(f"CPUFSDP2{base.__name__}", (CPUStandInForAccelerateFSDP2, base), {})
    if s["cp"] == 0:
        m.set_attn_implementation("sdpa")
        return base(**kw)
    from blockdiag_cp import CPConfig
    from blockdiag_cp.trainer import BlockDiagCPMixin

    config = None if s["layout"] is None else CPConfig(layout=s["layout"])
    return type(f"CP{base.__name__}", (BlockDiagCPMixin, base), {})(cp_size=s["cp"], whole_batch=s["whole_batch"],
                                                                   cp_config=config, linear_ce=s.get("linear_ce", False),
                                                                   **kw)


class CPUStandInForAccelerateFSDP2:
    """Mixed in before the Trainer: accelerate's FSDP2 on CPU, as accelerate sets it up on GPUs.

    ``TrainingArguments(fsdp="full_shard", fsdp_config={"fsdp_version": 2})`` makes the Trainer build
    accelerate's ``FullyShardedDataParallelPlugin`` from ``args.fsdp_plugin_args``; on accelerator devices
    ``AcceleratorState`` then sets ``distributed_type = FSDP`` and keeps the plugin, but on CPU
    (``MULTI_CPU``) it drops it. This stands in for that one step of the GPU path, after the Trainer created
    its accelerator: the state gets ``DistributedType.FSDP`` and the plugin the Trainer built (with the mixed
    precision accelerate would give it), the Trainer's ``is_fsdp_enabled`` is set as the Trainer sets it from
    the state, and a ``ParallelismConfig`` (which accelerate refuses on ``MULTI_CPU``) is set and validated
    afterwards as ``Accelerator.__init__`` does it (its device mesh, its checks); from there on, accelerate's own FSDP2 preparation runs (``fully_shard`` of every decoder layer
    and the root over the world or ``ParallelismConfig``'s ``dp_shard x cp`` mesh, DTensor parameters, its
    gradient clipping and state dicts), exactly the code it runs on GPUs (design.md section 5).
    """

    def create_accelerator_and_postprocess(self) -> None:
        config, self.args.parallelism_config = self.args.parallelism_config, None  # accelerate refuses it on MULTI_CPU
        try:
            super().create_accelerator_and_postprocess()
        finally:
            self.args.parallelism_config = config
        from accelerate import PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        state = self.accelerator.state
        if state.distributed_type == DistributedType.FSDP:  # on GPUs: accelerate's own path, nothing to stand in for
            return
        plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
        if state.mixed_precision != "no":
            plugin.set_mixed_precision(state.mixed_precision)
        state.distributed_type, state.fsdp_plugin = DistributedType.FSDP, plugin
        # as AcceleratorState.__init__ ends: every later AcceleratorState() (the prepared optimizer's) copies the
        # PartialState's type over its own, which would turn the run back into MULTI_CPU (no FSDP2 state dicts)
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        self.is_fsdp_enabled = True
        if config is not None:  # what Accelerator.__init__ does with it, on the FSDP state
            state.parallelism_config, state.device_mesh = config, config.get_device_mesh(self.accelerator.device.type)
            config._validate_accelerator(self.accelerator)


def zero(stage: int, **extra) -> dict:
    """A DeepSpeed config as people write it for the Trainer: ZeRO `stage`, the rest "auto" (the Trainer's args)."""
    return {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto",
            "train_batch_size": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                      "weight_decay": "auto", "torch_adam": True}}, **extra}


def fsdp2(**config) -> dict:
    """``TrainingArguments`` options for accelerate's FSDP2, as people set them."""
    return {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2, **config}}


def run(s: dict) -> dict:
    """Train (and evaluate) the run `s`; what the comparisons read."""
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        before = set(threading.enumerate())  # a pool's process may hold threads of earlier runs
        trainer = build(s, s["output_dir"] or tmp)
        trainer.train(resume_from_checkpoint=s["resume"])
        planning = [t.name for t in set(threading.enumerate()) - before if t.name.startswith("blockdiag-cp-plan")]
        metrics = trainer.evaluate() if s["evaluate"] else {}
    steps = [e for e in trainer.state.log_history if "loss" in e and "train_loss" not in e]
    params = torch.cat([p.detach().double().reshape(-1) for p in full_parameters(trainer)])
    return {"steps": steps, "eval_loss": metrics.get("eval_loss"), "params": params,
            "tokens_seen": trainer.state.num_input_tokens_seen,
            "wrapper": wrapper_of(trainer), "cp_size": getattr(trainer, "cp_size", None),
            "dp_size": getattr(trainer, "dp_size", None), "planning_threads_after_train": planning,
            "metrics": {k: v for k, v in metrics.items() if not k.endswith(("runtime", "per_second"))}}


def full_parameters(trainer) -> list[torch.Tensor]:
    """The model's parameters, whole (gathered where ZeRO-3 or FSDP2 shard them)."""
    from blockdiag_cp.hf.parallelism import full_parameters as whole

    return whole(trainer)


def wrapper_of(trainer) -> str:
    """What trained the model: the wrapper's class, and ZeRO's stage under DeepSpeed."""
    wrapped = trainer.model_wrapped
    stage = getattr(wrapped, "zero_optimization_stage", None)
    return type(wrapped).__name__ + (f" ZeRO-{stage()}" if callable(stage) else "")


def pool_run(rank: int, world: int, s: dict) -> dict:
    """`run` on a rank of the pool: accelerate reads the launch from the environment (torchrun's variables)."""
    launched_as(rank, world)
    return run(s)


def launched_as(rank: int, world: int) -> None:
    """This pool rank as torchrun launches rank `rank` of `world` (the environment accelerate reads)."""
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))


def assert_same(got: dict, want: dict, keys=("loss", "grad_norm"), tol: float = 1e-6, param_tol: float = 1e-6,
                label: str = "", eval_tol: float | None = None) -> None:
    """Every logged step's `keys` within `tol` relative, the eval loss within `eval_tol` (default `tol`), the
    tokens seen equal (each replica's batch counted once, not once per CP rank), and the parameters within
    `param_tol`."""
    eval_tol = tol if eval_tol is None else eval_tol
    assert len(got["steps"]) == len(want["steps"]) >= 2, (label, got["steps"], want["steps"])
    if "tokens_seen" in got or "tokens_seen" in want:  # every run of this module reports it (stacks' logs may not)
        assert got.get("tokens_seen") == want.get("tokens_seen") > 0, (label, "tokens seen", got.get("tokens_seen"),
                                                                        want.get("tokens_seen"))
    for i, (a, b) in enumerate(zip(got["steps"], want["steps"]), 1):
        for key in keys:
            assert abs(a[key] - b[key]) <= tol * max(1.0, abs(b[key])), (label, "step", i, key, a[key], b[key])
    if want["eval_loss"] is not None:
        assert abs(got["eval_loss"] - want["eval_loss"]) <= eval_tol * abs(want["eval_loss"]), (
            label, "eval_loss", got["eval_loss"], want["eval_loss"])
    relative = float((got["params"] - want["params"]).norm() / want["params"].norm())
    assert relative <= param_tol, (label, "parameters", relative)
