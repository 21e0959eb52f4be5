"""The gated delta rule per document across CP ranks (mixers/recurrence.py) against a token-by-token recurrence.

The oracle runs each document alone, token by token, in float64
(`blockdiag_cp.testing.gated_delta_rule_oracle`); the library runs pieces chunked, passes each
straddling document's state across ranks in one all-gather and reruns continuing pieces.
Float64, forward and input gradients, both layouts, worlds 1 to 3, documents spanning
every rank, 1-token documents and padding-only ranks.
"""

import pytest
import torch

from blockdiag_cp import make_cp_blockdiag_batch_and_ctx
from blockdiag_cp.mixers.recurrence import chunked_gated_delta_rule
from blockdiag_cp.testing import doc_ids_from_lengths, gated_delta_rule_oracle

ROWS = {
    "mixed documents": (5, 1, 23, 2, 40, 9),
    "one document over every rank": (75,),
    "padding-only rank": (7, -50, 6),
}
HK, HV, DK, DV = 2, 4, 4, 3


def inputs(segments):
    g = torch.Generator().manual_seed(0)
    S = sum(abs(n) for n in segments)
    q, k = (torch.randn(S, HK, DK, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(S, HV, DV, generator=g, dtype=torch.float64)
    decay = -torch.rand(S, HV, generator=g, dtype=torch.float64)  # log decays <= 0
    beta = torch.rand(S, HV, generator=g, dtype=torch.float64)
    return q, k, v, decay, beta


def oracle(segments, q, k, v, decay, beta):
    """Each document alone, token by token; padding rows 0."""
    out, start = torch.zeros_like(v), 0
    for n in segments:
        if n > 0:
            part = slice(start, start + n)
            o, _ = gated_delta_rule_oracle(q[part][None], k[part][None], v[part][None], decay[part][None],
                                           beta[part][None])
            out[part] = o[0]
        start += abs(n)
    return out


def recurrence_worker(rank, world, segments, layout):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp import CPConfig

    full = [t.clone().requires_grad_(True) for t in inputs(segments)]
    S = full[0].shape[0]
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"] if world > 1 else None
    flat = torch.cat([t.reshape(S, -1) for t in full], dim=1)
    batch = {"inputs_embeds": flat.unsqueeze(0), "_packed_seq_ids": doc_ids_from_lengths(segments).unsqueeze(0)}
    ctx, batch = make_cp_blockdiag_batch_and_ctx(mesh, None, batch, config=CPConfig(layout=layout))
    local = batch["inputs_embeds"][0]
    sizes = [HK * DK, HK * DK, HV * DV, HV, HV]
    q, k, v, decay, beta = torch.split(local, sizes, dim=1)
    q, k, v = q.reshape(-1, HK, DK), k.reshape(-1, HK, DK), v.reshape(-1, HV, DV)
    with ctx() as state:
        out = state.piece_schedule.gated_delta_rule(q, k, v, decay, beta)
        (out * out.detach().sign()).sum().backward()
    grads = [torch.zeros_like(t) if t.grad is None else t.grad for t in full]
    if world > 1:
        for grad in grads:
            dist.all_reduce(grad)
    return state.positions.tolist(), out.detach(), grads


@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_document_recurs_alone_across_ranks(world, layout, rank_pools):
    for name, segments in ROWS.items():
        full = [t.clone().requires_grad_(True) for t in inputs(segments)]
        want = oracle(segments, *full)
        (want * want.detach().sign()).sum().backward()
        results = [recurrence_worker(0, 1, segments, layout)] if world == 1 else \
            rank_pools(world).run(recurrence_worker, segments, layout)
        S = full[0].shape[0]
        for positions, out, _ in results:
            real = [i for i, p in enumerate(positions) if p < S]
            torch.testing.assert_close(out[real], want.detach()[[positions[i] for i in real]], rtol=0, atol=1e-10,
                                       msg=f"{name}: outputs")
        for got, expected in zip(results[0][2], (t.grad for t in full)):
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-9, msg=f"{name}: gradients")


@pytest.mark.parametrize("length, chunk", [(70, 64), (5, 4), (33, 8), (1, 64)])
def test_the_chunked_rule_is_the_token_loop_from_any_state(length, chunk):
    g = torch.Generator().manual_seed(length)
    q, k = (torch.randn(2, length, 2, 4, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, length, 4, 3, generator=g, dtype=torch.float64)
    decay, beta = -torch.rand(2, length, 4, generator=g, dtype=torch.float64), torch.rand(2, length, 4, generator=g, dtype=torch.float64)
    start = torch.randn(2, 4, 4, 3, generator=g, dtype=torch.float64)
    got = chunked_gated_delta_rule(q, k, v, decay, beta, initial_state=start, chunk=chunk)
    want = gated_delta_rule_oracle(q, k, v, decay, beta, initial_state=start)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)
