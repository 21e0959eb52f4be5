"""torchtitan's trainer with document-packed rows under block-diagonal CP (issues #48, #52).

torchtitan 0.3.0 packs its text datasets into rows whose ``positions`` restart at 0 at every document and masks
attention per document from them, but its own context parallelism refuses that ("Varlen attention is not
supported with CP"; its FlexAttention CP all-gathers every key). `BlockDiagCPTrainer` is torchtitan's `Trainer`
with this library's step inside it::

    # my_configs.py: a config_registry module, as torchtitan's own
    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    from blockdiag_cp.integrations.torchtitan import blockdiag_config

    def my_run():
        return blockdiag_config(llama3_debugmodel(), cp_degree=2)   # spmd_backend "partial_dtensor"

    torchrun --nproc-per-node 4 -m torchtitan.train --module my_configs --config my_run \\
        --blockdiag_cp.cp_degree 2          # any key can be overridden on torchtitan's CLI

Note [The torchtitan way in]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each piece goes in through one of torchtitan's own extension points:

* attention: every layer's ``inner_attention`` config becomes `BlockDiagCPAttention.Config` (torchtitan's
  pluggable inner-attention module; `route_attention`, also as the model converter `BlockDiagCPConverter`), each
  field of the original read (Note [Routing torchtitan's attention configs] in torchtitan_attention.py). It calls
  `cp_blockdiag_sdpa`, which inside a step attends per document across the CP group, and it refuses to run
  outside one (plain SDPA there would let documents see each other). torchtitan's TP sharding rules wrap it as
  they wrap its own attention (``local_map``: it sees this TP rank's heads); its per-block compile traces it as
  one opaque op (step/opaque.py); its activation checkpointing recomputes it inside the step.
* MoE layers: every `GroupedExperts` computes in its weights' dtype (torchtitan's casts to bfloat16 would round
  each rank's expert gradients alone) and the padding's routes are not counted in the load balancing
  (`route_experts`, `uncount_padding`; Note [torchtitan's experts under CP] in torchtitan_moe.py).
* ranks: torchtitan sees the CP groups' ranks as data ranks (FSDP over dp x cp); ``world = rows x cp x tp``
  (Note [CP groups inside torchtitan's data ranks] in torchtitan_rows.py). The dataloader config is wrapped
  (`CPGroupRows`) so a CP group's ranks read the same rows; ``parallelism.data_parallel_shard_degree`` and
  ``training.global_batch_size`` keep their meaning (replicas' shards, rows per optimizer step) and are given to
  torchtitan counted per data rank (`_count_cp_ranks_as_data_ranks`).
* documents and the step: `BlockDiagCPTrainer.post_dataloading_process` (torchtitan's documented hook) lays the
  micro-batch's rows end to end as one packed row, reads its documents from ``positions`` and shards it by this
  library's plan; ``_forward_backward_body`` runs torchtitan's forward and backward inside the step context. The
  validator (`BlockDiagCPValidator`) does the same for its forward.
* the loss: torchtitan's loss is the shard's token sum over the global valid-token count, and FSDP sums
  gradients (``gradient_divide_factor=1``). Every rank of a CP group counted its group's whole rows, so the
  trainer divides the count torchtitan summed over the data ranks by ``cp_degree``: the loss, its gradients
  and the logged loss are the token mean over the global batch, as in the run without CP.
* the pipeline (``parallelism.pipeline_parallel_degree``): each micro-batch its own packed row and step, the
  schedule's stage actions bound to them (`PipelinedRows`, Note [torchtitan's pipeline under CP] in
  torchtitan_pp.py).

Refused by name (`check_options`): torchtitan's own CP (``parallelism.context_parallel_degree``), expert
parallelism, the SPMD backends other than ``partial_dtensor``; with a pipeline, its validator, TP, compile and
checkpoints (`REFUSED_WITH_PIPELINE`: not verified), and torchtitan's chunked loss under a schedule that splits
its backward (the final norm would get no gradient, with or without CP); a validator of another type than
torchtitan's; attention configs it cannot route exactly (`route_attention`).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Literal, Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torchtitan.components.validate import Validator
from torchtitan.trainer import Trainer

from ..config import CPConfig
from .torchtitan_attention import BlockDiagCPAttention, BlockDiagCPConverter, route_attention
from .torchtitan_moe import balances_expert_load, route_experts, uncount_padding
from .torchtitan_pp import REFUSED_WITH_PIPELINE, PipelinedRows, refuse_chunked_loss_under_split_backward
from .torchtitan_rows import (
    BlockDiagCPValidator,
    CPGroupRows,
    CPGroups,
    as_config,
    doc_ids_from_positions,
    local_multiple_of,
    row_padding,
    rows_per_micro_batch,
)

logger = logging.getLogger(__name__)

__all__ = (
    "BlockDiagCPAttention",
    "BlockDiagCPConverter",
    "BlockDiagCPOptions",
    "BlockDiagCPTrainer",
    "BlockDiagCPValidator",
    "CPGroupRows",
    "blockdiag_config",
    "check_options",
    "doc_ids_from_positions",
    "route_attention",
)


@dataclass(kw_only=True, slots=True)
class BlockDiagCPOptions:
    """The ``blockdiag_cp`` section of the job config (``--blockdiag_cp.cp_degree 2`` on torchtitan's CLI)."""

    cp_degree: int = 1
    """Ranks sharing one packed row (1 = no CP: documents are still masked per row). Divides the data ranks."""
    layout: Literal["contiguous", "balanced"] = "balanced"
    """How the row's tokens are laid over the CP ranks (`plan_shards`)."""
    kv_exchange: Literal["auto", "allgather", "halo", "a2a", "ring"] = "auto"
    """How each rank gets the keys its queries need."""

    def cp_config(self) -> CPConfig:
        return CPConfig(layout=self.layout, kv_exchange=self.kv_exchange)


#: torchtitan 0.3.0's default ``parallelism.spmd_backend`` (`blockdiag_config` replaces it by ``partial_dtensor``)
_TITAN_DEFAULT_BACKEND = "spmd_types"

#: (the option, the value that keeps it off, why it is refused)
_REFUSED = (
    ("parallelism.context_parallel_degree", 1,
     "torchtitan's own CP wraps the attention itself; set blockdiag_cp.cp_degree instead"),
    ("parallelism.expert_parallel_degree", 1,
     "expert parallelism under blockdiag-cp is not verified (MoE layers run unsharded at 1)"),
    ("parallelism.spmd_backend", "partial_dtensor",
     "the other SPMD backends wrap modules in local_map / full DTensors over a cp mesh axis torchtitan does not "
     "have here"),
)


def check_options(config: "BlockDiagCPTrainer.Config") -> None:
    """Refuse, by name, the job options that would be silently different (or are unverified) under blockdiag-cp.

    Raises:
        ValueError: naming the option, its value, the value to use and why.
    """
    if config.blockdiag_cp.cp_degree < 1:
        raise ValueError(f"blockdiag_cp.cp_degree must be >= 1, got {config.blockdiag_cp.cp_degree}")
    pipelined = config.parallelism.pipeline_parallel_degree > 1
    for path, keep, why in _REFUSED + (REFUSED_WITH_PIPELINE if pipelined else ()):
        section, name = path.split(".")
        value = getattr(getattr(config, section), name)
        if value != keep:
            raise ValueError(f"{path}={value!r} is refused by BlockDiagCPTrainer ({why}); set {path}={keep!r}")
    refuse_chunked_loss_under_split_backward(config)
    _refuse_uncountable_padding(config)
    if config.validator.enable and type(config.validator) not in (Validator.Config, BlockDiagCPValidator.Config):
        raise ValueError(f"validator={type(config.validator).__qualname__} is refused by BlockDiagCPTrainer: only "
                         "torchtitan's Validator is run inside a blockdiag-cp step (BlockDiagCPValidator)")


def _refuse_uncountable_padding(config: "BlockDiagCPTrainer.Config") -> None:
    """A compiled model whose MoE layers balance their load, on rows the trainer pads: the padding's routes are
    taken out of torchtitan's expert counts by a router hook (Note [torchtitan's experts under CP]), which a
    ``fullgraph`` per-block compile cannot trace (it reads the step)."""
    padding = row_padding(config, config.blockdiag_cp.cp_degree)
    compiled = config.compile.enable and "model" in config.compile.components
    if padding and compiled and config.model_spec is not None and balances_expert_load(config.model_spec.model):
        raise ValueError(
            f"compile.enable with a MoE model that balances its experts' load (load_balance_coeff) is refused by "
            f"BlockDiagCPTrainer on rows it pads ({padding} padding tokens per micro-batch: its rows x seq_len = "
            f"{rows_per_micro_batch(config) * config.training.seq_len} is not a multiple of cp_degree "
            f"x lcm(tensor_parallel_degree, the chunked loss's num_chunks)): the padding's routes must be taken out "
            f"of the experts' load counts, which the compiled blocks cannot do. Choose seq_len so that no padding is "
            f"needed, or compile.enable=False")


class BlockDiagCPTrainer(PipelinedRows, Trainer):
    """torchtitan's `Trainer` whose packed rows are sharded per document over ``blockdiag_cp.cp_degree`` ranks.

    See Note [The torchtitan way in]. Attributes: ``cp_groups`` (`CPGroups`: the CP group's mesh, one rank per
    group, torchtitan's TP mesh), ``cp_step`` (the current step's ``train_ctx``, set by
    `post_dataloading_process`).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        blockdiag_cp: BlockDiagCPOptions = field(default_factory=BlockDiagCPOptions)

    def __init__(self, config: Config) -> None:
        check_options(config)  # here, after torchtitan's CLI overrides were applied to the config function's Config
        if config.model_spec is None:
            raise ValueError("BlockDiagCPTrainer needs config.model_spec (set by the config_registry function)")
        config = _count_cp_ranks_as_data_ranks(copy.copy(config))
        cp_degree = config.blockdiag_cp.cp_degree
        config.model_spec = dataclasses.replace(
            config.model_spec, model=route_experts(route_attention(config.model_spec.model), cp_degree))
        config.dataloader = CPGroupRows.Config(rows=config.dataloader, cp_degree=cp_degree)
        if type(config.validator) is Validator.Config:
            config.validator = as_config(BlockDiagCPValidator.Config, config.validator)
        _keep_timeouts_where_torch_cannot_set_them()
        self.cp_step: Optional[Callable[[], ContextManager]] = None
        super().__init__(config)
        dims = self.parallel_dims
        self.cp_groups = CPGroups.build(cp_degree, config.blockdiag_cp.cp_config(),
                                        dims.get_mesh("tp") if dims.tp_enabled else None, self.device.type,
                                        local_multiple_of(dims.tp, self.loss_fn))
        self.cp_degree = cp_degree
        if row_padding(config, cp_degree):
            uncount_padding(self.model_parts)  # the padding's routes out of the experts' load counts
        if self.device.type == "cpu":
            _sum_gradients_over_gloo(self.model_parts)
            _accumulate_grad_norms_in_float64()
        if config.validator.enable:
            self.validator.use_cp_groups(self.cp_groups)

    @property
    def cp_mesh(self):
        """The CP group's 1-D mesh (None at ``cp_degree == 1``)."""
        return self.cp_groups.cp_mesh

    def post_dataloading_process(self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor):
        """Shard torchtitan's micro-batch ``[B, S]`` by the plan; ``(inputs [1, L], labels [1, L], {"positions"})``."""
        sharded = self.cp_groups.shard(input_dict, labels)
        self.cp_step = sharded.train_ctx
        self.ntokens_seen += sharded.real_tokens  # this rank's real tokens: summed over ranks
        return sharded.inputs, sharded.labels, sharded.extra

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens: torch.Tensor) -> torch.Tensor:
        # the batch mesh's sum counted each CP group's rows on all its cp_degree ranks
        return super().forward_backward_step(input_dict=input_dict, labels=labels,
                                             global_valid_tokens=global_valid_tokens // self.cp_degree)

    def _forward_backward_body(self, inputs, labels, global_valid_tokens, extra_kwargs) -> torch.Tensor:
        step, self.cp_step = self.cp_step, None
        if step is None:
            raise RuntimeError("no blockdiag-cp step: post_dataloading_process did not run before forward")
        with step():  # forward AND backward inside the step
            return super()._forward_backward_body(inputs, labels, global_valid_tokens, extra_kwargs)


def _count_cp_ranks_as_data_ranks(config: "BlockDiagCPTrainer.Config") -> "BlockDiagCPTrainer.Config":
    """`config` (a shallow copy) with the two counts torchtitan makes over its data ranks given per data rank.

    torchtitan counts ``world / tp`` data ranks; the user's ``parallelism.data_parallel_shard_degree`` counts the
    replicas' shards (``dp_shard 2`` with ``cp_degree 2`` is 4 ranks, as with torchtitan's own CP) and
    ``training.global_batch_size`` the rows of one optimizer step, of which a CP group's ``cp`` ranks read each
    once. So torchtitan gets both multiplied by ``cp`` (-1, "infer", stays): its FSDP shards over dp x cp and its
    accumulation steps and dataloader snapshot interval are the run's.
    """
    cp = config.blockdiag_cp.cp_degree
    shard, rows = config.parallelism.data_parallel_shard_degree, config.training.global_batch_size
    config.parallelism = dataclasses.replace(config.parallelism,
                                             data_parallel_shard_degree=shard * cp if shard > 0 else shard)
    config.training = dataclasses.replace(config.training, global_batch_size=rows * cp if rows > 0 else rows)
    return config


def _sum_gradients_over_gloo(model_parts: list[torch.nn.Module]) -> None:
    """Let torchtitan's FSDP modules reduce gradients with SUM on CPU processes.

    torchtitan sets FSDP's gradient divide factor to 1, which FSDP sends as ``ReduceOp.PREMUL_SUM(1.0)`` (or
    AVG over one rank); gloo has neither ("Cannot use ReduceOp.PREMUL_SUM with Gloo"). A plain SUM with no
    division is the same reduction.
    """
    for part in model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)


