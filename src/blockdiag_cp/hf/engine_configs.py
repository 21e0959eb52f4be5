"""What in a DeepSpeed config or an ``fsdp_config`` is verified under CP (the ``deepspeed`` and ``fsdp_config``
rules of `blockdiag_cp.hf.options` read these checks; the stacks' ways in call them when a config is read)."""

from __future__ import annotations

import json
import os
import types
from typing import Any

__all__ = ("deepspeed_problem", "fsdp_config_problem")


#: DeepSpeed config keys (top level, or in ``zero_optimization``) that change the numbers and are not verified
#: under CP, each with what to do instead
_DEEPSPEED_UNVERIFIED = types.MappingProxyType({
    "fp16": "fp16 with DeepSpeed's loss scaler: use bf16",
    "amp": "apex AMP: use bf16",
    "sequence_parallel_size": "DeepSpeed's own sequence parallelism (Ulysses): use the mixin's cp_size",
    "sequence_parallel": "DeepSpeed's own sequence parallelism (ALST / Ulysses, LLaMA-Factory's ds_z3_alst_config): use "
                         "the mixin's cp_size",
    "fp8": "FP8 training (LLaMA-Factory's ds_z3_fp8_config): use bf16",
    "tensor_parallel": "DeepSpeed's tensor parallelism (AutoTP)",
    "communication_data_type": "reductions in another dtype than the gradients'",
    "offload_param": "ZeRO-Offload of the parameters",
    "zero_quantized_weights": "ZeRO++ quantized weights",
    "zero_quantized_gradients": "ZeRO++ quantized gradients",
    "zero_hpz_partition_size": "ZeRO++ hierarchical partitioning",
    "data_efficiency": "DeepSpeed's data sampling and routing (it picks each process's data)",
    "curriculum_learning": "DeepSpeed's curriculum learning (it changes the sequences)",
    "progressive_layer_drop": "progressive layer dropping",
    "compression_training": "compression training",
})


def deepspeed_problem(config: Any) -> str:
    """What in a ``deepspeed=`` value (a config dict or a JSON file's path) is not verified under CP, or ``""``.

    Verified (`ZERO_TESTS`): ZeRO stages 1, 2 and 3 with fp32 or bf16 weights, gradient accumulation, gradient
    clipping, DeepSpeed's or the Trainer's optimizer and schedule; ZeRO-2 with the optimizer offloaded to the CPU
    (``offload_optimizer``: tests/stacks/test_axolotl.py; at other stages or to NVMe it is named). Set to anything but off, each key of
    `_DEEPSPEED_UNVERIFIED` is named."""
    if config is None or config == "":
        return ""  # no DeepSpeed
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config) as f:
                config = json.load(f)
        except (OSError, ValueError) as exc:
            return f"cannot read the DeepSpeed config {str(config)!r} as a JSON file ({exc}); pass a dict or a JSON file"
    if not isinstance(config, dict):
        return f"a DeepSpeed config of type {type(config).__name__}: pass a dict or a JSON file's path"
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    if stage not in (1, 2, 3):
        return f"zero_optimization.stage={stage!r}: ZeRO stages 1, 2 and 3 are verified under CP"
    offload = config.get("offload_optimizer", zero.get("offload_optimizer"))
    device = offload.get("device") if isinstance(offload, dict) else offload
    if _deepspeed_feature_on("offload_optimizer", offload) and (stage != 2 or device != "cpu"):
        return (f"offload_optimizer={offload!r} at ZeRO stage {stage} is not verified under CP (ZeRO-2 with the "
                "optimizer offloaded to the CPU is): offload at stage 2 to the CPU, or keep the optimizer on the device")
    for key, why in _DEEPSPEED_UNVERIFIED.items():
        value = config.get(key, zero.get(key))
        if _deepspeed_feature_on(key, value):
            return f"{key}={value!r} is not verified under CP ({why})"
    return ""


def _deepspeed_feature_on(key: str, value: Any) -> bool:
    """Whether DeepSpeed config key `key` set to `value` turns its feature on (``"auto"``: the Trainer's own
    argument decides, and that argument has its own rule)."""
    if value in (None, False, 0, "none", "auto") or value == {}:
        return False
    if key == "communication_data_type":
        return str(value) not in ("fp32", "float32", "torch.float32")
    if key == "sequence_parallel_size":
        return value != 1
    if isinstance(value, dict) and key == "tensor_parallel":
        return value.get("autotp_size", 1) not in (0, 1, None)
    if isinstance(value, dict) and key.startswith("offload"):
        return value.get("device", "none") not in ("none", None)
    if isinstance(value, dict) and key != "compression_training":
        return value.get("enabled", False) in (True, "true")
    return True


#: ``fsdp_config`` keys (transformers drops their ``fsdp_`` prefix) and the values verified under CP
_FSDP_VERIFIED = types.MappingProxyType({
    "version": lambda v: int(v) == 2,
    "cpu_offload": lambda v: str(v).lower() == "false",
    "xla": lambda v: str(v).lower() == "false",
    "xla_fsdp_v2": lambda v: str(v).lower() == "false",
    "xla_fsdp_grad_ckpt": lambda v: str(v).lower() == "false",
    # accelerate's checkpoint wrapper re-runs each layer (its CP attention too) in backward (tests/stacks/test_axolotl.py)
    "activation_checkpointing": lambda v: True,
    "reshard_after_forward": lambda v: True,
    "state_dict_type": lambda v: str(v).upper().split(".")[-1] in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"),
    "auto_wrap_policy": lambda v: True,  # where fully_shard cuts the model: not what it computes
    "transformer_layer_cls_to_wrap": lambda v: True,
    "min_num_params": lambda v: True,
    "cpu_ram_efficient_loading": lambda v: True,
    "sync_module_states": lambda v: True,
    # axolotl's spellings (its fsdp_config reaches the Trainer as written): offload_params is its cpu_offload; FSDP2
    # keeps the original parameters whatever use_orig_params says; pinned memory serves offloading only; the final
    # state dict's type is how axolotl saves the model after training
    "offload_params": lambda v: str(v).lower() in ("false", "none"),
    "use_orig_params": lambda v: True,
    "cpu_offload_pin_memory": lambda v: True,
    "final_state_dict_type": lambda v: True,
})


def fsdp_config_problem(config: Any) -> str:
    """What in ``fsdp_config`` (as transformers normalizes it) is not verified under CP, or ``""``.

    Verified (`FSDP2_TESTS`): accelerate's FSDP2 (``version`` 2, the default), resharding after forward or not,
    full and sharded state dicts, any wrap policy, FSDP's own activation checkpointing (tests/stacks/test_axolotl.py);
    refused: FSDP1, CPU offload, XLA, keys this table does not know."""
    if not config:
        return ""
    if not isinstance(config, dict):
        return f"an fsdp_config of type {type(config).__name__}: pass a dict or a JSON file's path"
    for key, value in config.items():
        key = key[len("fsdp_"):] if key.startswith("fsdp_") else key  # as transformers reads them
        check = _FSDP_VERIFIED.get(key)
        if check is None:
            return f"fsdp_config[{key!r}] is not verified under CP"
        if not check(value):
            return f"fsdp_config[{key!r}]={value!r} is not verified under CP"
    return ""
