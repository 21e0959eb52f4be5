"""The tiny local assets of the torchtitan runs (tests/stacks/test_torchtitan.py, benchmarks/gpu_torchtitan.py):
a word-level tokenizer, a jsonl dataset of random-word documents, and a torchtitan config_registry module."""

import json
import pathlib
import random

WORDS = [f"w{i}" for i in range(200)]
CONFIG_MODULE = '''\
"""A torchtitan config_registry module (torchtitan 0.3.0's config format), written by the test."""
from torchtitan.components.validate import Validator
from torchtitan.distributed.activation_checkpoint import FullAC
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.llama3 import model_registry as llama3_registry
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel
from torchtitan.models.qwen3.config_registry import qwen3_debugmodel
from blockdiag_cp.integrations.torchtitan import blockdiag_config


def tiny(config):
    config.model_spec.model.layers = config.model_spec.model.layers[:2]   # the debug flavor, 2 layers
    config.hf_assets_path = {tok!r}
    config.dataloader.dataset_path = {data!r}
    config.training.seq_len = {seq_len}
    config.training.local_batch_size = 1
    config.training.steps = {steps}
    config.training.mixed_precision_param = "float32"
    config.parallelism.spmd_backend = "partial_dtensor"
    config.checkpoint.enable = False
    config.validator.enable = False
    config.debug.seed = 0
    config.dump_folder = {dump!r}
    return config


def tiny_llama3():
    """torchtitan's trainer through blockdiag-cp (``--blockdiag_cp.cp_degree N`` on the command line)."""
    return tiny(blockdiag_config(llama3_debugmodel(), cp_degree=1))


def tiny_llama3_titan():
    """torchtitan's own trainer and attention (FlexAttention, block-causal from positions), no CP."""
    return tiny(llama3_debugmodel())


def tiny_llama3_compiled():
    """torchtitan's per-block compile (aot_eager: dynamo and AOTAutograd as inductor, without building C++)."""
    config = tiny_llama3()
    config.compile.enable = True
    config.compile.backend = "aot_eager"
    return config


def tiny_llama3_windowed():
    """varlen attention with a window of 31 keys, 2 rows per micro-batch, 2 micro-batches per step, the
    validator every 2 steps and a checkpoint every 2 steps (selective activation checkpointing: the default)."""
    config = tiny_llama3()
    config.model_spec = llama3_registry("debugmodel", attn_backend="varlen")
    config.model_spec.model.layers = config.model_spec.model.layers[:2]
    for layer in config.model_spec.model.layers:
        layer.attention.inner_attention.window_size = (31, 0)
    config.training.local_batch_size = 2
    config.training.global_batch_size = 8
    config.training.steps = 4
    config.validator = Validator.Config(enable=True, freq=2, steps=2, dataloader=HuggingFaceTextDataLoader.Config(
        dataset="c4_test", dataset_path={validation!r}))
    config.checkpoint.enable = True
    config.checkpoint.interval = 2
    config.activation_checkpoint = None
    return config


def tiny_deepseek_v3():
    """torchtitan's deepseek_v3 debugmodel (MLA; a dense layer, then a MoE layer of 8 routed experts, top 3, 2 shared,
    load balancing by expert biases), selective activation checkpointing (the flavor's default)."""
    return tiny(blockdiag_config(deepseek_v3_debugmodel(), cp_degree=1))


def tiny_qwen3_full_ac():
    """torchtitan's qwen3 debugmodel (fused QKV, QK norm, GQA, tied embeddings), full activation checkpointing."""
    config = tiny(blockdiag_config(qwen3_debugmodel(), cp_degree=1))
    config.activation_checkpoint = FullAC.Config()
    return config
'''


def config_module(root: pathlib.Path, *, seq_len: int, steps: int, dump: pathlib.Path) -> str:
    """`CONFIG_MODULE` for the assets under `root` (`write_assets`; the perturbed data is the validation set)."""
    return CONFIG_MODULE.format(tok=str(root / "tok"), data=str(root / "data"), seq_len=seq_len, steps=steps,
                                dump=str(dump), validation=str(root / "data_perturbed"))


def write_tokenizer(folder: pathlib.Path) -> None:
    """A word-level tokenizer (tokenizer.json + tokenizer_config.json) torchtitan's HuggingFaceTokenizer loads."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


def documents(perturb_first: bool = False) -> list[str]:
    """48 documents of 5..70 words; `perturb_first` changes every word of the first one (same length)."""
    rng = random.Random(0)
    docs = [[rng.choice(WORDS) for _ in range(rng.randint(5, 70))] for _ in range(48)]
    if perturb_first:
        docs[0] = [WORDS[(WORDS.index(w) + 7) % len(WORDS)] for w in docs[0]]
    return [" ".join(d) for d in docs]


def write_dataset(folder: pathlib.Path, docs: list[str]) -> None:
    folder.mkdir(parents=True)
    (folder / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))


def write_assets(root: pathlib.Path) -> None:
    """``root/tok``, ``root/data`` and ``root/data_perturbed`` (the first document changed, same length)."""
    write_tokenizer(root / "tok")
    write_dataset(root / "data", documents())
    write_dataset(root / "data_perturbed", documents(perturb_first=True))
