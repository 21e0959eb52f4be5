"""`make_cp_world_batch_and_ctx`: one plan for the whole batch, every replica's documents over all dp x cp ranks.

Note [The whole-batch step]
---------------------------
With ``make_cp_blockdiag_batch_and_ctx`` each dp replica's CP group runs its own packed
row, and the step waits for the replica whose row has the most attention work. Here every
rank of the ``(dp, cp)`` mesh passes its replica's row (the cp ranks of a replica pass the
same one), and the step:

1. gathers every replica's run lengths (a header, then the runs: two small all-gathers
   over the mesh); ranks of one replica must agree on their row, every rank on the config,
   else every rank raises the same `ValueError` (Note [Ranks agree]);
2. builds the *global row*: the replicas' documents in dp order, padding left out (it
   carries no loss and no attention), and plans it over all ``dp x cp`` ranks (by default
   the grouped layout, Note [Grouped planner]; the plan is the same on every rank);
3. moves each sequence-aligned tensor's rows to the ranks that own them: the real tokens
   of a replica are split between its cp ranks in contiguous thirds (quarters, ...), each
   sends its part straight to the owners (batched point-to-point, one exchange per dtype;
   differentiable for a tensor that requires grad, e.g. ``inputs_embeds``); a rank given a
   padding position fills it locally;
4. returns this rank's shard (``[1, L_r]`` tensors, the global row's document ids as
   ``_packed_seq_ids``, ``padding_mask``) and the step's context, over the mesh's process
   group: per layer a rank exchanges K/V (and mixers their halos and states) with the
   ranks that share its documents only (``kv_exchange="auto"`` picks ``p2p``).

The loss is the token mean over the world, as with fixed rows: `token_mean_loss` over the
default group, gradients summed (or averaged with ``grads_averaged_over``) over dp x cp.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Mapping, Optional

import numpy as np
import torch
import torch.distributed as dist

from ..config import CPConfig
from ..errors import CPTypeError
from ..parallel.collectives import all_gather_flat, p2p_rows
from ..parallel.heads import SUBGROUPS
from ..parallel.routes import PeerRows
from ..plan import ShardPlan, make_plan
from ..plan.geometry import Runs
from ..plan.grouped import place_runs, row_runs
from ..plan.ranges import concat_ranges
from ..parallel.agree import gather_fingerprints
from .inputs import SEQUENCE_KEYS, UNSHARDED_ROW_KEYS, seq_dim_of
from .pipeline import mesh_device, run_step


@dataclass(frozen=True)
class WorldView:
    """This rank's place in the ``(dp, cp)`` mesh flattened to one group.

    Attributes:
        group: the process group of every rank of the mesh; rank: this rank in it; world: its size.
        dp, cp: replicas and ranks per replica; replica, cp_index: this rank's coordinates.
        rank_at: ``[dp][cp]`` the group rank at each coordinate.
    """

    group: Any
    rank: int
    world: int
    dp: int
    cp: int
    replica: int
    cp_index: int
    rank_at: tuple[tuple[int, ...], ...]

    @staticmethod
    def of(mesh) -> "WorldView":
        from torch.distributed.device_mesh import DeviceMesh

        if not isinstance(mesh, DeviceMesh):
            raise CPTypeError(f"mesh must be the (dp, cp) DeviceMesh, got {type(mesh).__name__}")
        grid = _dp_cp_grid(mesh)  # [dp, cp] global ranks
        ranks = tuple(sorted(grid.flatten().tolist()))
        group = dist.group.WORLD if len(ranks) == dist.get_world_size() else SUBGROUPS.get(ranks, dist.get_backend())
        rank_at = tuple(tuple(dist.get_group_rank(group, g) for g in row) for row in grid.tolist())
        me = dist.get_rank()
        replica, cp_index = [(d, c) for d, row in enumerate(grid.tolist()) for c, g in enumerate(row) if g == me][0]
        return WorldView(group, dist.get_group_rank(group, me), len(ranks), grid.shape[0], grid.shape[1], replica,
                         cp_index, rank_at)


#: the mesh dimension names the whole-batch step reads (Note [The whole-batch step]); an unnamed mesh is (dp, cp)
MESH_DIMS = ("dp", "cp")


def _dp_cp_grid(mesh) -> torch.Tensor:
    """``[dp, cp]`` global ranks of `mesh`, its dimensions read by name: ``("dp", "cp")`` in either order, one of
    them alone (``"cp"``: one replica; ``"dp"``: replicas of one rank), or unnamed ``(cp)`` / ``(dp, cp)``."""
    if mesh.ndim not in (1, 2):
        raise ValueError(f"mesh must be 1-D (cp) or 2-D (dp, cp), got {mesh.ndim}-D; slice the (dp, cp) dims of a "
                         "larger mesh (mesh['dp', 'cp']), or with tensor parallelism use make_cp_blockdiag_batch_and_ctx")
    ranks = mesh.mesh
    names = mesh.mesh_dim_names
    if names is None:
        return ranks.reshape(-1, ranks.shape[-1])
    if len(set(names)) != len(names) or not set(names) <= set(MESH_DIMS):
        raise ValueError(f"the whole-batch step reads the mesh's dimensions by name and knows {MESH_DIMS}; this mesh "
                         f"has {tuple(names)}: name its data-parallel dimension 'dp' and its context-parallel one "
                         "'cp' (or pass mesh['dp', 'cp'] of a larger mesh)")
    if names == ("dp",):
        return ranks.reshape(-1, 1)
    return ranks.t() if names == ("cp", "dp") else ranks.reshape(-1, ranks.shape[-1])


def make_cp_world_batch_and_ctx(
    mesh,
    batch: dict[str, Any],
    *,
    loss_mask: Optional[torch.Tensor] = None,
    padding_token_id: int = 0,
    config: Optional[CPConfig] = None,
    seq_dims: Optional[Mapping[str, int]] = None,
) -> tuple[Callable[[], ContextManager], dict[str, Any]]:
    """Plan every replica's row over all ranks of `mesh` and return this rank's shard (Note [The whole-batch step]).

    Args:
        mesh: the ``(dp, cp)`` DeviceMesh, its dimensions read by name (``("cp", "dp")`` works too; a 1-D mesh
            named ``"cp"`` or unnamed: one replica; a slice ``mesh["dp", "cp"]`` of a larger mesh works too).
        batch: this replica's packed row, as `make_cp_blockdiag_batch_and_ctx` takes it (``input_ids`` or
            ``inputs_embeds``, document ids or flattening metadata, ``shift_labels`` added beforehand);
            the cp ranks of a replica pass the same row. Mutated in place into this rank's shard.
        loss_mask, padding_token_id, seq_dims: as for `make_cp_blockdiag_batch_and_ctx`.
        config: `CPConfig`; default ``CPConfig(layout="grouped")`` (its ``plan``: ``ranks_per_node``,
            ``token_cap`` and ``costs`` shape the plan).

    Returns:
        ``(train_ctx, batch)``: ``batch`` holds this rank's ``L_r`` positions of the global row (ranks may
        hold different numbers), ``train_ctx()`` activates the step; run forward and backward inside it.
    """
    config = CPConfig(layout="grouped") if config is None else config
    if not isinstance(config, CPConfig):
        raise CPTypeError(f"config must be a CPConfig, got {type(config).__name__}")
    return run_step(GlobalRowSource(WorldView.of(mesh), mesh_device(mesh)), batch, config, loss_mask, padding_token_id,
                    seq_dims)


@dataclass(frozen=True)
class GlobalRowSource:
    """The row source of the whole-batch step (Note [One step pipeline] in pipeline.py): every replica's row,
    gathered as run lengths over the mesh."""

    view: "WorldView"
    device: torch.device

    @property
    def world(self) -> int:
        return self.view.world

    @property
    def rank(self) -> int:
        return self.view.rank

    @property
    def group(self) -> Any:
        return self.view.group

    def agree(self, doc_ids_1S: Optional[torch.Tensor], config: CPConfig, problem: Optional[Exception]) -> "WholeBatch":
        """Every replica's run lengths gathered; every rank raises alike when a rank rejected its batch, a
        replica's ranks hold different rows, or the configs differ (Note [The whole-batch step], 1)."""
        runs = gather_replica_runs(doc_ids_1S, self.view, config, self.device, problem)
        row = GlobalRow.of(runs, self.view)
        return WholeBatch(row, self.view, self.device, doc_ids_1S.device)


