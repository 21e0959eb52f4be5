"""Vision-language rows: `make_cp_vlm_batch_and_ctx` against each sample run alone (Qwen2-VL, Qwen2.5-VL).

Packed rows of image+text and text-only samples with padding, an image straddling a
rank boundary, at cp = 2 and 3, both layouts: logits, loss, vision-tower and
language-model gradients. transformers runs the vision rotary embedding and some
RMSNorms in float32 even in a float64 model, so gradients of an image whose
placeholders are split across ranks round differently: the tolerances say so.
"""

import pytest
import torch

from blockdiag_cp.testing import hang_timeout

transformers = pytest.importorskip("transformers")



IMAGE, VIDEO, V_START, V_END, TIMESTAMP = 60, 61, 62, 63, 7
#: (text tokens before, [(kind, (t, h, w))], text tokens after) per sample, then PADDING tokens
SAMPLES = (
    (3, [("image", (1, 4, 4))], 4),
    (6, [], 2),
    (2, [("image", (1, 8, 8)), ("video", (2, 4, 4)), ("image", (1, 2, 2))], 5),
    (4, [("image", (1, 8, 4))], 9),
)
PADDING = 3
SECONDS_PER_GRID = 0.5  # Qwen2.5-VL video positions scale with it
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def tiny_vlm(family: str, attn: str):
    text = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]})
    vision = dict(depth=2, hidden_size=32, num_heads=2, patch_size=2, spatial_merge_size=2, temporal_patch_size=2,
                  in_channels=3)
    if family == "qwen2_vl":
        config = transformers.Qwen2VLConfig(text_config=text, vision_config={**vision, "embed_dim": 16, "mlp_ratio": 2},
                                            image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=V_START,
                                            vision_end_token_id=V_END)
        model_cls = transformers.Qwen2VLForConditionalGeneration
    elif family == "qwen3_vl":  # deepstack: visual features also enter after decoder layers 0 and 1
        text = {**text, "head_dim": 8, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                           "mrope_section": [1, 1, 2], "mrope_interleaved": True}}
        del text["rope_scaling"]
        config = transformers.Qwen3VLConfig(
            text_config=text, vision_config={**vision, "intermediate_size": 32, "out_hidden_size": 32,
                                             "num_position_embeddings": 16, "deepstack_visual_indexes": [0, 1]},
            image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=V_START, vision_end_token_id=V_END)
        model_cls = transformers.Qwen3VLForConditionalGeneration
    else:
        config = transformers.Qwen2_5_VLConfig(
            text_config=text, vision_config={**vision, "intermediate_size": 32, "out_hidden_size": 32, "window_size": 8,
                                             "fullatt_block_indexes": [1]},
            image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=V_START, vision_end_token_id=V_END)
        model_cls = transformers.Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(0)
    model = model_cls(config).to(torch.float64)
    model.set_attn_implementation(attn)
    return model


