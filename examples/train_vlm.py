"""Train a vision-language model on packed image+text rows with block-diagonal CP on a (dp x cp) mesh.

    torchrun --standalone --nproc-per-node 4 examples/train_vlm.py --dp 2 --cp 2 --steps 10
    torchrun --standalone --nproc-per-node 3 examples/train_vlm.py --cp 3 --family qwen3_vl

A tiny random Qwen2.5-VL (or Qwen2-VL / Qwen3-VL with ``--family``), built locally (no
downloads), learns a synthetic captioning task: each sample is a prompt, one image of
a random size whose patches encode a colour class, and the answer naming that class.
Rows pack several samples, as a VLM collator with packing hands them over: ``input_ids``
with the placeholder tokens, ``_packed_seq_ids``, ``labels`` (-100 on prompt and image
tokens), ``pixel_values`` and ``image_grid_thw``. `make_cp_vlm_batch_and_ctx` turns
such a row into this rank's step batch; each rank of a CP group runs the vision tower
on about ``1/cp`` of the row's patches.

Gradients are summed over all dp x cp ranks with one all-reduce per parameter (every
rank holds the whole model), and the loss handed to backward is this rank's token-loss
sum over the global token count, so the update is exactly the global token mean's.
`single_process_losses` is the same training in one process without CP (each sample
run alone): the logged losses must agree.
"""

from __future__ import annotations

import argparse
import random

import torch
import torch.distributed as dist
import torch.nn.functional as F
from launch import finish, start_dp_cp

IMAGE, VIDEO, V_START, V_END = 60, 61, 62, 63
CLASSES = 8  # answer tokens 1..8 name the class
MERGE = 2  # spatial_merge_size: an image of grid (1, h, w) takes h * w / 4 placeholders
PATCH_DIM = 3 * 2 * 2 * 2  # channels x temporal patch x patch x patch
GRIDS = ((1, 4, 4), (1, 4, 8), (1, 8, 4), (1, 8, 8))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--cp", type=int, default=None, help="default: world size // dp")
    p.add_argument("--family", choices=("qwen2_vl", "qwen2_5_vl", "qwen3_vl"), default="qwen2_5_vl")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--samples-per-row", type=int, default=6)
    p.add_argument("--layout", choices=("contiguous", "balanced"), default="balanced")
    p.add_argument("--lr", type=float, default=3e-3)
    return p.parse_args(argv)


def tiny_vlm(family: str, attn: str) -> torch.nn.Module:
    """A tiny random model of `family` (float32, the same weights on every call)."""
    import transformers

    text = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, bos_token_id=None, eos_token_id=None)
    vision = dict(depth=2, hidden_size=32, num_heads=2, patch_size=2, spatial_merge_size=MERGE,
                  temporal_patch_size=2, in_channels=3)
    tokens = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=V_START, vision_end_token_id=V_END)
    mrope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    if family == "qwen2_vl":
        config = transformers.Qwen2VLConfig(
            text_config={**text, "rope_parameters": {**mrope, "type": "mrope"}},
            vision_config={**vision, "embed_dim": 32, "mlp_ratio": 2}, **tokens)
        model_cls = transformers.Qwen2VLForConditionalGeneration
    elif family == "qwen2_5_vl":
        config = transformers.Qwen2_5_VLConfig(
            text_config={**text, "rope_parameters": {**mrope, "type": "mrope"}},
            vision_config={**vision, "intermediate_size": 64, "out_hidden_size": 64, "window_size": 8,
                           "fullatt_block_indexes": [1]}, **tokens)
        model_cls = transformers.Qwen2_5_VLForConditionalGeneration
    else:
        config = transformers.Qwen3VLConfig(
            text_config={**text, "rope_parameters": {**mrope, "mrope_interleaved": True}},
            vision_config={**vision, "intermediate_size": 64, "out_hidden_size": 64, "num_position_embeddings": 16,
                           "deepstack_visual_indexes": [0]}, **tokens)
        model_cls = transformers.Qwen3VLForConditionalGeneration
    torch.manual_seed(0)
    model = model_cls(config)
    model.set_attn_implementation(attn)
    return model


