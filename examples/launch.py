"""The start and end every torchrun example shares: the process group and the (dp, cp) DeviceMesh."""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def start_dp_cp(dp: int, cp: Optional[int]) -> tuple[DeviceMesh, torch.device]:
    """Join the torchrun group (NCCL on GPUs, gloo on CPU) and build the ``(dp, cp)`` mesh.

    `cp` None: the world size // `dp`. A dp x cp that is not the world size exits with a message.
    """
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    cp = cp or world // dp
    if dp * cp != world:
        raise SystemExit(f"--dp {dp} x --cp {cp} must equal the world size {world}")
    device = torch.device("cuda" if cuda else "cpu")
    return init_device_mesh(device.type, (dp, cp), mesh_dim_names=("dp", "cp")), device


def finish() -> None:
    """Tear the group down once every rank is past its last collective."""
    dist.barrier()
    dist.destroy_process_group()
