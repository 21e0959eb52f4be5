"""axolotl under block-diagonal CP: a plugin for the ``plugins:`` list of an axolotl YAML (docs/axolotl.md).

    plugins:
      - blockdiag_cp.integrations.axolotl.BlockDiagCPPlugin
    context_parallel_size: 2
    sample_packing: true
    attn_implementation: sdpa

    torchrun --nproc-per-node 2 -m axolotl.cli.train config.yml

axolotl's own trainer class (``AxolotlTrainer``) runs with `BlockDiagCPMixin` mixed in: its packed rows
(``sample_packing``: the multipack sampler's bins, each document's ``position_ids`` restarting at 0) are
sharded over ``context_parallel_size`` ranks with per-document attention, and the losses, the evaluation
and the final parameters are those of the same YAML without the plugin and without CP.

Note [context_parallel_size is the mixin's cp_size]
---------------------------------------------------
axolotl reads ``context_parallel_size > 1`` as its own sequence parallelism: ring attention over
flash-attention 2 (ringmaster), under which packed documents attend across each other. The plugin
reads the value when axolotl registers it (before axolotl validates the YAML), keeps it as the mixin's
``cp_size`` and sets ``context_parallel_size: 1`` in the YAML's dict, so axolotl's ring attention,
its parallelism config and its flash-attention requirement never start: only one of the two ever
shards a row. axolotl then counts every process as a data-parallel replica in ``batch_size``
(``micro_batch_size x gradient_accumulation_steps x world``, which sizes the run's steps and its
schedule); `BlockDiagCPPlugin.load_datasets` puts back the ``world / cp`` replicas there are.

The documents the mixin sees are axolotl's: with ``attn_implementation`` sdpa or eager, axolotl drops
the collator's ``attention_mask`` and its own attention separates the documents where
``position_ids`` restart; the mixin splits the row at the same places (`resolve_doc_ids`). Options
that would make the run differ from axolotl's run without CP in ways no test here has checked are
refused when axolotl registers the plugin, each by name with what to do (`refusal`).

Note [axolotl's multipack sampler sees the dp replicas as its world]
--------------------------------------------------------------------
The world is ``dp x cp`` processes under the plugin, ``dp`` in the run without CP. axolotl's
``MultipackBatchSampler`` reads ``WORLD_SIZE`` when it is built: at 4 processes or more it estimates
its length once, below 4 it estimates 4 times (the shortest wins). Each estimate packs a fresh
shuffle drawn from torch's global RNG, and the last one's bins are the batches it then serves at
dp > 1 (accelerate's shard of it never passes an epoch on, so they are not packed again). axolotl
builds it twice: while it loads the datasets (``calculate_total_num_steps``: the run's step count,
hence ``max_steps`` and the schedule, and the RNG state the model and its LoRA weights are then
initialized from) and in the trainer (the batches). So dp 2 x cp 2 (4 processes) would train on
other batches, for another number of steps, than dp 2. The plugin builds both with ``WORLD_SIZE``
set to ``dp`` (`sampler_world`): it loads the datasets itself, by axolotl's own ``load_datasets``,
after starting axolotl's distributed state (torch.distributed reads ``WORLD_SIZE`` too, so it must
be up first), and its trainer class wraps ``_create_multipack_sampler``. The samplers' collectives
(the shortest estimate over all ranks) still run over the whole world, where every rank computes
the same value.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import types
from typing import Any, Iterator, Mapping, Optional

from axolotl.integrations.base import BasePlugin

from ..hf.engine_configs import deepspeed_problem, fsdp_config_problem

#: the attention settings axolotl's run without CP separates packed documents with (its baseline); under the
#: plugin every rank attends with blockdiag-cp's per-document kernel instead (`CPConfig`'s kernel)
ATTENTION = ("sdpa", "eager")

#: why QLoRA is refused, and what to do
QLORA = ("bitsandbytes' 4-bit layers on CPU (its packed AVX512-bf16 path) give results that depend on how many rows "
         "a rank multiplies: measured against axolotl's run without CP, grad norms 2.8e-5 relative and LoRA weights "
         "5.6e-4 apart after 4 steps, beyond the 1e-5 the plugin promises; on GPUs not verified yet "
         "(benchmarks/gpu_session.sh runs the check): use adapter: lora on 16/32-bit weights")

#: axolotl options refused when set (to anything but off, or 1 for the sizes), each with why and what to do
REFUSED: Mapping[str, str] = types.MappingProxyType({
    "ring_attn_func": "axolotl's ring attention shards the rows itself (and lets packed documents attend across "
                      "each other); the plugin shards them: leave it out",
    "heads_k_stride": "an option of axolotl's ring attention, which the plugin keeps off: leave it out",
    "sdpa_varlen": "axolotl's varlen SDPA replaces the attention the plugin runs: leave it out",
    "flash_attention": "the plugin attends with blockdiag-cp's per-document kernel (flash-attn on GPUs where "
                       "installed, CPConfig(kernel=...)): use attn_implementation: sdpa",
    "xformers_attention": "see flash_attention: use attn_implementation: sdpa",
    "flex_attention": "see flash_attention: use attn_implementation: sdpa",
    "sage_attention": "see flash_attention: use attn_implementation: sdpa",
    "flash_attn_cross_entropy": "flash-attention's fused loss is not verified under the plugin",
    "flash_attn_fuse_mlp": "flash-attention's fused MLP is not verified under the plugin",
    "chunked_cross_entropy": "axolotl's chunked loss does not read the rows' shift_labels the shards need",
    "use_eaft": "the entropy-adaptive loss (a compute_loss_func) is not verified under the plugin",
    "rl": "axolotl's preference and RL trainers are not verified under the plugin (the mixin covers TRL's "
          "DPOTrainer and GRPOTrainer directly: docs/rl.md)",
    "reward_model": "reward-model trainers are not trainers of language-model rows",
    "process_reward_model": "reward-model trainers are not trainers of language-model rows",
    "trainer_cls": "a custom trainer class: mix BlockDiagCPMixin into it yourself (docs/trainer.md)",
    "pretraining_dataset": "streamed pretraining rows are not verified under the plugin: pre-tokenize the data",
    "streaming": "streamed datasets are not verified under the plugin",
    "batch_flattening": "the plugin trains the multipack sampler's rows (sample_packing: true)",
    "load_in_8bit": "8-bit weights are not verified under the plugin",
    "load_in_4bit": f"QLoRA's 4-bit weights: {QLORA}",
    "tensor_parallel_size": "tensor parallelism is not verified under the plugin",
    "dp_shard_size": "axolotl's sharded data parallelism is not verified under the plugin",
    "dp_replicate_size": "axolotl's data-parallel mesh is not verified under the plugin",
    "torch_compile": "torch.compile is not verified under the plugin",
    "activation_offloading": "axolotl's activation offloading is not verified under the plugin",
    "neftune_noise_alpha": "NEFTune through axolotl is not verified under the plugin",
    "tiled_mlp": "axolotl's tiled MLP is not verified under the plugin",
})


#: axolotl's fused LoRA kernels (it turns them on with LoRA unless one is set): refused when the plugin sees the
#: validated config (`BlockDiagCPPlugin.load_datasets`), before the data loads
LORA_KERNELS = ("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel", "lora_embedding_kernel")


def _is_off(name: str, value: Any) -> bool:
    """Whether option `name` set to `value` leaves its feature off (sizes: 1 is off)."""
    if name in ("tensor_parallel_size", "dp_shard_size", "dp_replicate_size"):
        return value in (None, 1)
    return value is None or value is False or value == "" or value == {} or value == []


def refusal(cfg: Mapping[str, Any]) -> Optional[str]:
    """What in axolotl's YAML (its dict before validation) the plugin refuses, and what to do; None if nothing."""
    plugins = list(cfg.get("plugins") or [])
    others = [p for p in plugins if not _is_this_plugin(p)]
    if others:
        return f"plugins {others} together with {PLUGIN} are not verified: run the plugin alone"
    if len(plugins) > 1:
        return f"plugins {plugins}: list {PLUGIN} (or one subclass of it) once"
    for name, why in REFUSED.items():
        if not _is_off(name, cfg.get(name)):
            return f"{name}={cfg.get(name)!r} is refused by {PLUGIN}: {why}"
    for name, problem in (("deepspeed", deepspeed_problem(cfg.get("deepspeed"))), ("fsdp_config", _fsdp_problem(cfg))):
        if problem:
            return f"{name}={cfg.get(name)!r} is refused by {PLUGIN}: {problem}"
    checks = (
        ("sample_packing", cfg.get("sample_packing") is True,
         "set sample_packing: true (the plugin shards axolotl's packed rows; padded rows are not verified)"),
        ("eval_sample_packing", cfg.get("eval_sample_packing") is not False,
         "leave eval_sample_packing unset or true (evaluation on packed rows)"),
        ("multipack_real_batches", cfg.get("multipack_real_batches") is not False,
         "leave multipack_real_batches unset (micro_batch_size rows of sequence_len tokens per step)"),
        ("attn_implementation", cfg.get("attn_implementation") in ATTENTION,
         f"set attn_implementation to one of {ATTENTION}: axolotl's run without CP then separates packed documents "
         "where position_ids restart, as the plugin does; under the plugin every rank attends with blockdiag-cp's "
         "per-document kernel whichever is set"),
        ("adapter", cfg.get("adapter") in (None, "", "lora"),
         f"adapter: lora (or none); QLoRA: {QLORA}" if cfg.get("adapter") == "qlora" else
         "adapter: lora (or none): the other adapters are not verified under the plugin"),
        ("gradient_checkpointing", cfg.get("gradient_checkpointing") in (None, False, True),
         "gradient_checkpointing: true or false (axolotl's offloading checkpoints are not verified)"),
    )
    for name, ok, what in checks:
        if not ok:
            return f"{name}={cfg.get(name)!r} is refused by {PLUGIN}: {what}"
    return None


