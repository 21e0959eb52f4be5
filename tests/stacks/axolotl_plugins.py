"""Test-only axolotl plugins: what a GPU machine gives axolotl that a CPU gloo world has to be given.

- ``CPUWorldPlugin`` is for the runs without CP (axolotl's own single process, DDP, DeepSpeed or FSDP2): axolotl puts
  each process's model on the accelerator of its local rank and passes the Trainer no ``use_cpu``, so on CPU the
  processes neither find a device nor form one world; the plugin sets what ``accelerate launch --cpu`` sets and keeps
  the model on the CPU, as `BlockDiagCPPlugin` does itself on CPU (the same functions).
- ``CPUBlockDiagCPPlugin`` is `BlockDiagCPPlugin` with the stand-ins below and nothing else.

The stand-ins (`stand_in_for_gpu_world`, `stand_in_trainer_class`), each for one step of axolotl's GPU path that
accelerate 1.13 skips on CPU:

- DeepSpeed: accelerate starts DeepSpeed's world only on an accelerator (NCCL); on a CPU state it turns DeepSpeed off,
  and without one it counts one process. Here accelerate's state is started first over gloo with
  ``ACCELERATE_USE_DEEPSPEED`` (what axolotl sets a moment later), so DeepSpeed's communication joins that world
  (axolotl's single-process DeepSpeed set-up, which starts NCCL itself, then finds it started), and the trainer uses
  that state (``accelerator_config.use_configured_state``: transformers would otherwise start a new one without a
  backend, which counts one process; `KeepConfiguredState`: axolotl's trainer reads that option after transformers
  popped it from the arguments, and resets the state).
- FSDP2: accelerate drops its FSDP plugin on CPU; ``trainer_runs.CPUStandInForAccelerateFSDP2`` (the Trainer tests'
  stand-in, design.md section 5) puts it back after the trainer created its accelerator, so accelerate's own FSDP2
  preparation (``fully_shard`` over the world) runs as on GPUs.
"""

from __future__ import annotations

import os
from typing import Any

from axolotl.integrations.base import BasePlugin

from blockdiag_cp.integrations.axolotl import BlockDiagCPPlugin, cpu_world, keep_on_cpu


def stand_in_for_gpu_world(cfg: dict) -> None:
    """At registration (before axolotl sets up DeepSpeed): accelerate's state over gloo for DeepSpeed (module
    docstring)."""
    import torch

    if cfg.get("deepspeed") and not torch.cuda.is_available():
        from accelerate import PartialState

        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
        cfg["accelerator_config"] = {**(cfg.get("accelerator_config") or {}), "use_configured_state": True}


class KeepConfiguredState:
    """Mixed in before axolotl's trainer: the Trainer's accelerator on the accelerate state started for DeepSpeed
    (module docstring), which ``AxolotlTrainer.create_accelerator_and_postprocess`` would reset."""

    def create_accelerator_and_postprocess(self) -> None:
        import transformers

        transformers.Trainer.create_accelerator_and_postprocess(self)


def stand_in_trainer_class(base: type, cfg: Any) -> type:
    """`base` with the stand-ins the YAML needs on CPU: DeepSpeed's state kept, accelerate's FSDP2 set up (module
    docstring)."""
    import torch

    if torch.cuda.is_available():
        return base
    if cfg.deepspeed:
        return type(f"CPUDeepSpeed{base.__name__}", (KeepConfiguredState, base), {})
    if cfg.fsdp_config or cfg.fsdp:
        from trainer_runs import CPUStandInForAccelerateFSDP2

        return type(f"CPUFSDP2{base.__name__}", (CPUStandInForAccelerateFSDP2, base), {})
    return base


class CPUWorldPlugin(BasePlugin):
    """axolotl's run without CP on a CPU gloo world (module docstring)."""

    def register(self, cfg: dict) -> None:
        cpu_world(cfg)
        stand_in_for_gpu_world(cfg)

    def load_datasets(self, cfg: Any, preprocess: bool = False) -> None:
        keep_on_cpu(cfg)

    def get_trainer_cls(self, cfg: Any) -> Any:
        from axolotl.core.trainers import AxolotlTrainer

        cls = stand_in_trainer_class(AxolotlTrainer, cfg)
        return None if cls is AxolotlTrainer else cls  # None: axolotl picks its own class


class CPUBlockDiagCPPlugin(BlockDiagCPPlugin):
    """`BlockDiagCPPlugin` with the CPU stand-ins (module docstring)."""

    def register(self, cfg: dict) -> None:
        super().register(cfg)
        stand_in_for_gpu_world(cfg)

    def get_trainer_cls(self, cfg: Any) -> type:
        return stand_in_trainer_class(super().get_trainer_cls(cfg), cfg)
