"""Run torchtitan's own ``torchtitan.train`` on a machine without an accelerator (CPU processes over gloo).

    torchrun --nproc-per-node 2 -m blockdiag_cp.integrations.torchtitan_cpu --module my_configs --config my_run

torchtitan 0.3.0 picks its device once, when ``torchtitan.tools.utils`` loads (``_get_available_device_type() or
"cuda"``), and its other modules copy that choice when they load. On a CPU-only machine every `Trainer` therefore
fails at its first line of device setup::

    AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'

This launcher sets that one choice, ``torchtitan.tools.utils.device_type`` and ``device_module``, to the CPU
before any other torchtitan module is imported, then runs ``torchtitan.train.main`` unchanged (its
``ConfigManager``, ``--module``/``--config`` and ``--section.key`` overrides). Where an accelerator is present it
changes nothing. `CpuDevice` is the device module torchtitan calls; it has no memory statistics (torchtitan's
memory monitor logs -1 GiB).
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch

__all__ = ("CpuDevice", "main", "use_cpu_device")


class CpuDevice:
    """The device-module calls torchtitan's trainer makes (``torch.cuda``'s names), answered for the CPU."""

    def set_device(self, device: torch.device) -> None:
        return None

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def synchronize(self, device: object = None) -> None:
        return None

    def get_device_name(self, device: object = None) -> str:
        return "cpu"

    def get_device_properties(self, device: object = None) -> SimpleNamespace:
        return SimpleNamespace(name="cpu", total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    def reset_peak_memory_stats(self, device: object = None) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def memory_stats(self, device: object = None) -> dict:
        return {}


def use_cpu_device() -> bool:
    """Point torchtitan's device choice at the CPU when no accelerator is present; True if it did.

    Raises:
        RuntimeError: a torchtitan module that copies the device choice was imported before (it would keep
            "cuda"): call this first in the process.
    """
    from torch._utils import _get_available_device_type

    if _get_available_device_type() is not None:
        return False
    early = sorted(m for m in ("torchtitan.trainer", "torchtitan.distributed.utils", "torchtitan.components.metrics")
                   if m in sys.modules)
    if early:
        raise RuntimeError(f"use_cpu_device() must run before torchtitan's {early} are imported")
    import torchtitan.tools.utils as titan_utils

    titan_utils.device_type, titan_utils.device_module = "cpu", CpuDevice()
    return True


def main() -> None:
    """``torchtitan.train.main`` on the CPU where there is no accelerator (the command line is torchtitan's)."""
    use_cpu_device()
    from torchtitan.train import main as titan_main

    titan_main()


if __name__ == "__main__":
    main()
