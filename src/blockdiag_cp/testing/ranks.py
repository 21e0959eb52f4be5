"""Real multi-process runs on gloo: `spawn` (fresh ranks per call) and `RankPool` (long-lived ranks).

Note [Timeouts only a hang exceeds]
-----------------------------------
A timeout here exists to turn a hang (ranks waiting in unmatched collectives) into an error,
never to judge speed: a correct run on a loaded machine (load average 20 on 2 cores) takes many
times its idle time. So every harness timeout is generous, and every one is multiplied by
`TIMEOUT_SCALE_VARIABLE` (``BLOCKDIAG_CP_TIMEOUT_SCALE=4`` on a crowded machine, or to wait
longer for a debugger): `hang_timeout` is the one place that reads it, for `spawn`, `RankPool`
and the test suite's subprocess launches.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_module
import tempfile
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist


#: seconds a rank may take to exit once its work is done (then it is killed)
JOIN_SECONDS = 30.0
#: environment variable multiplying every harness timeout (a positive number; default 1)
TIMEOUT_SCALE_VARIABLE = "BLOCKDIAG_CP_TIMEOUT_SCALE"


def hang_timeout(seconds: float) -> float:
    """`seconds` times ``$BLOCKDIAG_CP_TIMEOUT_SCALE`` (Note [Timeouts only a hang exceeds]); `ValueError` for a
    scale that is not a positive number."""
    raw = os.environ.get(TIMEOUT_SCALE_VARIABLE, "1")
    try:
        scale = float(raw)
    except ValueError:
        scale = float("nan")
    if not scale > 0 or scale == float("inf"):
        raise ValueError(f"{TIMEOUT_SCALE_VARIABLE}={raw!r}: expected a positive number (a factor on every timeout)")
    return seconds * scale


def _worker(rank: int, world: int, init_file: str, fn: Callable, args: tuple, results) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        try:
            # plain pickle bytes: tensors must not travel as shared-memory handles of a process that exits
            results.put((rank, "ok", pickle.dumps(fn(rank, world, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report every failure (even SystemExit) to the parent
        results.put((rank, "error", traceback.format_exc()))
    _exit_after_flush(results)


def _exit_after_flush(results) -> None:
    """End a rank once its replies are flushed, skipping the interpreter's teardown of every
    imported module (seconds per rank with transformers loaded, paid by each join)."""
    results.close()
    results.join_thread()
    os._exit(0)


def spawn(fn: Callable, world: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in `world` fresh gloo processes; return results by rank.

    `fn` must be importable (module level). A failure on any rank, or no answer
    within `timeout` seconds (a hang; scaled by `hang_timeout`), raises `RuntimeError` with
    the rank's traceback.
    """
    timeout = hang_timeout(timeout)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_worker, args=(r, world, init_file, fn, args, results)) for r in range(world)]
        for p in procs:
            p.start()
        try:
            collected = _collect(results, procs, world, timeout)
        finally:
            for p in procs:
                p.join(timeout=hang_timeout(JOIN_SECONDS))
                if p.is_alive():
                    p.kill()
    return [collected[r] for r in range(world)]


def _collect(results, procs, world: int, timeout: float) -> dict[int, Any]:
    import time

    collected: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(collected) < world:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RuntimeError(f"spawned ranks did not finish within {timeout:.0f}s (hang?); got {sorted(collected)} "
                               f"(on a loaded machine, raise ${TIMEOUT_SCALE_VARIABLE})")
        try:
            rank, status, payload = results.get(timeout=min(remaining, 1.0))
        except queue_module.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in collected]
            if dead:
                raise RuntimeError(f"rank(s) {dead} died (exit codes {[procs[r].exitcode for r in dead]})")
            continue
        if status == "error":
            raise RuntimeError(f"rank {rank} failed:\n{payload}")
        collected[rank] = pickle.loads(payload)
    return collected


def _groups_held() -> int:
    """How many process groups this rank holds, the default one included."""
    from torch.distributed import distributed_c10d

    return len(distributed_c10d._world.pg_map)


