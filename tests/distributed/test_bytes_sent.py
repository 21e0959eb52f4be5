"""Bytes each rank really sends (wchar of /proc/self/io) versus the needed-only minimum."""

import pytest
import torch

from blockdiag_cp.testing import doc_ids_from_lengths
from blockdiag_cp.tools.bench import bytes_written
from scenarios import minimum_rows

HK, D = 4, 64
ROW_BYTES = 2 * HK * D * 4  # K and V of one token, float32
FRAMING = 8192  # gloo message headers: a few hundred bytes per message

LAYOUTS = {
    "short_docs": (200, 150, 300, 90, 400, 250, 310, 120, 180, 260, 330, 140, 210, 380, 290, 150, 199),
    "one_doc": (3750,),
    "mixed": (1200, 40, 70, 900, 10, 600, 880, 50),
}


def meter_worker(rank, world, segments, exchanges, layout, window=None):
    """Bytes this rank writes during one attention forward+backward, per requested exchange."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp import CPConfig, cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    ids = doc_ids_from_lengths(segments).unsqueeze(0)
    results = {}
    for exchange in exchanges:
        x = torch.randn(1, ids.shape[1], 3 * HK * D, generator=torch.Generator().manual_seed(0), requires_grad=True)
        config = CPConfig(kv_exchange=exchange, layout=layout)
        batch = {"inputs_embeds": x, "_packed_seq_ids": ids}
        train_ctx, batch = make_cp_blockdiag_batch_and_ctx(mesh["cp"], None, batch, config=config)
        q, k, v = (t.reshape(1, t.shape[1], HK, D).transpose(1, 2) for t in batch["inputs_embeds"].split(HK * D, -1))
        dist.barrier()
        with train_ctx() as state:
            before = bytes_written()
            out = cp_blockdiag_sdpa(q, k, v, sliding_window=window)
            out.sum().backward()
            sent = bytes_written() - before
        dist.barrier()
        routed = state.exchange_for(window)
        t = routed.traffic
        results[exchange] = {"sent": sent, "min_rows": minimum_rows(state.geometry, rank, window),
                             "full_causal_rows": minimum_rows(state.geometry, rank),
                             "exchange": routed.name, "planned_rows": t.sent_fwd + t.sent_bwd}
    return results


@pytest.mark.parametrize("world, name", [(world, name) if (world, name) != (4, "mixed") else
                                         pytest.param(world, name, marks=pytest.mark.slow)
                                         for world in (2, 4) for name in sorted(LAYOUTS)])
def test_needed_only_exchanges_send_within_10_percent_of_minimum(world, name, rank_pools):
    exchanges = ("auto", "a2a", "halo", "p2p")
    for rank, per_exchange in enumerate(rank_pools(world).run(meter_worker, LAYOUTS[name], exchanges, "contiguous")):
        for exchange, r in per_exchange.items():
            minimum = r["min_rows"] * ROW_BYTES
            assert r["planned_rows"] == r["min_rows"], (rank, exchange, r)
            assert minimum <= r["sent"] <= 1.10 * minimum + FRAMING, (rank, exchange, r)


def test_ring_and_allgather_send_what_they_plan(rank_pools):
    """The allgather plan counts a ring all-gather plus a ring reduce-scatter ((W-1) L rows
    each); gloo implements reduce-scatter as an all-reduce, which sends twice that."""
    results = rank_pools(4).run(meter_worker, LAYOUTS["mixed"], ("ring", "allgather"), "balanced")
    for rank, per_exchange in enumerate(results):
        ring, gather = per_exchange["ring"], per_exchange["allgather"]
        planned = ring["planned_rows"] * ROW_BYTES
        assert planned <= ring["sent"] <= 1.10 * planned + FRAMING, (rank, ring)
        gloo = gather["planned_rows"] * ROW_BYTES * 3 // 2
        assert gather["min_rows"] < gather["planned_rows"]
        assert gloo <= gather["sent"] <= 1.10 * gloo + FRAMING, (rank, gather)


@pytest.mark.parametrize("world,layout", [(2, "contiguous"), (4, "contiguous"), (2, "balanced")])
def test_windowed_exchanges_move_only_the_window(world, layout, rank_pools):
    """A window of 64 over long documents: each boundary moves at most 63 rows (plus their gradients)."""
    segments, window = LAYOUTS["one_doc"], 64
    results = rank_pools(world).run(meter_worker, segments, ("auto", "a2a", "halo"), layout, window)
    for rank, per_exchange in enumerate(results):
        for exchange, r in per_exchange.items():
            minimum = r["min_rows"] * ROW_BYTES
            assert r["planned_rows"] == r["min_rows"], (rank, exchange, r)
            assert minimum <= r["sent"] <= 1.10 * minimum + FRAMING, (rank, exchange, r)
            if layout == "contiguous":
                assert r["min_rows"] <= 2 * 2 * (window - 1), (rank, exchange, r)  # both boundaries, fwd + bwd
                assert r["min_rows"] * 10 < r["full_causal_rows"], (rank, exchange, r)


MLA_HEADS, MLA_KV_HEADS, MLA_DK, MLA_DV = 4, 2, 64, 32  # values narrower than queries and keys (MLA)
MLA_RUNS = (("a2a", "contiguous", 1), ("ring", "balanced", 1), ("auto", "balanced", 2))


def mla_meter_worker(rank, world, segments, runs):
    """Bytes this rank writes in one forward+backward of an MLA layer (K at Dk, V at Dv), per (exchange, layout,
    ulysses degree), beside `StepState.bytes_per_layer`'s prediction and the K/V rows the routing moves."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp import CPConfig, HeadsConfig, cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    ids = doc_ids_from_lengths(segments).unsqueeze(0)
    H, Hk, Dk, Dv = MLA_HEADS, MLA_KV_HEADS, MLA_DK, MLA_DV
    results = {}
    for exchange, layout, degree in runs:
        x = torch.randn(1, ids.shape[1], (H + Hk) * Dk + Hk * Dv, generator=torch.Generator().manual_seed(0),
                        requires_grad=True)
        config = CPConfig(kv_exchange=exchange, layout=layout, heads=HeadsConfig(ulysses_degree=degree))
        train_ctx, batch = make_cp_blockdiag_batch_and_ctx(mesh["cp"], None, {"inputs_embeds": x, "_packed_seq_ids": ids},
                                                           config=config)
        q, k, v = (t.reshape(1, t.shape[1], -1, d).transpose(1, 2) for t, d in
                   zip(batch["inputs_embeds"].split([H * Dk, Hk * Dk, Hk * Dv], -1), (Dk, Dk, Dv)))
        with train_ctx() as state:
            cp_blockdiag_sdpa(q, k, v, enable_gqa=True)  # the first call of a shape: the ranks agree on it
            dist.barrier()
            before = bytes_written()
            out = cp_blockdiag_sdpa(q, k, v, enable_gqa=True)
            out.sum().backward()
            sent = bytes_written() - before
        dist.barrier()
        t = state.traffic
        results[exchange, layout, degree] = {"sent": sent, "out_dim": out.shape[-1], "kv_rows": t.sent_fwd + t.sent_bwd,
                                             "predicted": state.bytes_per_layer(H, Hk, Dk, torch.float32, v_head_dim=Dv)}
    return results


