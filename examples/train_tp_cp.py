"""Tensor parallelism x block-diagonal CP: a transformers causal LM on a (dp, cp, tp) DeviceMesh.

    torchrun --standalone --nproc-per-node 4 examples/train_tp_cp.py --cp 2 --tp 2 --steps 10

gloo on CPU, NCCL on GPUs. `parallelize_module` splits every decoder layer over ``mesh["tp"]``
(Megatron style: q/k/v and gate/up column-wise, o and down row-wise), so each TP rank's
attention sees its own heads; the CP batch is built on ``mesh["cp"]`` with ``mesh["tp"]``
beside it (every TP rank of a CP rank passes the same row and gets the same shard). The
loss is this rank's token-loss sum over the dp x cp token count, and
`blockdiag_cp.parallel.reduce_gradients` sums the gradients over dp x cp: the local shards of
the DTensor parameters and the plain ones (norms, embeddings, head) alike; TP reduces its own.
`single_process_run` is the same training in one process without any parallelism: the
logged losses, the last gradients and the final parameters must agree (``--save``).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from launch import finish, one_line_errors, start_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import blockdiag_cp.hf  # noqa: F401  registers attn_implementation="blockdiag_cp"
from blockdiag_cp import CPConfig, HeadsConfig, make_cp_blockdiag_batch_and_ctx
from blockdiag_cp.loss import add_shift_labels, token_mean_loss
from blockdiag_cp.parallel import reduce_gradients
from blockdiag_cp.tools.demo import make_model, pack_rows, stdlib_documents, train_unsharded

#: Megatron-style plan of one Llama decoder layer
LAYER_PLAN = {
    "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel(),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--tp", type=int, default=None, help="default: world size // (dp * cp)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--layout", choices=("contiguous", "balanced"), default="balanced")
    p.add_argument("--ulysses-degree", type=int, default=1, help="head-parallel ranks inside each CP group")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--save", default=None, help="write losses, last gradients and final parameters here (rank 0)")
    return p.parse_args(argv)


def replica_rows(dp_rank: int, steps: int, seq_len: int):
    """The packed rows dp replica `dp_rank` trains on (one stream per replica)."""
    return pack_rows(stdlib_documents(), steps, seq_len, seed=2000 + dp_rank)


def single_process_run(dp: int, steps: int, seq_len: int, lr: float = 3e-3, dtype: torch.dtype = torch.float32) -> dict:
    """The same training in one process, unsharded, transformers' own SDPA: losses, last grads, params."""
    return train_unsharded([replica_rows(d, steps, seq_len) for d in range(dp)], dtype, lr)


def tensor_parallel(model, tp_mesh) -> None:
    """Split every decoder layer over `tp_mesh` (`LAYER_PLAN`)."""
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, LAYER_PLAN)


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective over its mesh), or the tensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def train(args: argparse.Namespace, mesh, device: torch.device, dtype: torch.dtype = torch.float32) -> dict:
    """The TP x CP training of `args` on `mesh` (dimensions ``dp``, ``cp``, ``tp``): the losses, and the
    last gradients and final parameters as whole tensors (collectives over ``tp``: every rank calls it)."""
    dp_cp = mesh["dp", "cp"]._flatten("dp_cp")
    model = make_model("blockdiag_cp", dtype).to(device)
    tensor_parallel(model, mesh["tp"])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    rows = replica_rows(mesh.get_local_rank("dp"), args.steps, args.seq_len)
    config = CPConfig(layout=args.layout, heads=HeadsConfig(ulysses_degree=args.ulysses_degree))
    losses = []
    for step, row in enumerate(rows):
        batch = add_shift_labels({"input_ids": row.input_ids.to(device), "position_ids": row.position_ids.to(device)})
        train_ctx, batch = make_cp_blockdiag_batch_and_ctx(mesh["cp"], mesh["tp"], batch, config=config)
        with train_ctx() as state:
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
            targets = batch["shift_labels"][0]
            loss_sum = F.cross_entropy(logits[0].to(torch.promote_types(dtype, torch.float32)), targets,
                                       ignore_index=-100, reduction="sum")
            # the token mean over dp x cp (TP ranks hold the same tokens: counted once), gradients summed below
            loss, value = token_mean_loss(loss_sum, (targets != -100).sum(), group=dp_cp.get_group())
            opt.zero_grad()
            loss.backward()
        reduce_gradients(model.parameters(), dp_cp)
        opt.step()
        losses.append(value.item())
        if dist.get_rank() == 0:
            print(f"step {step + 1}/{args.steps}  loss {value.item():.6f}  exchange={state.exchange.name} "
                  f"kernel={state.kernel.name}  tp={mesh['tp'].size()}", flush=True)
    return {"losses": losses, "grads": {n: full(p.grad) for n, p in model.named_parameters()},
            "params": {n: full(p.detach()) for n, p in model.named_parameters()}}


@one_line_errors
def main(argv=None) -> None:
    args = parse_args(argv)
    mesh, device = start_mesh({"dp": args.dp, "cp": args.cp, "tp": args.tp})
    result = train(args, mesh, device)
    if args.save and dist.get_rank() == 0:
        torch.save(result, args.save)
    finish()


if __name__ == "__main__":
    main()