#: the items of axolotl's ``fsdp:`` list that FSDP2 runs as verified (sharded after forward or not, any wrap policy)
_FSDP_MODES_VERIFIED = ("full_shard", "shard_grad_op", "auto_wrap")


def _fsdp_problem(cfg: Mapping[str, Any]) -> str:
    """What in the YAML's FSDP settings is not verified under the plugin (the mixin's `fsdp_config_problem` on
    axolotl's ``fsdp_config`` as transformers will read it: ``fsdp_`` prefixes dropped, the version in it), or ``""``."""
    config = cfg.get("fsdp_config")
    if not (config or cfg.get("fsdp")):
        return ""
    if not isinstance(config, Mapping):
        return f"fsdp_config of type {type(config).__name__}: pass axolotl's fsdp_config mapping"
    modes = cfg.get("fsdp") or []
    modes = modes.split() if isinstance(modes, str) else [str(mode) for mode in modes]
    unverified = [mode for mode in modes if mode not in _FSDP_MODES_VERIFIED]
    if unverified:  # transformers turns ``offload`` into cpu_offload, ``hybrid_shard`` into HSDP
        return f"fsdp: {unverified} is not verified under the plugin (only {list(_FSDP_MODES_VERIFIED)})"
    config = {key.removeprefix("fsdp_"): value for key, value in config.items()}
    inner = config.pop("version", None)
    version = cfg.get("fsdp_version") or inner or 1  # axolotl's default: FSDP1
    if str(version) != "2":
        return f"fsdp_version={version!r}: FSDP2 (fsdp_version: 2) is verified under the plugin, FSDP1 is not"
    return fsdp_config_problem({**config, "version": 2})


