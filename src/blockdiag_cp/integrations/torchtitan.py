"""torchtitan's trainer with document-packed rows under block-diagonal CP (issue #48).

torchtitan 0.3.0 packs its text datasets into rows whose ``positions`` restart at 0 at every document and masks
attention per document from them, but its own context parallelism refuses that ("Varlen attention is not
supported with CP"; its FlexAttention CP all-gathers every key). `BlockDiagCPTrainer` is torchtitan's `Trainer`
with this library's step inside it::

    # my_configs.py: a config_registry module, as torchtitan's own
    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    from blockdiag_cp.integrations.torchtitan import blockdiag_config

    def my_run():
        config = blockdiag_config(llama3_debugmodel(), cp_degree=2)
        config.parallelism.spmd_backend = "partial_dtensor"
        return config

    torchrun --nproc-per-node 4 -m torchtitan.train --module my_configs --config my_run \\
        --blockdiag_cp.cp_degree 2          # any key can be overridden on torchtitan's CLI

Note [The torchtitan way in]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each piece goes in through one of torchtitan's own extension points:

* attention: every layer's ``inner_attention`` config becomes `BlockDiagCPAttention.Config` (torchtitan's
  pluggable inner-attention module; `route_attention`, also as the model converter `BlockDiagCPConverter`).
  It calls `cp_blockdiag_sdpa`, which inside a step attends per document across the CP group, and it refuses
  to run outside one (plain SDPA there would let documents see each other).
* rows: torchtitan sees ``world`` data-parallel ranks; the dataloader config is wrapped (`CPGroupRows`) so the
  ``cp_degree`` consecutive ranks of a CP group read the same rows (data-parallel rank ``rank // cp_degree``).
* documents: torchtitan's packed rows carry ``positions`` that restart at 0 at each document (its own
  block-causal masks read them the same way); `doc_ids_from_positions` turns them into ``_packed_seq_ids``.
* the step: `BlockDiagCPTrainer.post_dataloading_process` (torchtitan's documented hook) shards the row by this
  library's plan; ``_forward_backward_body`` runs torchtitan's forward and backward inside the step context.
* the loss: torchtitan's loss is the shard's token sum over the global valid-token count, and FSDP sums
  gradients (``gradient_divide_factor=1``). Every rank of a CP group counted its group's whole rows, so the
  trainer divides the count torchtitan summed over the data ranks by ``cp_degree``: the loss, its gradients
  and the logged loss are the token mean over the global batch, as in the run without CP.

* the pipeline (``parallelism.pipeline_parallel_degree``): each micro-batch its own row and step
  (`PipelinedRows`, Note [torchtitan's pipeline under CP] in torchtitan_pp.py).

torchtitan's own CP (``parallelism.context_parallel_degree``), tensor and expert parallelism, the
other SPMD backends, validation, checkpoints, compile and more than one row per micro-batch are refused by name
(`check_options`): each would be silently different or is not yet verified here.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Literal, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.models.common.attention import BaseAttention
from torchtitan.models.common.decoder import Decoder
from torchtitan.protocols.model import ModelConfigConverter
from torchtitan.protocols.module import Module
from torchtitan.trainer import Trainer

from ..attention import cp_blockdiag_sdpa
from ..config import CPConfig
from ..step.batch import make_cp_blockdiag_batch_and_ctx
from ..step.slot import current_step
from .torchtitan_pp import PipelinedRows, check_rows_per_micro_batch

logger = logging.getLogger(__name__)

__all__ = (
    "BlockDiagCPAttention",
    "BlockDiagCPConverter",
    "BlockDiagCPOptions",
    "BlockDiagCPTrainer",
    "CPGroupRows",
    "blockdiag_config",
    "check_options",
    "doc_ids_from_positions",
    "route_attention",
)


class BlockDiagCPAttention(Module):
    """torchtitan inner attention: per-document causal attention of this rank's shard, through `cp_blockdiag_sdpa`.

    Takes torchtitan's ``(B, L, N, H)`` layout (``B == 1``, ``L`` this rank's shard) and returns the same layout.
    torchtitan's ``attention_masks`` are not read: the step's document ids are the mask.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config) -> None:
        super().__init__()

    def forward(self, q_BLNH: torch.Tensor, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor, *,
                attention_masks: Any = None, scale: Optional[float] = None, enable_gqa: bool = False,
                **kwargs) -> torch.Tensor:
        if current_step() is None:
            raise RuntimeError(
                "BlockDiagCPAttention ran outside a blockdiag-cp step: plain attention there would let a packed "
                "row's documents attend to each other. Run the model through BlockDiagCPTrainer (its train step "
                "opens the step), or open one with make_cp_blockdiag_batch_and_ctx(...)'s train_ctx().")
        dropped = sorted(k for k, v in kwargs.items() if v is not None)
        if dropped:
            raise ValueError(f"BlockDiagCPAttention got {dropped}, which it would drop (e.g. a FlexAttention score_mod); "
                             "only per-document causal attention with a scale is routed through blockdiag-cp")
        q_BNLH, k_BNLH, v_BNLH = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        out_BNLH = cp_blockdiag_sdpa(q_BNLH, k_BNLH, v_BNLH, is_causal=True, scale=scale, enable_gqa=enable_gqa)
        return out_BNLH.transpose(1, 2)


