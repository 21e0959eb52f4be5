"""Pipeline parallelism x block-diagonal CP: a transformers causal LM on a (dp, pp, cp) DeviceMesh.

    torchrun --standalone --nproc-per-node 4 examples/train_pp_cp.py --pp 2 --cp 2 --schedule 1F1B --steps 10

gloo on CPU, NCCL on GPUs. The model's decoder layers are cut into pipeline stages (`CausalLMStage`:
the embeddings on the first, the final norm and the head on the last, every stage its rotary
embeddings from the micro-batch's ``position_ids``); torch's schedule (`SCHEDULES`: every one torch
2.13 ships) runs ``--microbatches`` packed rows per step. Each row is sharded over ``mesh["cp"]`` by
`make_cp_pipeline_batch_and_ctx`, which returns their steps and the shards stacked one row per
micro-batch; ``with steps(schedule):`` makes every stage action (forward, backward, zero-bubble's
split backward, the recompute of checkpointed layers) attend with its own micro-batch's documents,
on every stage. The loss is the last stage's token-loss sum over the step's dp x cp token count;
`blockdiag_cp.parallel.reduce_gradients` sums each stage's gradients over dp x cp.
`single_process_run` is the same training in one process without any parallelism: the logged
losses, the last gradients and the final parameters must agree (``--save``).
"""

from __future__ import annotations

import argparse
import types
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from launch import finish, one_line_errors, start_mesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules

import blockdiag_cp.hf  # noqa: F401  registers attn_implementation="blockdiag_cp"
from blockdiag_cp import CPConfig, make_cp_pipeline_batch_and_ctx
from blockdiag_cp.loss import add_shift_labels
from blockdiag_cp.parallel import reduce_gradients
from blockdiag_cp.tools.demo import make_model, pack_rows, stdlib_documents, train_unsharded

#: --schedule -> (torch's class, how a rank holds its stages: one, two looped (r, r + pp), two in a V (r, 2 pp - 1 - r))
SCHEDULES = types.MappingProxyType({
    "GPipe": ("ScheduleGPipe", "one"),
    "1F1B": ("Schedule1F1B", "one"),
    "Interleaved1F1B": ("ScheduleInterleaved1F1B", "loop"),
    "LoopedBFS": ("ScheduleLoopedBFS", "loop"),
    "InterleavedZeroBubble": ("ScheduleInterleavedZeroBubble", "loop"),
    "ZBVZeroBubble": ("ScheduleZBVZeroBubble", "v"),
    "DualPipeV": ("ScheduleDualPipeV", "v"),
})


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--cp", type=int, default=None, help="default: world size // (dp * pp)")
    p.add_argument("--schedule", choices=tuple(SCHEDULES), default="1F1B")
    p.add_argument("--microbatches", type=int, default=4, help="packed rows per step and replica")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--layers", type=int, default=4, help="decoder layers (at least one per stage)")
    p.add_argument("--layout", choices=("contiguous", "balanced"), default="balanced")
    p.add_argument("--checkpointing", choices=("none", "reentrant", "non_reentrant"), default="none",
                   help="activation checkpointing of every decoder layer (zero-bubble schedules: non_reentrant)")
    p.add_argument("--static-shapes", action="store_true",
                   help="give the stages their shapes (reentrant checkpointing needs it: torch's shape inference "
                        "computes input gradients with autograd.grad, which reentrant checkpointing refuses)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--save", default=None, help="write losses, last gradients and final parameters here (rank 0)")
    return p.parse_args(argv)


