"""The whole-batch step's host work at worlds of a thousand ranks, measured in one process (issue #41).

    python benchmarks/whole_batch_scale.py                      # worlds 64, 256, 1024; three length mixes
    python benchmarks/whole_batch_scale.py --worlds 64 --ranks 2 --step sleep:0.5

For each world (dp x cp 4, 8 ranks per node) and each length mix (lognormal SFT lengths, a power law,
SFT lengths with 5% long documents: `blockdiag-cp plan --whole-batch`'s ``--lengths``), one micro-batch
of 32k-token rows packed best fit decreasing (the rows' leftover room is padding), and:

- planning s: `plan_world_step` (the global row and its plan; the same on every rank);
- host ms per rank: `WorldStepPlan.rank_step` (the rank's `StepState`: geometry, pieces, exchange
  routing, kernel tables, and its token route), the max over the sampled ranks (rank 0, the middle
  one, the last one, the one holding the most positions, the one whose queries see the most keys);
- blocking ms: how long the step waits for its plan when planning (planning + one rank's host work)
  runs on a background thread, as `prefetched_world_steps` runs it, beside a stand-in for the previous
  step (``--step sleep:S``: a sleep of S seconds, the GIL free; ``matmul:S``: S seconds of torch
  matmuls, which release the GIL in the kernel but not between calls; ``python:S``: S seconds of a
  pure-Python loop, which holds it).

``--world4``: the prefetched step itself on 4 gloo ranks (dp 2 x cp 2, ``--steps`` micro-batches of
``--mixes``' first mix, 32k-token rows), a sleep of ``--step``'s seconds standing in for each step's
forward and backward: per step, the seconds `make_cp_world_batch_and_ctx` takes (no prefetch) against
the seconds the loop waits in ``next()`` under `prefetched_world_steps` (its agreement, the wait for
the plan, the token exchange), the max over ranks, median over the steps after the first.

Everything else runs in this process on one thread (plus the planning thread), CPU, `kernel="auto"` (sdpa
here); the per-rank state is the one `make_cp_world_batch_and_ctx` builds on that rank (a test checks).
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from blockdiag_cp import CPConfig
from blockdiag_cp.plan import PlanOptions
from blockdiag_cp.plan.whole_batch import micro_batches, pack_rows
from blockdiag_cp.step.world_plan import plan_world_step
from blockdiag_cp.tools.plan import sample_lengths

MIXES = ("lognormal", "powerlaw", "longmix")


def replica_rows(mix: str, dp: int, row_len: int, seed: int) -> list[list[int]]:
    """One micro-batch: `dp` rows of `mix` lengths packed best fit decreasing, their leftover room padding."""
    lengths = sample_lengths(mix, int(1.3 * dp * row_len), row_len, seed)
    batch = micro_batches(pack_rows(lengths, row_len), dp, seed)[0]
    return [r.tolist() + ([-(row_len - int(r.sum()))] if r.sum() < row_len else []) for r in batch]


def sampled_ranks(world_plan, count: int) -> list[int]:
    """Rank 0, the middle one, the last one, the one holding the most positions, and the one holding the last
    position of the longest document (its queries see the most keys)."""
    plan, row = world_plan.plan, world_plan.row
    lens = plan.offsets[1:] - plan.offsets[:-1]
    longest = int(np.argmax(row.lengths))
    last = int(row.lengths[: longest + 1].sum()) - 1
    ranks = [0, plan.world // 2, plan.world - 1, int(torch.argmax(lens)), int(plan.segments.locate(torch.tensor([last]))[0])]
    return list(dict.fromkeys(ranks))[:count]


def stand_in_step(spec: str) -> None:
    kind, _, seconds = spec.partition(":")
    end = time.perf_counter() + float(seconds)
    if kind == "sleep":
        time.sleep(float(seconds))
        return
    if kind == "python":  # holds the GIL but for the interpreter's switch interval
        while time.perf_counter() < end:
            sum(range(1000))
        return
    a = torch.randn(384, 384)
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


def blocking_seconds(rows, dp: int, cp: int, rank: int, config: CPConfig, step: str) -> float:
    """The wait for a plan built on a background thread beside a stand-in for the previous step."""
    with ThreadPoolExecutor(1) as planner:
        future = planner.submit(lambda: plan_world_step(rows, dp, cp, config).rank_step(rank))
        stand_in_step(step)
        t0 = time.perf_counter()
        future.result()
        return time.perf_counter() - t0


def measure(world: int, mix: str, args: argparse.Namespace) -> tuple[float, float, float, int]:
    """``(host s per rank, planning s, blocking s, tokens)`` of one micro-batch at `world`."""
    dp, cp = world // args.cp, args.cp
    rows = replica_rows(mix, dp, args.row_len, args.seed)
    config = CPConfig(layout="grouped", plan=PlanOptions(ranks_per_node=args.ranks_per_node))
    t0 = time.perf_counter()
    world_plan = plan_world_step(rows, dp, cp, config)
    planning = time.perf_counter() - t0
    host = []
    ranks = sampled_ranks(world_plan, args.ranks)
    for rank in ranks:
        t0 = time.perf_counter()
        world_plan.rank_step(rank)
        host.append(time.perf_counter() - t0)
    blocking = blocking_seconds(rows, dp, cp, ranks[int(np.argmax(host))], config, args.step)
    return max(host), planning, blocking, world_plan.row.seq_len


def world4_worker(rank: int, world: int, batches: list, step: str) -> tuple[list[float], list[float]]:
    """Seconds each step's setup blocks on this rank: without prefetch, and in `prefetched_world_steps`."""
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp import make_cp_world_batch_and_ctx
    from blockdiag_cp.step.prefetch import prefetched_world_steps
    from blockdiag_cp.testing import doc_ids_from_lengths

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "cp"))
    d = mesh.get_local_rank("dp")
    config = CPConfig(layout="grouped", plan=PlanOptions(ranks_per_node=8))

    def batch_of(rows):
        ids = doc_ids_from_lengths(rows[d])
        return {"input_ids": torch.arange(ids.numel())[None] % 1000, "_packed_seq_ids": ids[None]}

    plain = []
    for batch in [batch_of(rows) for rows in batches]:  # the data loading before the clock
        t0 = time.perf_counter()
        make_cp_world_batch_and_ctx(mesh, batch, config=config)
        plain.append(time.perf_counter() - t0)
        stand_in_step(step)
    prefetched, steps = [], prefetched_world_steps(mesh, [batch_of(rows) for rows in batches], config=config)
    while True:
        t0 = time.perf_counter()
        if next(steps, None) is None:
            break
        prefetched.append(time.perf_counter() - t0)
        stand_in_step(step)
    return plain, prefetched


