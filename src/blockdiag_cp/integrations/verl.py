"""verl's FSDP engine with per-document CP in place of Ulysses (docs/verl.md).

    # the actor, reference and critic workers import this module (verl's own hook for external code) ...
    actor_rollout_ref.model.external_lib=blockdiag_cp.integrations.verl
    critic.model.external_lib=blockdiag_cp.integrations.verl
    # ... and verl's engine registry picks this engine by vendor (an environment variable of every worker)
    +ray_kwargs.ray_init.runtime_env.env_vars.VERL_ENGINE_VENDOR=blockdiag_cp
    # the CP size is verl's sequence-parallel size; the engine shards with this library, not Ulysses
    actor_rollout_ref.actor.ulysses_sequence_parallel_size=4
    actor_rollout_ref.ref.ulysses_sequence_parallel_size=4
    critic.ulysses_sequence_parallel_size=4
    actor_rollout_ref.actor.strategy=fsdp2  (and ref, critic)

Importing the module registers `BlockDiagCPEngineWithLMHead` (actor, reference) and
`BlockDiagCPEngineWithValueHead` (critic) in verl's ``EngineRegistry`` for verl's FSDP backends on CUDA under the
vendor ``blockdiag_cp``; ``VERL_ENGINE_VENDOR=blockdiag_cp`` makes verl's workers build them instead of its own
FSDP engines. No verl file is edited and nothing of verl is patched: the engines are subclasses of verl's
``FSDPEngineWithLMHead`` / ``FSDPEngineWithValueHead`` that override the seams verl's Ulysses uses.

Note [verl's engine, per document, each micro-batch in its step]
----------------------------------------------------------------
verl keeps everything it does: its (dp, sp) mesh (the ``sp`` dimension is the CP group), its dispatch (every
rank of a CP group gets its dp replica's data), its micro-batching and dynamic batch size (``sp_size`` = cp
scales the token budget as under Ulysses), its losses, FSDP2 over every rank. What changes:

- the model attends through ``attn_implementation="blockdiag_cp"`` with its token mixers routed per document
  (`blockdiag_cp.hf.prepare_model`: hybrids too), whatever ``override_config.attn_implementation`` says; verl's
  monkey patch is applied as at sp 1 (no Ulysses head-count asserts, no Ulysses input slicing);
- ``prepare_model_inputs``: verl packs the micro-batch into one row ``[1, total_nnz]`` and rolls the labels on
  the whole row (as at sp 1); the row is then planned over the CP group (`CPConfig(layout="balanced")`, each
  sequence a document: ``input_ids.offsets()``), and ``input_ids``, ``position_ids``, the rolled labels and the
  per-token temperature become this rank's positions;
- ``_gather_and_unpad_packed``: per-token log-probs, entropies and values ``[L]`` are gathered back to the row
  ``[total_nnz]`` (`gather_sequence`: O(tokens) numbers, never logits), identical on every CP rank, so verl's
  losses run unchanged on every rank. Backward of the gather sums every rank's gradient of each shard's values:
  ``cp`` times one rank's (each rank computes the same loss), which FSDP's average over ``dp x cp`` ranks turns
  into the average over the dp replicas (verl's Ulysses gather multiplies its own slice by ``sp``: the same);
- the step of each micro-batch: verl runs a micro-batch's forward in ``forward_step`` and its backward after it
  in ``forward_backward_batch``, inside ``_gradient_sync_context`` (the per-micro-batch context of its loop). The
  step is entered when ``prepare_model_inputs`` shards the micro-batch and left when that context exits, after the
  backward (and any checkpointed recompute in it); a forward-only micro-batch (log-probs, values) leaves it at the
  end of ``forward_step`` (`MicroBatchSteps`). A training forward outside that context is an `InvariantError`
  rather than a step left open.

What the engine has not verified is refused by name when it is built, before the model loads (`refusal`), and
per micro-batch (images, top-k distillation).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

from ..config import ENTRY_LAYOUT, CPConfig
from ..errors import InvariantError
from ..hf import ATTN_IMPLEMENTATION, prepare_model
from ..step.batch import make_cp_blockdiag_batch_and_ctx
from ..step.gather import gather_sequence
from ..step.inputs import pad_to
from ..step.pipeline import TrainCtx
from ..step.state import StepState

__all__ = ("BlockDiagCPEngineWithLMHead", "BlockDiagCPEngineWithValueHead", "MicroBatchSteps", "VENDOR",
           "attend_per_document", "refusal", "shard_packed_row")

#: the ``VERL_ENGINE_VENDOR`` that selects these engines
VENDOR = "blockdiag_cp"
#: where refusals say they were raised
WHERE = "blockdiag_cp.integrations.verl"


def refusal(engine_config: Any, model_config: Any) -> Optional[str]:
    """What the engine refuses in verl's engine and model configs (verl's dataclasses), and what to do; None if
    nothing. Read before anything is built: every rank refuses alike."""
    hf_config = model_config.hf_config
    checks = (
        (engine_config.strategy == "fsdp2", "strategy",
         "FSDP1 needs an accelerator for its module sync and is not verified under the engine: set strategy: fsdp2"),
        (model_config.use_remove_padding, "use_remove_padding",
         "the engine shards verl's packed micro-batch: set use_remove_padding: true"),
        (not engine_config.pad_to_length, "pad_to_length",
         "a static pad to a bucket length is not verified under the engine (the plan pads to what it needs): leave "
         "it off"),
        (not model_config.use_fused_kernels, "use_fused_kernels",
         "verl's fused LM-head kernels are not verified under the engine: leave them off"),
        (not model_config.use_liger, "use_liger", "Liger kernels are not verified under the engine: leave them off"),
        (not model_config.enable_activation_offload, "enable_activation_offload",
         "activation offloading is not verified under the engine: leave it off"),
        (not getattr(engine_config.qat, "enable", False), "qat",
         "quantization-aware training is not verified under the engine"),
        (not getattr(model_config.mtp, "enable", False), "mtp",
         "multi-token prediction layers are not verified under the engine"),
        (getattr(hf_config, "vision_config", None) is None, "vision_config",
         "vision-language models (verl's input slicing after the embeddings, mRoPE positions) are not verified "
         "under the engine: train text models"),
    )
    for ok, name, what in checks:
        if not ok:
            return f"{WHERE}: {name} is refused: {what}"
    return None


def shard_packed_row(cp_mesh: Any, cu_seqlens: torch.Tensor, model_inputs: dict[str, Any],
                     output_args: dict[str, Any], config: CPConfig) -> tuple[TrainCtx, dict[str, Any], dict[str, Any]]:
    """verl's packed micro-batch (what its ``prepare_model_inputs`` returns at sp 1) as this rank's shard of a step.

    Args:
        cp_mesh: the CP group (verl's ``sp`` mesh dimension), None for one rank.
        cu_seqlens: ``[B + 1]`` the sequences' offsets in the row (``input_ids.offsets()``): each is a document.
        model_inputs: ``input_ids [1, S]``, ``position_ids [1, S]``, ``attention_mask`` None.
        output_args: ``input_ids_rmpad_rolled [S]`` (next-token labels, rolled on the whole row),
            ``temperature_rmpad [S]``, ``pad_size`` (0: no static pad), and verl's other flags.

    Returns:
        ``(train_ctx, model_inputs, output_args)`` with ``[1, L]`` inputs and ``[L]`` labels and temperatures, the
        positions this rank owns under the step's plan.
    """
    ids_1S, pos_1S = model_inputs["input_ids"], model_inputs["position_ids"]
    S = ids_1S.shape[1]
    lengths = cu_seqlens.diff()
    if int(cu_seqlens[-1]) != S or output_args.get("pad_size", 0):
        raise InvariantError(f"verl's packed row holds {S} tokens, its sequences {int(cu_seqlens[-1])} (pad "
                             f"{output_args.get('pad_size', 0)}): the engine expects the unpadded row at sp 1")
    docs = torch.arange(1, lengths.numel() + 1, device=ids_1S.device).repeat_interleave(lengths.to(ids_1S.device))
    batch = {"input_ids": ids_1S, "position_ids": pos_1S, "_packed_seq_ids": docs.unsqueeze(0)}
    ctx, batch = make_cp_blockdiag_batch_and_ctx(cp_mesh, None, batch, config=config)
    sharded_inputs = {**model_inputs, "input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    sharded_args = {
        **output_args,
        "input_ids_rmpad_rolled": _own_positions(output_args["input_ids_rmpad_rolled"], ctx.state, 0),
        "temperature_rmpad": _own_positions(output_args["temperature_rmpad"], ctx.state, 1.0),
    }
    return ctx, sharded_inputs, sharded_args


def _own_positions(values_S: torch.Tensor, state: StepState, fill: Any) -> torch.Tensor:
    """``[S]`` per-token values of the row -> ``[L]`` this rank's positions (the plan's padding: `fill`)."""
    padded = pad_to(values_S, 0, state.plan.padded_len, fill)
    return padded.index_select(0, state.positions.to(values_S.device))


def attend_per_document(module: torch.nn.Module) -> torch.nn.Module:
    """verl's freshly loaded model attending through blockdiag-cp (verl loads value models with flash attention 2:
    switched), its token mixers routed per document (`prepare_model`, which refuses what it cannot route); a model
    that is not a transformers model (trl's ``AutoModelForCausalLMWithValueHead``, verl's fallback critic) is
    refused by name."""
    from transformers import PreTrainedModel

    if not isinstance(module, PreTrainedModel):
        raise ValueError(f"{WHERE}: {type(module).__name__} is refused: the engine verifies transformers models (for "
                         "a critic, a token-classification model with num_labels=1, which verl loads first)")
    if module.config._attn_implementation != ATTN_IMPLEMENTATION:
        module.set_attn_implementation(ATTN_IMPLEMENTATION)
    prepare_model(module, f"in {WHERE}")
    return module


class MicroBatchSteps:
    """The CP step of the micro-batch in flight (Note [verl's engine, per document, each micro-batch in its step]).

    `training_micro_batch` spans one training micro-batch's forward and backward, `forward` one ``forward_step``;
    `enter` enters a step inside them, left when the span that holds it ends (with the span's exception, if any).
    """

    def __init__(self) -> None:
        self._stack: Optional[contextlib.ExitStack] = None

    @contextlib.contextmanager
    def training_micro_batch(self) -> Iterator[None]:
        with self._span():
            yield

    @contextlib.contextmanager
    def forward(self, training: bool) -> Iterator[None]:
        """One ``forward_step``: a training one runs inside `training_micro_batch` (its step lives on until the
        backward ends); a forward-only one is its own span."""
        if not training:
            with self._span():
                yield
            return
        if self._stack is None:
            raise InvariantError(
                f"{WHERE}: verl ran a training forward outside _gradient_sync_context, the per-micro-batch context "
                "its forward_backward_batch wraps each micro-batch's forward and backward in (the engine enters the "
                "micro-batch's CP step there): this verl version's loop is not the one the engine was verified with"
            )
        yield

    def enter(self, ctx: TrainCtx) -> StepState:
        """Enter the step of the micro-batch whose forward runs (one per span)."""
        if self._stack is None:
            raise InvariantError(f"{WHERE}: a micro-batch was sharded outside a forward_step")
        return self._stack.enter_context(ctx())

    @contextlib.contextmanager
    def _span(self) -> Iterator[None]:
        if self._stack is not None:
            raise InvariantError(f"{WHERE}: a micro-batch's step is still open when the next one starts")
        with contextlib.ExitStack() as stack:
            self._stack = stack
            try:
                yield
            finally:
                self._stack = None


class _PerDocumentCP:
    """The overrides both engines share (Note [verl's engine, per document, each micro-batch in its step]).

    Attributes:
        cp_config: the `CPConfig` of every micro-batch's step (a subclass may set another).
        cp_mesh: verl's ``sp`` mesh dimension, the CP group (None at cp 1).
    """

    cp_config: CPConfig = CPConfig(layout=ENTRY_LAYOUT)

    def __init__(self, model_config: Any, engine_config: Any, *args: Any, **kwargs: Any) -> None:
        problem = refusal(engine_config, model_config)
        if problem:
            raise ValueError(problem)
        self.micro_batch_steps = MicroBatchSteps()
        super().__init__(model_config, engine_config, *args, **kwargs)

    def _init_device_mesh(self) -> None:
        """verl's meshes (its (dp, sp) mesh sizes the replicas and dispatch), with verl's Ulysses kept off."""
        super()._init_device_mesh()
        self.cp_mesh = None if self.ulysses_device_mesh is None else self.ulysses_device_mesh["sp"]
        self.use_ulysses_sp = False  # no Ulysses slicing of the inputs, no Ulysses gather of the outputs
        self.ulysses_parallel_group = None  # verl's train / eval contexts set its Ulysses group from this

    def _build_module(self) -> torch.nn.Module:
        """verl's model, attending through blockdiag-cp, its token mixers routed per document; verl's monkey
        patch applied as at sp 1 (Ulysses' head-count asserts and input slicing belong to Ulysses)."""
        self.model_config.hf_config._attn_implementation = ATTN_IMPLEMENTATION  # the LM loads with its config's
        cp_size, self.ulysses_sequence_parallel_size = self.ulysses_sequence_parallel_size, 1
        try:
            module = super()._build_module()
        finally:
            self.ulysses_sequence_parallel_size = cp_size
        return attend_per_document(module)

    @contextlib.contextmanager
    def _gradient_sync_context(self, *, is_last_micro_batch: bool) -> Iterator[None]:
        with super()._gradient_sync_context(is_last_micro_batch=is_last_micro_batch):
            with self.micro_batch_steps.training_micro_batch():
                yield

    def forward_step(self, micro_batch: Any, loss_function: Any, forward_only: bool) -> Any:
        with self.micro_batch_steps.forward(training=not forward_only):
            return super().forward_step(micro_batch, loss_function=loss_function, forward_only=forward_only)

    def prepare_model_inputs(self, micro_batch: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        _refuse_micro_batch(micro_batch)
        model_inputs, output_args = super().prepare_model_inputs(micro_batch)
        cu_seqlens = micro_batch["input_ids"].offsets()
        ctx, model_inputs, output_args = shard_packed_row(self.cp_mesh, cu_seqlens, model_inputs, output_args,
                                                          self.cp_config)
        self.micro_batch_steps.enter(ctx)
        return model_inputs, output_args

    def _gather_and_unpad_packed(self, tensor: torch.Tensor, pad_size: int) -> torch.Tensor:
        """``[L]`` this rank's per-token values -> ``[total_nnz]`` the row's, in order, on every CP rank."""
        return gather_sequence(tensor, 0)


def _refuse_micro_batch(micro_batch: Any) -> None:
    """`ValueError` for a micro-batch the engine has not verified (the same data reaches every rank of a group)."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.model import extract_multi_modal_inputs

    if extract_multi_modal_inputs(micro_batch.get("multi_modal_inputs", [])) or micro_batch["position_ids"].dim() == 3:
        raise ValueError(f"{WHERE}: images and mRoPE positions are refused: vision-language rows are not verified "
                         "under the engine")
    if tu.get_non_tensor_data(data=micro_batch, key="distillation_use_topk", default=False):
        raise ValueError(f"{WHERE}: top-k distillation is refused: verl slices the teacher's tensors by its Ulysses "
                         "rule, not by the engine's plan")
    if not tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True):
        raise ValueError(f"{WHERE}: use_remove_padding=False is refused: the engine shards verl's packed rows")


@EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device="cuda", vendor=VENDOR)
class BlockDiagCPEngineWithLMHead(_PerDocumentCP, FSDPEngineWithLMHead):
    """verl's FSDP actor / reference engine with per-document CP (the module docstring)."""


@EngineRegistry.register(model_type="value_model", backend=["fsdp", "fsdp2"], device="cuda", vendor=VENDOR)
class BlockDiagCPEngineWithValueHead(_PerDocumentCP, FSDPEngineWithValueHead):
    """verl's FSDP critic engine with per-document CP: values per token, gathered (the module docstring)."""
