"""Every option of transformers' TrainingArguments and TRL's SFT, DPO and GRPO configs is classified
for the Trainer mixin (inert, verified by a named test, or refused when set), and the refusals name
the option at construction (Note [Options the mixin has not verified are refused] in hf/options.py)."""

import dataclasses
import pathlib
import re
import types

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from blockdiag_cp.hf import options  # noqa: E402
from blockdiag_cp.hf.model_checks import check_loss_inputs, virtual_token_adapters  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
KINDS = {"TrainingArguments": "rows", "Seq2SeqTrainingArguments": "rows", "SFTConfig": "rows", "DPOConfig": "scoring",
         "GRPOConfig": "generating"}


def configs():
    """One default instance of each classified config class (TRL's when installed)."""
    out = [cls(output_dir="/tmp/blockdiag_cp_options", use_cpu=True)
           for cls in (transformers.TrainingArguments, transformers.Seq2SeqTrainingArguments)]
    try:
        import trl
    except ImportError:
        return out
    return out + [cls(output_dir="/tmp/blockdiag_cp_options", use_cpu=True)
                  for cls in (trl.SFTConfig, trl.DPOConfig, trl.GRPOConfig)]


@pytest.fixture(scope="module")
def defaults():
    return configs()


def test_every_option_of_the_trainers_configs_is_classified(defaults):
    """A field transformers or TRL add fails here until it has a rule; no rule names a field that is gone."""
    for args in defaults:
        unclassified = [name for name in options.library_fields(args) if options.rule_for(args, name) is None]
        assert not unclassified, f"{type(args).__name__}: classify {unclassified} in blockdiag_cp/hf/options.py"
    for table, cls in ((options.TRAINING_ARGUMENTS, transformers.TrainingArguments),
                       (options.SEQ2SEQ_ARGUMENTS, transformers.Seq2SeqTrainingArguments)):
        stale = sorted(set(table) - {f.name for f in dataclasses.fields(cls)})
        assert not stale, f"rules for fields {cls.__name__} no longer has: {stale}"


def test_the_default_of_every_option_is_accepted(defaults):
    for args in defaults:
        assert options.refusals(args, KINDS[type(args).__name__]) == [], type(args).__name__


def test_every_verified_option_names_tests_that_exist():
    tables = (options.TRAINING_ARGUMENTS, options.FORMER_TRAINING_ARGUMENTS, options.SFT_CONFIG, options.DPO_CONFIG,
              options.GRPO_CONFIG)
    for table in tables:
        for name, rule in table.items():
            if rule.verdict != options.VERIFIED:
                continue
            cited = re.findall(r"(tests/[\w/]+\.py)::(\w+)", rule.why)
            assert cited, f"{name}: a verified option names the test that compares it ({rule.why!r})"
            for path, test in cited:
                source = (ROOT / path).read_text()
                assert re.search(rf"^def {test}\(", source, re.M), f"{name}: {path}::{test} does not exist"


def set_args(args, **changes):
    for name, value in changes.items():
        setattr(args, name, value)
    return args


REFUSED_FOR_ROWS = {
    "deepspeed": {"zero_optimization": {"stage": 3}, "fp16": {"enabled": True}}, "fsdp_config": {"fsdp_version": 1}, "fp16": True, "auto_find_batch_size": True,
    "use_cache": True, "use_liger_kernel": True, "dataloader_in_order": False, "optim": "galore_adamw_layerwise",
    "label_names": ["targets"],
}


@pytest.mark.parametrize("name, value", sorted(REFUSED_FOR_ROWS.items()))
def test_unverified_values_are_refused_by_name(name, value):
    args = transformers.TrainingArguments(output_dir="/tmp/blockdiag_cp_options", use_cpu=True)
    found = options.refusals(set_args(args, **{name: value}), "rows")
    assert len(found) == 1 and found[0].startswith(f"{name}="), found


@pytest.mark.parametrize("optim", ["lomo", "adalomo", "galore_adamw_layerwise", "apollo_adamw_layerwise"])
def test_optimizers_that_step_inside_backward_are_refused_when_passed_at_construction(optim):
    """`TrainingArguments(optim=...)` holds an `OptimizerNames` enum, not the string: its value is what is read."""
    args = transformers.TrainingArguments(output_dir="/tmp/blockdiag_cp_options", use_cpu=True, optim=optim)
    found = options.refusals(args, "rows")
    assert len(found) == 1 and found[0].startswith(f"optim={optim!r}: "), found
    plain = transformers.TrainingArguments(output_dir="/tmp/blockdiag_cp_options", use_cpu=True, optim="adamw_torch")
    assert options.refusals(plain, "rows") == []


def test_verified_values_pass_and_kinds_matter():
    args = transformers.TrainingArguments(output_dir="/tmp/blockdiag_cp_options", use_cpu=True)
    set_args(args, label_smoothing_factor=0.1, neftune_noise_alpha=5.0, optim="adamw_torch", max_grad_norm=0.5,
             train_sampling_strategy="group_by_length", label_names=["labels"])
    assert options.refusals(args, "rows") == []
    refused = options.refusals(args, "scoring")  # verified for trainers of rows only
    assert [r.split("=")[0] for r in refused] == ["label_smoothing_factor", "neftune_noise_alpha"], refused
    args.accelerator_config.split_batches = True
    assert [r.split("=")[0] for r in options.refusals(args, "rows")] == ["accelerator_config"]


