"""Every option of transformers' ``TrainingArguments`` and TRL's configs, classified for the mixin.

Note [Options the mixin has not verified are refused]
-----------------------------------------------------
An option of the Trainer or of TRL that changes how the loss, the inputs or the gradients
are computed, and that the mixin has not checked against the run without CP, could be
silently wrong under CP. So every field of ``TrainingArguments``, ``SFTConfig``,
``DPOConfig`` and ``GRPOConfig`` has a `Rule`:

- ``inert``: it cannot make the run under CP differ from the run without CP (where files
  go, logging, saving, the Hub, which steps evaluate, how batches are loaded, options read
  only together with a refused one);
- ``verified``: a test compares it with the run without CP (`Rule.why` names the test),
  for every value or for the values `Rule.ok` accepts;
- ``refused``: set to anything but its default, `refuse_unverified_options` raises at
  construction, naming the field, why, and what to do instead.

A rule may hold for some trainer kinds only (``rows``: Trainer, SFTTrainer; ``scoring``:
DPOTrainer; ``generating``: GRPOTrainer); for the others the field is refused when set.
A field that transformers or TRL add later has no rule: it is refused when set (a default
value keeps the old behaviour), and ``tests/unit/test_trainer_options.py`` fails until
someone classifies it. Fields of your own ``TrainingArguments`` subclass are yours, not
checked.
"""

from __future__ import annotations

import dataclasses
import enum
import types
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .engine_configs import deepspeed_problem, fsdp_config_problem

INERT, VERIFIED, REFUSED = "inert", "verified", "refused"
ALL_KINDS = frozenset({"rows", "scoring", "generating"})
ROWS = frozenset({"rows"})

#: the tests a verified rule cites (``path::test``; a unit test checks that each exists)
TRAINER_TESTS = "tests/integrations/test_trainer.py::test_partial_last_batches_at_dp2_equal_plain_ddp"
LOSS_TESTS = "tests/integrations/test_trainer_losses.py::test_trainer_loss_paths_equal_the_run_without_cp"
SFT_TESTS = "tests/integrations/test_trainer_losses.py::test_sft_loss_paths_equal_the_run_without_cp"
DP_TESTS = "tests/integrations/test_trainer_losses.py::test_loss_normalization_at_dp2_cp2_equals_plain_ddp"
MOE_TESTS = "tests/integrations/test_trainer_losses.py::test_moe_router_loss_equals_the_run_without_cp"
NOISE_TESTS = "tests/integrations/test_trainer_losses.py::test_neftune_noise_is_the_run_without_cps"
RL_TESTS = "tests/integrations/test_trl_rl.py::test_grpo_under_cp_equals_grpo_without_cp"
REPLICA_TESTS = "tests/distributed/test_replica.py::test_the_replica_view_gathers_over_replicas_and_shares_cp_rank0"
DPO_TESTS = "tests/integrations/test_trl_rl.py::test_dpo_and_grpo_at_dp2_cp2_equal_the_runs_without_cp"
READERS = "tests/integrations/test_trainer.py::test_every_cp_rank_reads_what_its_replica_reads_without_cp"
FSDP2_TESTS = "tests/integrations/test_sharded_trainer.py::test_accelerate_fsdp2_equals_fsdp2_without_cp"
ZERO_TESTS = "tests/integrations/test_sharded_trainer.py::test_deepspeed_zero_equals_the_same_stage_without_cp"
OFFLOAD_TESTS = "tests/integrations/test_activation_offloading.py::test_activation_offloading_under_cp_equals_the_run_without_it"


def _unset(value: Any) -> bool:
    return value is None or value is False or (isinstance(value, (str, list, tuple, dict)) and not value)


