"""A CPU platform for verl: a TEST FIXTURE, not a way to run verl on CPU (docs/verl.md).

verl 0.9 has no CPU platform of its own; its public plugin API (`verl.plugin.platform.PlatformRegistry`,
``VERL_PLATFORM``) accepts one. Under this one verl's FSDP engines build their meshes on ``"cpu"`` and train over
gloo, which is what the tests of `blockdiag_cp.integrations.verl` need: verl's own engine at sp 1 and the
block-diagonal CP engine, side by side, on the same rows. Import it (or name it in ``VERL_USE_EXTERNAL_MODULES``)
before anything resolves verl's platform: `use_cpu_platform` selects it.

Engines are looked up by device; the tests set ``VERL_ENGINE_DEVICE=cuda`` so that verl's registry hands out the
engines it registers for CUDA (verl's FSDP engine, and the block-diagonal CP engine under
``VERL_ENGINE_VENDOR=blockdiag_cp``) while those engines place everything on this platform's ``"cpu"``.
"""

from __future__ import annotations

import contextlib
import os
import types
from typing import Any, Optional

import torch

from verl.plugin.platform import PlatformBase, PlatformRegistry, set_platform

#: the name verl's ``VERL_PLATFORM`` selects this platform by
NAME = "cpu-test"


def _memory_module() -> types.ModuleType:
    """``torch.cpu`` with the CUDA memory calls verl makes (statistics, caches) answered for a CPU: 0 / no-op."""
    module = types.ModuleType("verl_cpu_device")
    for name in dir(torch.cpu):
        if not name.startswith("_"):
            setattr(module, name, getattr(torch.cpu, name))
    for name in ("max_memory_allocated", "max_memory_reserved", "memory_allocated", "memory_reserved"):
        setattr(module, name, lambda *a, **k: 0)
    for name in ("empty_cache", "ipc_collect", "reset_peak_memory_stats", "set_per_process_memory_fraction",
                 "manual_seed", "manual_seed_all"):
        setattr(module, name, lambda *a, **k: None)
    module.mem_get_info = lambda *a, **k: (0, 0)
    module.get_rng_state = torch.get_rng_state
    module.set_rng_state = torch.set_rng_state
    module.get_device_name = lambda *a, **k: "cpu"
    return module


@PlatformRegistry.register(platform=NAME)
class PlatformCPUTest(PlatformBase):
    """verl's platform interface on the CPU: device ``"cpu"``, gloo, no accelerator, no profiler (test fixture)."""

    _device_module = _memory_module()

    device_name = property(lambda self: "cpu")
    vendor_name = property(lambda self: "cpu")
    device_module = property(lambda self: self._device_module)

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return False  # never auto-detected: selected by name only

    def current_device(self) -> Any:
        return "cpu"  # verl moves each micro-batch with .to(current_device())

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> None:
        return None


def use_cpu_platform() -> None:
    """Make this platform verl's (before anything resolves verl's platform), and engines resolve as on CUDA.

    Two things of verl need an accelerator, and the fixture replaces them for its runs: its FSDP2 engine offloads a
    forward-only model's parameters (the reference) to pinned host memory (here: ordinary memory, where a CPU
    computes anyway), and it loads critics with flash attention (`_load_value_model`)."""
    os.environ["VERL_PLATFORM"] = NAME
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"
    set_platform(PlatformCPUTest())
    import verl.utils.model as verl_model
    from verl.workers.engine.fsdp import transformer_impl

    policy = transformer_impl.CPUOffloadPolicy
    transformer_impl.CPUOffloadPolicy = lambda **kwargs: policy(**{**kwargs, "pin_memory": False})
    verl_model.load_valuehead_model = _load_value_model


def _load_value_model(local_path: str, torch_dtype: Any, model_config: Any, trust_remote_code: bool) -> Any:
    """verl's critic loader (``verl.utils.model.load_valuehead_model``) names ``flash_attention_2``, which needs a
    GPU; under this fixture the critic loads with its config's attention instead (sdpa for verl's engine, the
    block-diagonal CP engine's own for it), as a model at sp 1 on CPU attends."""
    from transformers import AutoModelForTokenClassification

    return AutoModelForTokenClassification.from_pretrained(local_path, torch_dtype=torch_dtype, config=model_config,
                                                           trust_remote_code=trust_remote_code)