def _accumulate_grad_norms_in_float64() -> None:
    """On CPU processes, torchtitan's ``clip_grad_norm_`` becomes `_clip_grad_norm_in_float64` (Note [Gradient
    norms on CPU]); idempotent. A function someone else put there (a wrapper) is left, with a warning."""
    import torchtitan.distributed.utils as titan_dist

    current = titan_dist.clip_grad_norm_
    if current is _clip_grad_norm_in_float64:
        return
    if (getattr(current, "__module__", None), getattr(current, "__qualname__", None)) != (titan_dist.__name__,
                                                                                          "clip_grad_norm_"):
        logger.warning("torchtitan.distributed.utils.clip_grad_norm_ is %r, not torchtitan's: left as it is, so the "
                       "logged gradient norm is torch's float32 CPU norm (it moves ~1e-5 with the sharding)", current)
        return
    titan_dist.clip_grad_norm_ = _clip_grad_norm_in_float64


@torch.no_grad()
def _clip_grad_norm_in_float64(parameters: Any, max_norm: float, norm_type: float = 2.0,
                               error_if_nonfinite: bool = False, foreach: Optional[bool] = None,
                               pp_mesh: Any = None, ep_enabled: bool = False) -> torch.Tensor:
    """torchtitan's ``clip_grad_norm_`` with each gradient's (shard's) norm accumulated in float64.

    Note [Gradient norms on CPU]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    torchtitan's ``clip_grad_norm_`` takes torch's float32 norm of each rank's gradient shards (``_foreach_norm``)
    and combines them over the DTensor meshes. On CPU torch accumulates a float32 norm sequentially (a few vector
    lanes, one running sum each), so a shard of 2.6e5 elements is off by ~1e-5 relative, and by an amount that
    depends on where the shards are cut: qwen3's gradients at step 1 log 3.8878241 at tp 2 (FSDP over 1 rank)
    and 3.8878684 at tp 2 x cp 2 (FSDP over 2 ranks), 1.1e-5 apart, while their float64 norms agree to 3e-10
    and each run's gradients, laid out as the other run's shards, give the other run's logged norm. Here each
    shard's norm is accumulated in float64 (one float64 copy of one gradient at a time) and the total returned
    in the gradients' dtype: the logged norm and the clipping are then the gradients' own, whatever the sharding.
    Everything else is torchtitan's: the DTensor reductions, the pipeline stages' sum, the clipping.
    """
    if ep_enabled:
        raise ValueError("expert parallelism is refused under blockdiag-cp (check_options names it before the run)")
    parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    norms = [torch.linalg.vector_norm(g, norm_type, dtype=torch.float64) for g in grads]
    # a stage without gradients still joins the pipeline's sum below (torch's get_total_norm: 0 for none)
    total_norm = torch.linalg.vector_norm(torch.stack(norms), norm_type) if norms else torch.zeros((), dtype=torch.float64)
    if isinstance(total_norm, DTensor):  # partial over the sharded mesh dims: reduce
        total_norm = total_norm.full_tensor()
    if pp_mesh is not None:
        if math.isinf(norm_type):
            dist.all_reduce(total_norm, op=dist.ReduceOp.MAX, group=pp_mesh.get_group())
        else:
            total_norm **= norm_type
            dist.all_reduce(total_norm, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
            total_norm **= 1.0 / norm_type
    if error_if_nonfinite and not torch.isfinite(total_norm):
        raise RuntimeError(f"The total norm of order {norm_type} of the gradients is non-finite, so it cannot be "
                           "clipped (error_if_nonfinite=True)")
    total_norm = total_norm.to(grads[0].dtype if grads else torch.get_default_dtype())
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total_norm, foreach)
    return total_norm


