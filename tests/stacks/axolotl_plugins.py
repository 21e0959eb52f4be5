"""Test-only axolotl plugins: what a GPU machine gives axolotl that a CPU gloo world has to be given.

- ``CPUWorldPlugin`` is for the runs without CP (axolotl's own single process, DDP, DeepSpeed or FSDP2): axolotl puts
  each process's model on the accelerator of its local rank and passes the Trainer no ``use_cpu``, so on CPU the
  processes neither find a device nor form one world; the plugin sets what ``accelerate launch --cpu`` sets and keeps
  the model on the CPU, as `BlockDiagCPPlugin` does itself on CPU (the same functions).
- ``CPUBlockDiagCPPlugin`` is `BlockDiagCPPlugin` with the stand-ins below and nothing else.
- ``QLoRAProbePlugin`` is ``CPUBlockDiagCPPlugin`` with the plugin's refusal of QLoRA lifted, for the GPU check that
  measures QLoRA under the plugin (``test_qlora_on_gpus_against_axolotl_without_cp``, benchmarks/gpu_session.sh).

The stand-ins (`stand_in_for_gpu_world`, `stand_in_trainer_class`), each for one step of axolotl's GPU path that
accelerate 1.13 skips on CPU:

- DeepSpeed: accelerate starts DeepSpeed's world only on an accelerator (NCCL); on a CPU state it turns DeepSpeed off,
  and without one it counts one process. Here accelerate's state is started first over gloo with
  ``ACCELERATE_USE_DEEPSPEED`` (what axolotl sets a moment later), so DeepSpeed's communication joins that world
  (axolotl's single-process DeepSpeed set-up, which starts NCCL itself, then finds it started; a single process
  launched without torchrun gets the one-process world's variables axolotl itself sets on one GPU), and the trainer uses
  that state (``accelerator_config.use_configured_state``: transformers would otherwise start a new one without a
  backend, which counts one process; `KeepConfiguredState`: axolotl's trainer reads that option after transformers
  popped it from the arguments, and resets the state).
- Resuming: on a CPU world accelerate names each process's device ``cpu:<local rank>`` (``cuda:<local rank>`` on GPUs),
  and transformers 5.16 loads the optimizer's checkpoint with that device as ``map_location``, which ``torch.load``
  cannot map to (`LoadOnCPU`: ``cpu`` while it loads).
- FSDP2: axolotl builds accelerate's ``ParallelismConfig`` device mesh for ``"cuda"`` by name while it loads the model
  (`on_cpu`: the same mesh on the CPU), and accelerate drops its FSDP plugin on CPU;
  ``trainer_runs.CPUStandInForAccelerateFSDP2`` (the Trainer tests' stand-in, design.md section 5) puts it back after
  the trainer created its accelerator, so accelerate's own FSDP2 preparation (``fully_shard`` over the world) runs as
  on GPUs.
"""

from __future__ import annotations

import os
from typing import Any

from axolotl.integrations.base import BasePlugin
from transformers import TrainerCallback

from blockdiag_cp.integrations.axolotl import BlockDiagCPPlugin, cpu_world, keep_on_cpu


def stand_in_for_gpu_world(cfg: dict) -> None:
    """At registration (before axolotl sets up DeepSpeed or loads the model): accelerate's state over gloo for
    DeepSpeed, its parallelism meshes on the CPU for FSDP (module docstring)."""
    import torch

    if torch.cuda.is_available():
        return
    if cfg.get("fsdp_config") or cfg.get("fsdp"):
        from accelerate.parallelism_config import ParallelismConfig

        build = ParallelismConfig.build_device_mesh
        if not getattr(build, "on_cpu", False):
            ParallelismConfig.build_device_mesh = on_cpu(build)
    if cfg.get("deepspeed"):
        from accelerate import PartialState

        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        if "LOCAL_RANK" not in os.environ:  # one process, no launcher
            os.environ.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(free_port()))
        PartialState(backend="gloo")
        cfg["accelerator_config"] = {**(cfg.get("accelerator_config") or {}), "use_configured_state": True}