def attention_problem(attn_implementation: Optional[str], config: Any) -> str:
    """What in the model's attention the YAML's ``attn_implementation`` computes otherwise than the plugin, or ``""``:
    transformers' ``sdpa`` drops a logit softcap (Gemma 2's ``attn_logit_softcapping``) that eager attention and the
    plugin's per-document kernel apply, so axolotl's run without CP would not be the same model's."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    softcap = getattr(text, "attn_logit_softcapping", None)
    if softcap is not None and attn_implementation != "eager":
        return (f"the model's attn_logit_softcapping={softcap} with attn_implementation {attn_implementation!r}: "
                "transformers' sdpa drops the softcap the plugin applies, so the run without CP is another model's; "
                "set attn_implementation: eager")
    return ""


def _model_config(cfg: Any) -> Any:
    """The transformers config of the YAML's model (``base_model_config``, else ``base_model``), read before the data
    and the weights load."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(cfg.get("base_model_config") or cfg.get("base_model"),
                                      trust_remote_code=bool(cfg.get("trust_remote_code")))


def _is_this_plugin(name: Any) -> bool:
    """Whether the ``plugins:`` entry `name` is this plugin or a subclass of it (``module.Class``, as axolotl
    imports it)."""
    if name == PLUGIN:
        return True
    module, _, attr = str(name).rpartition(".")
    try:
        found = getattr(importlib.import_module(module), attr, None) if module else None
    except ImportError:
        return False
    return isinstance(found, type) and issubclass(found, BlockDiagCPPlugin)