@dataclass(frozen=True)
class Rule:
    """How the mixin treats one option (Note [Options the mixin has not verified are refused]).

    Attributes:
        verdict: ``inert``, ``verified`` or ``refused``.
        why: for ``inert``, why it cannot change the numbers; for ``verified``, the test (and
            what it covers); for ``refused``, why and what to do instead.
        kinds: the trainer kinds the verdict holds for; for other kinds the option is refused when set.
        ok: for ``verified``, the values that are (default: any); for ``refused``, the values that
            count as not set (default: the field's default or an empty value).
        explain: for a value `ok` rejects, what exactly is not verified in it (said before `why`), or None.
    """

    verdict: str
    why: str
    kinds: frozenset = ALL_KINDS
    ok: Optional[Callable[[Any], bool]] = None
    explain: Optional[Callable[[Any], str]] = None

    def __post_init__(self) -> None:
        if self.verdict not in (INERT, VERIFIED, REFUSED):
            raise ValueError(f"verdict must be {INERT!r}, {VERIFIED!r} or {REFUSED!r}, got {self.verdict!r}")


def _rules(verdict: str, why: str, names: str, **kw: Any) -> dict[str, Rule]:
    rule = Rule(verdict, why, **kw)
    return {name: rule for name in names.split()}


def _not(*values: Any) -> Callable[[Any], bool]:
    return lambda value: value not in values


def _optimizer_ok(name: Any) -> bool:
    """Optimizers that step once per optimizer step from the reduced gradients (not inside backward)."""
    name = str(getattr(name, "value", name))
    return name not in ("lomo", "adalomo") and not name.endswith("_layerwise")


def _accelerator_ok(config: Any) -> bool:
    split = config.get("split_batches") if isinstance(config, dict) else getattr(config, "split_batches", False)
    return not split