class CausalLMStage(torch.nn.Module):
    """Stage `index` of `count` of a transformers Llama-style causal LM: its share of the decoder layers, the
    embeddings on the first stage, the final norm and the head on the last. ``forward(x, position_ids)``: token ids
    ``[1, L]`` (first stage) or hidden states ``[1, L, E]``, and the micro-batch's ``position_ids [1, L]`` (every
    stage computes its rotary embeddings from them) -> hidden states, or logits ``[1, L, V]`` on the last stage.
    The documents reach every stage through its micro-batch's step, not through these arguments."""

    def __init__(self, model, index: int, count: int) -> None:
        super().__init__()
        layers = model.model.layers
        lo, hi = index * len(layers) // count, (index + 1) * len(layers) // count
        self.embed = model.model.embed_tokens if index == 0 else None
        self.layers = torch.nn.ModuleList(layers[lo:hi])
        self.rotary = model.model.rotary_emb
        self.norm, self.head = (final_norm(model.model), model.lm_head) if index == count - 1 else (None, None)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        rotary = self.rotary(h, position_ids)
        for layer in self.layers:
            h = layer(h, attention_mask=None, position_ids=position_ids, position_embeddings=rotary)
        return self.head(self.norm(h)) if self.head is not None else h


def final_norm(decoder) -> torch.nn.Module:
    """The decoder's norm after its last layer (Llama-style ``norm``; LFM2's ``embedding_norm``)."""
    return decoder.norm if hasattr(decoder, "norm") else decoder.embedding_norm


def stage_indices(style: str, pp: int, rank: int) -> tuple[int, ...]:
    """The stages pipeline rank `rank` holds (`SCHEDULES`)."""
    return {"one": (rank,), "loop": (rank, rank + pp), "v": (rank, 2 * pp - 1 - rank)}[style]


