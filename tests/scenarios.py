"""Packed rows shared by the multi-process tests: (name, segments). n > 0: a document of
n tokens; -n: n padding tokens."""

import torch

from blockdiag_cp.testing import ParityCase

SCENARIOS = {
    "straddle": (5, 9, -2, 13, 1, 2, 3, -3, 7),
    "one_doc_all_ranks": (37,),
    "tiny_docs": (1, 2, 3, 1, 1, 2, 3, 2, 1, 3, 2, 1, 1, 2, 3, 1, 2, 2, 1, 3),
    "interior_tail_padding": (4, -3, 6, -2, 5, -4, 3, -1),
    "padding_ranks": (6, -31),
    "leading_padding": (-19, 4, 8),
    "mixed": (2, 17, 1, 1, 9, 3),
}

EXCHANGES = ("allgather", "halo", "a2a", "ring", "auto")
KERNELS = ("dense", "sdpa")
LAYOUTS = ("contiguous", "balanced")


#: at world 5 (5 ranks on a small machine) the scenarios that exercise most: straddling, one document, padding ranks
WORLD5_SCENARIOS = ("straddle", "one_doc_all_ranks", "padding_ranks")


def matrix_cases(world=None):
    """Every scenario x exchange x kernel x layout, GQA on some, checkpointing on some."""
    cases = []
    gqa = [(4, 4), (8, 2), (4, 1)]
    for i, (name, segments) in enumerate(SCENARIOS.items()):
        if world == 5 and name not in WORLD5_SCENARIOS:
            continue
        heads, kv_heads = gqa[i % len(gqa)]
        for exchange in EXCHANGES:
            for kernel in KERNELS:
                for layout in LAYOUTS:
                    cases.append(ParityCase(segments, heads=heads, kv_heads=kv_heads, head_dim=8,
                                            kv_exchange=exchange, kernel=kernel, layout=layout, seed=i))
    for exchange in EXCHANGES:
        for mode in ("reentrant", "non_reentrant"):
            cases.append(ParityCase(SCENARIOS["straddle"], heads=8, kv_heads=2, kv_exchange=exchange,
                                    kernel="sdpa", checkpoint=mode, seed=99))
    return cases


def minimum_rows(geometry, rank, window=None):
    """The needed-only minimum of K/V rows `rank` sends per layer (under `window`). Forward: rows
    it owns that others need; backward: the gradients of rows it received."""
    owner = geometry.owner
    mine = owner == rank
    need = geometry.need_at(torch.arange(owner.numel()), window)  # checked against a brute force in test_geometry
    others_need = sum(int((need[j] & mine).sum()) for j in range(geometry.world) if j != rank)
    i_received = int((need[rank] & ~mine).sum())
    return others_need + i_received


def pieces_by_rank(plan, doc_ids):
    """Per rank: (document, first offset, length) of each run of consecutive positions of one document."""
    starts = torch.nonzero(torch.cat([torch.ones(1, dtype=torch.bool), doc_ids[1:] != doc_ids[:-1]])).flatten()
    doc_start = starts[torch.searchsorted(starts, torch.arange(doc_ids.numel()), right=True) - 1]
    out = []
    for r in range(plan.world):
        pos = plan.rank_positions(r)
        pos = pos[pos < doc_ids.numel()]
        ids = doc_ids[pos]
        new = torch.ones(pos.numel(), dtype=torch.bool)
        new[1:] = (ids[1:] != ids[:-1]) | (pos[1:] != pos[:-1] + 1)
        first = torch.nonzero(new).flatten()
        lengths = torch.diff(first, append=torch.tensor([pos.numel()]))
        out.append([(int(ids[f]), int(pos[f] - doc_start[pos[f]]), int(n)) for f, n in zip(first, lengths)
                    if int(ids[f]) != 0])
    return out