#: ``TrainingArguments`` (transformers 5.x): every field
TRAINING_ARGUMENTS = types.MappingProxyType({
    **_rules(INERT, "where files go and what is saved or pushed to the Hub",
             "output_dir save_strategy save_steps save_total_limit save_on_each_node save_only_model push_to_hub "
             "hub_token hub_private_repo hub_model_id hub_strategy hub_always_push hub_revision enable_jit_checkpoint "
             "resume_from_checkpoint restore_callback_states_from_checkpoint ignore_data_skip"),
    **_rules(INERT, "logging and reporting only",
             "logging_strategy logging_steps logging_first_step log_on_each_node logging_nan_inf_filter log_level "
             "log_level_replica disable_tqdm report_to run_name project trackio_space_id trackio_bucket_id "
             "trackio_static_space_id skip_memory_metrics debug"),
    **_rules(INERT, "when evaluation runs, and which saved checkpoint is kept as the best by its (verified) metric",
             "eval_strategy eval_steps eval_delay eval_on_start load_best_model_at_end metric_for_best_model "
             "greater_is_better"),
    **_rules(INERT, "read by scripts, not by the Trainer", "do_train do_eval do_predict local_rank"),
    **_rules(INERT, "the process and device set-up, the same with and without CP",
             "use_cpu ddp_backend ddp_timeout ddp_find_unused_parameters ddp_bucket_cap_mb ddp_broadcast_buffers "
             "ddp_static_graph torch_empty_cache_steps full_determinism tf32"),
    **_rules(INERT, "how batches are loaded, not which (worker processes; the order is checked by dataloader_in_order)",
             "dataloader_num_workers dataloader_pin_memory dataloader_persistent_workers dataloader_prefetch_factor "
             "dataloader_multiprocessing_context remove_unused_columns length_column_name"),
    **_rules(INERT, "read only with a refused option (use_liger_kernel)", "liger_kernel_config"),
    "fsdp_config": Rule(VERIFIED, f"accelerate's FSDP2 averages the gradients over every dp x cp rank as DDP does: "
                        f"{FSDP2_TESTS}", kinds=ROWS, ok=lambda config: not fsdp_config_problem(config),
                        explain=fsdp_config_problem),
    **_rules(VERIFIED, f"the optimizer and schedule step from the reduced gradients, which CP makes equal: {TRAINER_TESTS}",
             "learning_rate lr_scheduler_type lr_scheduler_kwargs warmup_steps weight_decay adam_beta1 adam_beta2 "
             "adam_epsilon optim_args optim_target_modules max_grad_norm seed data_seed"),
    "optim": Rule(VERIFIED, f"optimizers stepping from the reduced gradients: {TRAINER_TESTS}; LOMO, AdaLOMO and the "
                  "layer-wise optimizers update inside backward, before the gradients are reduced over dp x cp: use "
                  "another optimizer", ok=_optimizer_ok),
    **_rules(VERIFIED, f"batches, accumulation and the token count over dp x cp: {TRAINER_TESTS}, {DP_TESTS}",
             "per_device_train_batch_size per_device_eval_batch_size gradient_accumulation_steps num_train_epochs "
             "max_steps dataloader_drop_last average_tokens_across_devices include_num_input_tokens_seen "
             "prediction_loss_only"),
    **_rules(VERIFIED, f"activation checkpointing inside the CP step: {TRAINER_TESTS}, {DPO_TESTS}",
             "activation_checkpointing activation_checkpointing_kwargs gradient_checkpointing "
             "gradient_checkpointing_kwargs"),
    "bf16": Rule(VERIFIED, "bf16 autocast: tests/integrations/test_trainer.py::"
                 "test_trainer_head_parallel_bf16_on_a_stream_equals_the_run_without_cp (TRL's configs default to it)"),
    **_rules(VERIFIED, "tests/integrations/test_trainer.py::"
             "test_partial_last_batches_at_dp1_compiled_equal_the_run_without_cp (DPO and GRPO: not compiled)",
             "torch_compile torch_compile_backend torch_compile_mode", kinds=ROWS),
    "label_smoothing_factor": Rule(VERIFIED, f"the smoothed loss on shards against the unsharded rows' targets: "
                                   f"{LOSS_TESTS}, {SFT_TESTS}, {DP_TESTS}", kinds=ROWS),
    "neftune_noise_alpha": Rule(VERIFIED, f"the noise of the run without CP, token by token: {NOISE_TESTS}", kinds=ROWS),
    **_rules(VERIFIED, f"evaluation outputs gathered once per replica: {LOSS_TESTS}, {DP_TESTS}",
             "eval_accumulation_steps include_for_metrics batch_eval_metrics eval_do_concat_batches "
             "eval_use_gather_object bf16_full_eval", kinds=ROWS),
    "label_names": Rule(VERIFIED, f"the labels under their default name: {TRAINER_TESTS}; other names are not shifted "
                        "across shards: rename the key to 'labels'", ok=lambda v: v is None or list(v) == ["labels"]),
    "train_sampling_strategy": Rule(
        VERIFIED, f"samplers over the dp replicas: {LOSS_TESTS} (sequential, group_by_length), {TRAINER_TESTS} (random); "
        "'batch_rebalance' gives every process its own batches (refused under CP)",
        ok=lambda v: v in ("random", "sequential", "group_by_length", "batch_rebalance")),
    "accelerator_config": Rule(VERIFIED, f"even_batches and the loaders sharded over dp: {READERS}; split_batches=True "
                               "splits each batch over every process, CP ranks included: leave it False",
                               ok=_accelerator_ok),
    "dataloader_in_order": Rule(REFUSED, "dataloader_in_order=False yields batches as workers finish them, so the CP "
                                "ranks of a replica could read different batches: keep it True",
                                ok=lambda v: v is not False),
    "use_cache": Rule(REFUSED, "a KV cache filled by a packed CP row cannot be continued: keep use_cache=False for "
                      "training"),
    "auto_find_batch_size": Rule(REFUSED, "each rank would shrink its batch on its own out-of-memory error, so the CP "
                                 "ranks of a replica could read different batches: set the batch size"),
    **_rules(REFUSED, "not verified under CP (loss scaling and inf checks per rank); use bf16",
             "fp16 fp16_full_eval"),
    "deepspeed": Rule(VERIFIED, f"ZeRO stages 1, 2 and 3 (fp32 or bf16 weights; DeepSpeed averages the gradients over "
                      f"dp x cp ranks as DDP does): {ZERO_TESTS}; turn the named feature off or train without it",
                      kinds=ROWS, ok=lambda config: not deepspeed_problem(config), explain=deepspeed_problem),
    "fsdp": Rule(VERIFIED, f"accelerate's FSDP2 (fsdp_config['fsdp_version']=2, the default), sharded over every dp x "
                 f"cp rank: {FSDP2_TESTS}", kinds=ROWS),
    "parallelism_config": Rule(VERIFIED, f"dp_replicate_size, dp_shard_size and cp_size read as the mixin's mesh (Note "
                               f"[accelerate's ParallelismConfig under the mixin] in hf/parallelism.py): {FSDP2_TESTS}; "
                               "tp_size and sp_size are refused", kinds=ROWS),
    **_rules(REFUSED, "Liger kernels replace the model's loss forward, which would shift labels inside each shard: "
             "turn them off under the mixin; for a loss that never holds the logits pass linear_ce=True to the mixin", "use_liger_kernel"),
})