def _pool_worker(rank: int, world: int, init_file: str, tasks, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        while True:
            task = tasks.get()
            if task is None:
                break
            task_id, fn, args = task
            try:
                reply = ("ok", pickle.dumps(fn(rank, world, *args)))
            except BaseException:  # report, keep serving: the parent decides
                reply = ("error", traceback.format_exc())
            results.put((task_id, rank, *reply, _groups_held()))
    finally:
        dist.destroy_process_group()
    _exit_after_flush(results)


class RankPool:
    """`world` long-lived gloo ranks; ``pool.run(fn, *args)`` runs ``fn(rank, world, *args)`` on all.

    Saves the process start-up per task, so hundreds of small parity checks stay fast.
    Use as a context manager. Every task waits for all ranks' replies (replies of an
    earlier task are discarded by id), so one failing task cannot shift the next one's
    results; a rank that dies or a task that outlives `timeout` (scaled by `hang_timeout`) marks the pool `broken`
    (its ranks may sit in an unmatched collective): make a new one.

    Process groups the tasks make (each DeviceMesh makes its own) live as long as the ranks, and
    each idle gloo group polls: a pool whose `groups_held` grew large should be replaced. Destroying
    them between tasks is not an option: torch's DTensor caches keep meshes that name them.
    """

    def __init__(self, world: int, timeout: float = 300.0, failure_grace: float = 30.0) -> None:
        ctx = mp.get_context("spawn")
        self.world, self.timeout, self.failure_grace = world, hang_timeout(timeout), hang_timeout(failure_grace)
        self.broken = False
        self.groups_held = 1  # the most process groups a rank holds, after the last task
        self._task_id = 0
        self._tmp = tempfile.TemporaryDirectory()
        self._tasks = [ctx.Queue() for _ in range(world)]
        self._results = ctx.Queue()
        init_file = os.path.join(self._tmp.name, "rendezvous")
        self._procs = [
            ctx.Process(target=_pool_worker, args=(r, world, init_file, self._tasks[r], self._results))
            for r in range(world)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable, *args: Any) -> list[Any]:
        if self.broken:
            raise RuntimeError("this RankPool is broken (a rank died or hung); make a new one")
        self._task_id += 1
        for q in self._tasks:
            q.put((self._task_id, fn, args))
        replies = self._replies(self._task_id)
        failed = [(rank, payload) for rank, (status, payload) in sorted(replies.items()) if status == "error"]
        if failed:
            raise RuntimeError(f"rank {failed[0][0]} failed:\n{failed[0][1]}")
        return [pickle.loads(replies[r][1]) for r in range(self.world)]

    def _replies(self, task_id: int) -> dict[int, tuple[str, Any]]:
        """Every rank's ``(status, payload)`` for `task_id`; a death or a timeout breaks the pool.

        Once a rank has failed, the others get `failure_grace` seconds more (they may wait in a
        collective the failed rank never joined), not the whole timeout; then the failure is
        reported and the pool is broken.
        """
        import time

        replies: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + self.timeout
        while len(replies) < self.world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.broken = True
                if any(status == "error" for status, _ in replies.values()):
                    return replies  # the caller reports the failure
                raise RuntimeError(f"pool ranks did not finish within {self.timeout:.0f}s (hang?); got {sorted(replies)} "
                                   f"(on a loaded machine, raise ${TIMEOUT_SCALE_VARIABLE})")
            try:
                got_id, rank, status, payload, groups = self._results.get(timeout=min(remaining, 1.0))
            except queue_module.Empty:
                dead = [r for r, p in enumerate(self._procs) if p.exitcode is not None and r not in replies]
                if dead:
                    self.broken = True
                    raise RuntimeError(f"pool rank(s) {dead} died (exit codes {[self._procs[r].exitcode for r in dead]})")
                continue
            if got_id == task_id:
                replies[rank] = (status, payload)
                self.groups_held = max(self.groups_held, groups)
                if status == "error":
                    deadline = min(deadline, time.monotonic() + self.failure_grace)
        return replies

    def stop(self) -> None:
        """Ask every rank to leave (returns at once; `close` waits). Stopping several pools first
        lets their ranks tear down at the same time."""
        for q in self._tasks:
            q.put(None)

    def close(self) -> None:
        self.stop()
        for p in self._procs:
            p.join(timeout=hang_timeout(JOIN_SECONDS))
            if p.is_alive():
                p.kill()
        self._tmp.cleanup()

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------
# Counting host synchronisations (what would stall a GPU) on any device

#: Tensor operations that copy a value to the host or wait for the device to decide a size.
