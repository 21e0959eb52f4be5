"""The tiny local assets of the torchtitan runs (tests/stacks/test_torchtitan.py, benchmarks/gpu_torchtitan.py):
a word-level tokenizer, a jsonl dataset of random-word documents, and a torchtitan config_registry module."""

import json
import os
import pathlib
import random
import subprocess
import sys

WORDS = [f"w{i}" for i in range(200)]
CONFIG_MODULE = '''\
"""A torchtitan config_registry module (torchtitan 0.3.0's config format), written by the test."""
from torchtitan.models.llama3.config_registry import llama3_debugmodel
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
'''


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


def launch(root: pathlib.Path, name: str, world: int, runner: pathlib.Path, runner_args: tuple[str, ...],
           overrides: tuple[str, ...], seq_len: int, steps: int) -> pathlib.Path:
    """torchtitan's training under torchrun on CPU gloo: `runner` with ``OUT.pt``, `runner_args` and the config of
    `CONFIG_MODULE` (`seq_len`, `steps`) plus the CLI `overrides`; returns ``OUT.pt`` (``root / f"{name}.pt"``)."""
    cfg_dir = root / f"cfg_{name}"
    cfg_dir.mkdir()
    (cfg_dir / "tt_tiny_config.py").write_text(CONFIG_MODULE.format(
        tok=str(root / "tok"), data=str(root / "data"), seq_len=seq_len, steps=steps, dump=str(root / f"out_{name}")))
    out = root / f"{name}.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(cfg_dir), str(runner.parent), *sys.path]),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(root / "hf_cache")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", str(runner),
           str(out), *runner_args, "--module", "tt_tiny_config", "--config", "tiny_llama3", *overrides]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-8000:]
    return out
