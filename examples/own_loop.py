# torchrun --standalone --nproc-per-node 2 examples/own_loop.py [--dp 1] [--steps 4]
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from torch.distributed.device_mesh import init_device_mesh

import blockdiag_cp.hf  # noqa: F401  registers attn_implementation="blockdiag_cp"
from blockdiag_cp import CPConfig, make_cp_blockdiag_batch_and_ctx
from blockdiag_cp.loss import add_shift_labels, token_mean_loss
from blockdiag_cp.parallel import reduce_gradients

p = argparse.ArgumentParser()
p.add_argument("--dp", type=int, default=1)
p.add_argument("--steps", type=int, default=4)
args = p.parse_args()

cuda = torch.cuda.is_available()
if cuda:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl" if cuda else "gloo")
device = torch.device("cuda" if cuda else "cpu")
world = dist.get_world_size()
dp, cp = args.dp, world // args.dp  # world = dp x cp ranks; the cp ranks of a dp replica share a row
mesh = init_device_mesh(device.type, (dp, cp), mesh_dim_names=("dp", "cp"))

torch.manual_seed(0)  # the same initial weights on every rank
config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="blockdiag_cp").to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

# one packed row per dp replica and step: 4 documents, 500 tokens
lengths = torch.tensor([180, 37, 250, 33])
doc_ids = torch.repeat_interleave(torch.arange(1, len(lengths) + 1), lengths)[None]   # [1, S], 1-based
positions = torch.cat([torch.arange(n) for n in lengths.tolist()])[None]            # restart per document
data = torch.Generator().manual_seed(mesh.get_local_rank("dp"))                      # same row on a replica's cp ranks

for step in range(args.steps):
    input_ids = torch.randint(0, config.vocab_size, doc_ids.shape, generator=data)
    batch = {"input_ids": input_ids, "_packed_seq_ids": doc_ids, "position_ids": positions}
    batch = add_shift_labels({k: v.to(device) for k, v in batch.items()})  # next-token targets, before sharding
    train_ctx, batch = make_cp_blockdiag_batch_and_ctx(mesh["cp"], None, batch, config=CPConfig(layout="balanced"))
    with train_ctx():  # forward AND backward inside the step
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        targets = batch["shift_labels"][0]                                            # this rank's shard
        loss_sum = F.cross_entropy(logits[0].float(), targets, ignore_index=-100, reduction="sum")
        # token mean over all dp x cp ranks; grads summed below, so grads_averaged_over=1
        # (DDP or FSDP2 fully_shard over the flattened dp x cp mesh average: pass grads_averaged_over=world)
        loss, value = token_mean_loss(loss_sum, (targets != -100).sum(), group=None, grads_averaged_over=1)
        opt.zero_grad()
        loss.backward()
    reduce_gradients(model.parameters())  # every rank holds the whole model: SUM its gradients over dp x cp
    opt.step()
    if dist.get_rank() == 0:
        print(f"step {step + 1}/{args.steps}  loss {value.item():.6f}", flush=True)

dist.barrier()
dist.destroy_process_group()
