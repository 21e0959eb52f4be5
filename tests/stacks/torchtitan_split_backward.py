"""torchtitan's chunked loss under torch's pipeline schedules, without blockdiag-cp (tests/stacks/test_torchtitan_pp.py).

    python tests/stacks/torchtitan_split_backward.py OUT.json

One process, gloo world 1: four stages on the one rank (a tanh linear each, then torchtitan's last stage: an RMS
norm whose output goes to the loss, the head left to the loss), 4 micro-batches of a row of 16, one schedule step.
The norm and the head are one FSDP unit, as torchtitan's `apply_fsdp_to_decoder` shards them (over a mesh of 1
rank here). For Interleaved1F1B (a full backward) and InterleavedZeroBubble (split into input and weight parts),
with torchtitan's `ChunkedLossWrapper` and with its plain cross-entropy on the head's logits, writes each
parameter's gradient norm (None: no gradient) as JSON: Note [torchtitan's chunked loss under a split backward].
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

D, V, L, MICRO_BATCHES = 8, 11, 16, 4


class Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Last(nn.Module):
    """torchtitan's last stage with ``_skip_lm_head``: returns the normed hidden states ``[B, L, D]``."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


def grad_norms(schedule_class: type, chunked: bool) -> dict:
    torch.manual_seed(0)
    parts = [Body(), Body(), Body(), Last()]
    mesh = init_device_mesh("cpu", (1,))
    fully_shard([parts[3].norm, parts[3].lm_head], mesh=mesh, reshard_after_forward=False)
    for part in parts:
        fully_shard(part, mesh=mesh)
    if chunked:
        loss = ChunkedLossWrapper(ChunkedLossWrapper.Config(num_chunks=2))
        loss.set_lm_head(parts[3].lm_head)
    else:
        cross_entropy = CrossEntropyLoss(CrossEntropyLoss.Config())

        def loss(pred, labels, global_valid_tokens):
            return cross_entropy(parts[3].lm_head(pred), labels, global_valid_tokens)

    stages = [PipelineStage(part, i, len(parts), torch.device("cpu")) for i, part in enumerate(parts)]
    schedule = schedule_class(stages, n_microbatches=MICRO_BATCHES, scale_grads=False,
                              loss_fn=lambda out, target, **kw: loss(out, target, **kw)[0])
    x, y = torch.randn(MICRO_BATCHES, L, D), torch.randint(0, V, (MICRO_BATCHES, L))
    for _ in range(2):  # the second step: torch's metadata inference ran in the first
        for part in parts:
            part.zero_grad()
        schedule.step(x, target=y, loss_kwargs={"global_valid_tokens": torch.tensor(float(MICRO_BATCHES * L))})
    return {f"{i}.{name}": None if p.grad is None else float(p.grad.full_tensor().norm())
            for i, part in enumerate(parts) for name, p in part.named_parameters()}


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:0")
    out = {f"{cls.__name__[len('Schedule'):]}/{'chunked' if chunked else 'plain'}": grad_norms(cls, chunked)
           for cls in (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble) for chunked in (False, True)}
    dist.destroy_process_group()
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
