"""LLaMA-Factory's SFT workflow (``neat_packing``) through blockdiag_cp.integrations.llamafactory, against itself.

YAML configs written here for tiny models of three families (Llama, Qwen3, Gemma3; random weights saved from a
config) with a character-level tokenizer and a local dataset registered in a local ``dataset_info.json`` (nothing
is downloaded). Each config runs twice, at the same dp:

- without CP: LLaMA-Factory's own ``run_exp``, as ``FORCE_TORCHRUN=1 llamafactory-cli train cfg.yaml`` runs it;
- under CP: the entry at ``blockdiag_cp_size: 2`` on CPU gloo, with a leak probe after training.

The configs of one world share a launch (tests/stacks/llamafactory_runs.py runs them one after another):

- dp 1 (LLaMA-Factory on 1 process, the entry on 2): LoRA (+ a save at step 2 and a resume from it to the
  end), freeze (with a ``cutoff_len`` that is not a multiple of 8), LoRA under LLaMA-Factory's ZeRO-2 config with
  non-reentrant checkpointing, full fine-tuning under its ZeRO-3 config;
- dp 2 (LLaMA-Factory on 2 processes, the entry on 4: dp 2 x cp 2): LoRA under DDP without gradient
  checkpointing, full fine-tuning under ZeRO-2, LoRA under ZeRO-3.

They must agree on every logged loss and grad norm, the evaluation loss (over a partial last batch) and the saved
parameters or adapter weights (float32, as LLaMA-Factory trains on CPU; losses 1e-5 relative, parameters 1e-4
absolute, the project's tolerances), and changing one packed document must change no other document's loss, bit
for bit. LLaMA-Factory's own gradient checkpointing (on by default, reentrant) runs in every config but the DDP one.
Needs LLaMA-Factory and DeepSpeed (``pip install -e ".[llamafactory]"``, docs/llamafactory.md); skipped without it.
"""

import json
import os
import pathlib
import random
import string
import subprocess
import sys

import pytest
import torch

pytest.importorskip("llamafactory")
try:
    import llamafactory.train.sft.workflow  # noqa: F401  (imports torchvision and torchaudio when installed)
except (ImportError, OSError, RuntimeError) as exc:
    pytest.fail(f"LLaMA-Factory is installed but its SFT workflow does not import ({type(exc).__name__}: {exc}); "
                "with a CPU-only torch see docs/llamafactory.md#cpu-only-torch-as-on-the-projects-ci-machine",
                pytrace=False)

from blockdiag_cp.testing import hang_timeout  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CONFIG = dict(stage="sft", do_train=True, finetuning_type="full", dataset="tiny_train", eval_dataset="tiny_eval",
              template="default", cutoff_len=96, packing=True, neat_packing=True, overwrite_cache=True,
              preprocessing_num_workers=1, overwrite_output_dir=True, per_device_train_batch_size=2,
              per_device_eval_batch_size=3, gradient_accumulation_steps=2, learning_rate=1.0e-2, max_steps=2,
              logging_steps=1, save_strategy="no", eval_strategy="no", do_eval=True, report_to="none",
              use_cpu=True, seed=0)
#: LLaMA-Factory's examples/deepspeed/ds_z{2,3}_config.json (its settings, as it ships them)
_DS_COMMON = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
              "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                       "hysteresis": 2, "min_loss_scale": 1},
              "bf16": {"enabled": "auto"}, "comms_config": {"verbose": False},
              "monitor_config": {"enabled": True, "tag": "DeepSpeedMonitor", "csv_monitor": {"enabled": False}}}
DS_Z2 = {**_DS_COMMON, "zero_optimization": {
    "stage": 2, "allgather_partitions": True, "allgather_bucket_size": 5e8, "overlap_comm": False, "reduce_scatter": True,
    "reduce_bucket_size": 5e8, "contiguous_gradients": True, "round_robin_gradients": True}}
