"""The tiny local assets of the torchtitan runs (tests/stacks/test_torchtitan*.py, benchmarks/gpu_torchtitan.py):
a word-level tokenizer, a jsonl dataset of random-word documents, a torchtitan config_registry module, and the
launcher the test files share (`launch`: torchtitan's training under torchrun, tests/stacks/torchtitan_run.py)."""

import json
import os
import pathlib
import random
import subprocess
import sys

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


def pipelined(config, schedule, microbatches, rows=1):
    """torchtitan's pipeline over 2 ranks: `microbatches` of `rows` rows each per step (a row per micro-batch
    by default), full activation checkpointing (torchtitan's selective AC cannot run a zero-bubble schedule)."""
    config.parallelism.pipeline_parallel_degree = 2
    config.parallelism.pipeline_parallel_schedule = schedule
    config.parallelism.pipeline_parallel_microbatch_size = rows
    config.training.local_batch_size = microbatches * rows
    config.training.disable_cuda_graphs = True  # torchtitan refuses CUDA graphs with a pipeline
    config.activation_checkpoint = FullAC.Config()
    return config


def accumulated(config, microbatches, rows=1):
    """The same rows per step without a pipeline: `microbatches` micro-batches of `rows` rows (accumulation)."""
    config.training.local_batch_size = rows
    config.training.global_batch_size = microbatches * rows
    config.activation_checkpoint = FullAC.Config()
    return config


def tiny_llama3_1f1b():
    """llama3, torchtitan's 1F1B over 2 stages, 4 micro-batches of 2 rows."""
    return pipelined(tiny_llama3(), "1F1B", 4, rows=2)


def tiny_llama3_accumulated():
    """llama3 without a pipeline: the same 8 rows per step, 4 micro-batches of 2 rows."""
    return accumulated(tiny_llama3(), 4, rows=2)


def unchunked(config):
    """torchtitan's cross-entropy on the whole shard instead of its ChunkedLossWrapper (whose backward inside the
    loss moves the final norm's gradient under a zero-bubble schedule, with or without CP)."""
    config.loss = config.loss.loss_fn
    return config


def tiny_deepseek_v3_zero_bubble():
    """deepseek_v3 (MLA, MoE), torchtitan's InterleavedZeroBubble (4 virtual stages over 2 ranks: embeddings, the
    dense layer, the MoE layer, norm and head), 4 micro-batches of a row."""
    return unchunked(pipelined(tiny_deepseek_v3(), "InterleavedZeroBubble", 4))


def tiny_deepseek_v3_accumulated():
    """deepseek_v3 without a pipeline: the same 4 rows per step by accumulation."""
    return unchunked(accumulated(tiny_deepseek_v3(), 4))


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


def launch(root: pathlib.Path, name: str, world: int, config_fn: str, *overrides: str, seq_len: int, steps: int,
           probe: bool = True, timeout: float = 400) -> dict:
    """One torchtitan run under torchrun on CPU gloo (tests/stacks/torchtitan_run.py, `config_fn` of the config
    module written for the assets under `root`, torchtitan's CLI `overrides`); returns what the runner recorded.
    `probe`: the leak probe on ``root/data_perturbed`` (not under a pipeline)."""
    import torch

    cfg_dir = root / f"cfg_{name}"
    cfg_dir.mkdir()
    (cfg_dir / "tt_tiny_config.py").write_text(config_module(root, seq_len=seq_len, steps=steps, dump=root / f"out_{name}"))
    out = root / f"{name}.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(cfg_dir), *sys.path]), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(root / "hf_cache")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           str(pathlib.Path(__file__).resolve().parent / "torchtitan_run.py"), str(out),
           str(root / "data_perturbed") if probe else "-", "--module", "tt_tiny_config", "--config", config_fn,
           *overrides]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-8000:]
    return torch.load(out, weights_only=False)


def assert_trains_alike(ours: dict, ref: dict, steps: int) -> None:
    """Per-step losses, gradient norms and final parameters of two runs of the same config (float32)."""
    import torch

    assert ours["steps"] == ref["steps"] and len(ref["steps"]) == steps
    assert ours["tokens_seen"] == ref["tokens_seen"]  # torchtitan's n_tokens_seen: each token once
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
    # the logged norms, and each the gradients' own (float64, whole): torch's float32 CPU norm of each rank's
    # shards is off by ~1e-5 by an amount that moves with the sharding (Note [Gradient norms on CPU])
    torch.testing.assert_close(torch.tensor(ours["grad_norms"], dtype=torch.float64),
                               torch.tensor(ref["grad_norms"], dtype=torch.float64), rtol=1e-6, atol=0)
    for run in (ours, ref):
        torch.testing.assert_close(torch.tensor(run["grad_norms"], dtype=torch.float64),
                                   torch.tensor(run["exact_grad_norms"], dtype=torch.float64), rtol=1e-6, atol=0)
    assert ref["params"].keys() == ours["params"].keys()
    # float32 Adam: an element whose gradient is ~0 moves by up to lr x (a float32 rounding's sign), so a few
    # elements in 10^5 differ by ~1e-5 after 3 steps; any real difference moves every element by ~lr
    for name, p_ref in ref["params"].items():
        delta = ours["params"][name] - p_ref
        assert delta.abs().max() < 1e-4 and delta.norm() < 1e-5 * p_ref.norm(), (name, delta.abs().max())