def test_mla_layers_send_what_the_byte_formulas_count(rank_pools):
    """Keys at Dk, values (and Ulysses' outputs) at Dv: the formulas `StepState.bytes_per_layer` and the cost model
    use, against gloo's bytes; counting values at the key width (2 Hk Dk a row) would over-predict by a third."""
    H, Hk, Dk, Dv = MLA_HEADS, MLA_KV_HEADS, MLA_DK, MLA_DV
    for per_run in rank_pools(2).run(mla_meter_worker, LAYOUTS["mixed"], MLA_RUNS):
        for (exchange, layout, degree), r in per_run.items():
            predicted = r["predicted"]
            assert r["out_dim"] == Dv
            if degree == 1:
                assert predicted.ulysses.sent == 0 and predicted.kv.sent == r["kv_rows"] * Hk * (Dk + Dv) * 4
            else:  # pure Ulysses at world 2: q and k at Dk, v and the output at Dv, forward and backward
                local_len = sum(abs(n) for n in LAYOUTS["mixed"]) // 2
                assert predicted.ulysses.sent == 2 * local_len * (Dk + Dv) * (H + Hk) // 2 * 4 and predicted.kv.sent == 0
            assert predicted.sent <= r["sent"] <= 1.10 * predicted.sent + FRAMING, (exchange, layout, degree, r)