@dataclass(frozen=True)
class WholeBatch:
    """The agreed global row (Note [The whole-batch step], 2-3): planned from lengths, moved point-to-point.

    Attributes:
        row: every replica's documents; view: this rank's place; device: the step's; batch_device: where the
        batch's tensors live.
    """

    row: "GlobalRow"
    view: "WorldView"
    device: torch.device
    batch_device: torch.device

    @property
    def doc_ids(self) -> torch.Tensor:
        """``[S]`` the global row's ids on the step's device (built when read: Note [Localized geometry])."""
        return self.row.doc_ids.to(self.device)

    @property
    def runs(self) -> Runs:
        return self.row.runs

    def plan(self, config: CPConfig) -> ShardPlan:
        return plan_global_row(self.row, self.view.world, config)

    def move(self, batch: dict[str, Any], plan: ShardPlan, padding_token_id: int, seq_dims: Mapping[str, int],
             route: Optional["TokenRoute"] = None) -> None:
        """`route`: this rank's token route when built already (the prefetching step builds it ahead)."""
        _move_rows(batch, self.batch_device, self.row, plan, self.view, padding_token_id, seq_dims, route)

    def replica_of_row(self, plan: ShardPlan) -> torch.Tensor:
        return self.row.replica_of(plan.rank_positions(self.view.rank)).to(self.device)