#: ``TrainingArguments`` fields of earlier transformers 5.x that later ones dropped (LLaMA-Factory 0.9.5 pins
#: transformers 5.6, whose LR schedule still reads ``warmup_ratio``)
FORMER_TRAINING_ARGUMENTS = types.MappingProxyType({
    "warmup_ratio": Rule(VERIFIED, "the schedule's warmup as a fraction of the steps, stepped from the reduced "
                         "gradients as warmup_steps: tests/stacks/test_llamafactory.py::"
                         "test_lora_at_cp2_equals_llamafactory_and_resumes_to_the_same_end"),
    "logging_dir": Rule(INERT, "where the logs of a reporting integration go"),
})

#: ``SFTConfig``'s own fields (TRL 1.x)
SFT_CONFIG = types.MappingProxyType({
    **_rules(INERT, "dataset and model preparation before training, the same with and without CP",
             "model_init_kwargs trust_remote_code chat_template_path dataset_text_field dataset_kwargs dataset_num_proc "
             "eos_token pad_token max_length truncation_mode shuffle_dataset pad_to_multiple_of"),
    "eval_packing": Rule(INERT, "SFTTrainer evaluates unsharded on each rank (TRL's own prediction step)"),
    **_rules(VERIFIED, f"rows as the collator makes them, flattened and sharded: {SFT_TESTS}, "
             "tests/integrations/test_trainer.py::test_trl_sft_packing_equals_the_run_without_cp",
             "packing packing_strategy padding_free completion_only_loss assistant_only_loss"),
    "loss_type": Rule(VERIFIED, f"nll and dft on shards with the unsharded rows' targets: {SFT_TESTS}",
                      ok=lambda v: v in ("nll", "dft")),
    "router_aux_loss_coef": Rule(VERIFIED, f"the load-balancing loss of the unsharded rows: {MOE_TESTS}"),
    "activation_offloading": Rule(VERIFIED, "TRL's saved-tensor hooks copy and rebuild the CP attention's saved tensors "
                                  f"as any others: {OFFLOAD_TESTS}"),
})

#: fields DPOConfig and GRPOConfig share
_SCORING_SHARED = types.MappingProxyType({
    **_rules(INERT, "dataset and model preparation before training, the same with and without CP",
             "model_init_kwargs trust_remote_code pad_to_multiple_of"),
    "router_aux_loss_coef": Rule(INERT, "read only with output_router_logits, which DPO and GRPO refuse under CP"),
    "disable_dropout": Rule(INERT, "dropout masks are random draws with and without CP alike"),
    **_rules(INERT, "read only with sync_ref_model, which is refused", "ref_model_mixup_alpha ref_model_sync_steps"),
    "sync_ref_model": Rule(REFUSED, "TR-DPO's reference sync is not verified under CP"),
})