def visual_tokens(family: str, kind: str, grid) -> list[int]:
    """A visual input's placeholders as the family's processor writes them."""
    t, h, w = grid
    token = IMAGE if kind == "image" else VIDEO
    if kind == "video" and family == "qwen3_vl":  # Qwen3-VL: a timestamp and its own run per frame
        return sum(([TIMESTAMP, V_START] + [token] * (h * w // 4) + [V_END] for _ in range(t)), [])
    return [V_START] + [token] * (t * h * w // 4) + [V_END]


def samples(family: str, spec=SAMPLES):
    """[(input_ids list, [(kind, grid, pixel rows)])] with deterministic text tokens and pixels."""
    g = torch.Generator().manual_seed(3)
    out, index = [], 0
    for before, visuals, after in spec:
        ids, inputs = torch.randint(0, 59, (before,), generator=g).tolist(), []
        for kind, grid in visuals:
            ids += visual_tokens(family, kind, grid)
            rows = torch.randn(grid[0] * grid[1] * grid[2], 3 * 2 * 2 * 2, dtype=torch.float64,
                               generator=torch.Generator().manual_seed(index))
            inputs.append((kind, grid, rows))
            index += 1
        out.append((ids + torch.randint(0, 59, (after,), generator=g).tolist(), inputs))
    return out


def visual_kwargs(family: str, inputs) -> dict:
    """The model's pixel / grid keyword arguments for a list of ``(kind, grid, rows)``."""
    kw = {}
    for kind, pixel_key, grid_key in (("image", "pixel_values", "image_grid_thw"),
                                      ("video", "pixel_values_videos", "video_grid_thw")):
        mine = [(grid, rows) for k, grid, rows in inputs if k == kind]
        if mine:
            kw[pixel_key] = torch.cat([rows for _, rows in mine])
            kw[grid_key] = torch.tensor([grid for grid, _ in mine])
            if kind == "video" and family == "qwen2_5_vl":
                kw["second_per_grid_ts"] = torch.full((len(mine),), SECONDS_PER_GRID)
    return kw


def packed_row(family: str, spec=SAMPLES):
    rows = samples(family, spec)
    ids = sum((sample_ids for sample_ids, _ in rows), []) + [0] * PADDING
    doc = [d + 1 for d, (sample_ids, _) in enumerate(rows) for _ in sample_ids] + [0] * PADDING
    batch = {"input_ids": torch.tensor([ids]), "_packed_seq_ids": torch.tensor([doc]), "labels": torch.tensor([ids]),
             **visual_kwargs(family, [x for _, inputs in rows for x in inputs])}
    batch["labels"][0, -PADDING:] = -100
    return batch


def reference(family, spec=SAMPLES, train_vision=True):
    """Each sample alone: logits, mean next-token loss over all samples, parameter gradients."""
    model = tiny_vlm(family, "sdpa")
    model.model.visual.requires_grad_(train_vision)
    logits, loss_sum, count = [], 0.0, 0
    for ids, inputs in samples(family, spec):
        x = torch.tensor([ids])
        kw = visual_kwargs(family, inputs)
        if kw:
            kw["mm_token_type_ids"] = ((x == IMAGE) + 2 * (x == VIDEO)).int()
        out = model(input_ids=x, use_cache=False, **kw).logits
        logits.append(out.detach())
        loss_sum = loss_sum + torch.nn.functional.cross_entropy(out[0, :-1], x[0, 1:], reduction="sum")
        count += len(ids) - 1
    (loss_sum / count).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return torch.cat(logits, 1), (loss_sum / count).item(), grads


def relative(got, want):
    return float((got - want).abs().max()) / max(1.0, float(want.abs().max()))


def vlm_worker(rank, world, family, layouts, spec=SAMPLES, train_vision=True):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp import CPConfig, gather_sequence
    from blockdiag_cp.hf import make_cp_vlm_batch_and_ctx, vlm_model_inputs
    from blockdiag_cp.loss import add_shift_labels

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"]
    ref_logits, ref_loss, ref_grads = reference(family, spec, train_vision)
    S = sum(len(ids) for ids, _ in samples(family, spec))
    results = {}
    for layout in layouts:
        model = tiny_vlm(family, "blockdiag_cp")
        model.model.visual.requires_grad_(train_vision)
        encoded = []
        model.model.visual.register_forward_hook(lambda m, args, out: encoded.append(args[0].shape[0]))
        row = add_shift_labels(packed_row(family, spec))
        image_positions = ((row["input_ids"][0] == IMAGE) | (row["input_ids"][0] == VIDEO)).nonzero().flatten()
        train_ctx, batch = make_cp_vlm_batch_and_ctx(mesh, model, row, config=CPConfig(layout=layout))
        owner = train_ctx.state.plan.owner()
        breaks = ((image_positions.diff() != 1).nonzero().flatten() + 1).tolist()
        straddling = sum(owner[run].unique().numel() > 1 for run in image_positions.tensor_split(breaks))
        with train_ctx() as state:
            logits = model(**vlm_model_inputs(batch), use_cache=False).logits
            count = sum(len(ids) - 1 for ids, _ in samples(family, spec))
            loss = torch.nn.functional.cross_entropy(logits[0], batch["shift_labels"][0], reduction="sum") / count
            loss.backward()
            full = gather_sequence(logits.detach())[:, :S]
        total = loss.detach().clone()
        dist.all_reduce(total, group=mesh.get_group())
        errors = {"logits": relative(full, ref_logits), "loss": abs(float(total) - ref_loss)}
        for name, p in model.named_parameters():
            grad = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(grad, group=mesh.get_group())
            part = "vision" if ".visual." in name else "language"
            errors[part] = max(errors.get(part, 0.0), relative(grad, ref_grads.get(name, torch.zeros_like(grad))))
        results[layout] = (errors, sum(encoded), state.call_notes.vision, straddling)
    return results


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_packed_vlm_rows_match_each_sample_run_alone(family, world, rank_pools):
    total_patches = sum(t * h * w for _, visuals, _ in SAMPLES for _, (t, h, w) in visuals)
    per_rank = rank_pools(world).run(vlm_worker, family, ("contiguous", "balanced"))
    for layout in ("contiguous", "balanced"):
        encoded = [r[layout][1] for r in per_rank]
        assert sum(encoded) == total_patches, encoded  # every image encoded on exactly one rank
        assert list(per_rank[0][layout][2].patches_per_rank) == encoded
        largest = max(t * h * w for _, visuals, _ in SAMPLES for _, (t, h, w) in visuals)
        assert max(encoded) <= total_patches / world + largest, encoded  # balanced by patch count
        assert per_rank[0][layout][3] >= 1, "no image or video straddles a rank boundary: the row no longer tests that"
        check_errors(per_rank, layout)


def check_errors(per_rank, layout):
    for errors in (r[layout][0] for r in per_rank):
        assert errors["logits"] < 1e-10 and errors["loss"] < 1e-10, (layout, errors)
        # float32 vision rotary / RMSNorm inside the float64 model: split images round at ~1e-8
        assert errors["language"] < 1e-7 and errors.get("vision", 0.0) < 1e-7, (layout, errors)


@pytest.mark.slow
@pytest.mark.parametrize("train_vision", [True, False])
def test_a_rank_with_no_image_to_encode_still_pairs_the_exchange(train_vision, rank_pools):
    """One image at cp = 3: two ranks encode nothing, yet join the all-gather and its backward
    (a frozen vision tower: no backward exchange on any rank). A hang fails the pool's task."""
    spec = ((2, [("image", (1, 4, 8))], 3), (5, [], 4))
    per_rank = rank_pools(3).run(vlm_worker, "qwen3_vl", ("balanced",), spec, train_vision)
    assert sorted(r["balanced"][1] for r in per_rank) == [0, 0, 32]
    check_errors(per_rank, "balanced")


def test_placeholder_and_grid_mismatches_are_clear_errors():
    from blockdiag_cp.hf import make_cp_vlm_batch_and_ctx

    model = tiny_vlm("qwen2_vl", "blockdiag_cp")
    batch = packed_row("qwen2_vl")
    batch["image_grid_thw"] = batch["image_grid_thw"][:-1]
    with pytest.raises(ValueError, match="placeholder"):
        make_cp_vlm_batch_and_ctx(None, model, batch)
    batch = packed_row("qwen2_vl")
    batch["image_grid_thw"][0, 1] = 8  # more tokens than the first image's placeholders
    with pytest.raises(ValueError, match="placeholders and image_grid_thw disagree"):
        make_cp_vlm_batch_and_ctx(None, model, batch)
    with pytest.raises(ValueError, match="not a supported vision-language model"):
        make_cp_vlm_batch_and_ctx(None, transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)), batch)


@pytest.mark.slow
def test_vlm_example_under_torchrun_equals_the_single_process_run():
    """examples/train_vlm.py at dp 2 x cp 2: the logged losses are the single-process run's."""
    import re
    import subprocess
    import sys

    from examples_module import ROOT as root, example

    train_vlm = example("train_vlm")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(root / "examples" / "train_vlm.py"), "--dp", "2", "--cp", "2", "--steps", "2"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=hang_timeout(400), cwd=root)
    assert result.returncode == 0, result.stdout + result.stderr
    logged = [float(x) for x in re.findall(r"step \d+/\d+  loss ([0-9.]+)", result.stdout)]
    reference = train_vlm.single_process_losses("qwen2_5_vl", dp=2, steps=2, per_row=6)
    assert len(logged) == 2
    assert all(abs(a - b) <= 2e-4 * abs(b) for a, b in zip(logged, reference)), (logged, reference)
    patches = re.findall(r"vision patches per cp rank \[([0-9, ]+)\]", result.stdout)
    assert patches and all(len(p.split(",")) == 2 for p in patches)