@dataclass(frozen=True)
class GlobalRow:
    """Every replica's documents in dp order, padding left out (Note [The whole-batch step], 2).

    Attributes:
        lengths: ``[n]`` the documents' lengths (document ``i`` has id ``i + 1`` on the global row).
        first: ``[dp + 1]`` where each replica's tokens start on the global row.
        tables: per replica, its row's ``[runs, 2]`` (length, real) table.

    Per-position tables (`doc_ids`) are built on first use (Note [Localized geometry]).
    """

    lengths: np.ndarray
    first: np.ndarray
    tables: tuple[np.ndarray, ...]

    @staticmethod
    def of(runs: list[np.ndarray], view: WorldView) -> "GlobalRow":
        tables = tuple(runs[view.rank_at[d][0]] for d in range(view.dp))  # [runs, 2]: (length, real) of replica d
        lengths = [t[t[:, 1] == 1, 0] for t in tables]
        all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        first = np.concatenate([[0], np.cumsum([int(n.sum()) for n in lengths])]).astype(np.int64)
        return GlobalRow(all_lengths.astype(np.int64), first, tables)

    @functools.cached_property
    def doc_ids(self) -> torch.Tensor:
        """``[S]`` the documents' ids (1-based) on the global row."""
        return torch.repeat_interleave(torch.arange(1, self.lengths.size + 1), torch.from_numpy(self.lengths))

    @functools.cached_property
    def runs(self) -> Runs:
        """The global row's documents as `Runs` (no padding inside it)."""
        return Runs.of_lengths(self.lengths)

    def ids_at(self, positions: torch.Tensor) -> torch.Tensor:
        """``[n]`` the document ids of global positions ``[n]`` (each ``< seq_len``)."""
        return torch.searchsorted(torch.from_numpy(np.cumsum(self.lengths)), positions, right=True) + 1

    def real_of(self, replica: int) -> np.ndarray:
        """``[n_d]`` the positions of replica `replica`'s real tokens on its own row."""
        table = self.tables[replica]
        starts = np.concatenate([[0], np.cumsum(table[:, 0])[:-1]]).astype(np.int64)
        is_doc = table[:, 1] == 1
        return concat_ranges(torch.from_numpy(starts[is_doc]), torch.from_numpy(table[is_doc, 0])).numpy()

    @property
    def seq_len(self) -> int:
        return int(self.first[-1])


    def replica_of(self, positions: torch.Tensor) -> torch.Tensor:
        """``[n]`` int64: the replica each global position came from (-1 beyond the row: padding)."""
        replica = torch.searchsorted(torch.from_numpy(self.first), positions, right=True) - 1
        return torch.where(positions < self.seq_len, replica, -1)

    def sender(self, positions: np.ndarray, cp: int) -> tuple[np.ndarray, np.ndarray]:
        """``(replica, cp index)`` that sends each global position: a replica's real tokens split in `cp`
        contiguous parts, part c sent by its cp rank c."""
        replica = np.searchsorted(self.first, positions, side="right") - 1
        k = positions - self.first[replica]
        count = self.first[replica + 1] - self.first[replica]
        return replica, (k * cp) // np.maximum(count, 1)


