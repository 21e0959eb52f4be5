"""The axolotl plugin (issues #48, #52): axolotl's own CLI on its own YAML with the plugin equals the same YAML without
the plugin and without CP at the same dp (every logged step's loss, grad norm and token counts, every evaluation's
loss, the final parameters or adapter weights), at cp 2 (2 processes against 1) and dp 2 x cp 2 (4 processes against
axolotl's own dp 2 run), with LoRA, DeepSpeed ZeRO-2 and ZeRO-3 (axolotl's own JSON configs), FSDP2 and a
resume from a checkpoint, on three model families (Llama, Qwen3, Gemma 2); a changed document moves no other
document's loss, full fine-tuning or LoRA; the options the plugin has not verified are refused by name when axolotl
registers it. Needs axolotl (``pip install -e ".[axolotl]"``, docs/axolotl.md): skipped in every other venv
(``importorskip`` below).

All the launches start at once from one fixture (`runs`), a few side by side, and each test reads what its pair
left; the resume is queued behind the biggest launches and starts once the run it resumes has finished.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import pathlib
from typing import Callable, Optional

import pytest
import torch
import transformers
import yaml

pytest.importorskip("axolotl")

from axolotl_plugins import REPORT  # noqa: E402
from axolotl_runs import (  # noqa: E402
    PLUGIN, ZERO2, ZERO3, deepspeed, launch, leak_worker, lora, results, tiny_model, with_cp, write_inputs)

from blockdiag_cp.integrations.axolotl import BlockDiagCPPlugin, refusal  # noqa: E402

#: float32 (axolotl loads the model in float32 on CPU): losses, grad norms and evaluations within 1e-5 relative
#: (reduction order moved them up to 2e-7 here), parameters within 1e-4 absolute (observed up to 1.3e-5)
LOSS_TOL, PARAM_TOL = 1e-5, 1e-4
#: the CPU stand-ins' plugins (tests/stacks/axolotl_plugins.py): the run without CP, and the plugin under test
BASELINE, CP_PLUGIN = "axolotl_plugins.CPUWorldPlugin", "axolotl_plugins.CPUBlockDiagCPPlugin"
#: how many launches run at once (2 shared cores; a dp 2 x cp 2 launch is 4 processes)
PARALLEL = 3


def fsdp2(family: str) -> dict:
    """axolotl's FSDP2 YAML lines as its docs write them, activation checkpointing by FSDP (not the Trainer's)."""
    layer = {"llama": "LlamaDecoderLayer", "qwen3": "Qwen3DecoderLayer"}[family]
    return dict(fsdp_version=2, gradient_checkpointing=False,
                fsdp_config=dict(offload_params=False, cpu_ram_efficient_loading=False,
                                 auto_wrap_policy="TRANSFORMER_BASED_WRAP", transformer_layer_cls_to_wrap=layer,
                                 state_dict_type="FULL_STATE_DICT", reshard_after_forward=True,
                                 activation_checkpointing=True))


@dataclasses.dataclass(frozen=True)
class Pair:
    """One comparison: the plugin at ``cp`` x ``dp`` against axolotl without CP at ``dp``, on `family`'s model, with
    the YAML lines ``extra(root, family)`` added to both; ``wrapper``: what must have trained the model."""

    name: str
    family: str
    dp: int
    extra: Callable[[pathlib.Path, str], dict]
    wrapper: str
    cp: int = 2
    hidden: int = 32


PAIRS = (
    # Gemma 2 with eager attention (transformers' sdpa drops its logit softcap: the plugin refuses sdpa for it)
    Pair("cp2", "gemma2", 1, lambda root, family: {"attn_implementation": "eager"}, "DistributedDataParallel"),
    Pair("dp2cp2_lora", "qwen3", 2, lambda root, family: {**lora(root, family), "save_steps": 1},
         "DistributedDataParallel"),
    Pair("cp2_lora_zero2", "qwen3", 1, lambda root, family: {**lora(root, family), **deepspeed(root, ZERO2, "z2.json")},
         "DeepSpeedEngine ZeRO-2"),
    Pair("dp2cp2_zero2", "llama", 2, lambda root, family: deepspeed(root, ZERO2, "z2.json"), "DeepSpeedEngine ZeRO-2"),
    Pair("cp2_lora_zero3", "qwen3", 1, lambda root, family: {**lora(root, family), **deepspeed(root, ZERO3, "z3.json")},
         "DeepSpeedEngine ZeRO-3"),
    Pair("dp2cp2_zero3", "llama", 2, lambda root, family: deepspeed(root, ZERO3, "z3.json"), "DeepSpeedEngine ZeRO-3"),
    # accelerate's FSDP2 cannot shard PEFT's modules_to_save wrappers (axolotl's own run fails alike): LoRA alone
    Pair("dp2cp2_lora_fsdp2", "qwen3", 2, lambda root, family: {**lora(root, family, saved=()), **fsdp2(family)},
         "FSDPPeftModel"),
)
#: the run that resumes one of the pairs' CP runs from its checkpoint at step 1
RESUMED, RESUME_STEP = "dp2cp2_lora", 1


def pair_yamls(root: pathlib.Path, pair: Pair) -> dict[str, tuple[pathlib.Path, int]]:
    """``{"plain": (yaml, processes), "cp": (yaml, processes)}`` of `pair`, written under ``root / pair.name``."""
    base = root / pair.name
    base.mkdir()
    cfg = {**write_inputs(base, pair.family, pair.hidden), **pair.extra(base, pair.family)}
    plain = {**cfg, "plugins": [BASELINE], "output_dir": str(base / "plain"),
             "dataset_prepared_path": str(base / "prepared_plain")}
    cp = with_cp({**cfg, "dataset_prepared_path": str(base / "prepared_cp")}, base / "cp", pair.cp, plugin=CP_PLUGIN)
    out = {}
    for name, run_cfg, nproc in (("plain", plain, pair.dp), ("cp", cp, pair.dp * pair.cp)):
        (base / f"{name}.yml").write_text(yaml.safe_dump(run_cfg))
        out[name] = (base / f"{name}.yml", nproc)
    return out


def resume_yaml(root: pathlib.Path) -> tuple[pathlib.Path, int]:
    """The YAML of `RESUMED`'s CP run resumed from its checkpoint at `RESUME_STEP`, into an output folder of its
    own."""
    base = root / RESUMED
    cfg = yaml.safe_load((base / "cp.yml").read_text())
    cfg.update(output_dir=str(base / "resumed"), resume_from_checkpoint=str(base / "cp" / f"checkpoint-{RESUME_STEP}"))
    (base / "resumed.yml").write_text(yaml.safe_dump(cfg))
    pair = next(p for p in PAIRS if p.name == RESUMED)
    return base / "resumed.yml", pair.dp * pair.cp


def resume_after(whole: concurrent.futures.Future, root: pathlib.Path) -> None:
    """`RESUMED`'s CP run resumed from its checkpoint, once that run (`whole`) has finished (its error if it failed)."""
    whole.result()
    path, nproc = resume_yaml(root)
    launch(path, nproc, path.with_suffix(".log"))


