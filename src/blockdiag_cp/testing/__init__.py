"""The verification harness: a dense float64 oracle, multi-process runs on real collectives,
and a counter of host synchronisations.

Used by the test suite, the benchmarks and ``blockdiag-cp verify``; a training script
never imports it. A `ParityCase` describes one
packed row and one configuration; `run_parity_case` (inside an initialized process
group) shards it with `make_cp_blockdiag_batch_and_ctx`, runs forward and backward
through `cp_blockdiag_sdpa`, and compares every rank's output rows and the summed
input gradients with `oracle_attention` on the full row.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import pickle
import queue as queue_module
import tempfile
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..step.doc_ids import block_causal_mask


def oracle_attention(
    q_HSD: torch.Tensor, k_HSD: torch.Tensor, v_HSD: torch.Tensor, doc_ids_S: torch.Tensor, scale: float,
    window: Optional[int] = None, softcap: Optional[float] = None, sinks_H: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Dense block-causal attention of the whole row (``[H, S, D]``, GQA allowed); padding rows are 0.

    Optionally with a sliding `window` (keys ``(q - w, q]``), logit `softcap`, and `sinks_H`
    (one extra logit per head in every row's softmax denominator), written the plain way.
    """
    mask_SS = block_causal_mask(doc_ids_S.reshape(1, -1))[0]
    if window is not None:
        S = mask_SS.shape[0]
        mask_SS = mask_SS & torch.ones(S, S, dtype=torch.bool, device=mask_SS.device).triu(-(window - 1))
    groups = q_HSD.shape[0] // k_HSD.shape[0]
    k = k_HSD.repeat_interleave(groups, dim=0)
    v = v_HSD.repeat_interleave(groups, dim=0)
    scores = torch.matmul(q_HSD, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask_SS, float("-inf"))
    if sinks_H is not None:
        sink = sinks_H.to(scores.dtype).reshape(-1, 1, 1).expand(-1, scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        probs = probs.masked_fill(~mask_SS, 0.0)
    else:
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.matmul(probs, v)


def doc_ids_from_lengths(segments: Sequence[int]) -> torch.Tensor:
    """``[S]`` ids from segment lengths: a positive n is a document of n tokens, -n is n padding tokens."""
    ids, doc = [], 0
    for n in segments:
        if n > 0:
            doc += 1
            ids += [doc] * n
        else:
            ids += [0] * (-n)
    return torch.tensor(ids, dtype=torch.long)


@dataclass(frozen=True)
class ParityCase:
    """One packed row and configuration to compare against the oracle."""

    segments: tuple[int, ...]
    heads: int = 4
    kv_heads: int = 4
    head_dim: int = 8
    kv_exchange: str = "auto"
    kernel: str = "auto"
    layout: str = "contiguous"
    checkpoint: Optional[str] = None  # None, "reentrant" or "non_reentrant"
    dtype: str = "float64"
    seed: int = 0
    device: str = "cpu"
    window: Optional[int] = None  # sliding window (keys (q - w, q])
    softcap: Optional[float] = None
    sinks: bool = False  # one learned logit per head (its gradient is checked too)
    ulysses_degree: Any = 1  # head-parallel degree (int or "auto")

    @property
    def doc_ids(self) -> torch.Tensor:
        return doc_ids_from_lengths(self.segments)


@dataclass
class ParityResult:
    """One rank's comparison with the oracle, and what it computed (float64, CPU).

    ``output`` is this rank's ``[H, L, D]`` rows; ``input_grad`` the ``[1, S, X]``
    input gradient summed over the CP group.
    """

    case: ParityCase
    out_err: float
    grad_err: float
    exchange: str
    kernel: str
    traffic_rows: tuple[int, int, int, int]
    output: Optional[torch.Tensor] = None
    input_grad: Optional[torch.Tensor] = None


def _case_tensors(case: ParityCase) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Full-row inputs ``[1, S, (H + 2 Hk) D]``, upstream gradient ``[H, S, D]`` and sinks ``[H]`` (or None),
    the same on every rank."""
    gen = torch.Generator().manual_seed(1000 + case.seed)
    S = case.doc_ids.numel()
    width = (case.heads + 2 * case.kv_heads) * case.head_dim
    dtype = getattr(torch, case.dtype)
    x = torch.randn(1, S, width, generator=gen, dtype=torch.float64).to(device=case.device, dtype=dtype)
    grad = torch.randn(case.heads, S, case.head_dim, generator=gen, dtype=torch.float64)
    sinks = torch.randn(case.heads, generator=gen, dtype=torch.float64).to(case.device, dtype) if case.sinks else None
    return x, grad.to(case.device), sinks


def _split_qkv(x_1SX: torch.Tensor, case: ParityCase) -> tuple[torch.Tensor, ...]:
    """``[1, S, (H + 2 Hk) D]`` -> q ``[1, H, S, D]``, k and v ``[1, Hk, S, D]``."""
    H, Hk, D = case.heads, case.kv_heads, case.head_dim
    q, k, v = torch.split(x_1SX, [H * D, Hk * D, Hk * D], dim=-1)
    return tuple(t.reshape(1, t.shape[1], -1, D).transpose(1, 2) for t in (q, k, v))


def oracle_case(case: ParityCase, dtype: torch.dtype = torch.float64):
    """Oracle output ``[H, S, D]``, input gradient ``[1, S, X]`` and sinks gradient ``[H]`` (or None),
    computed in `dtype`, as float64.

    In float64 this is the ground truth; in the case's low precision it is the dense
    reference's own rounding error, the yardstick for low-precision tolerances.
    """
    x, grad, sinks = _case_tensors(case)
    x = x.to(dtype).requires_grad_(True)
    sinks = None if sinks is None else sinks.to(dtype).requires_grad_(True)
    q, k, v = _split_qkv(x, case)
    out = oracle_attention(q[0], k[0], v[0], case.doc_ids.to(x.device), 1.0 / math.sqrt(case.head_dim),
                           case.window, case.softcap, sinks)
    (out.to(torch.float64) * grad).sum().backward()
    sinks_grad = None if sinks is None else sinks.grad.to(torch.float64)
    return out.detach().to(torch.float64), x.grad.to(torch.float64), sinks_grad


def reference_error(case: ParityCase) -> tuple[float, float]:
    """Max output and gradient error of the dense reference run in the case's dtype."""
    out64, grad64, _ = oracle_case(case)
    out_lo, grad_lo, _ = oracle_case(case, getattr(torch, case.dtype))
    return float((out_lo - out64).abs().max()), float((grad_lo - grad64).abs().max())


def run_parity_case(case: ParityCase, cp_mesh) -> ParityResult:
    """Run `case` on this rank of `cp_mesh` (None: one process) and compare with the oracle."""
    from .. import CPConfig, cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx

    x, grad, sinks = _case_tensors(case)
    x.requires_grad_(True)
    sinks = None if sinks is None else sinks.requires_grad_(True)
    config = CPConfig(kv_exchange=case.kv_exchange, kernel=case.kernel, layout=case.layout,
                      ulysses_degree=case.ulysses_degree, attention_heads=(case.heads, case.kv_heads))
    batch = {"inputs_embeds": x, "_packed_seq_ids": case.doc_ids.unsqueeze(0).to(x.device)}
    train_ctx, batch = make_cp_blockdiag_batch_and_ctx(cp_mesh, None, batch, config=config)
    with train_ctx() as state:
        positions = state.positions
        q, k, v = _split_qkv(batch["inputs_embeds"], case)
        attend = lambda q, k, v: cp_blockdiag_sdpa(q, k, v, enable_gqa=True, sliding_window=case.window,
                                                   softcap=case.softcap, sinks=sinks)
        if case.checkpoint is None:
            out = attend(q, k, v)
        else:
            reentrant = case.checkpoint == "reentrant"
            out = torch.utils.checkpoint.checkpoint(attend, q, k, v, use_reentrant=reentrant)
        S = case.doc_ids.numel()
        positions = positions.to(x.device)
        grad_local = torch.zeros(case.heads, positions.numel(), case.head_dim, dtype=torch.float64, device=x.device)
        real = positions < S
        grad_local[:, real] = grad[:, positions[real]]
        (out[0].to(torch.float64) * grad_local).sum().backward()
    x_grad = x.grad.to(torch.float64)
    sinks_grad = None if sinks is None else sinks.grad.to(torch.float64)
    if cp_mesh is not None and cp_mesh.size() > 1:
        dist.all_reduce(x_grad, group=cp_mesh.get_group())
        if sinks_grad is not None:
            dist.all_reduce(sinks_grad, group=cp_mesh.get_group())
    ref_out, ref_grad, ref_sinks_grad = oracle_case(case)
    grad_err = float((x_grad - ref_grad).abs().max())
    if sinks_grad is not None:
        grad_err = max(grad_err, float((sinks_grad - ref_sinks_grad).abs().max()))
    expected = torch.zeros(case.heads, positions.numel(), case.head_dim, dtype=torch.float64, device=x.device)
    expected[:, real] = ref_out[:, positions[real]]
    t = state.traffic
    return ParityResult(
        case,
        out_err=float((out[0].detach().to(torch.float64) - expected).abs().max()),
        grad_err=grad_err,
        exchange=state.exchange_for(case.window).name,
        kernel=state.kernel.name,
        traffic_rows=(t.sent_fwd, t.recv_fwd, t.sent_bwd, t.recv_bwd),
        output=out[0].detach().to(torch.float64).cpu(),
        input_grad=x_grad.cpu(),
    )


# ---------------------------------------------------------------------------
# Spawning gloo process groups on 127.0.0.1


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


def spawn(fn: Callable, world: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in `world` fresh gloo processes; return results by rank.

    `fn` must be importable (module level). A failure on any rank, or no answer
    within `timeout` seconds (a hang), raises `RuntimeError` with the rank's traceback.
    """
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
                p.join(timeout=10)
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
            raise RuntimeError(f"spawned ranks did not finish within {timeout:.0f}s (hang?); got {sorted(collected)}")
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


def parity_worker(rank: int, world: int, cases: Sequence[ParityCase]) -> list[ParityResult]:
    """Spawned entry: run every case on a 1-D CP mesh of the whole world."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    return [run_parity_case(case, mesh["cp"]) for case in cases]


# ---------------------------------------------------------------------------
# A pool of gloo ranks that serves many small tasks (property-based tests)


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
                results.put((task_id, rank, "ok", pickle.dumps(fn(rank, world, *args))))
            except BaseException:  # report, keep serving: the parent decides
                results.put((task_id, rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class RankPool:
    """`world` long-lived gloo ranks; ``pool.run(fn, *args)`` runs ``fn(rank, world, *args)`` on all.

    Saves the process start-up per task, so hundreds of small parity checks stay fast.
    Use as a context manager. Every task waits for all ranks' replies (replies of an
    earlier task are discarded by id), so one failing task cannot shift the next one's
    results; a rank that dies or a task that outlives `timeout` marks the pool `broken`
    (its ranks may sit in an unmatched collective): make a new one.
    """

    def __init__(self, world: int, timeout: float = 300.0, failure_grace: float = 30.0) -> None:
        ctx = mp.get_context("spawn")
        self.world, self.timeout, self.failure_grace = world, timeout, failure_grace
        self.broken = False
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
                raise RuntimeError(f"pool ranks did not finish within {self.timeout:.0f}s (hang?); got {sorted(replies)}")
            try:
                got_id, rank, status, payload = self._results.get(timeout=min(remaining, 1.0))
            except queue_module.Empty:
                dead = [r for r, p in enumerate(self._procs) if p.exitcode is not None and r not in replies]
                if dead:
                    self.broken = True
                    raise RuntimeError(f"pool rank(s) {dead} died (exit codes {[self._procs[r].exitcode for r in dead]})")
                continue
            if got_id == task_id:
                replies[rank] = (status, payload)
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
            p.join(timeout=10)
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
HOST_SYNC_OPS = frozenset({
    "__bool__", "__int__", "__float__", "__index__", "item", "tolist", "cpu", "numpy",
    "equal", "nonzero", "argwhere", "unique", "unique_consecutive", "masked_select",
    "allclose", "is_nonzero",
})


class count_host_syncs(torch.overrides.TorchFunctionMode):
    """Context manager: records every `HOST_SYNC_OPS` call made inside it (this thread).

    ``calls`` lists ``(op name, "file:line" of the caller)``. On a GPU each is a host
    synchronisation; on CPU they are the same calls, so a CPU test can prove a path
    makes none. ``repeat_interleave`` without ``output_size`` is counted too.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in HOST_SYNC_OPS or (name == "repeat_interleave" and kwargs.get("output_size") is None
                                     and len(args) > 1 and isinstance(args[1], torch.Tensor)):
            self.calls.append((name, _caller()))
        return func(*args, **kwargs)


def _caller() -> str:
    """The innermost stack frame outside torch and this module, as "file:line"."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in frame.filename and not frame.filename.endswith("testing.py"):
            return f"{os.path.basename(frame.filename)}:{frame.lineno}"
    return "?"