DS_Z3 = {**_DS_COMMON, "zero_optimization": {
    "stage": 3, "overlap_comm": False, "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
    "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
    "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
    "stage3_gather_16bit_weights_on_model_save": True}}

LORA = dict(finetuning_type="lora", lora_target="all", lora_rank=4, lora_alpha=8, learning_rate=2e-2)
FREEZE = dict(finetuning_type="freeze", freeze_trainable_layers=1, freeze_trainable_modules="all")
#: name -> (model family, changes to CONFIG): the configs of each dp, run by LLaMA-Factory and the entry
RUNS = {
    1: {"lora": ("llama", {**LORA, "max_steps": 3, "save_strategy": "steps", "save_steps": 2,
                           "lr_scheduler_type": "cosine", "warmup_ratio": 0.1}),  # as LLaMA-Factory's examples
        # cutoff_len 100: LLaMA-Factory's collator pads input_ids to a multiple of 8, not position_ids
        "freeze": ("qwen3", {**FREEZE, "cutoff_len": 100, "learning_rate": 2e-3}),
        "zero2_lora": ("qwen3", {**LORA, "deepspeed": "ds_z2.json", "use_reentrant_gc": False}),
        "zero3_full": ("gemma3", {"deepspeed": "ds_z3.json"})},
    2: {"ddp_lora": ("qwen3", {**LORA, "disable_gradient_checkpointing": True}),
        "zero2_full": ("llama", {"deepspeed": "ds_z2.json"}),
        "zero3_lora": ("qwen3", {**LORA, "deepspeed": "ds_z3.json"})},
}


def tiny_model(family: str, vocab_size: int):
    """A tiny causal LM of `family` (random weights, float32)."""
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    if family == "qwen3":  # per-head q/k norms, an explicit head_dim, tied embeddings
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=16, tie_word_embeddings=True))
    if family == "gemma3":  # sliding and full layers (the window, 4096 by default, is longer than the rows), q/k norms,
        # GeGLU, scaled and tied embeddings
        return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**common, head_dim=8))
    raise ValueError(f"unknown family {family!r}")


def tiny_stack(root: pathlib.Path) -> dict:
    """Tiny models and their tokenizer in ``root/<family>``, SFT data in ``root/data``, LLaMA-Factory's DeepSpeed
    configs in ``root``; returns the base config (without a model)."""
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = list(string.ascii_letters + string.digits + " .,:?!\n")
    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", *chars])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()
    for family in ("llama", "qwen3", "gemma3"):
        transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                            eos_token="</s>").save_pretrained(root / family)
        tiny_model(family, len(vocab)).save_pretrained(root / family)
    rng = random.Random(0)

    def text(lo, hi):
        return "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(rng.randint(lo, hi)))

    rows = [{"instruction": text(2, 8), "input": "", "output": text(3, 14)} for _ in range(44)]
    data = root / "data"
    data.mkdir()
    (data / "train.json").write_text(json.dumps(rows[:36]))
    (data / "eval.json").write_text(json.dumps(rows[36:]))
    (data / "dataset_info.json").write_text(json.dumps({"tiny_train": {"file_name": "train.json"},
                                                         "tiny_eval": {"file_name": "eval.json"}}))
    (root / "ds_z2.json").write_text(json.dumps(DS_Z2))
    (root / "ds_z3.json").write_text(json.dumps(DS_Z3))
    return {**CONFIG, "dataset_dir": str(data)}


def config_of(root: pathlib.Path, base: dict, family: str, changes: dict, output: str, **more) -> dict:
    """`base` with `changes` for the model of `family`, writing to ``root/output``."""
    out = {**base, **changes, **more, "model_name_or_path": str(root / family), "output_dir": str(root / output)}
    if "deepspeed" in out:
        out["deepspeed"] = str(root / out["deepspeed"])
    return out


def write_yaml(path: pathlib.Path, config: dict) -> pathlib.Path:
    import yaml

    path.write_text(yaml.safe_dump(config))
    return str(path)