def selected_pairs(items: list) -> tuple[list[Pair], bool]:
    """The pairs whose comparisons this session runs (``-k`` may pick some), and whether it runs the resume."""
    names = {item.callspec.params["pair"].name for item in items
             if item.name.startswith("test_axolotl_cli_under_the_plugin") and hasattr(item, "callspec")}
    resume = any(item.name == "test_a_resumed_run_ends_as_the_uninterrupted_one" for item in items)
    return [p for p in PAIRS if p.name in names or (resume and p.name == RESUMED)], resume


@pytest.fixture(scope="module")
def runs(tmp_path_factory, request) -> dict:
    """The selected pairs' two launches each (and the resume), `PARALLEL` at a time, biggest first; then what each
    left: ``{pair: {"root": its folder, "plain": results, "cp": results, "resumed": ...}}``, or the exception."""
    root = tmp_path_factory.mktemp("axolotl")
    pairs, resume = selected_pairs(request.session.items)
    jobs = {}
    for pair in pairs:
        for name, (path, nproc) in pair_yamls(root, pair).items():
            jobs[(pair.name, name)] = (path, nproc)
    order = sorted(jobs, key=lambda key: (-jobs[key][1], key != (RESUMED, "cp")))  # the resumed run's first
    biggest = sum(nproc == jobs[order[0]][1] for _, nproc in jobs.values())
    with concurrent.futures.ThreadPoolExecutor(PARALLEL) as pool:
        futures = {}
        for key in order:
            futures[key] = pool.submit(launch, jobs[key][0], jobs[key][1], jobs[key][0].with_suffix(".log"))
            if resume and len(futures) == biggest:
                # behind the biggest launches (the run it resumes long done by then), not at the end of the queue
                futures[(RESUMED, "resumed")] = pool.submit(resume_after, futures[(RESUMED, "cp")], root)
        concurrent.futures.wait(futures.values())
    out: dict = {}
    for (pair, name), future in futures.items():
        base = root / pair
        try:
            future.result()
            got = results(base / name)
            got["log"] = (base / f"{name}.yml").with_suffix(".log").read_text()
        except Exception as exc:  # noqa: BLE001  (each test reports its own pair's failure)
            got = exc
        out.setdefault(pair, {"root": base})[name] = got
    return out