ZERO3 = {"zero_optimization": {"stage": 3}}


@pytest.mark.parametrize("config, named", [
    ({"zero_optimization": {"stage": 0}}, "zero_optimization.stage=0"),
    ({}, "zero_optimization.stage=0"),
    ({**ZERO3, "fp16": {"enabled": True}}, "fp16="),
    ({**ZERO3, "amp": {"enabled": True}}, "amp="),
    ({**ZERO3, "sequence_parallel_size": 2}, "sequence_parallel_size=2"),
    ({**ZERO3, "sequence_parallel": {"enabled": True, "size": 4, "mode": "ulysses"}}, "sequence_parallel="),
    ({**ZERO3, "fp8": {"enabled": True}}, "fp8="),
    ({**ZERO3, "tensor_parallel": {"autotp_size": 2}}, "tensor_parallel="),
    ({**ZERO3, "communication_data_type": "bf16"}, "communication_data_type='bf16'"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, "offload_param="),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}, "offload_optimizer="),
    ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}, "at ZeRO stage 1"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}, "offload_optimizer="),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": True}}, "offload_optimizer=True"),
    ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, "zero_quantized_weights=True"),
    ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}, "zero_hpz_partition_size=2"),
    ({**ZERO3, "curriculum_learning": {"enabled": True}}, "curriculum_learning="),
    ("/nonexistent/ds_config.json", "cannot read the DeepSpeed config"),
])
def test_deepspeed_features_not_verified_are_named(config, named):
    args = set_args(transformers.TrainingArguments(output_dir="/tmp/blockdiag_cp_options", use_cpu=True), deepspeed=config)
    (found,) = options.refusals(args, "rows")
    assert found.startswith("deepspeed=") and named in found, found