def token_loss(logits: torch.Tensor, targets: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """One micro-batch's next-token loss sum on this shard over the step's token count (dp x cp, all micro-batches)."""
    loss_sum = F.cross_entropy(logits[0].to(torch.promote_types(logits.dtype, torch.float32)), targets[0],
                               ignore_index=-100, reduction="sum")
    return loss_sum / tokens


def build_schedule(model, name: str, pp_mesh, device: torch.device, microbatches: int,
                   static_len: Optional[int] = None):
    """``(schedule, this rank's stage modules)``: `model` cut into stages, `name`'s schedule over ``pp_mesh``.
    `static_len`: give every stage its shapes for micro-batches of that many positions (torch then skips its
    shape inference, which runs micro-batch 0 through each stage once)."""
    cls_name, style = SCHEDULES[name]
    pp, rank = pp_mesh.size(), pp_mesh.get_local_rank()
    count = pp * (1 if style == "one" else 2)
    indices = stage_indices(style, pp, rank)
    modules = [CausalLMStage(model, i, count) for i in indices]
    stages = []
    for module, index in zip(modules, indices):
        shapes = {} if static_len is None else stage_shapes(model.config, index, count, static_len, model.dtype)
        stages.append(PipelineStage(module, index, count, device, group=pp_mesh.get_group(), **shapes))
    cls = getattr(schedules, cls_name)
    schedule = cls(stages[0] if style == "one" else stages, n_microbatches=microbatches, loss_fn=token_loss,
                   scale_grads=False)
    return schedule, modules


def stage_shapes(config, index: int, count: int, length: int, dtype: torch.dtype) -> dict[str, Any]:
    """Stage `index`'s inputs and outputs and their gradients for one micro-batch of `length` positions (meta
    tensors; hidden states require gradients, token ids none; the last stage receives none)."""
    hidden = torch.empty(1, length, config.hidden_size, dtype=dtype, device="meta", requires_grad=True)
    ids = torch.empty(1, length, dtype=torch.long, device="meta")
    logits = torch.empty(1, length, config.vocab_size, dtype=dtype, device="meta", requires_grad=True)
    first, last = index == 0, index == count - 1
    return {"input_args": ids if first else hidden, "output_args": logits if last else hidden,
            "input_grads": None if first else hidden, "output_grads": None if last else hidden}


def replica_rows(dp_rank: int, steps: int, microbatches: int, seq_len: int):
    """The packed rows dp replica `dp_rank` trains on: step ``t``'s micro-batch ``m`` is row ``t * M + m``."""
    return pack_rows(stdlib_documents(), steps * microbatches, seq_len, seed=3000 + dp_rank)


def single_process_run(args: argparse.Namespace, dtype: torch.dtype = torch.float32) -> dict:
    """The same training in one process, unsharded, transformers' own SDPA: losses, last grads, params."""
    M = args.microbatches
    rows = [replica_rows(d, args.steps, M, args.seq_len) for d in range(args.dp)]
    streams = [replica[m::M] for replica in rows for m in range(M)]  # step t: every replica's M rows
    return train_unsharded(streams, dtype, args.lr, layers=args.layers)


def train(args: argparse.Namespace, mesh, device: torch.device, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The PP x CP training of `args` on `mesh` (dimensions ``dp``, ``pp``, ``cp``): the losses (on the ranks that
    hold the last stage, else None), and the last gradients and final parameters of this rank's stages."""
    dp_cp = mesh["dp", "cp"]._flatten("dp_cp")
    model = make_model("blockdiag_cp", dtype, args.layers).to(device)
    if args.checkpointing != "none":
        model.gradient_checkpointing_enable({"use_reentrant": args.checkpointing == "reentrant"})
    model.train()
    names = {id(p): n for n, p in model.named_parameters()}
    rows = replica_rows(mesh.get_local_rank("dp"), args.steps, args.microbatches, args.seq_len)
    config, losses, schedule = CPConfig(layout=args.layout), [], None
    for step in range(args.steps):
        micro = [add_shift_labels({"input_ids": r.input_ids.to(device), "position_ids": r.position_ids.to(device)})
                 for r in rows[step * args.microbatches:(step + 1) * args.microbatches]]
        steps, batch = make_cp_pipeline_batch_and_ctx(mesh["cp"], None, micro, config=config)
        if schedule is None:  # the shard length is known now
            static = batch["input_ids"].shape[1] if args.static_shapes else None
            schedule, modules = build_schedule(model, args.schedule, mesh["pp"], device, args.microbatches, static)
            first, last = any(m.embed is not None for m in modules), any(m.head is not None for m in modules)
            params = [p for m in modules for p in m.parameters()]
            opt = torch.optim.AdamW(params, lr=args.lr)
        tokens = (batch["shift_labels"] != -100).sum()
        dist.all_reduce(tokens, group=dp_cp.get_group())
        step_losses: list = []
        inputs = (batch["input_ids"],) if first else ()
        targets = dict(target=batch["shift_labels"], losses=step_losses) if last else {}
        opt.zero_grad()
        with steps(schedule):
            schedule.step(*inputs, position_ids=batch["position_ids"], loss_kwargs={"tokens": tokens}, **targets)
        reduce_gradients(params, dp_cp)
        opt.step()
        if last:
            value = torch.stack(step_losses).sum().detach()
            dist.all_reduce(value, group=dp_cp.get_group())  # the token mean over dp x cp
            losses.append(value.item())
            if mesh.get_local_rank("dp") == 0 and mesh.get_local_rank("cp") == 0:
                print(f"step {step + 1}/{args.steps}  loss {value.item():.6f}  schedule={args.schedule}", flush=True)
    return {"losses": losses if last else None,
            "grads": {names[id(p)]: p.grad.clone() for p in params},
            "params": {names[id(p)]: p.detach().clone() for p in params}}


@one_line_errors
def main(argv=None) -> None:
    args = parse_args(argv)
    mesh, device = start_mesh({"dp": args.dp, "pp": args.pp, "cp": args.cp})
    result = train(args, mesh, device)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)  # rank 0 saves every stage's
    if args.save and dist.get_rank() == 0:
        merged = {"losses": next(r["losses"] for r in gathered if r["losses"] is not None),
                  "grads": {k: v for r in gathered for k, v in r["grads"].items()},
                  "params": {k: v for r in gathered for k, v in r["params"].items()}}
        torch.save(merged, args.save)
    finish()


if __name__ == "__main__":
    main()
