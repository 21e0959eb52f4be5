"""NeMo AutoModel: blockdiag-cp as the `ContextParallelSharder` a model hands AutoModel's train step (issue #55).

Since Automodel#2937 (nemo-automodel 0.7.0) AutoModel's recipes resolve a ``ContextParallelSharder`` for every
forward (``context_parallel.utils._prepare_cp_sharder``): a model-owned one first (the model's
``prepare_model_inputs_for_cp(batch, num_chunks=)`` returns ``{"cp_sharder": ...}``), else magi, TE, or torch's
round-robin ``context_parallel``, which knows nothing of documents. The recipe then calls the sharder's
``shard_batch(cp_mesh, tp_mesh, batch, *, loss_mask=None, padding_token_id=0)`` and runs forward and backward
inside the context it returns; labels, losses and outputs follow the sharder's token verbs
(``shard_token_tensor`` / ``gather_token_tensor``), which index by the ``ShardLayout``'s
``local_token_global_indices``. Selecting blockdiag-cp in AutoModel's fine-tuning recipe, for any Hugging Face
causal LM::

    model:
      _target_: blockdiag_cp.integrations.automodel.from_pretrained    # or .from_config
      pretrained_model_name_or_path: meta-llama/Llama-3.2-1B
      torch_dtype: bfloat16
      cp_layout: balanced            # optional: contiguous | balanced (the default)
    distributed:
      cp_size: 2

Note [The AutoModel way in]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each piece goes in through an extension point AutoModel already has; nothing of AutoModel is patched:

* the model: the recipe's ``model._target_`` takes any callable that returns a model (AutoModel applies its
  FSDP2 / PEFT / checkpointing infrastructure to it afterwards, as for its GPT-2 builder). `from_pretrained` /
  `from_config` load the transformers model with ``attn_implementation="blockdiag_cp"`` (AutoModel's own
  builder would force ``"sdpa"`` under CP, and refuses packed rows at cp > 1) and `enable` it.
* the sharder: `enable` gives the model instance ``prepare_model_inputs_for_cp``, which AutoModel calls
  before anything else at cp > 1 and which returns `make_sharder`'s sharder. Its `shard_batch` runs this
  library's step (`make_cp_blockdiag_batch_and_ctx`, ``layout="balanced"`` unless configured) and reports
  the plan's positions of this rank as the layout's ``local_token_global_indices``, so AutoModel's token
  verbs shard and gather every other tensor exactly as the step sharded the batch.
* the data: `enable` declares AutoModel's packing capabilities (``packed_mask_type = "document_ids"``: its
  neat-packing collator then gives ``[B, S]`` document ids, never an ``S x S`` mask; ``_owns_cp_attention``;
  ``model.supports``, which its recipe reads at cp > 1 and attaches only to models its own builder made).
* the step's metadata: the sharded batch keeps ``padding_mask`` and ``_packed_seq_ids`` (the seed's
  contract); the recipe hands every batch key to the model, so `enable`'s forward pre-hook takes them out of
  the model call inside a step (the step already holds the documents). At cp 1 AutoModel calls no hook and
  hands the model the collator's packed row as it is (``_packed_seq_ids``, a 4-D block-causal
  ``attention_mask``); the pre-hook then passes its documents as ``cu_seq_lens_q`` / ``cu_seq_lens_k``,
  which the ``blockdiag_cp`` attention honours outside a step: documents never see each other at cp 1 either.

What cannot be exact is refused by name: pipeline parallelism's micro-batches (``num_chunks > 1``), the
``shard_primary=False`` form of AutoModel's reference (the model would shard its own primary stream by a
closed-form contiguous layout that knows nothing of this plan), the ``grouped`` layout (unequal shards: the
layout's indices must be ``padded_seq_len / cp`` long on every rank), AutoModel models whose attention does
not go through transformers' attention interface (``backend.attn`` must be ``"sdpa"``: ``"te"`` and
``"magi"`` would take the packed row elsewhere) and models whose token mixers the library cannot route
(`blockdiag_cp.hf.prepare_model`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, ContextManager, Optional

import torch

from ..config import ENTRY_LAYOUT, CPConfig
from ..errors import CPTypeError
from ..hf.interface import ATTN_IMPLEMENTATION
from ..step.batch import make_cp_blockdiag_batch_and_ctx
from ..step.doc_ids import resolve_doc_ids
from ..step.slot import current_step

__all__ = (
    "DEFAULT_LAYOUT",
    "STEP_METADATA_KEYS",
    "enable",
    "from_config",
    "from_pretrained",
    "make_sharder",
    "prepare_model_inputs_for_cp",
    "shard_batch",
)

#: the layout AutoModel's models get unless configured: the library's own entries plan ``balanced``
DEFAULT_LAYOUT = ENTRY_LAYOUT
#: batch keys the step shards for AutoModel's loss and MoE code that the model call must not get inside a step
STEP_METADATA_KEYS = ("padding_mask", "_packed_seq_ids", "loss_mask")
#: AutoModel backends whose attention goes through transformers' attention interface (so through this library)
ROUTED_BACKENDS = ("sdpa",)


def shard_batch(cp_mesh, tp_mesh, batch: dict[str, Any], *, loss_mask: Optional[torch.Tensor] = None,
                padding_token_id: int = 0, config: Optional[CPConfig] = None,
                shard_primary: bool = True) -> tuple[Callable[[], ContextManager], dict[str, Any], Any]:
    """AutoModel's ``shard_batch`` verb: this library's step, and the layout it applied.

    Args:
        cp_mesh, tp_mesh, batch, loss_mask, padding_token_id: as `make_cp_blockdiag_batch_and_ctx` (the seed's
            contract: ``batch`` ``[1, S]`` ids or ``[1, S, E]`` embeddings, mutated in place to this rank's
            ``L = S_pad / cp`` positions).
        config: the step's `CPConfig`; default ``CPConfig(layout=DEFAULT_LAYOUT)`` (balanced). ``layout="grouped"``
            is refused.
        shard_primary: AutoModel 0.7.0's reference flag; only True (the step shards the primary stream) is exact:
            False is a `ValueError` (a model slicing its own primary stream would not follow the plan).

    Returns:
        ``(train_ctx, batch, layout)``: ``train_ctx()`` opens the step (run forward *and* backward inside),
        ``layout`` an AutoModel ``ShardLayout`` with ``local_token_global_indices`` ``[L]`` (this rank's plan
        positions, local order), ``original_seq_len`` ``S`` and ``padded_seq_len`` ``S_pad``.
    """
    from nemo_automodel.components.distributed.context_parallel.sharder import ShardLayout

    train_ctx, batch = make_cp_blockdiag_batch_and_ctx(cp_mesh, tp_mesh, batch, loss_mask=loss_mask,
                                                       padding_token_id=padding_token_id,
                                                       config=_checked_config(config), shard_primary=shard_primary)
    state = train_ctx.state
    plan = state.plan
    indices_L = plan.rank_positions(state.rank).to(device=state.device, dtype=torch.long)
    layout = ShardLayout(local_token_global_indices=indices_L, original_seq_len=plan.seq_len,
                         padded_seq_len=plan.padded_len)
    return train_ctx, batch, layout


def make_sharder(config: Optional[CPConfig] = None):
    """A ``ContextParallelSharder`` whose ``shard_batch`` is this library's step (`shard_batch` with `config`).

    Its layout is data-dependent (the plan follows the documents), so it has no closed-form
    ``local_token_global_indices``: AutoModel's token verbs index by the layout the shard reports.
    """
    from nemo_automodel.components.distributed.context_parallel.sharder import ContextParallelSharder

    return ContextParallelSharder(shard_batch=functools.partial(shard_batch, config=_checked_config(config)))


def prepare_model_inputs_for_cp(model: torch.nn.Module, batch: dict[str, Any], *, num_chunks: int = 1) -> dict[str, Any]:
    """The model hook AutoModel calls at cp > 1 (bound to the model by `enable`): ``{"cp_sharder": sharder}``.

    `ValueError` for ``num_chunks > 1`` (pipeline parallelism's micro-batches of one step, each its own token
    space: not verified under this sharder) and for an AutoModel backend that bypasses transformers' attention.
    """
    if num_chunks != 1:
        raise ValueError(f"blockdiag-cp's AutoModel sharder got num_chunks={num_chunks} (pipeline-parallel "
                         "micro-batches): not supported; train with pipeline parallelism off (pp_size 1)")
    check_attention(model)
    return {"cp_sharder": make_sharder(getattr(model, "blockdiag_cp_config", None))}


def enable(model: torch.nn.Module, config: Optional[CPConfig] = None) -> torch.nn.Module:
    """Make `model` select blockdiag-cp in AutoModel's train step; returns `model` (changed in place).

    Sets ``attn_implementation="blockdiag_cp"`` (registered by `blockdiag_cp.hf`), routes a hybrid's token
    mixers (`blockdiag_cp.hf.prepare_model`: refuses by name what it cannot route), binds
    `prepare_model_inputs_for_cp` to the instance and adds the forward pre-hook of Note [The AutoModel way in].
    The model's class is left as it is (its checkpoints keep their architecture's name).
    """
    from ..hf import prepare_model

    if getattr(model, "blockdiag_cp_config", None) is not None:
        raise ValueError("blockdiag-cp: enable(model) was already called on this model")
    check_attention(model)
    _refuse_vision(model)
    _route_attention(model)
    prepare_model(model, "in blockdiag_cp.integrations.automodel.enable")
    model.blockdiag_cp_config = _checked_config(config)
    model.prepare_model_inputs_for_cp = functools.partial(prepare_model_inputs_for_cp, model)
    model.register_forward_pre_hook(_model_call_inputs, with_kwargs=True)
    _declare_capabilities(model)
    return model


def _declare_capabilities(model: torch.nn.Module) -> None:
    """AutoModel's capability flags for a model that owns its CP and its packed attention, and ``model.supports``
    (its recipes read it at cp > 1; AutoModel attaches it only to models its own builder made)."""
    from nemo_automodel._transformers.capabilities import attach_capabilities_and_validate

    model._owns_cp_attention = True  # the sharder and the attention are this library's, every layer
    model._owns_packed_attention = True  # documents are kept apart by the step, not by a mask or a backend
    model.packed_mask_type = "document_ids"  # the packed collator's [B, S] ids, never an S x S mask
    attach_capabilities_and_validate(model, None)


def from_pretrained(pretrained_model_name_or_path: str, *, cp_layout: str = DEFAULT_LAYOUT,
                    cp_config: Optional[CPConfig] = None, model_class: Any = None, **kwargs: Any) -> torch.nn.Module:
    """A ``model._target_`` for AutoModel's recipes: `blockdiag_cp.hf.from_pretrained`, then `enable`.

    ``kwargs`` go to transformers' ``from_pretrained`` (``torch_dtype`` as a string such as ``"bfloat16"`` is
    read as the dtype). ``cp_layout`` sets the step's layout; ``cp_config`` (a `CPConfig`) replaces the whole
    config.
    """
    from .. import hf

    model = hf.from_pretrained(pretrained_model_name_or_path, model_class, **_load_kwargs(kwargs))
    return enable(model, _config_of(cp_layout, cp_config))


def from_config(config: Any, *, cp_layout: str = DEFAULT_LAYOUT, cp_config: Optional[CPConfig] = None,
                model_class: Any = None, **kwargs: Any) -> torch.nn.Module:
    """A ``model._target_`` for AutoModel's recipes: random weights from `config` (a transformers config, or a
    name or path to read one from), `blockdiag_cp.hf.from_config`, then `enable`."""
    from .. import hf

    if isinstance(config, str):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(config, **{k: kwargs.pop(k) for k in hf.load.HUB_ARGUMENTS if k in kwargs})
    model = hf.from_config(config, model_class, **_load_kwargs(kwargs))
    return enable(model, _config_of(cp_layout, cp_config))


def _route_attention(model: torch.nn.Module) -> None:
    """``attn_implementation="blockdiag_cp"``: through transformers for its models; on the config for AutoModel's own
    implementations (its Llama, Qwen2, Qwen3 read ``config._attn_implementation`` at every call, but transformers
    will not switch a class that does not declare the attention interface). `ValueError` when it does not take."""
    if getattr(model, "backend", None) is None:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    else:
        model.config._attn_implementation = ATTN_IMPLEMENTATION
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise ValueError(f"blockdiag-cp: {type(model).__name__} kept attn_implementation="
                         f"{model.config._attn_implementation!r}; its attention cannot be routed through blockdiag-cp")


def _refuse_vision(model: torch.nn.Module) -> None:
    """`ValueError` for a vision-language model: AutoModel's VLM recipe hands its sharder raw pixels and token ids
    (images merged inside the model's forward, after the step sharded the row); not verified under this sharder."""
    config = getattr(model, "config", None)
    if getattr(config, "vision_config", None) is not None:
        raise ValueError(f"blockdiag-cp's AutoModel sharder does not take vision-language models yet "
                         f"({type(model).__name__}): AutoModel merges the images inside the model's forward, after "
                         "the step sharded the row. Train VLM rows with blockdiag_cp.hf.make_cp_vlm_batch_and_ctx "
                         "(docs/vlm.md)")


def check_attention(model: torch.nn.Module) -> None:
    """`ValueError` for an AutoModel model whose ``backend.attn`` takes attention away from transformers'
    attention interface (TE and magi attention modules never call this library)."""
    backend = getattr(getattr(model, "backend", None), "attn", None)
    if backend is not None and str(backend) not in ROUTED_BACKENDS:
        raise ValueError(f"blockdiag-cp under AutoModel needs backend.attn in {ROUTED_BACKENDS} (its attention then "
                         f"calls transformers' interface, which blockdiag-cp serves); this model has "
                         f"backend.attn={backend!r}")


def _model_call_inputs(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """The forward pre-hook of Note [The AutoModel way in]: inside a step the step's metadata leaves the call;
    outside one a packed row's documents reach the attention as ``cu_seq_lens_q`` / ``cu_seq_lens_k``."""
    if current_step() is not None:
        return args, {k: v for k, v in kwargs.items() if k not in STEP_METADATA_KEYS}
    packed = kwargs.get("_packed_seq_ids")
    mask = kwargs.get("attention_mask")
    if packed is None and not (isinstance(mask, torch.Tensor) and mask.dim() == 4):
        return args, {k: v for k, v in kwargs.items() if k not in STEP_METADATA_KEYS}
    return args, _documents_as_lengths(kwargs)


def _documents_as_lengths(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A packed row's model call outside a step: its document ids (`resolve_doc_ids`: ``_packed_seq_ids``, else
    the 4-D block-causal mask, split where ``position_ids`` restart) as the runs' cumulative lengths; padding runs
    are runs of their own (their rows carry no label)."""
    primary = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    if primary is None or primary.shape[0] != 1:
        raise ValueError("blockdiag-cp: a packed row outside a CP step must be one row ([1, S]); AutoModel's "
                         "packed collator gives one per micro-batch with local_batch_size 1")
    S = primary.shape[1]
    doc_ids_S = resolve_doc_ids(kwargs, S, primary.device, 1)[0]
    starts = torch.ones(S, dtype=torch.bool, device=primary.device)
    starts[1:] = doc_ids_S[1:] != doc_ids_S[:-1]
    bounds = torch.cat([starts.nonzero().flatten(), torch.tensor([S], device=primary.device)]).to(torch.int32)
    longest = int((bounds[1:] - bounds[:-1]).max())
    call = {k: v for k, v in kwargs.items() if k not in STEP_METADATA_KEYS and k != "attention_mask"}
    call.update(cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=longest, max_length_k=longest)
    return call


def _checked_config(config: Optional[CPConfig]) -> CPConfig:
    config = CPConfig(layout=DEFAULT_LAYOUT) if config is None else config
    if not isinstance(config, CPConfig):
        raise CPTypeError(f"config must be a CPConfig, got {type(config).__name__}")
    if config.layout == "grouped":
        raise ValueError("blockdiag-cp's AutoModel sharder needs equal shards (AutoModel's token verbs take every "
                         "rank's indices to be padded_seq_len / cp long); use layout 'balanced' or 'contiguous'")
    return config


def _config_of(cp_layout: str, cp_config: Optional[CPConfig]) -> CPConfig:
    return CPConfig(layout=cp_layout) if cp_config is None else cp_config


def _load_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """YAML's strings for dtypes (``torch_dtype: bfloat16``) as torch dtypes, under transformers' ``dtype``."""
    out = dict(kwargs)
    if "torch_dtype" in out and "dtype" not in out:
        out["dtype"] = out.pop("torch_dtype")
    if isinstance(out.get("dtype"), str) and out["dtype"] != "auto":
        out["dtype"] = getattr(torch, out["dtype"].removeprefix("torch."))
    return out