#: ``DPOConfig``'s own fields (TRL 1.x)
DPO_CONFIG = types.MappingProxyType({
    **_SCORING_SHARED,
    **_rules(INERT, "dataset preparation before training, the same with and without CP",
             "dataset_num_proc max_length truncation_mode pad_token"),
    **_rules(VERIFIED, f"DPO's loss runs per replica on the gathered per-token log-probs: {DPO_TESTS}, "
             "tests/integrations/test_scoring.py::test_scoring_forwards_equal_the_padded_rows_without_cp",
             "beta loss_type loss_weights label_smoothing use_weighting ld_alpha discopop_tau f_divergence_type "
             "f_alpha_divergence_coef"),
    "precompute_ref_batch_size": Rule(INERT, "read only with precompute_ref_log_probs, which is refused"),
    "precompute_ref_log_probs": Rule(REFUSED, "precomputed reference log-probs run before training, not verified "
                                     "under CP: score the reference in each step (the default)"),
    "padding_free": Rule(REFUSED, "DPO's own padding-free rows are not verified under CP: the mixin packs the rows itself"),
    "activation_offloading": Rule(REFUSED, "activation offloading is not verified under CP: use activation checkpointing"),
})

#: ``GRPOConfig``'s own fields (TRL 1.x)
GRPO_CONFIG = types.MappingProxyType({
    **_SCORING_SHARED,
    **_rules(VERIFIED, f"generation runs per replica as without CP, CP rank 0's completions shared with the others: "
             f"{RL_TESTS}, {REPLICA_TESTS}",
             "temperature top_p top_k min_p repetition_penalty generation_kwargs cache_implementation "
             "max_completion_length chat_template_kwargs max_tool_calling_iterations num_generations "
             "num_generations_eval generation_batch_size steps_per_generation shuffle_dataset "
             "use_transformers_continuous_batching transformers_continuous_batching_config use_transformers_paged"),
    **_rules(VERIFIED, f"GRPO's loss runs per replica on the gathered per-token values: {RL_TESTS}, {DPO_TESTS}",
             "beta epsilon epsilon_high delta loss_type importance_sampling_level scale_rewards reward_weights "
             "multi_objective_aggregation mask_truncated_completions top_entropy_quantile entropy_coef "
             "use_adaptive_entropy entropy_coef_min entropy_coef_max entropy_coef_delta entropy_target "
             "use_bias_correction_kl off_policy_mask_threshold sapo_temperature_neg sapo_temperature_pos vespo_k_pos "
             "vespo_lambda_pos vespo_k_neg vespo_lambda_neg cast_lm_head_to_fp32"),
    **_rules(INERT, "logging only", "log_completions log_completions_hub_repo log_multimodal log_unique_prompts "
             "num_completions_to_print"),
    **_rules(INERT, "read only with use_vllm or DeepSpeed (both refused for GRPO)",
             "vllm_mode vllm_model_impl vllm_enable_sleep_mode vllm_structured_outputs_regex vllm_server_base_url "
             "vllm_server_host vllm_server_port vllm_server_timeout vllm_group_port vllm_gpu_memory_utilization "
             "vllm_max_model_length vllm_tensor_parallel_size vllm_importance_sampling_correction "
             "vllm_importance_sampling_mode vllm_importance_sampling_clip_max vllm_importance_sampling_clip_min "
             "vllm_importance_sampling_cap ds3_gather_for_generation"),
    "use_vllm": Rule(REFUSED, "vLLM generation is not verified under CP: generate with transformers (the default)"),
    "num_iterations": Rule(REFUSED, "several iterations per generated batch are not verified under CP: keep 1",
                           ok=lambda v: v == 1),
})

