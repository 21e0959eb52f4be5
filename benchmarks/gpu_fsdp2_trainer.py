"""accelerate's FSDP2 through the Trainer on a GPU, its own path (no CPU stand-in): the mixin against the same
FSDP2 run without it, in one process (one GPU: cp 1, the mixin's per-document attention and its loss paths
on FSDP2's DTensor parameters; the CP cases run on CPU in tests/integrations/test_sharded_trainer.py).

    torchrun --standalone --nproc-per-node 1 benchmarks/gpu_fsdp2_trainer.py
"""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import trainer_runs as tr  # noqa: E402

ARGS = {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2}, "use_cpu": False, "max_grad_norm": 0.5}

def kinds() -> list[str]:
    """The Trainer always; TRL's SFTTrainer where trl and datasets import (the GPU image may lack them)."""
    try:
        import datasets  # noqa: F401
        import trl  # noqa: F401
    except ImportError as exc:
        print(json.dumps({"case": "FSDP2 sft", "skipped": f"not installed: {exc}"}))
        return ["trainer"]
    return ["trainer", "sft"]


if __name__ == "__main__":
    for kind in kinds():
        got, want = tr.run(tr.spec(cp=1, trainer=kind, args=ARGS)), tr.run(tr.spec(cp=0, trainer=kind, args=ARGS))
        relative = float((got["params"] - want["params"]).norm() / want["params"].norm())
        losses = [abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(got["steps"], want["steps"])]
        print(json.dumps({"case": f"FSDP2 {kind}", "wrapper": [got["wrapper"], want["wrapper"]],
                          "loss_rel": max(losses), "params_rel": relative}))
        tr.assert_same(got, want, tol=1e-5, param_tol=5e-5, label=kind)
