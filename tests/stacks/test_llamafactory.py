"""LLaMA-Factory's SFT workflow (``neat_packing``) through blockdiag_cp.integrations.llamafactory, against itself.

One YAML config, written here for a tiny Llama (random weights, saved from a config) with a character-level
tokenizer and a local dataset registered in a local ``dataset_info.json`` (nothing is downloaded):

- the run without CP is LLaMA-Factory's own ``llamafactory-cli train cfg.yaml``, one process;
- the run under CP is the entry at ``blockdiag_cp_size: 2`` under torchrun on CPU gloo, with a leak probe after
  training (tests/stacks/llamafactory_probe.py).

They must agree on every logged loss and grad norm, the evaluation loss and the saved parameters (float32:
LLaMA-Factory trains the weights in float32; the tolerances are ~10x the rounding seen, far below a
normalization or a leak), and changing one packed document must change no other document's loss, bit for bit.
Needs LLaMA-Factory (``pip install -e ".[llamafactory]"``, docs/llamafactory.md); skipped without it.
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
              disable_shuffling=True, use_cpu=True, seed=0)


def tiny_stack(root: pathlib.Path) -> dict:
    """A tiny Llama and its tokenizer in ``root/model``, SFT data in ``root/data``; returns the base config."""
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = list(string.ascii_letters + string.digits + " .,:?!\n")
    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", *chars])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()
    model_dir = root / "model"
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>").save_pretrained(model_dir)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    transformers.LlamaForCausalLM(config).save_pretrained(model_dir)
    rng = random.Random(0)

    def text(lo, hi):
        return "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(rng.randint(lo, hi)))

    rows = [{"instruction": text(2, 8), "input": "", "output": text(3, 14)} for _ in range(32)]
    data = root / "data"
    data.mkdir()
    (data / "train.json").write_text(json.dumps(rows[:24]))
    (data / "eval.json").write_text(json.dumps(rows[24:]))
    (data / "dataset_info.json").write_text(json.dumps({"tiny_train": {"file_name": "train.json"},
                                                         "tiny_eval": {"file_name": "eval.json"}}))
    return {**CONFIG, "model_name_or_path": str(model_dir), "dataset_dir": str(data)}


def write_yaml(path: pathlib.Path, config: dict) -> pathlib.Path:
    import yaml

    path.write_text(yaml.safe_dump(config))
    return path


def launch(cmd: list, timeout: int = 300) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=hang_timeout(timeout), cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]


def outcome(out: pathlib.Path) -> dict:
    """What a run saved: per-step losses and grad norms, the evaluation loss, the final parameters."""
    from safetensors.torch import load_file

    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    steps = [(h["loss"], h["grad_norm"]) for h in history if "loss" in h]
    return {"steps": steps, "eval_loss": json.loads((out / "all_results.json").read_text())["eval_loss"],
            "params": load_file(str(out / "model.safetensors"))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """LLaMA-Factory's own run without CP and the entry's run at cp 2 (with the leak probe), on one config."""
    root = tmp_path_factory.mktemp("llamafactory")
    base = tiny_stack(root)
    cli = pathlib.Path(sys.executable).with_name("llamafactory-cli")
    plain = write_yaml(root / "plain.yaml", {**base, "output_dir": str(root / "plain")})
    launch([str(cli), "train", str(plain)])
    cp = write_yaml(root / "cp.yaml", {**base, "output_dir": str(root / "cp"), "blockdiag_cp_size": 2})
    launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(HERE / "llamafactory_probe.py"), str(cp)])
    return outcome(root / "plain"), outcome(root / "cp"), json.loads((root / "cp" / "leak_probe.json").read_text())


@pytest.mark.slow
def test_sft_at_cp2_equals_llamafactory_without_cp(runs):
    plain, cp, _ = runs
    assert len(plain["steps"]) == len(cp["steps"]) == CONFIG["max_steps"]
    for (loss, norm), (cp_loss, cp_norm) in zip(plain["steps"], cp["steps"]):
        assert cp_loss == pytest.approx(loss, rel=1e-5) and cp_norm == pytest.approx(norm, rel=1e-5)
    assert cp["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-5)
    assert plain["params"].keys() == cp["params"].keys()
    for name, value in plain["params"].items():
        torch.testing.assert_close(cp["params"][name], value, rtol=0, atol=2e-5, msg=name)


@pytest.mark.slow
def test_no_document_loss_moves_when_another_packed_document_changes(runs):
    _, _, probe = runs
    assert probe["documents"] >= 2  # the probed row packs several documents
    assert probe["changed_inside"] > 0  # the edit reaches the edited document's own targets
    assert probe["changed_elsewhere"] == 0, probe


def test_options_that_would_differ_under_cp_are_refused_by_name():
    from blockdiag_cp.integrations.llamafactory import check_config, refusals, split_config

    base = {k: v for k, v in CONFIG.items()}
    assert refusals(base) == []
    for change, named in ((dict(neat_packing=False), "neat_packing=False"), (dict(stage="dpo"), "stage='dpo'"),
                          (dict(finetuning_type="lora"), "finetuning_type='lora'"),
                          (dict(flash_attn="fa2"), "flash_attn='fa2'"), (dict(use_unsloth=True), "use_unsloth=True"),
                          (dict(enable_liger_kernel=True), "enable_liger_kernel=True"),
                          (dict(predict_with_generate=True), "predict_with_generate=True"),
                          (dict(use_hyper_parallel=True), "use_hyper_parallel=True")):
        with pytest.raises(ValueError, match=named.replace("(", r"\(")):
            check_config({**base, **change})
    without = {k: v for k, v in base.items() if k != "finetuning_type"}  # LLaMA-Factory's default is lora
    assert any(r.startswith("finetuning_type='lora'") for r in refusals(without))
    with pytest.raises(ValueError, match="set blockdiag_cp_size"):
        split_config(base)
    with pytest.raises(ValueError, match="blockdiag_cp_size must be an int >= 1"):
        split_config({**base, "blockdiag_cp_size": 0})
    assert split_config({**base, "blockdiag_cp_size": 2}) == (base, 2)


def test_neat_packing_documents_are_read_exactly_or_refused():
    from blockdiag_cp.integrations.llamafactory import neat_packing_documents

    mask = torch.tensor([[1, 1, 1, 2, 2, 3, 0, 0]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 0]])
    assert torch.equal(neat_packing_documents(mask, positions), mask)
    with pytest.raises(ValueError, match="set neat_packing: true"):  # packing without neat_packing: 0/1 masks
        neat_packing_documents(torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]]), positions)
    with pytest.raises(ValueError, match="comes back later"):
        neat_packing_documents(torch.tensor([[1, 1, 1, 2, 2, 1, 0, 0]]), positions)
    with pytest.raises(ValueError, match="a \\[B, S\\] attention_mask"):
        neat_packing_documents(torch.zeros(1, 1, 8, 8), positions)