#: ``Seq2SeqTrainingArguments``' own fields (LLaMA-Factory's SFT trainer is a Seq2SeqTrainer of rows)
SEQ2SEQ_ARGUMENTS = types.MappingProxyType({
    **_rules(INERT, "read only by generation (predict_with_generate, refused) or not at all (sortish_sampler)",
             "sortish_sampler generation_max_length generation_num_beams generation_config", kinds=ROWS),
    "predict_with_generate": Rule(REFUSED, "generation from packed CP rows is not supported: evaluate the loss under "
                                  "CP and generate without CP", kinds=ROWS),
})

#: config class name (transformers / TRL) -> its own fields' rules
RULES_BY_CONFIG = types.MappingProxyType({
    "TrainingArguments": TRAINING_ARGUMENTS,
    "Seq2SeqTrainingArguments": SEQ2SEQ_ARGUMENTS,
    "SFTConfig": SFT_CONFIG,
    "DPOConfig": DPO_CONFIG,
    "GRPOConfig": GRPO_CONFIG,
    "_BaseConfig": types.MappingProxyType({}),  # TRL's shared base: TrainingArguments' fields only
})


def library_fields(args: Any) -> dict[str, dataclasses.Field]:
    """The dataclass fields `args` gets from transformers' and TRL's config classes (not from your subclass)."""
    fields: dict[str, dataclasses.Field] = {}
    for cls in reversed(type(args).__mro__):
        if dataclasses.is_dataclass(cls) and cls.__module__.split(".")[0] in ("transformers", "trl"):
            fields.update({f.name: f for f in dataclasses.fields(cls)})
    return fields


def rule_for(args: Any, name: str) -> Optional[Rule]:
    """The rule of option `name` for `args`'s class (its own and its bases' tables), or None if unclassified."""
    for cls in type(args).__mro__:
        table = RULES_BY_CONFIG.get(cls.__name__) if cls.__module__.split(".")[0] in ("transformers", "trl") else None
        if table is not None and name in table:
            return table[name]
    return FORMER_TRAINING_ARGUMENTS.get(name)  # asked only for the fields `args` has


def refusals(args: Any, kind: str) -> list[str]:
    """``"name=value: why"`` for every option of `args` the mixin refuses for a trainer of `kind` (Note)."""
    out = []
    for name, field in library_fields(args).items():
        if not hasattr(args, name):
            continue
        value, default = getattr(args, name), _default(field)
        shown = repr(value.value) if isinstance(value, enum.Enum) else repr(value)
        rule = rule_for(args, name)
        is_default = _same(value, default)
        if rule is None:
            if not is_default:
                out.append(f"{name}={shown}: blockdiag-cp has not classified this option (new in transformers or "
                           "TRL?), so it cannot say that it is exact under CP: leave it at its default")
        elif kind not in rule.kinds:
            if not is_default:
                out.append(f"{name}={shown}: verified for {'/'.join(sorted(rule.kinds))} trainers only, not for "
                           f"this one ({rule.why})")
        elif rule.verdict == REFUSED and not (is_default or (rule.ok is not None and rule.ok(value))):
            out.append(f"{name}={shown}: {rule.why}")
        elif rule.verdict == VERIFIED and rule.ok is not None and not rule.ok(value):
            detail = f"{rule.explain(value)}; " if rule.explain is not None else ""
            out.append(f"{name}={shown}: {detail}{rule.why}")
    return out


def refuse_unverified_options(args: Any, kind: str, trainer: str) -> None:
    """`ValueError` naming every option of `args` that `refusals` lists (Note); nothing if there is none."""
    if args is None:
        return
    found = refusals(args, kind)
    if found:
        raise ValueError(f"{trainer} under blockdiag-cp refuses options it has not verified against the run without "
                         "CP:\n  " + "\n  ".join(found))


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _same(value: Any, default: Any) -> bool:
    """Whether `value` is the field's default (transformers normalizes some: ``""`` -> ``[]``, ``None`` -> a config)."""
    if default is dataclasses.MISSING:
        return True  # a required field (output_dir in older versions): no default to differ from
    return value == default or (_unset(value) and _unset(default))
