"""torchtitan's packed rows under block-diagonal CP: which ranks read which rows, and each step's shard.

Note [CP groups inside torchtitan's data ranks]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torchtitan's own CP is not used (it wraps the attention itself); torchtitan sees the ``cp_degree`` ranks of a CP
group as data ranks, so its FSDP shards parameters over dp x cp and reduces gradients over them, as its own CP does.
Its meshes put data ranks outside TP ranks (``world = dp x tp``, TP innermost), so a CP group is ``cp_degree``
consecutive data ranks at one TP rank::

    world = rows x cp x tp     rows: the CP groups (data replicas), cp: a group's ranks, tp: torchtitan's TP

* rows: `CPGroupRows` builds the stack's dataloader with ``dp_world_size // cp`` ranks and ``dp_rank // cp``, so a
  CP group's ranks read one replica's rows (and a checkpoint keeps one dataloader state per group: its ranks save
  the same state under one key, as torchtitan's TP ranks do).
* counts: a CP group's ranks count its rows' tokens ``cp`` times in torchtitan's sums over data ranks; the trainer
  divides its count by ``cp``, the validator sums its count over one rank per group (`CPGroups.rows_mesh`).
* the shard: `CPGroups.shard` lays the micro-batch's rows end to end as one packed row (Note [Several rows per
  micro-batch]), pads it so every shard splits evenly where torchtitan splits it (`local_multiple_of`: sequence
  parallelism, the chunked loss) and shards it by this library's plan; every TP rank of a CP rank gets the same
  shard.

Note [Several rows per micro-batch]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With ``training.local_batch_size = B``, torchtitan's micro-batch is ``[B, S]``. No document crosses a row, and a
row's leading tokens (a document carried over from the previous row) are a document of their own. Laid end to
end with document ids kept distinct across rows, the B rows are one packed row of ``B x S`` tokens whose every
token attends to exactly the keys it attends to in its own row, at the same RoPE positions (``positions`` restart
per document). torchtitan's loss is a token sum over the global valid-token count, so the step computes the same
loss and gradients as the ``[B, S]`` batch; only the order of the float sums differs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import IGNORE_INDEX, ChunkedLossWrapper
from torchtitan.components.validate import Validator

from ..config import CPConfig
from ..step.batch import make_cp_blockdiag_batch_and_ctx

__all__ = (
    "BlockDiagCPValidator",
    "CPGroupRows",
    "CPGroups",
    "ShardedRow",
    "doc_ids_from_positions",
    "local_multiple_of",
    "one_packed_row",
    "row_padding",
    "rows_per_micro_batch",
)


def doc_ids_from_positions(positions_BS: torch.Tensor) -> torch.Tensor:
    """1-based document ids ``[B, S]`` int64 of torchtitan's packed rows: a document starts where ``positions == 0``.

    This is the boundary torchtitan's own block-causal masks read (``get_document_mask_mod``). A row's leading
    tokens before the first 0 (a document carried over from the previous row) are its first document.
    """
    starts_BS = positions_BS == 0
    starts_BS[:, 0] = True
    return torch.cumsum(starts_BS.to(torch.int64), dim=1)


def one_packed_row(input_dict: dict[str, torch.Tensor], labels_BS: torch.Tensor, multiple: int = 1) -> dict[str, Any]:
    """torchtitan's micro-batch ``[B, S]`` as one packed row ``[1, B x S]`` (Note [Several rows per micro-batch]),
    padded at the end to a multiple of `multiple` (document id 0, label ``IGNORE_INDEX``, position 0).

    Returns the batch `make_cp_blockdiag_batch_and_ctx` takes: ``input_ids``, ``labels``, ``position_ids`` and
    ``_packed_seq_ids``, each ``[1, S']``.

    Raises:
        ValueError: the dataloader gave keys other than ``input`` and ``positions``, or no ``positions``.
    """
    unknown = sorted(set(input_dict) - {"input", "positions"})
    if unknown:
        raise ValueError(f"BlockDiagCPTrainer shards input, positions and labels; the dataloader also gave "
                         f"{unknown}, which it would leave whole")
    positions_BS = input_dict.get("positions")
    if positions_BS is None:
        raise ValueError("the dataloader gives no 'positions': blockdiag-cp reads the packed row's documents "
                         "from positions restarting at 0 (torchtitan's text and chat dataloaders give them)")
    doc_ids_BS = doc_ids_from_positions(positions_BS)
    docs_B = doc_ids_BS[:, -1]
    doc_ids_BS = doc_ids_BS + (torch.cumsum(docs_B, 0) - docs_B)[:, None]  # distinct across rows
    pad = -positions_BS.numel() % multiple
    fills = {"input_ids": (input_dict["input"], 0), "labels": (labels_BS, IGNORE_INDEX),
             "position_ids": (positions_BS, 0), "_packed_seq_ids": (doc_ids_BS, 0)}
    return {key: torch.nn.functional.pad(t.reshape(1, -1), (0, pad), value=fill) for key, (t, fill) in fills.items()}


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


@dataclass(frozen=True)
class ShardedRow:
    """This rank's shard of one micro-batch: ``inputs``/``labels`` ``[1, L]``, ``extra`` the model's keyword
    arguments (``positions [1, L]``), ``real_tokens`` this rank's non-padding tokens, ``train_ctx`` the step."""

    train_ctx: Callable[[], ContextManager]
    inputs: torch.Tensor
    labels: torch.Tensor
    extra: dict[str, torch.Tensor]
    real_tokens: int


@dataclass(frozen=True)
class CPGroups:
    """The CP groups inside torchtitan's data ranks (Note [CP groups inside torchtitan's data ranks]).

    ``cp_mesh``: this rank's CP group (None at ``cp_degree == 1``); ``rows_mesh``: one rank per CP group, the ranks
    of this rank's CP and TP index (None at ``cp_degree == 1``); ``tp_mesh``: torchtitan's TP mesh (None without TP);
    ``local_multiple``: what a shard's length must divide into (`local_multiple_of`).
    """

    cp_degree: int
    config: CPConfig
    cp_mesh: Optional[DeviceMesh]
    rows_mesh: Optional[DeviceMesh]
    tp_mesh: Optional[DeviceMesh]
    local_multiple: int = 1

    @classmethod
    def build(cls, cp_degree: int, config: CPConfig, tp_mesh: Optional[DeviceMesh], device_type: str,
              local_multiple: int = 1) -> "CPGroups":
        """Every rank calls this (it creates the groups). Raises `ValueError` if ``cp x tp`` does not divide the world."""
        world, tp = dist.get_world_size(), 1 if tp_mesh is None else tp_mesh.size()
        if world % (cp_degree * tp):
            raise ValueError(f"blockdiag_cp.cp_degree={cp_degree} x tensor_parallel_degree={tp} must divide the world "
                             f"size {world}")
        if cp_degree == 1:
            return cls(cp_degree, config, None, None, tp_mesh, local_multiple)
        mesh = init_device_mesh(device_type, (world // (cp_degree * tp), cp_degree, tp),
                                mesh_dim_names=("rows", "cp", "tp"))
        return cls(cp_degree, config, mesh["cp"], mesh["rows"], tp_mesh, local_multiple)

    def shard(self, input_dict: dict[str, torch.Tensor], labels_BS: torch.Tensor) -> ShardedRow:
        """This rank's shard of torchtitan's micro-batch ``[B, S]`` (laid out as one packed row)."""
        batch = one_packed_row(input_dict, labels_BS, multiple=self.cp_degree * self.local_multiple)
        train_ctx, batch = make_cp_blockdiag_batch_and_ctx(self.cp_mesh, self.tp_mesh, batch, config=self.config)
        real = int((~batch["padding_mask"]).sum())
        return ShardedRow(train_ctx, batch["input_ids"], batch["labels"], {"positions": batch["position_ids"]}, real)


class _RowsCountedOnce:
    """torchtitan's `ParallelDims` for the validator, whose ``"batch"`` mesh is one rank per CP group: the
    validator sums its valid-token count over it, so a CP group's rows count once (Note [CP groups inside
    torchtitan's data ranks]). Everything else is the trainer's."""

    def __init__(self, parallel_dims: Any, rows_mesh: DeviceMesh) -> None:
        self._dims, self._rows_mesh = parallel_dims, rows_mesh

    def get_mesh(self, dims: Any) -> DeviceMesh:
        return self._rows_mesh if dims == "batch" else self._dims.get_mesh(dims)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dims, name)


class BlockDiagCPValidator(Validator):
    """torchtitan's `Validator` whose forward runs inside a blockdiag-cp step, on a CP group's shard of its rows.

    `BlockDiagCPTrainer` builds it in place of ``Validator`` and hands it its `CPGroups` (`use_cp_groups`) before
    training: the CP group's ranks read one replica's validation rows, each forward runs on this rank's shard
    inside the step, and the eval loss is the token mean over the global validation batch, as without CP.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Validator.Config):
        pass

    cp_groups: Optional[CPGroups] = None
    _step: Optional[Callable[[], ContextManager]] = None

    def use_cp_groups(self, groups: CPGroups) -> None:
        """Read rows per CP group and run each forward in its step (call once, on every rank, before validating)."""
        if self.cp_groups is not None:
            raise RuntimeError("BlockDiagCPValidator.use_cp_groups was called twice")
        self.cp_groups = groups
        self.dp_world_size, self.dp_rank = self.dp_world_size // groups.cp_degree, self.dp_rank // groups.cp_degree
        if groups.rows_mesh is not None:
            self.parallel_dims = _RowsCountedOnce(self.parallel_dims, groups.rows_mesh)
        outer = self.validation_context
        self.validation_context = lambda: self._in_step(outer)

    def post_dataloading_process(self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor,
                                 model_parts: list[torch.nn.Module]):
        if self.cp_groups is None:
            raise RuntimeError("BlockDiagCPValidator has no CP groups: BlockDiagCPTrainer hands them over "
                               "(use_cp_groups) before training")
        sharded = self.cp_groups.shard(input_dict, labels)
        self._step = sharded.train_ctx
        return sharded.inputs, sharded.labels, sharded.extra

    @contextlib.contextmanager
    def _in_step(self, outer: Callable[[], ContextManager]) -> Iterator[None]:
        step, self._step = self._step, None
        if step is None:
            raise RuntimeError("no blockdiag-cp step: the validator's post_dataloading_process did not run")
        with outer(), step():
            yield


def local_multiple_of(tp_degree: int, loss_fn: Any) -> int:
    """What every shard's length must be a multiple of, so torchtitan's modules split it evenly: the TP degree
    (sequence parallelism splits the shard over the TP ranks) and `ChunkedLossWrapper`'s ``num_chunks`` (it splits
    the shard's sequence into that many chunks; `loss_fn` the loss or its config). The row is padded to ``cp x``
    this (padding has no loss)."""
    chunked = isinstance(loss_fn, (ChunkedLossWrapper, ChunkedLossWrapper.Config))
    return math.lcm(tp_degree, loss_fn.num_chunks if chunked else 1)


def rows_per_micro_batch(config: Any) -> int:
    """The rows of one training micro-batch: ``training.local_batch_size``, or with a pipeline
    ``parallelism.pipeline_parallel_microbatch_size`` (torchtitan's dataloader then reads that many at a time)."""
    if config.parallelism.pipeline_parallel_degree > 1:
        return config.parallelism.pipeline_parallel_microbatch_size
    return config.training.local_batch_size


def row_padding(config: Any, cp_degree: int) -> int:
    """The padding tokens `CPGroups.shard` adds to every training micro-batch's packed row (`one_packed_row`), from
    the job config alone: its rows (`rows_per_micro_batch`) x ``seq_len`` up to a multiple of ``cp x
    local_multiple_of``."""
    multiple = cp_degree * local_multiple_of(config.parallelism.tensor_parallel_degree, config.loss)
    return -(rows_per_micro_batch(config) * config.training.seq_len) % multiple


def as_config(config_type: type, base: Any, **extra: Any) -> Any:
    """`base` (a torchtitan config dataclass) as an instance of its subclass `config_type`, fields copied."""
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    return config_type(**fields, **extra)
