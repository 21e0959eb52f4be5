"""A Trainer run under the mixin at cp 2 that loses a rank to SIGKILL and resumes under torchrun's restart.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 PYTHONPATH=src:tests python -m torch.distributed.run --nproc-per-node 2 \
        --max-restarts 1 --rdzv-backend c10d --rdzv-endpoint localhost:0 tests/killed_rank_run.py OUTPUT_DIR 2

(The variable: a restarted worker must not read the dead attempt's store keys; tests/integrations/test_killed_rank.py.)

Every attempt builds the run of `spec` (tests/trainer_runs.py: the tiny float64 Llama, a checkpoint every optimizer
step) and resumes from the last checkpoint in OUTPUT_DIR if there is one (transformers' ``get_last_checkpoint``).
On the first attempt (``TORCHELASTIC_RESTART_COUNT == 0``) rank 1 sends itself SIGKILL in the forward of step
KILL_AFTER_STEP + 1 (the second argument; 2 above), as its second decoder layer starts: the first layer's CP exchange has already run, so rank 0
has finished writing ``checkpoint-KILL_AFTER_STEP`` (it saves before it enters the next step) and is left waiting
in the second layer's exchange. torchrun sees the worker die, stops the other and restarts both; the second attempt
resumes and finishes. Rank 0 writes, per attempt, what it saw (``attempt-N.json``: the checkpoint it resumed from,
its logged steps, or the error that ended it) and, when training ends, the final parameters (``final.pt``).

`survivor` is the same run without torchrun (no agent stops the survivors): what rank 0 raises, and when, after
its CP peer is killed or stopped mid-step.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import traceback

import torch

import trainer_runs as tr


def spec(output_dir: str, resume: str | None = None) -> dict:
    """The run: cp 2 on 2 ranks, 4 optimizer steps of 2 micro-batches, a checkpoint after each."""
    return tr.spec(cp=2, steps=4, evaluate=False, output_dir=output_dir, resume=resume,
                   args={"max_grad_norm": 0.5, "save_strategy": "steps", "save_steps": 1})


def kill_in_step(trainer, step: int, sig: int = signal.SIGKILL) -> None:
    """Send this process `sig` when the second decoder layer of optimizer step `step` starts its forward."""
    def hook(module, args):
        if trainer.state.global_step == step - 1:
            os.kill(os.getpid(), sig)

    trainer.accelerator.unwrap_model(trainer.model).model.layers[1].register_forward_pre_hook(hook)


def survivor(rank: int, world: int, init_file: str, sig: int, timeout_s: float, results) -> None:
    """One rank of `spec` at dp ``world // 2`` x cp 2 on a world group with a `timeout_s` timeout; rank 1 sends
    itself `sig` (SIGKILL: dead, SIGSTOP: hung) in step 2. Rank 0 puts ``(its error, seconds from its step-2
    second-layer forward to the error)`` on `results` (a multiprocessing queue)."""
    import time
    from datetime import timedelta

    import torch.distributed as dist

    tr.launched_as(rank, world)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    trainer = tr.build(spec(os.path.dirname(init_file)), os.path.dirname(init_file))
    if rank == 1:
        kill_in_step(trainer, 2, sig)
    started = [time.monotonic()]
    layer = trainer.accelerator.unwrap_model(trainer.model).model.layers[1]
    layer.register_forward_pre_hook(lambda module, args: started.__setitem__(0, time.monotonic()))
    try:
        trainer.train()
        error = None
    except Exception as exc:
        error = "".join(traceback.format_exception_only(exc))
    if rank == 0:
        results.put((error, time.monotonic() - started[0]))


def main(output_dir: str, kill_after: int) -> None:
    from transformers.trainer_utils import get_last_checkpoint

    attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
    os.makedirs(output_dir, exist_ok=True)
    stacks = open(os.path.join(output_dir, f"stacks-{attempt}-{rank}.txt"), "w")
    faulthandler.register(signal.SIGUSR1, file=stacks)  # `kill -USR1 <pid>` writes where a worker waits
    torch.set_num_threads(1)
    resume = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    trainer = tr.build(spec(output_dir, resume), output_dir)
    if attempt == 0 and rank == 1:
        kill_in_step(trainer, kill_after + 1)
    report = {"attempt": attempt, "resumed_from": resume}
    try:
        trainer.train(resume_from_checkpoint=resume)
    except Exception as exc:  # what the surviving rank saw, for the test to read; then fail as torchrun expects
        report["error"] = "".join(traceback.format_exception(exc))
        raise
    finally:
        report["steps"] = [e for e in trainer.state.log_history if "loss" in e and "train_loss" not in e]
        if rank == 0:
            with open(os.path.join(output_dir, f"attempt-{attempt}.json"), "w") as f:
                json.dump(report, f)
    params = torch.cat([p.detach().double().reshape(-1) for p in tr.full_parameters(trainer)])
    if rank == 0:
        torch.save(params, os.path.join(output_dir, "final.pt"))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(f"usage: {sys.argv[0]} OUTPUT_DIR KILL_AFTER_STEP")
    main(sys.argv[1], int(sys.argv[2]))
