"""NeMo AutoModel runs for tests/stacks/test_automodel.py: tiny models of two families, packed rows as AutoModel's
packed collator gives them (pre-shifted ``labels``, ``position_ids`` restarting per document, ``_packed_seq_ids``),
each document alone as the reference, and the gloo workers that run AutoModel's own CP code (its mesh, its sharder
resolution, its token verbs, its recipe's train step) on them. Nothing is downloaded: random weights, random tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from blockdiag_cp.testing.oracle import doc_ids_from_lengths

VOCAB = 64
IGNORE = -100
#: AutoModel's own blockdiag reference (the seed's home) as a transformers attention implementation
AUTOMODEL_REFERENCE = "automodel_blockdiag"


def model_config(family: str):
    """A 2-layer model of `family` (GQA: 4 query heads, 2 key/value heads), float64-sized for exact comparisons."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "qwen3":
        return transformers.Qwen3Config(head_dim=8, **common)
    if family == "mistral":
        return transformers.MistralConfig(sliding_window=7, **common)
    if family == "qwen2":
        return transformers.Qwen2Config(**common)
    if family == "gemma2":
        return transformers.Gemma2Config(head_dim=8, sliding_window=7, query_pre_attn_scalar=8, **common)
    if family == "phi3":
        return transformers.Phi3Config(pad_token_id=0, **common)
    raise ValueError(f"no tiny {family}")


def build(family: str, attn: str = "sdpa") -> torch.nn.Module:
    """The family's tiny causal LM with seeded random weights (the same on every rank), float64."""
    import transformers

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(model_config(family), attn_implementation=attn,
                                                         dtype=torch.float64)


@dataclass(frozen=True)
class Packing:
    """AutoModel's packed-sequence contract (a structural protocol of its collator): which mask the row carries."""

    packed_mask_type: str = "block_causal"
    requires_packed_sequence_metadata: bool = False


def automodel_llama() -> torch.nn.Module:
    """AutoModel's own Llama implementation (``backend.attn="sdpa"``) with `build`'s Llama weights, float64 (its RoPE
    tables stay float32: it differs from transformers' Llama by 5e-8, with or without CP)."""
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.llama.model import LlamaForCausalLM

    backend = BackendConfig(attn="sdpa", linear="torch", rms_norm="torch", rope_fusion=False)
    own = LlamaForCausalLM(model_config("llama"), backend=backend)
    own.load_state_dict(build("llama").state_dict())
    return own.to(torch.float64)


def packed_batch(segments: Sequence[int], mask: str = "block_causal", seed: int = 1) -> dict[str, torch.Tensor]:
    """The packed row of `segments` (n > 0: a document of n tokens, -n: n padding tokens) as AutoModel's neat-packing
    collator (``neat_packed_collater``) gives it: ``input_ids``, next-token ``labels`` already shifted (-100 at each
    document's last token and on padding), ``position_ids`` restarting at every document (0 on padding, as its
    packer writes them), the ``attention_mask`` of `mask` (``"block_causal"``: ``[1, 1, S, S]``; ``"document_ids"``: the
    indexed ``[1, S]``) and ``_packed_seq_ids`` (0 = padding) when the row holds several documents."""
    from nemo_automodel.components.datasets.utils import neat_packed_collater

    doc_ids = doc_ids_from_lengths(segments)
    S = doc_ids.numel()
    ids = torch.randint(1, VOCAB, (S,), generator=torch.Generator().manual_seed(seed))
    ids[doc_ids == 0] = 0
    labels = torch.full((S,), IGNORE)
    same_doc = (doc_ids[1:] == doc_ids[:-1]) & (doc_ids[1:] != 0)
    labels[:-1] = torch.where(same_doc, ids[1:], IGNORE)
    positions = torch.cat([torch.arange(n) if n > 0 else torch.zeros(-n, dtype=torch.long) for n in segments])
    sample = {"input_ids": ids, "labels": labels, "position_ids": positions, "attention_mask": doc_ids}
    return neat_packed_collater([sample], packing=Packing(mask))