def gather_replica_runs(doc_ids_1S: Optional[torch.Tensor], view: WorldView, config: CPConfig, device: torch.device,
                        problem: Optional[Exception]) -> list[np.ndarray]:
    """Every rank's replica row as runs ``[runs, 2]`` (length, real), gathered; every rank raises alike when a
    rank rejected its batch, a replica's ranks hold different rows, or the configs differ."""
    table = np.zeros((0, 2), dtype=np.int64)
    if doc_ids_1S is not None:
        _, lengths, real = row_runs(doc_ids_1S[0])
        table = np.stack([lengths, real.astype(np.int64)], 1)
    crc = lambda a: zlib.crc32(np.ascontiguousarray(a).tobytes())  # noqa: E731
    header = [table.shape[0], crc(table), zlib.crc32(repr(config).encode())]
    headers = gather_fingerprints(view.group, device, header, problem, "batch", ranks="rank(s) {} of the mesh")
    _check_agreement(headers, view)
    most = max(h[1] for h in headers)
    mine = torch.zeros(most, 2, dtype=torch.long, device=device)
    mine[: table.shape[0]] = torch.from_numpy(table).to(device)
    gathered = _all_gather(mine.reshape(-1), view).reshape(view.world, most, 2).cpu().numpy()
    return [gathered[r, : headers[r][1]] for r in range(view.world)]


def _check_agreement(headers: list[list[int]], view: WorldView) -> None:
    """`ValueError` on every rank if a replica's cp ranks hold different rows or ranks hold different configs."""
    if any(h[3] != headers[0][3] for h in headers):
        raise ValueError("ranks of the mesh disagree on the CPConfig; every rank must pass the same. "
                         f"[invalid, runs, row crc, config crc] per rank: {headers}")
    for d, ranks in enumerate(view.rank_at):
        rows = {tuple(headers[r][1:3]) for r in ranks}
        if len(rows) > 1:
            raise ValueError(f"the cp ranks {list(ranks)} of replica {d} hold different rows; the ranks of a replica "
                             f"must pass the same packed row. [invalid, runs, row crc, config crc] per rank: "
                             f"{[headers[r] for r in ranks]}")


def _all_gather(x: torch.Tensor, view: WorldView) -> torch.Tensor:
    out = x.new_empty(view.world * x.numel())
    all_gather_flat(out, x.contiguous(), view.group)
    return out.reshape(view.world, *x.shape)


def plan_global_row(row: GlobalRow, world: int, config: CPConfig) -> ShardPlan:
    """The global row's plan (the same on every rank): from lengths for the grouped layout."""
    options = config.plan
    if config.layout != "grouped":
        return make_plan(row.doc_ids, world, config.layout, options)
    starts = np.concatenate([[0], np.cumsum(row.lengths)[:-1]]).astype(np.int64)
    return place_runs(starts, row.lengths, np.ones(row.lengths.size, bool), world, options).shard_plan(row.seq_len)


def _move_rows(batch: dict[str, Any], device: torch.device, row: GlobalRow, plan: ShardPlan, view: WorldView,
               padding_token_id: int, seq_dims: Mapping[str, int], route: Optional["TokenRoute"] = None) -> None:
    """Replace every sequence-aligned tensor of `batch` by this rank's rows of the global row (Note [...], 3)."""
    route = TokenRoute.build(row, plan, view) if route is None else route
    for key in UNSHARDED_ROW_KEYS:
        batch.pop(key, None)
    batch.pop("attention_mask", None)
    rules = [(key, fill, None) for key, fill in SEQUENCE_KEYS.items() if key not in ("_packed_seq_ids", "padding_mask")]
    rules += [(key, 0, d) for key, d in seq_dims.items()]
    moving = [(key, batch[key], seq_dim_of(key, batch[key]) if d is None else d, fill) for key, fill, d in rules
              if isinstance(batch.get(key), torch.Tensor)]
    shards = route.move([(t, dim) for _, t, dim, _ in moving])
    for (key, _, dim, fill), shard in zip(moving, shards):
        batch[key] = route.fill_padding(shard, dim, padding_token_id if fill == "pad_token" else fill)
    positions = plan.rank_positions(view.rank)
    real = positions < row.seq_len
    ids = torch.zeros(positions.numel(), dtype=torch.long)
    ids[real] = row.ids_at(positions[real])
    ids = ids.to(device)
    batch["_packed_seq_ids"] = ids.unsqueeze(0)
    batch["padding_mask"] = (ids == 0).unsqueeze(0)