def test_deepspeed_configs_verified_pass(tmp_path):
    """ZeRO 1-3, fp32 or bf16 weights, features set off, and a JSON file."""
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 2}, "bf16": {"enabled": true}}')
    for config in ({"zero_optimization": {"stage": 1}}, {**ZERO3, "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}},
                   {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "sequence_parallel_size": 1,
                    "communication_data_type": "fp32", "fp16": {"enabled": False}, "fp8": {"enabled": False},
                    "sequence_parallel": {"enabled": False}}, str(path)):
        args = transformers.TrainingArguments(output_dir="/tmp/blockdiag_cp_options", use_cpu=True)
        assert options.refusals(set_args(args, deepspeed=config), "rows") == [], config


@pytest.mark.parametrize("config, named", [
    ({"fsdp_version": 1}, "fsdp_config['version']=1"),
    ({"version": 2, "cpu_offload": True}, "fsdp_config['cpu_offload']=True"),
    ({"fsdp_version": 2, "offload_params": True}, "fsdp_config['offload_params']=True"),
    ({"state_dict_type": "LOCAL_STATE_DICT"}, "fsdp_config['state_dict_type']"),
    ({"fsdp_version": 2, "something_new": 1}, "fsdp_config['something_new'] is not verified"),
])
def test_fsdp_configs_not_verified_are_named(config, named):
    args = set_args(transformers.TrainingArguments(output_dir="/tmp/blockdiag_cp_options", use_cpu=True),
                    fsdp=True, fsdp_config=config)
    (found,) = options.refusals(args, "rows")
    assert found.startswith("fsdp_config=") and named in found, found
    ok = {"fsdp_version": 2, "reshard_after_forward": False, "state_dict_type": "SHARDED_STATE_DICT",
          "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "activation_checkpointing": True,
          "offload_params": False}  # the last two verified through axolotl (tests/stacks/test_axolotl.py)
    assert options.refusals(set_args(args, fsdp_config=ok), "rows") == []


def test_trl_options_are_refused_by_name():
    trl = pytest.importorskip("trl")
    grpo = set_args(trl.GRPOConfig(output_dir="/tmp/blockdiag_cp_options", use_cpu=True), use_vllm=True,
                    num_iterations=2, temperature=0.7)
    assert [r.split("=")[0] for r in options.refusals(grpo, "generating")] == ["use_vllm", "num_iterations"]
    dpo = set_args(trl.DPOConfig(output_dir="/tmp/blockdiag_cp_options", use_cpu=True), precompute_ref_log_probs=True,
                   beta=0.3)
    assert [r.split("=")[0] for r in options.refusals(dpo, "scoring")] == ["precompute_ref_log_probs"]
    sft = set_args(trl.SFTConfig(output_dir="/tmp/blockdiag_cp_options", use_cpu=True), loss_type="chunked_nll",
                   activation_offloading=True)  # verified for SFT (test_activation_offloading.py), refused for DPO
    assert sorted(r.split("=")[0] for r in options.refusals(sft, "rows")) == ["loss_type"]
    dpo = set_args(trl.DPOConfig(output_dir="/tmp/blockdiag_cp_options", use_cpu=True), activation_offloading=True)
    assert [r.split("=")[0] for r in options.refusals(dpo, "scoring")] == ["activation_offloading"]


def test_an_unclassified_library_option_is_refused_when_set_and_your_own_fields_are_not():
    """A field a newer transformers adds (a dataclass in a transformers module) is refused when set;
    the fields of your own TrainingArguments subclass are yours."""
    newer = dataclasses.make_dataclass("TrainingArguments", [("shiny_new_option", int, dataclasses.field(default=0))],
                                       bases=(transformers.TrainingArguments,), namespace={"__module__": "transformers.x"})
    args = set_args(newer(output_dir="/tmp/blockdiag_cp_options", use_cpu=True), shiny_new_option=3)
    found = options.refusals(args, "rows")
    assert len(found) == 1 and found[0].startswith("shiny_new_option=3: blockdiag-cp has not classified"), found
    mine = dataclasses.make_dataclass("MyArgs", [("my_option", int, dataclasses.field(default=0))],
                                      bases=(transformers.TrainingArguments,))
    assert options.refusals(set_args(mine(output_dir="/tmp/blockdiag_cp_options", use_cpu=True), my_option=3),
                            "rows") == []


def test_the_mixin_refuses_at_construction_naming_the_option(tmp_path):
    from blockdiag_cp.trainer import BlockDiagCPTrainer

    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    args.auto_find_batch_size, args.use_cache = True, True
    with pytest.raises(ValueError, match="refuses options it has not verified") as refused:
        BlockDiagCPTrainer(model=None, args=args, cp_size=2)  # before the Trainer builds anything
    assert "auto_find_batch_size=True: each rank would shrink" in str(refused.value)
    assert "use_cache=True: a KV cache" in str(refused.value)


# -- the model: PEFT virtual tokens, the loss's inputs --------------------------------------------


def peft_stand_in(method: str, prompt_learning: bool):
    """What PEFT's models expose (``peft_config``: adapter name -> config with ``peft_type``), without peft."""
    config = types.SimpleNamespace(peft_type=types.SimpleNamespace(value=method), is_prompt_learning=prompt_learning,
                                   num_virtual_tokens=8 if prompt_learning else None)
    return types.SimpleNamespace(peft_config={"default": config})


def tiny_llama():
    import torch

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("method", ["PROMPT_TUNING", "P_TUNING", "PREFIX_TUNING", "MULTITASK_PROMPT_TUNING", "CPT",
                                    "ADAPTION_PROMPT"])
def test_peft_methods_that_add_virtual_tokens_are_named(method):
    assert virtual_token_adapters(peft_stand_in(method, method != "ADAPTION_PROMPT")) == [f"default ({method})"]
    assert virtual_token_adapters(peft_stand_in("LORA", False)) == []
    assert virtual_token_adapters(tiny_llama()) == []


def test_a_prompt_tuned_model_is_refused_at_construction(tmp_path):
    from blockdiag_cp.trainer import BlockDiagCPTrainer

    model = tiny_llama()
    model.peft_config = peft_stand_in("PROMPT_TUNING", True).peft_config
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match=r"default \(PROMPT_TUNING\) add virtual tokens"):
        BlockDiagCPTrainer(model=model, args=args, cp_size=1)


def test_real_peft_prompt_tuning_is_refused_and_lora_is_not(tmp_path):
    peft = pytest.importorskip("peft")
    from blockdiag_cp.trainer import BlockDiagCPTrainer

    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    prompt = peft.get_peft_model(tiny_llama(), peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(ValueError, match="PROMPT_TUNING"):
        BlockDiagCPTrainer(model=prompt, args=args, cp_size=1)
    lora = peft.get_peft_model(tiny_llama(), peft.LoraConfig(task_type="CAUSAL_LM", target_modules=["q_proj"]))
    assert BlockDiagCPTrainer(model=lora, args=args, cp_size=1).cp_size == 1


def test_a_loss_that_cannot_see_the_rows_targets_or_count_is_refused():
    from transformers.loss.loss_utils import ForCausalLMLoss

    class NoKwargs(transformers.LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, position_ids=None):
            return super().forward(input_ids=input_ids, labels=labels, position_ids=position_ids)

    model = tiny_llama()
    check_loss_inputs(model, accepts_loss_kwargs=False, own_loss=True, where="here")  # ForCausalLMLoss reads the count
    with pytest.raises(ValueError, match="NoKwargs.forward takes no shift_labels"):
        check_loss_inputs(NoKwargs(model.config), True, own_loss=True, where="here")
    check_loss_inputs(NoKwargs(model.config), True, own_loss=False, where="here")  # compute_loss_func: not its loss
    model.loss_function = lambda *a, **k: ForCausalLMLoss(*a, **k)
    with pytest.raises(ValueError, match="accepts_loss_kwargs=False and a loss other than"):
        check_loss_inputs(model, accepts_loss_kwargs=False, own_loss=True, where="here")