def context_parallel_size(cfg: Mapping[str, Any]) -> int:
    """The YAML's ``context_parallel_size`` (or its deprecated spelling ``sequence_parallel_degree``), 1 if unset."""
    cp = cfg.get("context_parallel_size")
    cp = cfg.get("sequence_parallel_degree") if cp is None else cp
    cp = 1 if cp is None else cp
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"context_parallel_size must be an int >= 1, got {cp!r}")
    return cp


def trainer_class(base: type, cp_size: int) -> type:
    """``base`` (axolotl's trainer class) with `BlockDiagCPMixin` mixed in and ``cp_size`` bound (axolotl builds the
    trainer with its own arguments only); its multipack samplers are built as in the run without CP (Note [axolotl's
    multipack sampler sees the dp replicas as its world])."""
    from ..trainer import BlockDiagCPMixin

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super(cls, self).__init__(*args, cp_size=cp_size, **kwargs)

    def _create_multipack_sampler(self, base_sampler: Any, dataset: Any) -> Any:
        with sampler_world(self.dp_size):
            return super(cls, self)._create_multipack_sampler(base_sampler, dataset)

    cls = type(f"BlockDiagCP{base.__name__}", (BlockDiagCPMixin, base),
               {"__init__": __init__, "_create_multipack_sampler": _create_multipack_sampler})
    return cls


@contextlib.contextmanager
def sampler_world(replicas: int) -> Iterator[None]:
    """``WORLD_SIZE`` = `replicas` inside (the world axolotl's multipack sampler reads when it is built), put back
    after (Note [axolotl's multipack sampler sees the dp replicas as its world]). torch.distributed must be up
    already: nothing inside may start it."""
    before = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(replicas)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = before


def replicas(cp_size: int) -> int:
    """The dp replicas of this launch: its processes (``WORLD_SIZE``) over `cp_size`; `ValueError` where `cp_size`
    does not divide them (read when axolotl registers the plugin, before anything loads)."""
    world = _world_size()
    if world % cp_size:
        raise ValueError(
            f"{PLUGIN}: context_parallel_size {cp_size} must divide the number of processes, got {world} "
            f"(the world is dp x cp: launch --nproc-per-node {cp_size}, {2 * cp_size}, ...)"
        )
    return world // cp_size