def run_of(runs: dict, pair: str, name: str) -> dict:
    got = runs[pair][name]
    if isinstance(got, BaseException):
        raise got
    return got


def start_of(base: pathlib.Path) -> dict:
    """The parameters the runs under `base` started from (the model, or the adapter), as `results` reads them."""
    adapter = base / "adapter"
    return results(adapter if adapter.exists() else base / "model", history=False)


def assert_same_run(got: dict, want: dict, start: Optional[dict], steps_from: int = 0) -> None:
    """Every logged step after `steps_from`: loss and grad norm within `LOSS_TOL` relative, token counts equal;
    every evaluation after it within `LOSS_TOL`; the final parameters within `PARAM_TOL` and moved by training."""
    steps = [s for s in got["steps"] if s["step"] > steps_from]
    wanted = [s for s in want["steps"] if s["step"] > steps_from]
    assert [s["step"] for s in steps] == [s["step"] for s in wanted] and steps, (got["steps"], want["steps"])
    for a, b in zip(steps, wanted):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= LOSS_TOL * abs(b[key]), (a["step"], key, a[key], b[key])
        for key in ("tokens/total", "tokens/trainable"):
            assert a.get(key) == b.get(key), (a["step"], key, a.get(key), b.get(key))
    evals = [e for e in got["evals"] if e["step"] > steps_from]
    wanted_evals = [e for e in want["evals"] if e["step"] > steps_from]
    assert [e["step"] for e in evals] == [e["step"] for e in wanted_evals] and evals, (got["evals"], want["evals"])
    for a, b in zip(evals, wanted_evals):
        assert abs(a["eval_loss"] - b["eval_loss"]) <= LOSS_TOL * b["eval_loss"], (a, b)
    assert got["names"] == want["names"]
    moved = float((got["params"] - want["params"]).abs().max())
    trained = float((want["params"] - start["params"]).abs().max()) if start is not None else float("inf")
    assert start is None or start["names"] == want["names"], (start["names"], want["names"])
    assert moved <= PARAM_TOL < trained, (moved, trained)


@pytest.mark.slow
@pytest.mark.parametrize("pair", PAIRS, ids=[p.name for p in PAIRS])
def test_axolotl_cli_under_the_plugin_equals_axolotl_without_cp(runs, pair):
    plain, cp = run_of(runs, pair.name, "plain"), run_of(runs, pair.name, "cp")
    assert f"Plugin loaded successfully: {CP_PLUGIN}" in cp["log"] and "BlockDiagCPPlugin" not in plain["log"]
    trained_by = [line.split(REPORT, 1)[1].strip() for line in cp["log"].splitlines() if REPORT in line]
    assert trained_by and pair.wrapper in trained_by[0], trained_by  # DDP / DeepSpeed / FSDP2 / one CP group
    assert len(cp["steps"]) == len(plain["steps"]) >= 2, (cp["steps"], plain["steps"])  # axolotl sized both alike
    assert_same_run(cp, plain, start_of(runs[pair.name]["root"]))


@pytest.mark.slow
def test_a_resumed_run_ends_as_the_uninterrupted_one(runs):
    resumed, whole = run_of(runs, RESUMED, "resumed"), run_of(runs, RESUMED, "cp")
    assert f"checkpoint-{RESUME_STEP}" in resumed["log"]
    assert_same_run(resumed, whole, None, steps_from=RESUME_STEP)
    assert_same_run(resumed, run_of(runs, RESUMED, "plain"), None, steps_from=RESUME_STEP)


@pytest.mark.slow
def test_a_changed_document_moves_no_other_documents_loss(tmp_path):
    from blockdiag_cp.testing import spawn

    adapter = lora(tmp_path, "qwen3")["lora_model_dir"]
    got = spawn(leak_worker, 2, str(tmp_path), 2, adapter, timeout=900)[0]
    for name in ("full", "lora"):
        probe = got[name]
        assert probe["trainer"] == "BlockDiagCPAxolotlTrainer", probe
        assert "attention_mask" not in probe["keys"] and "position_ids" in probe["keys"], probe["keys"]
        assert probe["changed_inside"] > 0 and probe["changed_elsewhere"] == 0, (name, probe)
        assert probe["max_elsewhere"] == 0.0 and probe["targets"] > 100, (name, probe)  # bit for bit
    assert got["full"]["lora_layers"] == 0 and got["lora"]["lora_layers"] == 14, got