def label_count(batch: dict) -> int:
    return int((batch["labels"] != IGNORE).sum())


def loss_fn():
    """AutoModel's loss, float64 kept (its default upcasts to float32)."""
    from nemo_automodel.components.loss.masked_ce import MaskedCrossEntropy

    return MaskedCrossEntropy(fp32_upcast=False)


@dataclass(frozen=True)
class Alone:
    """Each document run alone: logits ``[1, S, V]`` (0 on padding), the token-mean loss, every parameter's grad."""

    logits: torch.Tensor
    loss: float
    grads: dict


def each_document_alone(family: str, segments: Sequence[int], mask: str = "block_causal") -> Alone:
    """The reference: every document of the row alone through the family's SDPA attention (eager softmaxes in
    float32), AutoModel's loss over the row's label count. ``family="automodel_llama"``: AutoModel's own Llama."""
    model = automodel_llama() if family == "automodel_llama" else build(family)
    batch = packed_batch(segments, mask)
    doc_ids = doc_ids_from_lengths(segments)
    count = label_count(batch)
    logits = torch.zeros(1, doc_ids.numel(), VOCAB, dtype=torch.float64)
    loss = torch.zeros((), dtype=torch.float64)
    for doc in doc_ids.unique().tolist():
        if doc == 0:
            continue
        where = (doc_ids == doc).nonzero().flatten()
        out = model(input_ids=batch["input_ids"][:, where], position_ids=batch["position_ids"][:, where],
                    use_cache=False).logits
        logits[:, where] = out.detach()
        loss = loss + loss_fn()(out, batch["labels"][:, where], num_label_tokens=count)
    loss.backward()
    return Alone(logits, float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()})


def automodel_mesh(cp: int):
    """AutoModel's own FSDP2 device mesh (dp_replicate, dp_shard, cp, tp and the flattened dp / dp_cp axes) over
    the gloo world, cp ranks per CP group."""
    from nemo_automodel.recipes._dist_utils import create_distributed_setup_from_config

    return create_distributed_setup_from_config(strategy="fsdp2", cp_size=cp).mesh_context.device_mesh


def reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' SDPA attention with AutoModel's ``cp_blockdiag_sdpa`` (its blockdiag reference's kernel) in
    place of torch's: the mask transformers built is passed on, as transformers' own SDPA path does."""
    from nemo_automodel.components.distributed.blockdiag_cp import cp_blockdiag_sdpa

    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    out = cp_blockdiag_sdpa(query, key, value, attn_mask=attention_mask, is_causal=attention_mask is None,
                            scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def reference_hook(batch: dict, *, num_chunks: int = 1) -> dict:
    """The model hook AutoModel's Qwen3.5-MoE uses for its blockdiag path, primary stream sharded by the step."""
    from nemo_automodel.components.distributed.blockdiag_cp import make_cp_blockdiag_batch_and_ctx
    from nemo_automodel.components.distributed.context_parallel.sharder import (ContextParallelSharder,
                                                                                contiguous_local_indices)

    return {"cp_sharder": ContextParallelSharder(shard_batch=make_cp_blockdiag_batch_and_ctx,
                                                 local_token_global_indices=contiguous_local_indices)}


def path_model(family: str, path: str) -> torch.nn.Module:
    """``"blockdiag_cp"``: the family's model enabled by this library's integration; ``"automodel_llama"``: AutoModel's
    own Llama implementation with the same weights, enabled; ``"automodel"``: the same weights through AutoModel's own
    blockdiag reference (its kernel and its model-owned sharder)."""
    from blockdiag_cp.integrations.automodel import enable

    if path == "blockdiag_cp":
        return enable(build(family))
    if path == "automodel_llama":
        return enable(automodel_llama())
    from transformers import AttentionInterface

    AttentionInterface.register(AUTOMODEL_REFERENCE, reference_attention)
    model = build(family, AUTOMODEL_REFERENCE)
    model.prepare_model_inputs_for_cp = reference_hook
    return model


def sharder_worker(rank: int, world: int, family: str, segments: Sequence[int], path: str,
                   mask: str = "block_causal") -> dict[str, Any]:
    """One forward and backward of the row through AutoModel's sharder resolution (``ContextParallelSharder(model,
    device_mesh, batch)``), ``shard``, the model call the recipe makes, its loss, then its token verbs: the logits
    gathered (``gather_token_tensor(trim=True)``), the full row's labels and positions sharded
    (``shard_token_tensor``) beside what the step sharded; losses and grads summed over the CP group."""
    from nemo_automodel.components.distributed.context_parallel import ContextParallelSharder
    from nemo_automodel.components.utils.model_utils import filter_forward_kwargs

    mesh = automodel_mesh(world)
    model = path_model(family, path)
    batch = packed_batch(segments, mask)
    full = {k: batch[k].clone() for k in ("labels", "position_ids")}
    count = label_count(batch)
    sharder = ContextParallelSharder(model, mesh, batch)
    train_ctx, batch = sharder.shard(batch)
    labels = batch.pop("labels")
    with train_ctx():
        logits = model(**filter_forward_kwargs(model, batch)).logits
        loss = loss_fn()(logits, labels, num_label_tokens=count)
        loss.backward()
    group = mesh["cp"].get_group()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for g in grads.values():
        dist.all_reduce(g, group=group)
    layout = sharder.shard_layout
    return {
        "logits": sharder.gather_token_tensor(logits.detach(), seq_dim=1, trim=True),
        "loss": float(total), "grads": grads,
        "indices": None if layout.local_token_global_indices is None else layout.local_token_global_indices.clone(),
        "labels_by_verb": torch.equal(sharder.shard_token_tensor(full["labels"], fill=IGNORE), labels),
        "positions_by_verb": torch.equal(sharder.shard_token_tensor(full["position_ids"], fill=0),
                                         batch["position_ids"]),
        "keys": sorted(batch),
    }


def max_error(got: torch.Tensor, want: torch.Tensor, where: torch.Tensor | None = None) -> float:
    if where is not None:
        got, want = got[:, where], want[:, where]
    return float((got - want).abs().max())


def grad_error(got: dict, want: dict) -> float:
    return max(float((got[n] - want[n]).abs().max()) for n in want)



def automodel_setup(cp: int):
    """AutoModel's distributed setup (FSDP2 strategy) over the gloo world, float64 kept by its mixed precision."""
    from nemo_automodel.recipes._dist_utils import create_distributed_setup_from_config
    from torch.distributed.fsdp import MixedPrecisionPolicy

    f64 = torch.float64
    return create_distributed_setup_from_config(
        strategy="fsdp2", cp_size=cp,
        mp_policy=MixedPrecisionPolicy(param_dtype=f64, reduce_dtype=f64, output_dtype=f64))


def recipe_model(family: str, setup) -> torch.nn.Module:
    """What the recipe's ``build_model`` does for a ``model._target_`` that is not NeMoAutoModel's (here
    `blockdiag_cp.integrations.automodel.from_config`): call it, then AutoModel's infrastructure (FSDP2 over the
    dp x cp ranks), on the CPU where the recipe asks ``torch.cuda.current_device()``."""
    from nemo_automodel._transformers.infrastructure import apply_model_infrastructure, instantiate_infrastructure

    from blockdiag_cp.integrations.automodel import from_config

    torch.manual_seed(0)
    model = from_config(model_config(family), torch_dtype="float64")
    cpu = torch.device("cpu")
    wrapper, autopipeline, parallelize_fn, qat = instantiate_infrastructure(
        distributed_config=setup.strategy_config, pipeline_config=setup.pipeline_config,
        moe_parallel_config=setup.moe_parallel_config, activation_checkpointing=setup.activation_checkpointing,
        device=cpu, mesh=setup.mesh_context)
    return apply_model_infrastructure(model, is_meta_device=False, device=cpu, mesh=setup.mesh_context,
                                      model_wrapper=wrapper, autopipeline=autopipeline, parallelize_fn=parallelize_fn,
                                      qat_quantizer=qat, loss_fn=None, pretrained_model_name_or_path=None,
                                      load_base_model=False)


def finetune_recipe(model: torch.nn.Module, setup):
    """AutoModel's ``TrainFinetuneRecipeForNextTokenPrediction`` holding what its ``setup()`` builds for a train
    step: the mesh, the model parts, its loss, AdamW, no scheduler, no checkpoint staging. ``setup()`` itself cannot
    run on a CPU-only machine (its first line is ``torch.cuda.reset_peak_memory_stats()``: docs/automodel.md)."""
    import time
    from types import SimpleNamespace

    from nemo_automodel.components.config.loader import ConfigNode
    from nemo_automodel.recipes.llm.train_ft import TrainFinetuneRecipeForNextTokenPrediction

    recipe = object.__new__(TrainFinetuneRecipeForNextTokenPrediction)
    recipe.cfg = ConfigNode({})
    recipe.dist_env = SimpleNamespace(device=torch.device("cpu"), world_size=dist.get_world_size(),
                                      is_main=dist.get_rank() == 0)
    recipe.device_mesh, recipe.moe_mesh, recipe.pp_enabled = setup.mesh_context.device_mesh, None, False
    recipe.distributed_config = setup.strategy_config
    recipe.model_parts, recipe.tokenizer, recipe.loss_fn = [model], None, loss_fn()
    recipe.domain_mixture = recipe.te_fp8 = recipe.lr_scheduler = None
    recipe.optimizer = [torch.optim.AdamW(model.parameters(), lr=1e-2)]
    recipe.checkpointer = SimpleNamespace(maybe_wait_for_staging=lambda: None)
    recipe.step_scheduler = SimpleNamespace(step=0, epoch=0)
    recipe.timestamp = time.perf_counter()
    return recipe


#: the rows of each train step, one per data-parallel replica (interior padding, a 1-token document, a document
#: longer than a shard)
STEP_ROWS = ((13, -5, 20, 9, 1, 6), (31, 4, -3, 17))


def recipe_worker(rank: int, world: int, family: str, cp: int, steps: int) -> dict[str, Any]:
    """`steps` train steps of AutoModel's recipe (``_run_train_optim_step``: its label count over dp, its sharder
    resolution and train step per micro-batch, its gradient clipping, AdamW) at ``world / cp`` replicas of `cp`
    ranks; replica ``d`` trains on ``STEP_ROWS[d]`` (one replica: every row, as micro-batches of one step). Returns the
    logged losses and grad norms and the final parameters, whole."""
    setup = automodel_setup(cp)
    recipe = finetune_recipe(recipe_model(family, setup), setup)
    mask = recipe._configure_packing().packed_mask_type  # what the recipe's neat-packing collator is told to give
    dp = world // cp
    replica = setup.mesh_context.device_mesh["dp"].get_local_rank() if dp > 1 else None
    losses, norms = [], []
    for step in range(steps):
        rows = [packed_batch(seg, mask, seed=10 * step + k) for k, seg in enumerate(STEP_ROWS)]
        metrics = recipe._run_train_optim_step(rows if replica is None else [rows[replica]], max_grad_norm=1.0).metrics
        losses.append(metrics["loss"])
        norms.append(float(metrics["grad_norm"]))
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for n, p in recipe.model_parts[0].named_parameters()}
    return {"losses": losses, "grad_norms": norms, "params": params, "mask": mask,
            "eval_loss": eval_loss(recipe, packed_batch(STEP_ROWS[1], mask, seed=99), setup)}


def eval_loss(recipe, row: dict, setup) -> float:
    """The recipe's validation forward (``_forward_backward_step(is_train=False)`` under no_grad, as its
    ``_run_validation_epoch`` runs it) of one row, summed over the CP group."""
    buffer: list = []
    with torch.no_grad():
        recipe._forward_backward_step(0, row, loss_buffer=buffer, num_label_tokens=label_count(row), num_batches=1,
                                      is_train=False)
    total = buffer[0].detach().clone()
    if setup.mesh_context.cp_size > 1:
        dist.all_reduce(total, group=setup.mesh_context.device_mesh["cp"].get_group())
    return float(total)