def launch(world: int, mode: str, yamls: list, timeout: int = 900) -> None:
    """``torchrun --nproc-per-node world llamafactory_runs.py mode *yamls`` (gloo on CPU)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    # DeepSpeed builds its shared-memory op on first use (minutes on 2 cores) into torch's extension cache; a cache of
    # this venv's own, so that other venvs' DeepSpeed (other include paths) do not rebuild it back and forth
    env.setdefault("TORCH_EXTENSIONS_DIR", str(pathlib.Path(sys.prefix) / "torch_extensions"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           str(HERE / "llamafactory_runs.py"), mode, *yamls]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=hang_timeout(timeout), cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


def outcome(out: pathlib.Path) -> dict:
    """What a run saved: per-step losses and grad norms, the evaluation loss, the final parameters (the adapter's
    under LoRA), the leak probe's counts (runs under CP)."""
    from safetensors.torch import load_file

    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    weights = out / "adapter_model.safetensors"
    probe = out / "leak_probe.json"
    return {"steps": {h["step"]: (h["loss"], h["grad_norm"]) for h in history if "loss" in h},
            "eval_loss": json.loads((out / "all_results.json").read_text())["eval_loss"],
            "params": load_file(str(weights if weights.exists() else out / "model.safetensors")),
            "probe": json.loads(probe.read_text()) if probe.exists() else None}


def moved(params: dict, root: pathlib.Path, family: str) -> float:
    """The largest change training made to a saved weight: from the model's initial weights, or from 0 for an
    adapter's (LoRA's B matrices start at 0)."""
    from safetensors.torch import load_file

    initial = load_file(str(root / family / "model.safetensors"))
    return max(float((value - initial.get(name, torch.zeros_like(value))).abs().max()) for name, value in params.items()
               if name in initial or "lora_B" in name)


def run_group(root: pathlib.Path, base: dict, dp: int) -> dict:
    """Every config of ``RUNS[dp]`` by LLaMA-Factory on ``dp`` processes and by the entry on ``dp x 2``: name ->
    (LLaMA-Factory's outcome, the entry's outcome); at dp 1 also ``"lora_resumed"``: the entry resumed from the
    LoRA run's step-2 checkpoint."""
    plain, cp = [], []
    for name, (family, changes) in RUNS[dp].items():
        plain.append(write_yaml(root / f"{name}_plain.yaml", config_of(root, base, family, changes, f"{name}_plain")))
        cp.append(write_yaml(root / f"{name}_cp.yaml", config_of(root, base, family, changes, f"{name}_cp",
                                                                  blockdiag_cp_size=2)))
        if name == "lora":
            cp.append(write_yaml(root / "lora_resumed_cp.yaml", config_of(
                root, base, family, changes, "lora_resumed_cp", blockdiag_cp_size=2,
                resume_from_checkpoint=str(root / "lora_cp" / "checkpoint-2"))))
    launch(dp, "plain", plain)
    launch(2 * dp, "cp", cp)
    out = {name: (outcome(root / f"{name}_plain"), outcome(root / f"{name}_cp")) for name in RUNS[dp]}
    for name, (family, _) in RUNS[dp].items():
        out[name][0]["moved"] = moved(out[name][0]["params"], root, family)
    if dp == 1:
        out["lora_resumed"] = (out["lora"][0], outcome(root / "lora_resumed_cp"))
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("llamafactory")
    return root, tiny_stack(root)


@pytest.fixture(scope="module")
def dp1(stack):
    return run_group(*stack, dp=1)


@pytest.fixture(scope="module")
def dp2(stack):
    return run_group(*stack, dp=2)


