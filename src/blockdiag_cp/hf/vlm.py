"""Vision-language rows: from a raw packed batch to a sharded CP step, each image encoded once per CP group.

`make_cp_vlm_batch_and_ctx` (public as `blockdiag_cp.hf.make_cp_vlm_batch_and_ctx`) takes the
row a VLM collator hands over (``input_ids`` with image/video placeholder tokens, the
samples marked by ``_packed_seq_ids`` or restarting ``position_ids``, ``labels``,
``pixel_values`` + ``image_grid_thw``, videos likewise, ``mm_token_type_ids``) and
returns exactly what `make_cp_blockdiag_batch_and_ctx` returns for the hand-built batch
(merged ``inputs_embeds``, per-sample mRoPE ``position_ids [3, 1, S]``). Models that add
visual features inside the decoder too (Qwen3-VL's deepstack) keep ``input_ids`` and get
each rank's features as ``mm_encoder_outputs``, which their forward merges itself.

Note [One vision tower pass per CP group]
-----------------------------------------
Every rank of a CP group holds the same row. Instead of each encoding every image
(the vision work repeated ``cp`` times), the row's images and videos are cut into
``cp`` groups of about equal patch count; rank ``r`` runs the vision tower
(outside the step: it is not causal) on group ``r`` only. The features travel by one
differentiable all-gather (padded to the largest group), every rank scatters them
into its copy of the row's embeddings, and the step shards that row. Backward: the
all-gather's reduce-scatter returns to each rank the summed gradient of its own
images' features from every rank whose shard holds their placeholder tokens, so the
vision tower's gradients are the single-process run's. A rank with nothing to encode
still joins that all-gather (with zero rows) in forward and backward, and every rank's
step graph uses the gathered features (possibly zero rows of them), so the collective
calls always pair up.

Placeholders are matched to images and videos in order, each taking
``t * h * w / merge**2`` placeholder tokens inside one sample, in runs of whole frames
(one run for an image); a mismatch is a `ValueError`. mRoPE positions are the model's own `get_rope_index`, called per
sample (positions restart per sample).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..step.batch import make_cp_blockdiag_batch_and_ctx
from ..step.pipeline import TrainCtx
from ..config import ENTRY_LAYOUT, CPConfig
from ..step.doc_ids import resolve_doc_ids
from ..parallel.collectives import AllGatherRows
from ..mixers import refuse_unrouted_mixers

@dataclass(frozen=True)
class Modality:
    """How a row carries one kind of visual input (keys, placeholder token, the model's feature method).

    Attributes:
        rope_keys: batch keys with one entry per input that `get_rope_index` also takes
            (Qwen2.5-VL's ``second_per_grid_ts`` for videos); sliced per sample like the grids.
    """

    name: str
    pixel_key: str
    grid_key: str
    token_attr: str
    feature_method: str
    type_id: int
    rope_keys: tuple[str, ...] = ()


#: the modalities a row may carry, in the order the model merges them
MODALITIES = (
    Modality("image", "pixel_values", "image_grid_thw", "image_token_id", "get_image_features", 1),
    Modality("video", "pixel_values_videos", "video_grid_thw", "video_token_id", "get_video_features", 2,
             ("second_per_grid_ts",)),
)


@dataclass(frozen=True)
class VisionInput:
    """One image or video of the row: its placeholder tokens and its rows of pixel patches.

    Attributes:
        token_positions: ``[tokens]`` row positions of its placeholders, ascending (one
            run, or one run per frame where the model separates frames by timestamps).
    """

    modality: str
    token_positions: torch.Tensor
    patch_start: int
    patches: int
    grid: tuple[int, int, int]


@dataclass(frozen=True)
class RowFeatures:
    """One modality's features for the whole row, rank group by rank group (differentiable).

    Attributes:
        positions: ``[T]`` the row position of each feature row's placeholder.
        main: ``[T, E]`` the features that replace the placeholder embeddings.
        deepstack: ``K x [T, E]`` features added after the first ``K`` decoder layers (Qwen3-VL).
    """

    positions: torch.Tensor
    main: torch.Tensor
    deepstack: tuple[torch.Tensor, ...]


class EmbedsMerge:
    """Features scattered into the row's ``inputs_embeds`` before sharding (Qwen2-VL, Qwen2.5-VL)."""

    def row_inputs(self, core, input_ids: torch.Tensor, features: dict[str, RowFeatures]) -> dict[str, torch.Tensor]:
        embeds = core.get_input_embeddings()(input_ids)
        for f in features.values():
            index = (torch.zeros_like(f.positions), f.positions.to(embeds.device))
            embeds = embeds.index_put(index, f.main.to(embeds.dtype))
        return {"inputs_embeds": embeds}

    def shard_inputs(self, features: dict[str, RowFeatures], state) -> dict[str, Any]:
        return {}


class EncoderOutputsMerge:
    """``input_ids`` are sharded as they are; each rank gets ``mm_encoder_outputs`` holding the
    features of its shard's placeholders, so the model merges them itself, deepstack included (Qwen3-VL).

    Attributes:
        output_class: the model's own feature output (``BaseModelOutputWithDeepstackFeatures``).
    """

    def __init__(self, core) -> None:
        module = sys.modules[type(core).__module__]
        self.output_class = getattr(module, "BaseModelOutputWithDeepstackFeatures", None)
        if self.output_class is None:
            raise ValueError(
                f"{type(core).__name__} adds deepstack visual features but {module.__name__} defines no "
                "BaseModelOutputWithDeepstackFeatures to carry them as mm_encoder_outputs"
            )

    def row_inputs(self, core, input_ids: torch.Tensor, features: dict[str, RowFeatures]) -> dict[str, torch.Tensor]:
        return {"input_ids": input_ids}

    def shard_inputs(self, features: dict[str, RowFeatures], state) -> dict[str, Any]:
        held = state.plan.rank_positions(state.rank)
        outputs = {}
        for name, f in features.items():
            slot = torch.full((state.plan.padded_len,), -1, dtype=torch.long)
            slot[f.positions.cpu()] = torch.arange(f.positions.numel())
            pick = slot[held]
            pick = pick[pick >= 0].to(f.main.device)  # possibly empty: keeps the exchange in this rank's graph
            outputs[name] = self.output_class(
                pooler_output=(f.main.index_select(0, pick),),
                deepstack_features=[(d.index_select(0, pick),) for d in f.deepstack],
            )
        return {"mm_encoder_outputs": outputs}


def make_cp_vlm_batch_and_ctx(
    cp_mesh,
    model: torch.nn.Module,
    batch: dict[str, Any],
    *,
    config: Optional[CPConfig] = None,
    loss_mask: Optional[torch.Tensor] = None,
    padding_token_id: int = 0,
) -> tuple[TrainCtx, dict[str, Any]]:
    """Shard a packed vision-language row for block-diagonal CP (Note [One vision tower pass per CP group]).

    Args:
        cp_mesh: the 1-D CP `DeviceMesh` (or None: one process).
        model: the VLM (e.g. ``Qwen2VLForConditionalGeneration``), or its inner model.
        batch: ``input_ids [1, S]``, the samples' ``_packed_seq_ids`` or restarting 2-D
            ``position_ids``, ``labels``, and per modality ``pixel_values`` /
            ``image_grid_thw`` (``pixel_values_videos`` / ``video_grid_thw``);
            ``mm_token_type_ids`` is derived from the placeholders when absent.
        config: `CPConfig`; None (default): ``CPConfig(layout="balanced")`` (the rule: `CPConfig.layout`).
        loss_mask, padding_token_id: as for `make_cp_blockdiag_batch_and_ctx`.

    Returns:
        ``(train_ctx, batch)``: ``batch`` holds this rank's mRoPE ``position_ids [3, 1, L]``,
        ``labels``, ``padding_mask``, ... and the model inputs: ``inputs_embeds [1, L, E]``
        (Qwen2-VL, Qwen2.5-VL) or ``input_ids [1, L]`` + ``mm_encoder_outputs`` (Qwen3-VL);
        `vlm_model_inputs` picks them. ``train_ctx.state.call_notes.vision`` reports the
        vision patches and estimated FLOPs per rank.
    """
    refuse_unrouted_mixers(model, "in make_cp_vlm_batch_and_ctx")
    config = CPConfig(layout=ENTRY_LAYOUT) if config is None else config
    core = vlm_core(model)
    input_ids = batch.get("input_ids")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError("make_cp_vlm_batch_and_ctx needs the packed row's input_ids [1, S]")
    doc_ids_S = resolve_doc_ids(batch, input_ids.shape[1], input_ids.device, 1)[0]
    inputs = {m.name: vision_inputs(core, batch, m, doc_ids_S) for m in MODALITIES}
    world, rank, group = _group(cp_mesh)
    features, work = encode_row(core, batch, inputs, world, rank, group)
    mm_types = batch.get("mm_token_type_ids")
    mm_types = _token_types(core, input_ids) if mm_types is None else mm_types
    merge = EncoderOutputsMerge(core) if _deepstack_levels(core) else EmbedsMerge()
    step_batch = {
        **merge.row_inputs(core, input_ids, features),
        "position_ids": mrope_positions(core, input_ids, doc_ids_S, mm_types, batch),
        "_packed_seq_ids": doc_ids_S.unsqueeze(0),
        **{k: batch[k] for k in ("labels", "shift_labels", "loss_mask") if batch.get(k) is not None},
    }
    train_ctx, step_batch = make_cp_blockdiag_batch_and_ctx(
        cp_mesh, None, step_batch, loss_mask=loss_mask, padding_token_id=padding_token_id, config=config
    )
    step_batch.update(merge.shard_inputs(features, train_ctx.state))
    train_ctx.state.call_notes.record_vision(*work)
    return train_ctx, step_batch


#: the keys of a `make_cp_vlm_batch_and_ctx` batch that the model's forward takes
MODEL_INPUT_KEYS = ("input_ids", "inputs_embeds", "position_ids", "mm_encoder_outputs")


def vlm_model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """The forward arguments of a `make_cp_vlm_batch_and_ctx` batch: ``model(**vlm_model_inputs(batch))``."""
    return {k: batch[k] for k in MODEL_INPUT_KEYS if k in batch}


def vlm_core(model: torch.nn.Module):
    """The module that owns the vision helpers (``model.model`` for ``...ForConditionalGeneration``)."""
    needed = ("get_image_features", "get_rope_index", "get_input_embeddings")
    for candidate in (model, getattr(model, "model", None)):
        if candidate is not None and all(hasattr(candidate, name) for name in needed):
            token_id = getattr(candidate.config, "image_token_id", None)
            merge = getattr(getattr(candidate.config, "vision_config", None), "spatial_merge_size", None)
            if token_id is not None and merge is not None:
                return candidate
    missing = [n for n in needed if not hasattr(getattr(model, "model", model), n)]
    raise ValueError(
        f"{type(model).__name__} is not a supported vision-language model for make_cp_vlm_batch_and_ctx: it needs "
        f"{', '.join(needed)}, config.image_token_id and config.vision_config.spatial_merge_size "
        f"(missing: {', '.join(missing) or 'a config field'}); the Qwen2-VL, Qwen2.5-VL and Qwen3-VL families have them"
    )


def vision_inputs(core, batch: dict[str, Any], modality: Modality, doc_ids_S: torch.Tensor) -> list[VisionInput]:
    """The row's images (or videos), matched in order to their placeholder tokens; `ValueError` on a mismatch.

    Input ``i`` of grid ``(t, h, w)`` takes the next ``t*h*w/merge**2`` placeholders, which
    must lie in one sample and form runs of whole frames (``h*w/merge**2`` tokens each).
    """
    grids, pixels = batch.get(modality.grid_key), batch.get(modality.pixel_key)
    token_id = getattr(core.config, modality.token_attr, None)
    where = (batch["input_ids"][0] == token_id).nonzero().flatten() if token_id is not None else torch.zeros(0)
    if grids is None or pixels is None:
        if where.numel():
            raise ValueError(
                f"the row has {where.numel()} {modality.name} placeholder tokens but no "
                f"{modality.pixel_key} / {modality.grid_key}"
            )
        return []
    merge = core.config.vision_config.spatial_merge_size
    out, token_at, patch_at = [], 0, 0
    for grid in grids.tolist():
        patches = grid[0] * grid[1] * grid[2]
        run = where[token_at : token_at + patches // merge**2]
        if not _whole_frames(run, patches // merge**2, grid[1] * grid[2] // merge**2, doc_ids_S):
            raise ValueError(
                f"{modality.name} {len(out)} (grid {grid}) needs {patches // merge**2} {modality.name} placeholder "
                f"tokens in runs of whole frames inside one sample, from placeholder {token_at} of {where.numel()}; "
                f"the placeholders and {modality.grid_key} disagree"
            )
        out.append(VisionInput(modality.name, run, patch_at, patches, tuple(grid)))
        token_at, patch_at = token_at + run.numel(), patch_at + patches
    if token_at != where.numel() or patch_at != pixels.shape[0]:
        raise ValueError(
            f"{modality.grid_key} accounts for {token_at} of {where.numel()} {modality.name} placeholder tokens and "
            f"{patch_at} of {pixels.shape[0]} rows of {modality.pixel_key}"
        )
    return out


def _whole_frames(run: torch.Tensor, tokens: int, frame: int, doc_ids_S: torch.Tensor) -> bool:
    """Whether `run` has `tokens` placeholders inside one sample, in consecutive runs of whole frames."""
    if run.numel() != tokens or tokens == 0:
        return False
    docs = doc_ids_S[run]
    if docs[0] == 0 or not bool((docs == docs[0]).all()):
        return False
    breaks = ((run[1:] - run[:-1]) != 1).nonzero().flatten() + 1
    lengths = torch.diff(torch.cat([breaks.new_zeros(1), breaks, breaks.new_tensor([tokens])]))
    return frame > 0 and bool((lengths % frame == 0).all())


def split_by_patches(items: list[VisionInput], world: int) -> list[list[VisionInput]]:
    """`items` in `world` groups of about equal patch count (largest first onto the least-loaded
    rank; ties to the lower rank), each group in row order. Same on every rank."""
    groups: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for index in sorted(range(len(items)), key=lambda i: (-items[i].patches, i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        groups[rank].append(index)
        load[rank] += items[index].patches
    return [[items[i] for i in sorted(group)] for group in groups]


def encode_row(core, batch, inputs, world: int, rank: int, group):
    """``({modality: RowFeatures}, (patches per rank, FLOPs per rank))``: this rank encodes its
    patch-balanced group of each modality and the features of all groups are gathered."""
    patches, flops, features = [0] * world, [0.0] * world, {}
    width = core.get_input_embeddings().weight.shape[-1]
    levels = _deepstack_levels(core)
    tower = _vision_tower(core)
    params = sum(p.numel() for p in tower.parameters())
    trainable = torch.is_grad_enabled() and any(p.requires_grad for p in tower.parameters())
    for modality in MODALITIES:
        items = inputs[modality.name]
        if not items:
            continue
        groups = split_by_patches(items, world)
        for r, owned in enumerate(groups):
            patches[r] += sum(item.patches for item in owned)
            flops[r] += sum(_vision_flops(core.config.vision_config, params, item.patches) for item in owned)
        mine = _encode(core, modality, batch[modality.pixel_key], groups[rank], width * (1 + levels))
        if trainable and not mine.requires_grad:
            mine.requires_grad_()  # a rank with nothing to encode still joins the backward all-gather
        rows = _gather_features(mine, [sum(i.token_positions.numel() for i in g) for g in groups], group)
        main, *deepstack = rows.split(width, dim=-1)
        positions = torch.cat([i.token_positions for group in groups for i in group])  # the rows' order
        features[modality.name] = RowFeatures(positions, main, tuple(deepstack))
    return features, (patches, flops)


def _encode(core, modality: Modality, pixels: torch.Tensor, owned: list[VisionInput], width: int) -> torch.Tensor:
    """``[tokens of the owned inputs, width]``: this rank's share of the vision tower (main | deepstack levels)."""
    dtype = core.get_input_embeddings().weight.dtype
    if not owned:
        return torch.zeros(0, width, dtype=dtype, device=pixels.device)
    rows = torch.cat([torch.arange(i.patch_start, i.patch_start + i.patches) for i in owned]).to(pixels.device)
    grids = torch.tensor([i.grid for i in owned], device=pixels.device)
    outputs = getattr(core, modality.feature_method)(pixels.index_select(0, rows), grids, return_dict=True)
    levels = [torch.cat(list(level)) for level in (getattr(outputs, "deepstack_features", None) or [])]
    return torch.cat([torch.cat(list(outputs.pooler_output)), *levels], dim=-1).to(dtype)


def _gather_features(mine: torch.Tensor, counts: list[int], group) -> torch.Tensor:
    """``[sum(counts), X]``: every rank's features, rank by rank (differentiable; padded to the
    largest group for the all-gather)."""
    if group is None:
        return mine
    longest = max(counts)
    padded = torch.cat([mine, mine.new_zeros(longest - mine.shape[0], mine.shape[-1])])
    gathered = AllGatherRows.apply(padded, group)
    keep = torch.cat([torch.arange(r * longest, r * longest + n) for r, n in enumerate(counts)])
    return gathered.index_select(0, keep.to(gathered.device))


def mrope_positions(core, input_ids, doc_ids_S: torch.Tensor, mm_types: torch.Tensor, batch) -> torch.Tensor:
    """``[3, 1, S]``: each sample's multimodal RoPE positions from the model's `get_rope_index`
    (positions restart per sample; padding gets 0)."""
    S = input_ids.shape[1]
    positions = torch.zeros(3, 1, S, dtype=torch.long, device=input_ids.device)
    next_input = {m.name: 0 for m in MODALITIES}
    for doc in [d for d in torch.unique_consecutive(doc_ids_S).tolist() if d != 0]:
        span = (doc_ids_S == doc).nonzero().flatten()
        lo, hi = int(span[0]), int(span[-1]) + 1
        types = mm_types[:, lo:hi]
        grids = {}
        for m in MODALITIES:
            first = next_input[m.name]
            count = _inputs_holding(core, batch.get(m.grid_key), first, int((types == m.type_id).sum()))
            if count:
                for key in (m.grid_key, *m.rope_keys):
                    if batch.get(key) is not None:
                        grids[key] = batch[key][first : first + count]
                next_input[m.name] += count
        if grids:
            sample, _ = core.get_rope_index(input_ids[:, lo:hi], mm_token_type_ids=types, **grids)
            positions[:, :, lo:hi] = sample
        else:
            positions[:, :, lo:hi] = torch.arange(hi - lo, device=input_ids.device)
    return positions


def _inputs_holding(core, grids: Optional[torch.Tensor], first: int, tokens: int) -> int:
    """How many inputs, from the `first`-th on, fill `tokens` placeholder tokens (their order is the row's)."""
    merge = core.config.vision_config.spatial_merge_size
    count = 0
    while tokens > 0:
        t, h, w = grids[first + count].tolist()
        tokens -= t * h * w // merge**2
        count += 1
    return count


def _token_types(core, input_ids: torch.Tensor) -> torch.Tensor:
    """``mm_token_type_ids`` from the placeholders: 0 text, 1 image, 2 video."""
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    for m in MODALITIES:
        token_id = getattr(core.config, m.token_attr, None)
        if token_id is not None:
            types[input_ids == token_id] = m.type_id
    return types


def _deepstack_levels(core) -> int:
    """How many decoder layers receive deepstack visual features (0: none; Qwen3-VL: several)."""
    return len(getattr(core.config.vision_config, "deepstack_visual_indexes", None) or ())


def _vision_tower(core) -> torch.nn.Module:
    tower = getattr(core, "visual", None)
    if tower is None:
        raise ValueError(f"{type(core).__name__} has no vision tower at .visual")
    return tower


def _vision_flops(config, params: int, patches: int) -> float:
    """An estimate of one input's vision-tower forward FLOPs: 2 x parameters x patches, plus attention."""
    width = getattr(config, "embed_dim", getattr(config, "hidden_size", 0))
    depth = getattr(config, "depth", getattr(config, "num_hidden_layers", 0))
    return 2.0 * params * patches + 4.0 * depth * width * patches**2


def _group(cp_mesh):
    if cp_mesh is None:
        return 1, 0, None
    world = cp_mesh.size()
    return world, cp_mesh.get_local_rank(), (cp_mesh.get_group() if world > 1 else None)
