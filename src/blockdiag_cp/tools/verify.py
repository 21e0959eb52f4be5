"""``blockdiag-cp verify``: the float64-oracle comparison for a user's settings.

Spawns ``--world`` gloo processes on CPU, or, when launched by ``torchrun``, uses
that process group (NCCL on GPUs, gloo on CPU) with every launched rank in CP.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from ..testing import ParityCase, parity_worker, reference_error, run_parity_case, spawn

FLOAT64_TOL = 1e-9


def _case(args: argparse.Namespace, device: str) -> ParityCase:
    return ParityCase(
        tuple(args.segments), heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
        kv_exchange=args.exchange, kernel=args.kernel, layout=args.layout,
        checkpoint=None if args.checkpoint == "none" else args.checkpoint, dtype=args.dtype, device=device,
    )


def _tolerances(case: ParityCase) -> tuple[float, float]:
    """float64: absolute; lower precision: 2x the dense reference's own error in that dtype, plus slack."""
    if case.dtype == "float64":
        return FLOAT64_TOL, FLOAT64_TOL
    ref_out, ref_grad = reference_error(case)
    return 2 * ref_out + 1e-3, 2 * ref_grad + 1e-3


def _report(results, case: ParityCase) -> int:
    tol_out, tol_grad = _tolerances(case)
    ok = True
    print(f"segments={case.segments} heads={case.heads}/{case.kv_heads}x{case.head_dim} dtype={case.dtype}")
    for rank, r in enumerate(results):
        good = r.out_err <= tol_out and r.grad_err <= tol_grad
        ok &= good
        print(f"  rank {rank}: exchange={r.exchange} kernel={r.kernel} max|out-oracle|={r.out_err:.3e} "
              f"max|grad-oracle|={r.grad_err:.3e} K/V rows sent fwd={r.traffic_rows[0]} "
              f"[{'ok' if good else 'MISMATCH'}]")
    print(f"tolerance: out {tol_out:.1e}, grad {tol_grad:.1e} -> {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def run_verify(args: argparse.Namespace) -> int:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return _run_under_torchrun(args)
    case = _case(args, "cpu")
    results = [rank_results[0] for rank_results in spawn(parity_worker, args.world, [case])]
    return _report(results, case)


def _run_under_torchrun(args: argparse.Namespace) -> int:
    """Every torchrun rank joins one CP group; rank 0 prints the report."""
    from torch.distributed.device_mesh import init_device_mesh

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
    mesh = init_device_mesh("cuda" if cuda else "cpu", (world,), mesh_dim_names=("cp",))
    case = _case(args, device)
    result = run_parity_case(case, mesh["cp"])
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    code = _report(gathered, case) if dist.get_rank() == 0 else 0
    codes = torch.tensor([code], device=device)
    dist.all_reduce(codes, op=dist.ReduceOp.MAX)
    dist.barrier()  # every rank is past its last collective
    code = int(codes.item())
    if owns_group:
        # Exit without interpreter teardown: destroying gloo's background threads at exit
        # aborts now and then on a loaded machine after the work is done (seen here).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
