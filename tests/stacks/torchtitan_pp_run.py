"""One torchtitan run with its pipeline, for tests/stacks/test_torchtitan_pp.py, launched by torchrun on CPU gloo.

    torchrun --nproc-per-node W tests/stacks/torchtitan_pp_run.py OUT.pt --module CFG --config FN [--k V ...]

torchtitan's own ConfigManager, ``config.build()`` and ``trainer.train()``; around them, for the test only: the same
initial weights at every world size and pipeline split (`torchtitan_run.same_initial_weights`, per model part), each
step's logged loss and grad norm from a rank holding the last stage, and every stage's final parameters gathered
whole. Rank 0 saves them.
"""

import sys

from blockdiag_cp.integrations.torchtitan_cpu import use_cpu_device

use_cpu_device()  # before torchtitan's trainer is imported (it copies the device choice when it loads)

import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402

from torchtitan_run import record_logged, same_initial_weights  # noqa: E402


def main() -> None:
    out_path, argv = sys.argv[1], sys.argv[2:]
    trainer = ConfigManager().parse_args(argv).build()
    for part in trainer.model_parts:
        same_initial_weights(part)
    record = {"losses": [], "grad_norms": []}
    record_logged(trainer, record)
    trainer.train()
    record["params"] = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
                        for part in trainer.model_parts for name, p in part.named_parameters()}
    record["last_stage"] = bool(getattr(trainer, "pp_has_last_stage", True)) if trainer.parallel_dims.pp_enabled else True
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, record)
    if dist.get_rank() == 0:
        import torch

        last = next(r for r in gathered if r["last_stage"])
        torch.save({"losses": last["losses"], "grad_norms": last["grad_norms"], "world": dist.get_world_size(),
                    "params": {n: t for r in gathered for n, t in r["params"].items()}}, out_path)
    trainer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