def _world_size() -> int:
    """Processes in this run: torch.distributed's world once it is up, else the launcher's ``WORLD_SIZE``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def cpu_world(cfg: Mapping[str, Any]) -> None:
    """Launched as several processes on a machine without an accelerator: ``ACCELERATE_USE_CPU`` (what
    ``accelerate launch --cpu`` sets), so the Trainer runs them as one gloo world; axolotl passes no ``use_cpu``,
    and without it each process would train alone. Not with DeepSpeed (accelerate turns DeepSpeed off on a CPU
    state): its communication starts the world itself, over gloo on a CPU."""
    import torch

    if _world_size() > 1 and not torch.cuda.is_available() and not cfg.get("deepspeed"):
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")


def keep_on_cpu(cfg: Any) -> None:
    """Several processes on CPU (a gloo world: the tests, a laptop): each process's model stays on the CPU (axolotl
    places it on the accelerator of its local rank, which a CPU has not)."""
    if int(cfg.world_size or 1) > 1 and str(cfg.device) == "cpu":
        cfg.device_map = {"": "cpu"}


class BlockDiagCPPlugin(BasePlugin):
    """axolotl's trainer under `BlockDiagCPMixin`, ``context_parallel_size`` as its ``cp_size`` (module docstring).

    Attributes:
        cp_size: the YAML's ``context_parallel_size``, read when axolotl registers the plugin.
    """

    def __init__(self) -> None:
        super().__init__()
        self.cp_size, self.dp_size = 1, 1

    def register(self, cfg: dict) -> None:
        """The YAML before axolotl validates it: refuse what is not verified, take ``context_parallel_size`` as the
        mixin's ``cp_size`` (it must divide the launch's processes) and turn axolotl's own sequence parallelism off
        (Note [context_parallel_size is the mixin's cp_size])."""
        problem = refusal(cfg)
        if problem:
            raise ValueError(problem)
        self.cp_size = context_parallel_size(cfg)
        self.dp_size = replicas(self.cp_size)
        cpu_world(cfg)
        cfg["context_parallel_size"] = 1
        cfg.pop("sequence_parallel_degree", None)

    def load_datasets(self, cfg: Any, preprocess: bool = False) -> Any:
        """After axolotl normalized the YAML: LoRA kernels and an attention setting that computes another model than the
        plugin (`attention_problem`) refused; ``batch_size`` counts the ``world / cp`` data-parallel replicas, not
        every process (Note [context_parallel_size is the mixin's cp_size]); on CPU (gloo) each process's model stays
        on the CPU; then axolotl's own ``load_datasets``, its multipack sampler seeing the dp replicas as its world
        (Note [axolotl's multipack sampler sees the dp replicas as its world]). ``axolotl preprocess``: None (axolotl
        prepares the datasets itself)."""
        kernels = [name for name in LORA_KERNELS if cfg.get(name)]
        if kernels:
            raise ValueError(
                f"{', '.join(kernels)} (axolotl's fused LoRA kernels, CUDA / triton, on by default with LoRA) are not "
                f"verified under {PLUGIN}: set {': false, '.join(LORA_KERNELS)}: false"
            )
        problem = attention_problem(cfg.get("attn_implementation"), _model_config(cfg))
        if problem:
            raise ValueError(f"{PLUGIN}: {problem}")
        cfg.batch_size = cfg.micro_batch_size * cfg.gradient_accumulation_steps * self.dp_size
        keep_on_cpu(cfg)
        if preprocess:
            return None
        from axolotl.common.datasets import load_datasets
        from axolotl.utils.distributed import init_distributed_state

        init_distributed_state()  # torch.distributed up before the sampler's world is set (it reads WORLD_SIZE too)
        with sampler_world(self.dp_size):
            return load_datasets(cfg=cfg)

    def get_trainer_cls(self, cfg: Any) -> type:
        """axolotl's causal trainer with the mixin mixed in (`trainer_class`)."""
        from axolotl.core.trainers import AxolotlTrainer

        return trainer_class(AxolotlTrainer, self.cp_size)

    def post_trainer_create(self, cfg: Any, trainer: Any) -> None:
        """Refuse a trainer built without the mixin (another way in chose the class)."""
        from ..trainer import BlockDiagCPMixin

        if not isinstance(trainer, BlockDiagCPMixin):
            raise ValueError(f"{PLUGIN}: axolotl built {type(trainer).__name__}, not the plugin's trainer class")


#: the name the YAML's ``plugins:`` list gives the plugin
PLUGIN = f"{__name__}.{BlockDiagCPPlugin.__name__}"