@dataclass(frozen=True)
class TokenRoute:
    """Which of this replica's rows this rank sends to each rank, and where what it receives goes."""

    send_rows: torch.Tensor  # [T] rows of the replica row, grouped by destination
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    recv_local: torch.Tensor  # [R] local row of each received row, in arrival order
    local_len: int
    padding_local: torch.Tensor  # local rows holding padding positions (beyond the global row)
    group: Any

    @staticmethod
    def build(row: GlobalRow, plan: ShardPlan, view: WorldView) -> "TokenRoute":
        # sends: my part of my replica's real tokens, grouped by the rank that owns each
        d, c = view.replica, view.cp_index
        mine = np.arange(row.first[d], row.first[d + 1])
        mine = mine[row.sender(mine, view.cp)[1] == c]
        owner = plan.segments.locate(torch.from_numpy(mine))[0].numpy()
        order = np.lexsort((mine, owner))
        mine, owner = mine[order], owner[order]
        send_rows = row.real_of(d)[mine - row.first[d]]
        send_splits = np.bincount(owner, minlength=view.world) if mine.size else np.zeros(view.world, int)
        # receives: my positions on the global row, grouped by the rank that sends each
        positions = plan.rank_positions(view.rank).numpy()
        local = np.arange(positions.size)
        real = positions < row.seq_len
        replica, cp_index = row.sender(positions[real], view.cp)
        src = np.array([view.rank_at[a][b] for a, b in zip(replica.tolist(), cp_index.tolist())], dtype=np.int64)
        arrival = np.lexsort((positions[real], src))
        recv_splits = np.bincount(src, minlength=view.world) if src.size else np.zeros(view.world, int)
        return TokenRoute(torch.from_numpy(send_rows), tuple(int(n) for n in send_splits),
                           tuple(int(n) for n in recv_splits), torch.from_numpy(local[real][arrival]), positions.size,
                           torch.from_numpy(local[~real]), view.group)

    def move(self, tensors: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
        """Each ``(tensor, sequence dim)`` of the replica row -> this rank's ``L_r`` rows (padding rows 0);
        tensors that require grad travel differentiably, the others packed per dtype (one exchange each)."""
        rows = [t.movedim(dim, 0) for t, dim in tensors]
        out: list[Optional[torch.Tensor]] = [None] * len(rows)
        plain: dict[torch.dtype, list[int]] = {}
        for i, r in enumerate(rows):
            if r.requires_grad:
                sent = r.index_select(0, self.send_rows.to(r.device))
                out[i] = self._place(PeerRows.apply(sent, self.send_splits, self.recv_splits, self.group), r)
            else:
                plain.setdefault(r.dtype, []).append(i)
        for dtype, members in plain.items():
            flat = [rows[i].reshape(rows[i].shape[0], -1) for i in members]
            sent = torch.cat(flat, 1).index_select(0, self.send_rows.to(flat[0].device))
            received = p2p_rows(sent, list(self.send_splits), list(self.recv_splits), self.group)
            for i, part in zip(members, received.split([f.shape[1] for f in flat], 1)):
                out[i] = self._place(part.reshape(-1, *rows[i].shape[1:]), rows[i])
        return [o.movedim(0, dim) for o, (_, dim) in zip(out, tensors)]

    def _place(self, received: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        shard = like.new_zeros((self.local_len, *like.shape[1:]))
        return shard.index_copy(0, self.recv_local.to(like.device), received)

    def fill_padding(self, shard: torch.Tensor, dim: int, value: Any) -> torch.Tensor:
        """`shard` with its padding positions (beyond the global row) on `dim` set to `value` (floats: 0,
        as `move` left them)."""
        if self.padding_local.numel() == 0 or shard.is_floating_point():
            return shard
        fill = value
        return shard.index_fill(dim, self.padding_local.to(shard.device), fill)
