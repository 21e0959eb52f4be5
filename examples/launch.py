"""What every torchrun example shares: the launch check, the process group and the (dp, cp) DeviceMesh, errors."""

from __future__ import annotations

import functools
import os
import sys
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def launched_by_torchrun() -> bool:
    """Whether torchrun (or another launcher that sets RANK / WORLD_SIZE) started this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def require_torchrun(nproc: int = 2) -> None:
    """Exit with one line saying how to launch this script, unless torchrun started it."""
    if not launched_by_torchrun():
        script = os.path.relpath(sys.argv[0])
        args = " ".join(sys.argv[1:])
        raise SystemExit(f"{script} runs under torchrun, one process per rank: "
                         f"torchrun --standalone --nproc-per-node {nproc} {script} {args}".rstrip())


def start_dp_cp(dp: int, cp: Optional[int]) -> tuple[DeviceMesh, torch.device]:
    """Join the torchrun group (NCCL on GPUs, gloo on CPU) and build the ``(dp, cp)`` mesh.

    `cp` None: the world size // `dp`. Not under torchrun, or a dp x cp that is not the
    world size: exits with a one-line message.
    """
    return start_mesh({"dp": dp, "cp": cp})


def start_mesh(sizes: dict[str, Optional[int]]) -> tuple[DeviceMesh, torch.device]:
    """Join the torchrun group and build the mesh of these named dimensions, outermost first
    (e.g. ``{"dp": 1, "cp": 2, "tp": 2}``); one size may be None: what the world size leaves."""
    known = 1
    for size in sizes.values():
        known *= size or 1
    require_torchrun(known * (2 if None in sizes.values() else 1))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    shape = {name: size or world // known for name, size in sizes.items()}
    total = 1
    for size in shape.values():
        total *= size
    if total != world:
        named = " x ".join(f"--{name} {size}" for name, size in shape.items())
        raise SystemExit(f"{named} must equal the world size {world}")
    device = torch.device("cuda" if cuda else "cpu")
    return init_device_mesh(device.type, tuple(shape.values()), mesh_dim_names=tuple(shape)), device


def finish() -> None:
    """Tear the group down once every rank is past its last collective."""
    dist.barrier()
    dist.destroy_process_group()


def one_line_errors(main: Callable[..., None]) -> Callable[..., None]:
    """Run `main`; a `ValueError` (bad input: blockdiag-cp raises it on every rank alike) is printed
    once, by rank 0, as one line, and every rank exits with status 1."""

    @functools.wraps(main)
    def run(*args, **kwargs) -> None:
        try:
            main(*args, **kwargs)
        except ValueError as exc:
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None

    return run