def route_attention(model_config: Decoder.Config) -> Decoder.Config:
    """Return a copy of `model_config` whose every attention layer's ``inner_attention`` is `BlockDiagCPAttention`.

    Raises:
        ValueError: the model is not a torchtitan `Decoder`, builds its own masks (sliding windows, chunked or
            bidirectional attention: overriding ``get_attention_masks``), or has no attention layer to route.
    """
    owner = type(model_config)._owner
    if not isinstance(model_config, Decoder.Config) or owner is None:
        raise ValueError(f"route_attention takes a torchtitan Decoder config, got {type(model_config).__name__}")
    if owner.get_attention_masks is not Decoder.get_attention_masks:
        raise ValueError(
            f"{owner.__name__} builds its own attention masks (get_attention_masks is overridden: sliding windows, "
            "chunked or bidirectional spans); blockdiag-cp would drop them. Only decoders masked by torchtitan's "
            "default per-document causal rule are routed (verified: llama3).")
    routed = copy.deepcopy(model_config)
    found = [cfg for _, cfg, _, _ in routed.traverse(BaseAttention.Config)]
    if not found:
        raise ValueError(f"{type(model_config).__name__} has no attention layer to route through blockdiag-cp")
    for cfg in found:
        cfg.inner_attention = BlockDiagCPAttention.Config()
    return routed