@pytest.mark.gpu
@pytest.mark.slow
def test_qlora_on_gpus_against_axolotl_without_cp(tmp_path):
    """QLoRA is refused (bitsandbytes' CPU path is not exact under CP: docs/axolotl.md); on GPUs this measures it,
    the plugin's refusal lifted (``QLoRAProbePlugin``): cp 2 on 2 GPUs against 1 (benchmarks/gpu_session.sh)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (NCCL: one process per GPU)")
    pair = Pair("gpu_qlora", "llama", 1, lambda root, family: {
        **lora(root, family, hidden=64), "adapter": "qlora", "load_in_4bit": True}, "DistributedDataParallel",
        hidden=64)  # bitsandbytes' 4-bit layers want rows of 64 and more
    yamls = pair_yamls(tmp_path, pair)
    cp_cfg = yaml.safe_load(yamls["cp"][0].read_text())
    yamls["cp"][0].write_text(yaml.safe_dump({**cp_cfg, "plugins": ["axolotl_plugins.QLoRAProbePlugin"]}))
    for name, (path, nproc) in yamls.items():
        launch(path, nproc, path.with_suffix(".log"))
    base = tmp_path / pair.name
    assert_same_run(results(base / "cp"), results(base / "plain"), start_of(base))


# -- refusals and the plugin's pieces (no launch) --------------------------------------------------------------------


def yaml_of(**changes) -> dict:
    base = {"plugins": [PLUGIN], "context_parallel_size": 2, "sample_packing": True, "attn_implementation": "sdpa"}
    return {**base, **changes}


@pytest.mark.parametrize("changes, named", [
    ({"ring_attn_func": "varlen_llama3"}, "ring_attn_func"),
    ({"heads_k_stride": 1}, "heads_k_stride"),
    ({"sample_packing": False}, "sample_packing"),
    ({"eval_sample_packing": False}, "eval_sample_packing"),
    ({"multipack_real_batches": False}, "multipack_real_batches"),
    ({"attn_implementation": "flash_attention_2"}, "attn_implementation"),
    ({"attn_implementation": None}, "attn_implementation"),
    ({"flash_attention": True}, "flash_attention"),
    ({"rl": "dpo"}, "rl"),
    ({"adapter": "ia3"}, "adapter"),
    ({"load_in_8bit": True}, "load_in_8bit"),
    ({"load_in_4bit": True, "adapter": "qlora"}, "load_in_4bit"),
    ({"adapter": "qlora"}, "QLoRA"),
    ({"deepspeed": {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}}, "offload_param"),
    ({"deepspeed": {"zero_optimization": {"stage": 0}}}, "stage"),
    ({"fsdp_version": 1, "fsdp_config": {"auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}}, "fsdp_version"),
    ({"fsdp_version": 2, "fsdp_config": {"offload_params": True}}, "offload_params"),
    ({"fsdp_version": 2, "fsdp_config": {"fsdp_offload_params": True}}, "offload_params"),
    ({"fsdp_version": 2, "fsdp": ["full_shard", "offload"], "fsdp_config": {"reshard_after_forward": True}}, "offload"),
    ({"fsdp_version": 2, "fsdp": "hybrid_shard auto_wrap", "fsdp_config": {"reshard_after_forward": True}},
     "hybrid_shard"),
    ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
    ({"dp_shard_size": 2}, "dp_shard_size"),
    ({"chunked_cross_entropy": True}, "chunked_cross_entropy"),
    ({"gradient_checkpointing": "offload"}, "gradient_checkpointing"),
    ({"plugins": [PLUGIN, "axolotl.integrations.liger.LigerPlugin"]}, "LigerPlugin"),
    ({"plugins": [PLUGIN, PLUGIN]}, "once"),
])
def test_options_the_plugin_has_not_verified_are_refused_by_name(changes, named):
    cfg = yaml_of(**changes)
    assert named in (refusal(cfg) or "")
    with pytest.raises(ValueError, match=named):
        BlockDiagCPPlugin().register(cfg)


def test_what_the_plugin_verified_registers(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    for changes in ({}, {"adapter": "lora"},
                    {"deepspeed": ZERO2}, {"deepspeed": ZERO3}, fsdp2("llama"),
                    {**fsdp2("qwen3"), "fsdp": ["full_shard", "auto_wrap"]},
                    {"fsdp_version": None, "fsdp_config": {"fsdp_version": 2, "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP",
                                                           "fsdp_state_dict_type": "SHARDED_STATE_DICT"}},
                    {"plugins": [CP_PLUGIN]}, {"tensor_parallel_size": 1, "gradient_checkpointing": True}):
        cfg = yaml_of(**changes)
        assert refusal(cfg) is None, (changes, refusal(cfg))
        plugin = BlockDiagCPPlugin()
        plugin.register(cfg)
        assert (plugin.cp_size, plugin.dp_size) == (2, 2)


def test_context_parallel_size_becomes_the_mixins_cp_size_and_axolotls_own_is_off(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    for key in ("context_parallel_size", "sequence_parallel_degree"):
        cfg = {**yaml_of(context_parallel_size=None), key: 4}
        plugin = BlockDiagCPPlugin()
        plugin.register(cfg)
        assert (plugin.cp_size, plugin.dp_size) == (4, 2)
        assert cfg["context_parallel_size"] == 1 and "sequence_parallel_degree" not in cfg
    with pytest.raises(ValueError, match="context_parallel_size"):
        BlockDiagCPPlugin().register(yaml_of(context_parallel_size=0))


def test_a_world_that_cp_does_not_divide_is_refused_when_axolotl_registers_the_plugin(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="must divide the number of processes, got 3"):
        BlockDiagCPPlugin().register(yaml_of())


def test_axolotls_fused_lora_kernels_are_refused_before_the_data_loads(monkeypatch):
    from axolotl.utils.dict import DictDefault

    monkeypatch.setenv("WORLD_SIZE", "2")
    plugin = BlockDiagCPPlugin()
    plugin.register(yaml_of(adapter="lora"))
    for kernel in ("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel", "lora_embedding_kernel"):
        cfg = DictDefault({"adapter": "lora", kernel: True, "micro_batch_size": 1, "gradient_accumulation_steps": 1})
        with pytest.raises(ValueError, match=kernel):
            plugin.load_datasets(cfg)


def test_a_softcap_that_sdpa_would_drop_is_refused_before_the_data_loads(tmp_path, monkeypatch):
    """Gemma 2's attention logit softcap: transformers' sdpa drops it (the run without CP would be another model),
    eager attention applies it as the plugin does; models without one pass with either."""
    from axolotl.utils.dict import DictDefault

    from blockdiag_cp.integrations.axolotl import attention_problem

    for family in ("gemma2", "llama"):
        tiny_model(family).config.save_pretrained(tmp_path / family)
    gemma2, llama = (transformers.AutoConfig.from_pretrained(tmp_path / f) for f in ("gemma2", "llama"))
    assert "attn_logit_softcapping=2.0" in attention_problem("sdpa", gemma2)
    assert attention_problem("eager", gemma2) == attention_problem("sdpa", llama) == ""
    monkeypatch.setenv("WORLD_SIZE", "2")
    plugin = BlockDiagCPPlugin()
    plugin.register(yaml_of())
    cfg = DictDefault({"base_model": str(tmp_path / "gemma2"), "attn_implementation": "sdpa", "micro_batch_size": 1,
                       "gradient_accumulation_steps": 1})
    with pytest.raises(ValueError, match="attn_implementation: eager"):
        plugin.load_datasets(cfg, preprocess=True)
    cfg["attn_implementation"] = "eager"
    assert plugin.load_datasets(cfg, preprocess=True) is None


def test_the_multipack_sampler_sees_the_dp_replicas_as_its_world(monkeypatch):
    from axolotl.utils.samplers import MultipackBatchSampler

    from blockdiag_cp.integrations.axolotl import sampler_world

    def estimates() -> int:
        return MultipackBatchSampler(range(8), batch_size=1, batch_max_len=8, lengths=[4] * 8, bin_size=2,
                                     num_processes=1).num_count_samples

    monkeypatch.setenv("WORLD_SIZE", "4")
    assert estimates() == 1  # axolotl at 4 processes: one estimate
    with sampler_world(2):
        assert estimates() == 4  # as at dp 2 without CP
    assert estimates() == 1 and int(__import__("os").environ["WORLD_SIZE"]) == 4


def test_the_trainer_class_is_axolotls_with_the_mixin_and_cp_size_bound(monkeypatch):
    from axolotl.core.trainers import AxolotlTrainer

    from blockdiag_cp.trainer import BlockDiagCPMixin

    monkeypatch.setenv("WORLD_SIZE", "2")
    plugin = BlockDiagCPPlugin()
    plugin.register(yaml_of())
    cls = plugin.get_trainer_cls(None)
    assert issubclass(cls, AxolotlTrainer) and cls.__mro__[1] is BlockDiagCPMixin
    assert "_create_multipack_sampler" in vars(cls)  # its samplers see the dp replicas as their world