def assert_same(plain: dict, cp: dict, steps: int, label: str) -> None:
    """Every logged loss and grad norm (1e-5 relative), the eval loss (1e-5 relative), every parameter (1e-4
    absolute), and the leak probe: the edited document's own targets move, no other document's."""
    assert sorted(plain["steps"]) == sorted(cp["steps"]) == list(range(1, steps + 1)), (label, plain["steps"], cp["steps"])
    for step, (loss, norm) in plain["steps"].items():
        cp_loss, cp_norm = cp["steps"][step]
        assert cp_loss == pytest.approx(loss, rel=1e-5), (label, step, "loss", cp_loss, loss)
        assert cp_norm == pytest.approx(norm, rel=1e-5), (label, step, "grad_norm", cp_norm, norm)
    assert cp["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-5), (label, cp["eval_loss"], plain["eval_loss"])
    assert plain["params"].keys() == cp["params"].keys(), label
    for name, value in plain["params"].items():
        torch.testing.assert_close(cp["params"][name], value, rtol=0, atol=1e-4, msg=f"{label}: {name}")
    assert plain["moved"] > 1e-3, (label, "training hardly moved the weights", plain["moved"])
    probe = cp["probe"]
    assert probe["documents"] >= 2 and probe["changed_inside"] > 0, (label, probe)  # the edit reaches its own targets
    assert probe["changed_elsewhere"] == 0, (label, probe)


@pytest.mark.slow
def test_lora_at_cp2_equals_llamafactory_and_resumes_to_the_same_end(dp1):
    """LoRA (LLaMA-Factory's default) at cp 2, with the leak probe; resumed from its step-2 checkpoint it ends as
    the uninterrupted run (step 3, the eval loss, the adapter weights)."""
    assert_same(*dp1["lora"], steps=3, label="lora")
    plain, resumed = dp1["lora_resumed"]
    assert_same(plain, resumed, steps=3, label="lora resumed at step 2")


@pytest.mark.slow
def test_freeze_at_cp2_equals_llamafactory_at_any_cutoff_len(dp1):
    assert_same(*dp1["freeze"], steps=2, label="freeze, cutoff_len 100")


@pytest.mark.slow
def test_deepspeed_zero2_and_zero3_at_cp2_equal_llamafactory(dp1):
    assert_same(*dp1["zero2_lora"], steps=2, label="ZeRO-2, LoRA")
    assert_same(*dp1["zero3_full"], steps=2, label="ZeRO-3, full")


@pytest.mark.slow
def test_dp2_cp2_equals_llamafactory_at_dp2(dp2):
    """dp 2 x cp 2 (4 processes) against LLaMA-Factory's own dp 2 (2 processes): DDP, ZeRO-2 and ZeRO-3."""
    for name in RUNS[2]:
        assert_same(*dp2[name], steps=2, label=f"dp2 {name}")


def test_options_that_would_differ_under_cp_are_refused_by_name():
    from blockdiag_cp.integrations.llamafactory import check_config, refusals, split_config

    base = {**CONFIG, "model_name_or_path": "unused/model", "output_dir": "/tmp/blockdiag_cp_llamafactory"}
    assert refusals(base) == []
    for finetuning in ("lora", "freeze", "full"):
        assert refusals({**base, "finetuning_type": finetuning}) == []
    without = {k: v for k, v in base.items() if k != "finetuning_type"}  # LLaMA-Factory's default is lora
    assert refusals(without) == []
    assert any(r.startswith("stage='dpo'") for r in refusals({**base, "stage": "dpo"}))
    for change, named in ((dict(neat_packing=False), "neat_packing=False"), (dict(finetuning_type="oft"), "finetuning_type='oft'"),
                          (dict(flash_attn="fa2"), "flash_attn='fa2'"), (dict(use_unsloth=True), "use_unsloth=True"),
                          (dict(enable_liger_kernel=True), "enable_liger_kernel=True"),
                          (dict(predict_with_generate=True), "predict_with_generate=True"),
                          (dict(use_hyper_parallel=True), "use_hyper_parallel=True")):
        with pytest.raises(ValueError, match=named.replace("(", r"\(")):
            check_config({**base, **change})
    # the same refusals where LLaMA-Factory's parser reads --key value strings
    with pytest.raises(ValueError, match="finetuning_type='oft'"):
        check_config([f"--{k}={v}" for k, v in {**base, "finetuning_type": "oft"}.items()])
    with pytest.raises(ValueError, match="set blockdiag_cp_size"):
        split_config(base)
    with pytest.raises(ValueError, match="blockdiag_cp_size must be an int >= 1"):
        split_config({**base, "blockdiag_cp_size": 0})
    assert split_config({**base, "blockdiag_cp_size": 2}) == (base, 2)


def test_the_command_line_is_read_as_llamafactory_cli_reads_it(tmp_path, monkeypatch):
    """The entry reads ``cfg.yaml key=value ...``, ``cfg.json ...`` and ``--key value ...`` with LLaMA-Factory's own
    ``read_args`` (what ``llamafactory-cli train`` calls); an unquoted ``no`` that YAML reads as False for a string
    option is named before LLaMA-Factory's parser fails on it without naming it."""
    from llamafactory.hparams import read_args

    from blockdiag_cp.integrations.llamafactory import check_config, parsed_options, read_config, split_config

    base = {**CONFIG, "model_name_or_path": "unused/model", "output_dir": str(tmp_path / "out"), "blockdiag_cp_size": 2}
    yaml_path, json_path = write_yaml(tmp_path / "cfg.yaml", base), tmp_path / "cfg.json"
    json_path.write_text(json.dumps(base))
    argv = [yaml_path, "eval_strategy='no'", "learning_rate=3e-4", "blockdiag_cp_size=4"]
    monkeypatch.setattr(sys, "argv", ["llamafactory-cli", *argv])
    assert read_config(argv) == read_args()  # exactly what llamafactory-cli train reads
    config, cp_size = split_config(read_config(argv))
    assert cp_size == 4 and "blockdiag_cp_size" not in config
    check_config(config)
    monkeypatch.setattr(sys, "argv", ["llamafactory-cli", str(json_path)])
    with pytest.raises(AttributeError):  # LLaMA-Factory 0.9.5's own read_args fails on a JSON file
        read_args()
    with pytest.raises(ValueError, match="cannot read a JSON config"):
        read_config([str(json_path)])
    assert read_config([yaml_path, "learning_rate=3e-4"])["learning_rate"] == 3e-4
    with pytest.raises(ValueError, match=r"eval_strategy=False: YAML reads an unquoted no"):
        check_config(split_config(read_config([yaml_path, "eval_strategy=no"]))[0])
    flags = [f"--{k}={v}" for k, v in base.items() if k != "blockdiag_cp_size"]
    for given in (["--blockdiag_cp_size", "3"], ["--blockdiag-cp-size=3"]):
        monkeypatch.setattr(sys, "argv", ["llamafactory-cli", *flags, *given])
        assert read_config(flags + given) == read_args() == flags + given
        assert split_config(read_config(flags + given)) == (flags, 3)
    assert parsed_options(flags)["learning_rate"] == parsed_options(split_config(base)[0])["learning_rate"] == 1e-2
    with pytest.raises(ValueError, match="set --blockdiag_cp_size N"):
        split_config(flags)


def test_position_ids_past_cutoff_len_are_padded_as_packing_pads_them(stack):
    """LLaMA-Factory's own SFT collator (as run_sft builds it: pad_to_multiple_of=8) on neat-packed rows of a
    cutoff_len that is not a multiple of 8 pads every key but position_ids; the entry's collator pads those with 0
    (the packing's own padding value), so each row's documents are read and none gains a token."""
    from llamafactory.data import SFTDataCollatorWith4DAttentionMask, get_template_and_fix_tokenizer
    from llamafactory.hparams import DataArguments
    from transformers import AutoTokenizer

    from blockdiag_cp.integrations.llamafactory import NeatPackedDocuments

    root, _ = stack
    tokenizer = AutoTokenizer.from_pretrained(root / "llama")
    template = get_template_and_fix_tokenizer(tokenizer, DataArguments(template="default"))
    collator = SFTDataCollatorWith4DAttentionMask(template=template, tokenizer=tokenizer, pad_to_multiple_of=8,
                                                  label_pad_token_id=-100, block_diag_attn=True, neat_packing=True,
                                                  attn_implementation="sdpa")
    for cutoff_len, padded in ((100, 104), (96, 96)):
        rows = []
        for lengths in ((30, 50), (61,)):  # the documents of a packed row, then padding to cutoff_len
            pad = cutoff_len - sum(lengths)
            rows.append({"input_ids": [5 + (i % 40) for i in range(cutoff_len)],
                         "attention_mask": [d + 1 for d, n in enumerate(lengths) for _ in range(n)] + [0] * pad,
                         "position_ids": [p for n in lengths for p in range(n)] + [0] * pad,
                         "labels": [7] * sum(lengths) + [-100] * pad})
        own = collator([dict(r) for r in rows])
        assert own["input_ids"].shape == (2, padded) and own["position_ids"].shape == (2, cutoff_len)
        batch = NeatPackedDocuments(collator)([dict(r) for r in rows])
        assert batch["position_ids"].shape == (2, padded)
        assert torch.equal(batch["position_ids"][:, :cutoff_len], torch.tensor([r["position_ids"] for r in rows]))
        assert not batch["position_ids"][:, cutoff_len:].any()
        ids = batch["_packed_seq_ids"]
        assert torch.equal(ids[:, :cutoff_len], torch.tensor([r["attention_mask"] for r in rows]))
        assert not ids[:, cutoff_len:].any() and (batch["labels"][:, cutoff_len:] == -100).all()


def test_neat_packing_documents_are_read_exactly_or_refused():
    from blockdiag_cp.integrations.llamafactory import neat_packing_documents, padded_positions

    mask = torch.tensor([[1, 1, 1, 2, 2, 3, 0, 0]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 0]])
    assert torch.equal(neat_packing_documents(mask, positions), mask)
    with pytest.raises(ValueError, match="set neat_packing: true"):  # packing without neat_packing: 0/1 masks
        neat_packing_documents(torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]]), positions)
    with pytest.raises(ValueError, match="comes back later"):
        neat_packing_documents(torch.tensor([[1, 1, 1, 2, 2, 1, 0, 0]]), positions)
    with pytest.raises(ValueError, match="a \\[B, S\\] attention_mask"):
        neat_packing_documents(torch.zeros(1, 1, 8, 8), positions)
    assert torch.equal(padded_positions(positions[:, :6], mask), positions)  # the columns added are padding
    short = torch.tensor([[0, 1, 2, 0, 1]])
    assert padded_positions(short, mask) is short  # a column it would add holds a token: left for the check
    with pytest.raises(ValueError, match="position_ids"):
        neat_packing_documents(mask, padded_positions(short, mask))


def test_the_sliding_window_a_model_attends_within_is_read_from_its_config():
    import transformers

    from blockdiag_cp.integrations.llamafactory import sliding_window

    assert sliding_window(transformers.MistralConfig(sliding_window=24)) == 24
    assert sliding_window(transformers.MistralConfig(sliding_window=None)) is None
    assert sliding_window(transformers.Gemma3TextConfig(sliding_window=512)) == 512  # its sliding layers
    assert sliding_window(transformers.Gemma3TextConfig(sliding_window=512, layer_types=["full_attention"] * 26)) is None
    assert sliding_window(transformers.Qwen2Config(sliding_window=4096, use_sliding_window=False)) is None
    assert sliding_window(transformers.LlamaConfig()) is None
    assert sliding_window(transformers.PretrainedConfig(sliding_window=8)) == 8  # no layer_types: every layer
    assert sliding_window(transformers.PretrainedConfig(sliding_window=8, use_sliding_window=False)) is None
