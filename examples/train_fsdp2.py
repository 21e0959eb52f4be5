"""Train a transformers causal LM with FSDP2 and block-diagonal CP on a (dp x cp) DeviceMesh.

    torchrun --standalone --nproc-per-node 4 examples/train_fsdp2.py --dp 2 --cp 2 --steps 10

gloo on CPU, NCCL on GPUs (the torchtitan / NeMo pattern). The parameters are sharded
with `fully_shard` over the flattened dp x cp mesh, so FSDP2 reduce-scatters (averages)
every gradient over all dp x cp ranks; gradient checkpointing is on. Each dp replica
trains on its own packed rows (Python standard-library docstrings, byte-tokenized); the
cp ranks of a replica share a row and shard it. The loss handed to backward is
``world * (this rank's token-loss sum) / (global token count)``: averaged over the
world by FSDP2, the gradient is exactly that of the global token mean.
`single_process_losses` is the same training without any parallelism, in one process:
the logged losses must agree.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from launch import finish, start_dp_cp
from torch.distributed.fsdp import fully_shard

import blockdiag_cp.hf  # noqa: F401  registers attn_implementation="blockdiag_cp"
from blockdiag_cp import CPConfig, make_cp_blockdiag_batch_and_ctx
from blockdiag_cp.loss import add_shift_labels, token_mean_loss
from blockdiag_cp.tools.demo import make_model, pack_rows, stdlib_documents, train_unsharded


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--cp", type=int, default=None, help="default: world size // dp")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--layout", choices=("contiguous", "balanced"), default="balanced")
    p.add_argument("--lr", type=float, default=3e-3)
    return p.parse_args()


def replica_rows(dp_rank: int, steps: int, seq_len: int):
    """The packed rows dp replica `dp_rank` trains on (one stream per replica)."""
    return pack_rows(stdlib_documents(), steps, seq_len, seed=1000 + dp_rank)


def single_process_losses(dp: int, steps: int, seq_len: int, lr: float = 3e-3) -> list[float]:
    """The same training in one process, unsharded, transformers' own SDPA: the loss per step."""
    return train_unsharded([replica_rows(d, steps, seq_len) for d in range(dp)], torch.float32, lr)["losses"]


def shard_model(model, mesh) -> None:
    """FSDP2 over the flattened dp x cp mesh: each decoder layer, then the root."""
    flat = mesh["dp", "cp"]._flatten("dp_cp")
    for layer in model.model.layers:
        fully_shard(layer, mesh=flat)
    fully_shard(model, mesh=flat)


def main() -> None:
    args = parse_args()
    mesh, device = start_dp_cp(args.dp, args.cp)
    world = dist.get_world_size()
    dp_rank = mesh.get_local_rank("dp")

    model = make_model("blockdiag_cp", torch.float32).to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    shard_model(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    rows = replica_rows(dp_rank, args.steps, args.seq_len)
    config = CPConfig(layout=args.layout)

    for step, row in enumerate(rows):
        batch = add_shift_labels({"input_ids": row.input_ids.to(device), "position_ids": row.position_ids.to(device)})
        train_ctx, batch = make_cp_blockdiag_batch_and_ctx(mesh["cp"], None, batch, config=config)
        with train_ctx() as state:
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
            targets = batch["shift_labels"][0]
            loss_sum = F.cross_entropy(logits[0].float(), targets, ignore_index=-100, reduction="sum")
            # FSDP2 averages gradients over all dp x cp ranks: scale by the world (see the docstring)
            loss, value = token_mean_loss(loss_sum, (targets != -100).sum(), group=None, grads_averaged_over=world)
            opt.zero_grad()
            loss.backward()
        opt.step()
        if dist.get_rank() == 0:
            work = state.work_per_rank()
            print(f"step {step + 1}/{args.steps}  loss {value.item():.6f}  exchange={state.exchange.name} "
                  f"kernel={state.kernel.name}  cp work max/mean {work.max().item() / work.float().mean().item():.3f}",
                  flush=True)
    finish()


if __name__ == "__main__":
    main()
