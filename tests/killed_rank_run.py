"""A Trainer run under the mixin at cp 2 that loses a rank to SIGKILL and resumes under torchrun's restart.

    python -m torch.distributed.run --nproc-per-node 2 --max-restarts 1 --rdzv-backend c10d \
        --rdzv-endpoint localhost:0 tests/killed_rank_run.py OUTPUT_DIR KILL_AFTER_STEP

Every attempt builds the run of `spec` (tests/trainer_runs.py: the tiny float64 Llama, a checkpoint every optimizer
step) and resumes from the last checkpoint in OUTPUT_DIR if there is one (transformers' ``get_last_checkpoint``).
On the first attempt (``TORCHELASTIC_RESTART_COUNT == 0``) rank 1 sends itself SIGKILL in the forward of step
KILL_AFTER_STEP + 1, as its second decoder layer starts: the first layer's CP exchange has already run, so rank 0
has finished writing ``checkpoint-KILL_AFTER_STEP`` (it saves before it enters the next step) and is left waiting
in the second layer's exchange. torchrun sees the worker die, stops the other and restarts both; the second attempt
resumes and finishes. Rank 0 writes, per attempt, what it saw (``attempt-N.json``: the checkpoint it resumed from,
its logged steps, or the error that ended it) and, when training ends, the final parameters (``final.pt``).
"""

from __future__ import annotations

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


def kill_in_step(trainer, step: int) -> None:
    """SIGKILL this process when the second decoder layer of optimizer step `step` starts its forward."""
    def hook(module, args):
        if trainer.state.global_step == step - 1:
            os.kill(os.getpid(), signal.SIGKILL)

    trainer.accelerator.unwrap_model(trainer.model).model.layers[1].register_forward_pre_hook(hook)


def main(output_dir: str, kill_after: int) -> None:
    from transformers.trainer_utils import get_last_checkpoint

    attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
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
