"""A rank lost mid-training under the mixin at cp 2 (gloo, CPU): torchrun restarts the workers, which resume from the
last checkpoint and end with the parameters of the uninterrupted run; and what the surviving rank sees, without an
agent to stop it: a dead peer fails it at once, a hung one when the world group's timeout expires (the mesh's CP
groups keep that timeout), each as a `CollectiveFailure` naming the collective and the step (Note [A peer that
dies mid-step] in parallel/failures.py). The run is tests/killed_rank_run.py's.
"""

import json
import multiprocessing as mp
import os
import queue
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import killed_rank_run  # noqa: E402
import trainer_runs as tr  # noqa: E402
from blockdiag_cp.testing.ranks import hang_timeout  # noqa: E402

TESTS = Path(__file__).resolve().parents[1]


def torchrun(script: Path, *args: str, restarts: int, log: Path) -> int:
    """`script` under ``torchrun --nproc-per-node 2 --max-restarts restarts`` with a local c10d rendezvous on a free
    port, this checkout's src/ and tests/ first on the path, its output in the file `log`; returns its exit code.

    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: torch 2.13's agent keeps one rendezvous TCPStore for every attempt and
    the workers use it without a per-attempt prefix, so a restarted worker can read the dead attempt's gloo
    addresses and fail (``connectFullMesh ... Connection refused``) or hang in ``init_process_group``: seen in 5 of
    8 restarts here without it, 0 of 3 with it (rank 0 then hosts a fresh store per attempt)."""
    path = os.pathsep.join([str(TESTS.parent / "src"), str(TESTS), os.environ.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", str(restarts),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", str(script), *args]
    with open(log, "w") as out:
        env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        return subprocess.run(command, env=env, stdout=out,
                              stderr=subprocess.STDOUT, timeout=hang_timeout(600)).returncode


@pytest.mark.slow
def test_a_killed_rank_resumes_from_the_last_checkpoint_under_torchrun(own_pools, tmp_path):
    """Rank 1 SIGKILLed in step 3 of 4 (checkpoints after every step): torchrun restarts both workers, the second
    attempt resumes from checkpoint-2 and ends with the uninterrupted run's logged steps and parameters, bit for
    bit (float64)."""
    out = tmp_path / "killed"
    log = tmp_path / "torchrun.log"
    assert torchrun(TESTS / "killed_rank_run.py", str(out), "2", restarts=1, log=log) == 0, log.read_text()[-5000:]
    first, second = (json.loads((out / f"attempt-{n}.json").read_text()) for n in (0, 1))
    assert first["resumed_from"] is None and second["resumed_from"] == str(out / "checkpoint-2"), (first, second)
    assert [e["step"] for e in first["steps"]] == [1, 2] and "error" not in second, (first["steps"], second)
    want = own_pools(2).run(tr.pool_run, killed_rank_run.spec(str(tmp_path / "uninterrupted")))[0]
    got = {**want, "steps": second["steps"], "params": torch.load(out / "final.pt")}
    tr.assert_same(got, want, tol=0.0, param_tol=0.0, label="killed at step 3, resumed")


def survivor_of(sig: int, world: int, timeout_s: float, tmp_path) -> tuple[str, float]:
    """``(the error rank 0 raised, seconds it waited for it)`` once rank 1 got `sig` in step 2 (`world` ranks, cp 2,
    a world group timeout of `timeout_s`); every rank is killed afterwards."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_file = str(tmp_path / "rendezvous")
    procs = [ctx.Process(target=killed_rank_run.survivor, args=(r, world, init_file, sig, timeout_s, results))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        return results.get(timeout=hang_timeout(120 + timeout_s))
    except queue.Empty:
        pytest.fail(f"rank 0 neither finished nor raised within {hang_timeout(120 + timeout_s):.0f} s of its peer's "
                    f"{signal.Signals(sig).name}: a hang")
    finally:
        for p in procs:
            p.kill()
            p.join()


@pytest.mark.slow
def test_a_dead_peer_fails_the_survivor_at_once_naming_the_step(tmp_path):
    """Rank 1 SIGKILLed in step 2 (dp 1 x cp 2): rank 0, inside the second layer's K/V exchange, raises within
    seconds (gloo sees the closed connection), long before the world group's 300 s timeout."""
    error, waited = survivor_of(signal.SIGKILL, 2, 300, tmp_path)
    assert error is not None and error.startswith("blockdiag_cp.errors.CollectiveFailure: blockdiag-cp: "
                                                  "torch.distributed.all_to_all_single failed in optimizer step 2 on "
                                                  "rank 0 of 2 (dp replica 0 of 1, CP rank 0 of 2)"), error
    assert "called from all_to_all_rows (blockdiag_cp/parallel/collectives.py:" in error and "Connection" in error, error
    assert waited < 30, waited


@pytest.mark.slow
def test_a_hung_peer_fails_the_survivor_at_the_world_timeout(tmp_path):
    """Rank 1 stopped (SIGSTOP: alive, silent) in step 2 at dp 2 x cp 2, the world group started with a 10 s
    timeout: rank 0 waits in its CP group's K/V exchange for 10 s, not torch's 30-minute default for a new gloo
    group, and raises naming the step."""
    error, waited = survivor_of(signal.SIGSTOP, 4, 10, tmp_path)
    assert error is not None and "optimizer step 2 on rank 0 of 4 (dp replica 0 of 2, CP rank 0 of 2)" in error, error
    assert "Timed out" in error, error
    assert 8 <= waited < 60, waited