def world4(args: argparse.Namespace) -> None:
    from blockdiag_cp.testing import spawn

    batches = [replica_rows(args.mixes[0], 2, args.row_len, args.seed + i) for i in range(args.steps)]
    per_rank = spawn(world4_worker, 4, batches, args.step, timeout=600)
    plain = [max(r[0][i] for r in per_rank) for i in range(args.steps)]
    prefetched = [max(r[1][i] for r in per_rank) for i in range(args.steps)]
    print(f"world 4 (dp 2 x cp 2, {args.mixes[0]}, {args.steps} steps, stand-in {args.step}): per step, the max over "
          f"ranks; median of steps 2..{args.steps}")
    print(f"  without prefetch: make_cp_world_batch_and_ctx {np.median(plain[1:]) * 1e3:.1f} ms "
          f"(each: {', '.join(f'{t * 1e3:.1f}' for t in plain)})")
    print(f"  prefetched: blocking ms {np.median(prefetched[1:]) * 1e3:.1f} "
          f"(each: {', '.join(f'{t * 1e3:.1f}' for t in prefetched)}; the first plans in line)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--cp", type=int, default=4)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--row-len", type=int, default=32768)
    p.add_argument("--mixes", nargs="+", default=list(MIXES))
    p.add_argument("--ranks", type=int, default=5, help="ranks sampled per world (host ms: their max)")
    p.add_argument("--step", default="sleep:2.0", help="the stand-in step: sleep:S, matmul:S or python:S (seconds)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--world4", action="store_true", help="the prefetched step on 4 gloo ranks instead (see above)")
    p.add_argument("--steps", type=int, default=5, help="micro-batches of --world4")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.world4:
        return world4(args)
    print(f"| world | dp x cp | lengths | tokens | host ms per rank (max of {args.ranks}) | planning s | "
          f"blocking ms ({args.step}) |")
    print("|---|---|---|---|---|---|---|")
    last = {}
    for world in args.worlds:
        for mix in args.mixes:
            host, planning, blocking, tokens = measure(world, mix, args)
            print(f"| {world} | {world // args.cp} x {args.cp} | {mix} | {tokens / 1e6:.2f}M | {host * 1e3:.0f} | "
                  f"{planning:.2f} | {blocking * 1e3:.0f} |", flush=True)
            worst = last.get(world, (0.0, 0.0, 0.0))
            last[world] = (max(worst[0], host), max(worst[1], planning), max(worst[2], blocking))
    world = args.worlds[-1]
    host, planning, blocking = last[world]
    print(f"world {world}: host ms per rank {host * 1e3:.0f}, planning s {planning:.2f}, blocking ms {blocking * 1e3:.0f}")


if __name__ == "__main__":
    main()