def _keep_timeouts_where_torch_cannot_set_them() -> None:
    """torchtitan 0.3.0 shortens every process group's timeout after the first step with
    ``torch.distributed.set_timeout``, which torch 2.13 (and 2.11) lacks: the run dies after step 1
    ("module 'torch.distributed' has no attribute 'set_timeout'"). Where it is missing, the one torchtitan
    function that calls it, ``torchtitan.distributed.utils.set_pg_timeouts``, is replaced by
    `_keep_pg_timeouts`: the groups keep the (longer) timeouts they were created with; nothing computed changes.
    """
    if hasattr(dist, "set_timeout"):
        return
    import torchtitan.distributed.utils as titan_dist

    titan_dist.set_pg_timeouts = _keep_pg_timeouts


def _keep_pg_timeouts(timeout: Any, parallel_dims: Any) -> None:
    logger.warning("torch %s has no torch.distributed.set_timeout: the process groups keep their initial "
                   "timeout instead of torchtitan's train timeout %s", torch.__version__, timeout)


def blockdiag_config(base: Trainer.Config, **options: Any) -> BlockDiagCPTrainer.Config:
    """`base` (e.g. ``llama3_debugmodel()``) as a `BlockDiagCPTrainer.Config`; `options` fill its ``blockdiag_cp``.

    For a ``config_registry`` function: ``return blockdiag_config(llama3_debugmodel(), cp_degree=2)``. torchtitan's
    default SPMD backend (``spmd_types``, which `check_options` refuses) becomes ``partial_dtensor``, the one this
    trainer runs under; a backend set to anything else is left as it is (and refused by name).
    """
    config = as_config(BlockDiagCPTrainer.Config, base, blockdiag_cp=BlockDiagCPOptions(**options))
    if config.parallelism.spmd_backend == _TITAN_DEFAULT_BACKEND:
        config.parallelism = dataclasses.replace(config.parallelism, spmd_backend="partial_dtensor")
    return config