class BlockDiagCPConverter(ModelConfigConverter):
    """torchtitan model converter (``model_registry(flavor, converters=[BlockDiagCPConverter.Config()])``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        pass

    def __init__(self, config: Config) -> None:
        self.config = config

    def convert(self, model_config: Decoder.Config) -> Decoder.Config:
        return route_attention(model_config)


def doc_ids_from_positions(positions_BS: torch.Tensor) -> torch.Tensor:
    """1-based document ids ``[B, S]`` int64 of torchtitan's packed rows: a document starts where ``positions == 0``.

    This is the boundary torchtitan's own block-causal masks read (``get_document_mask_mod``). A row's leading
    tokens before the first 0 (a document carried over from the previous row) are its first document.
    """
    starts_BS = positions_BS == 0
    starts_BS[:, 0] = True
    return torch.cumsum(starts_BS.to(torch.int64), dim=1)


@dataclass(kw_only=True, slots=True)
class BlockDiagCPOptions:
    """The ``blockdiag_cp`` section of the job config (``--blockdiag_cp.cp_degree 2`` on torchtitan's CLI)."""

    cp_degree: int = 1
    """Ranks sharing one packed row (1 = no CP: documents are still masked per row). Divides the world."""
    layout: Literal["contiguous", "balanced"] = "balanced"
    """How the row's tokens are laid over the CP ranks (`plan_shards`)."""
    kv_exchange: Literal["auto", "allgather", "halo", "a2a", "ring"] = "auto"
    """How each rank gets the keys its queries need."""

    def cp_config(self) -> CPConfig:
        return CPConfig(layout=self.layout, kv_exchange=self.kv_exchange)


#: (the option, the value that keeps it off, why it is refused)
_REFUSED = (
    ("parallelism.context_parallel_degree", 1,
     "torchtitan's own CP wraps the attention itself; set blockdiag_cp.cp_degree instead"),
    ("parallelism.tensor_parallel_degree", 1, "tensor parallelism under blockdiag-cp is not verified in torchtitan"),
    ("parallelism.expert_parallel_degree", 1, "expert parallelism under blockdiag-cp is not verified"),
    ("parallelism.spmd_backend", "partial_dtensor",
     "the other SPMD backends wrap modules in local_map / full DTensors, not verified with this attention"),
    ("validator.enable", False, "torchtitan's validator runs the model outside a blockdiag-cp step"),
    ("compile.enable", False, "torch.compile of torchtitan's model around this attention is not verified"),
)


def check_options(config: "BlockDiagCPTrainer.Config") -> None:
    """Refuse, by name, the job options that would be silently different (or are unverified) under blockdiag-cp.

    Raises:
        ValueError: naming the option, its value, the value to use and why.
    """
    if config.blockdiag_cp.cp_degree < 1:
        raise ValueError(f"blockdiag_cp.cp_degree must be >= 1, got {config.blockdiag_cp.cp_degree}")
    for path, keep, why in _REFUSED:
        section, name = path.split(".")
        value = getattr(getattr(config, section), name)
        if value != keep:
            raise ValueError(f"{path}={value!r} is refused by BlockDiagCPTrainer ({why}); set {path}={keep!r}")
    check_rows_per_micro_batch(config)
    if config.checkpoint.enable and config.blockdiag_cp.cp_degree > 1:
        raise ValueError("checkpoint.enable=True is refused with blockdiag_cp.cp_degree > 1: the CP group's ranks "
                         "share a dataloader state, saving and resuming it is not verified yet; set "
                         "checkpoint.enable=False")


class CPGroupRows(BaseDataLoader):
    """The stack's own dataloader, read once per CP group: the ``cp_degree`` consecutive ranks get the same rows.

    torchtitan builds the dataloader with ``world`` data-parallel ranks; `rows` is built with
    ``dp_world_size // cp_degree`` ranks and ``dp_rank // cp_degree`` instead.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        rows: BaseDataLoader.Config
        """The stack's dataloader config (e.g. ``HuggingFaceTextDataLoader.Config``)."""
        cp_degree: int = 1

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, **kwargs) -> None:
        if dp_world_size % config.cp_degree:
            raise ValueError(f"blockdiag_cp.cp_degree={config.cp_degree} must divide the {dp_world_size} data ranks")
        self.rows = config.rows.build(dp_world_size=dp_world_size // config.cp_degree,
                                      dp_rank=dp_rank // config.cp_degree, **kwargs)

    def __iter__(self):
        return iter(self.rows)

    def state_dict(self) -> dict[str, Any]:
        return self.rows.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rows.load_state_dict(state_dict)


class BlockDiagCPTrainer(PipelinedRows, Trainer):
    """torchtitan's `Trainer` whose packed rows are sharded per document over ``blockdiag_cp.cp_degree`` ranks.

    See Note [The torchtitan way in]. Attributes: ``cp_mesh`` (the CP group's 1-D mesh, None at
    ``cp_degree == 1``), ``cp_step`` (the current step's ``train_ctx``, set by `post_dataloading_process`).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        blockdiag_cp: BlockDiagCPOptions = field(default_factory=BlockDiagCPOptions)

    def __init__(self, config: Config) -> None:
        check_options(config)  # here, after torchtitan's CLI overrides were applied to the config function's Config
        if config.model_spec is None:
            raise ValueError("BlockDiagCPTrainer needs config.model_spec (set by the config_registry function)")
        cp_degree = config.blockdiag_cp.cp_degree
        config.model_spec = dataclasses.replace(config.model_spec, model=route_attention(config.model_spec.model))
        config.dataloader = CPGroupRows.Config(rows=config.dataloader, cp_degree=cp_degree)
        _keep_timeouts_where_torch_cannot_set_them()
        self.cp_config = config.blockdiag_cp.cp_config()
        self.cp_step: Optional[Callable[[], ContextManager]] = None
        super().__init__(config)
        world = dist.get_world_size()
        if world % cp_degree:
            raise ValueError(f"blockdiag_cp.cp_degree={cp_degree} must divide the world size {world}")
        self.cp_degree = cp_degree
        self.cp_mesh = None if cp_degree == 1 else init_device_mesh(
            self.device.type, (world // cp_degree, cp_degree), mesh_dim_names=("dp_rows", "cp"))["cp"]
        if self.device.type == "cpu":
            _sum_gradients_over_gloo(self.model_parts)
        if config.training.global_batch_size > 0:  # torchtitan divided it by world data ranks; there are world/cp
            self.gradient_accumulation_steps = config.training.global_batch_size // (
                config.training.local_batch_size * (world // cp_degree))

    def post_dataloading_process(self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor):
        """Shard torchtitan's packed row ``[1, S]`` by the plan; ``(inputs [1, L], labels [1, L], {"positions"})``."""
        unknown = sorted(set(input_dict) - {"input", "positions"})
        if unknown:
            raise ValueError(f"BlockDiagCPTrainer shards input, positions and labels; the dataloader also gave "
                             f"{unknown}, which it would leave whole")
        positions = input_dict.get("positions")
        if positions is None:
            raise ValueError("the dataloader gives no 'positions': blockdiag-cp reads the packed row's documents "
                             "from positions restarting at 0 (torchtitan's text and chat dataloaders give them)")
        batch = {"input_ids": input_dict["input"], "labels": labels, "position_ids": positions,
                 "_packed_seq_ids": doc_ids_from_positions(positions)}
        self.cp_step, batch = make_cp_blockdiag_batch_and_ctx(self.cp_mesh, None, batch, config=self.cp_config)
        self.ntokens_seen += int((~batch["padding_mask"]).sum())  # this rank's real tokens: summed over ranks
        return batch["input_ids"], batch["labels"], {"positions": batch["position_ids"]}

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

    For a ``config_registry`` function: ``return blockdiag_config(llama3_debugmodel(), cp_degree=2)``.
    """
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    return BlockDiagCPTrainer.Config(**fields, blockdiag_cp=BlockDiagCPOptions(**options))