def free_port() -> int:
    """A TCP port free on this machine now (launches run side by side)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def on_cpu(build_device_mesh: Any) -> Any:
    """accelerate's ``ParallelismConfig.build_device_mesh`` building the mesh axolotl asks for on ``"cuda"`` on the
    CPU (module docstring)."""

    def build(self: Any, device_type: str) -> Any:
        return build_device_mesh(self, "cpu" if device_type == "cuda" else device_type)

    build.on_cpu = True
    return build


class LoadOnCPU:
    """Mixed in before axolotl's trainer on CPU: the optimizer's checkpoint loaded onto ``cpu``, not ``cpu:<local
    rank>`` (module docstring)."""

    def _load_optimizer_and_scheduler(self, checkpoint: Any) -> Any:
        import torch

        device = self.args.device
        if device.type != "cpu" or device.index is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        self.args.__dict__["_setup_devices"] = torch.device("cpu")  # the arguments' cached device, for this call
        try:
            return super()._load_optimizer_and_scheduler(checkpoint)
        finally:
            self.args.__dict__["_setup_devices"] = device


class KeepConfiguredState:
    """Mixed in before axolotl's trainer: the Trainer's accelerator on the accelerate state started for DeepSpeed
    (module docstring), which ``AxolotlTrainer.create_accelerator_and_postprocess`` would reset."""

    def create_accelerator_and_postprocess(self) -> None:
        import transformers

        transformers.Trainer.create_accelerator_and_postprocess(self)


def stand_in_trainer_class(base: type, cfg: Any) -> type:
    """`base` with the stand-ins the YAML needs on CPU: checkpoints loaded on the CPU, DeepSpeed's state kept,
    accelerate's FSDP2 set up (module docstring)."""
    import torch

    if torch.cuda.is_available():
        return base
    stand_ins: tuple = (LoadOnCPU,)
    if cfg.deepspeed:
        stand_ins += (KeepConfiguredState,)
    elif cfg.fsdp_config or cfg.fsdp:
        from trainer_runs import CPUStandInForAccelerateFSDP2

        stand_ins += (CPUStandInForAccelerateFSDP2,)
    return type(f"CPU{base.__name__}", (*stand_ins, base), {})


class WrapperReport(TrainerCallback):
    """Prints, after the first optimizer step, what trained the model (``trainer_runs.wrapper_of``: DDP, FSDP2's
    module, DeepSpeed's engine and its ZeRO stage), for the tests to read from the log."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from trainer_runs import wrapper_of

        if state.global_step == 1 and state.is_world_process_zero:
            print(f"{REPORT}{wrapper_of(self.trainer)}", flush=True)


#: the line `WrapperReport` prints
REPORT = "axolotl test run trained by: "


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

    def add_callbacks_post_trainer(self, cfg: Any, trainer: Any) -> list:
        return [WrapperReport(trainer)]


class CPUBlockDiagCPPlugin(BlockDiagCPPlugin):
    """`BlockDiagCPPlugin` with the CPU stand-ins (module docstring)."""

    def register(self, cfg: dict) -> None:
        super().register(cfg)
        stand_in_for_gpu_world(cfg)

    def get_trainer_cls(self, cfg: Any) -> type:
        return stand_in_trainer_class(super().get_trainer_cls(cfg), cfg)

    def add_callbacks_post_trainer(self, cfg: Any, trainer: Any) -> list:
        return [WrapperReport(trainer)]


class QLoRAProbePlugin(CPUBlockDiagCPPlugin):
    """``CPUBlockDiagCPPlugin`` registered as if the YAML had no QLoRA lines, which stay in it (module docstring)."""

    def register(self, cfg: dict) -> None:
        quantized = {key: cfg.pop(key) for key in ("adapter", "load_in_4bit") if key in cfg}
        try:
            super().register(cfg)
        finally:
            cfg.update(quantized)