def sample(rng: random.Random) -> dict:
    """One prompt + image + answer: ``input_ids``, ``labels``, ``pixels [patches, PATCH_DIM]``, ``grid``."""
    label = rng.randrange(CLASSES)
    grid = rng.choice(GRIDS)
    prompt = [rng.randrange(10, 59) for _ in range(rng.randint(2, 8))]
    image = [V_START] + [IMAGE] * (grid[0] * grid[1] * grid[2] // MERGE**2) + [V_END]
    answer = [1 + label] * 3
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    pixels = torch.randn(grid[0] * grid[1] * grid[2], PATCH_DIM, generator=g) * 0.5 + (label - CLASSES / 2) / 4
    ids = prompt + image + answer
    return {"input_ids": ids, "labels": [-100] * (len(prompt) + len(image)) + answer, "pixels": pixels, "grid": grid}


def replica_samples(dp_rank: int, steps: int, per_row: int) -> list[list[dict]]:
    """The samples of each step's packed row of dp replica `dp_rank`."""
    rng = random.Random(1000 + dp_rank)
    return [[sample(rng) for _ in range(per_row)] for _ in range(steps)]


def pack(samples: list[dict]) -> dict:
    """A packed row as a VLM collator with packing hands it over."""
    ids = sum((s["input_ids"] for s in samples), [])
    return {
        "input_ids": torch.tensor([ids]),
        "labels": torch.tensor([sum((s["labels"] for s in samples), [])]),
        "_packed_seq_ids": torch.tensor([[d + 1 for d, s in enumerate(samples) for _ in s["input_ids"]]]),
        "pixel_values": torch.cat([s["pixels"] for s in samples]),
        "image_grid_thw": torch.tensor([s["grid"] for s in samples]),
    }


def single_process_losses(family: str, dp: int, steps: int, per_row: int, lr: float = 3e-3) -> list[float]:
    """The same training in one process without CP, each sample run alone (SDPA): the loss per step."""
    model = tiny_vlm(family, "sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    streams = [replica_samples(d, steps, per_row) for d in range(dp)]
    losses = []
    for step in range(steps):
        loss_sum, tokens = 0.0, 0
        for s in (s for stream in streams for s in stream[step]):
            x = torch.tensor([s["input_ids"]])
            logits = model(input_ids=x, pixel_values=s["pixels"], image_grid_thw=torch.tensor([s["grid"]]),
                           mm_token_type_ids=(x == IMAGE).int(), use_cache=False).logits
            targets = torch.tensor(s["labels"][1:])
            loss_sum = loss_sum + F.cross_entropy(logits[0, :-1], targets, ignore_index=-100, reduction="sum")
            tokens += int((targets != -100).sum())
        loss = loss_sum / tokens
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main(argv=None) -> None:
    import blockdiag_cp.hf  # noqa: F401  registers attn_implementation="blockdiag_cp"
    from blockdiag_cp import CPConfig
    from blockdiag_cp.hf import make_cp_vlm_batch_and_ctx, vlm_model_inputs
    from blockdiag_cp.loss import add_shift_labels, token_mean_loss
    from blockdiag_cp.parallel import reduce_gradients

    args = parse_args(argv)
    mesh, device = start_dp_cp(args.dp, args.cp)

    model = tiny_vlm(args.family, "blockdiag_cp").to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    config = CPConfig(layout=args.layout)
    steps = replica_samples(mesh.get_local_rank("dp"), args.steps, args.samples_per_row)

    for step, samples in enumerate(steps):
        row = add_shift_labels({k: v.to(device) for k, v in pack(samples).items()})
        train_ctx, batch = make_cp_vlm_batch_and_ctx(mesh["cp"], model, row, config=config)
        with train_ctx() as state:
            logits = model(**vlm_model_inputs(batch), use_cache=False).logits
            targets = batch["shift_labels"][0]
            loss_sum = F.cross_entropy(logits[0].float(), targets, ignore_index=-100, reduction="sum")
            loss, value = token_mean_loss(loss_sum, (targets != -100).sum())  # over the world: dp x cp
            opt.zero_grad()
            loss.backward()
        reduce_gradients(model.parameters())  # SUM over dp x cp: every rank holds the whole model
        opt.step()
        if dist.get_rank() == 0:
            vision = state.call_notes.vision
            print(f"step {step + 1}/{args.steps}  loss {value.item():.6f}  "
                  f"vision patches per cp rank {list(vision.patches_per_rank)}  "
                  f"GFLOPs {[round(f / 1e9, 3) for f in vision.flops_per_rank]}", flush=True)
    finish()


if __name__ == "__main__":
    main()
