"""Linear recurrences per document across CP ranks (mixers/recurrence.py) against token-by-token loops:
the gated delta rule and Mamba2's state-space scan.

The oracle runs each document alone, token by token, in float64
(`blockdiag_cp.testing.gated_delta_rule_oracle`, `ssd_oracle`); the library runs pieces chunked,
passes each straddling document's state across ranks in one all-gather and reruns (delta rule)
or corrects (scan) continuing pieces. Float64, forward and input gradients, both layouts, worlds
1 to 3, documents spanning every rank, 1-token documents and padding-only ranks; the chunked
kernels against the loops from random states with random chunk sizes.
"""

import pytest
import torch

from blockdiag_cp import make_cp_blockdiag_batch_and_ctx
from blockdiag_cp.mixers.chunked import chunked_gated_delta_rule, chunked_ssd
from blockdiag_cp.mixers.recurrence import piece_schedule
from blockdiag_cp.testing import doc_ids_from_lengths, gated_delta_rule_oracle, ssd_oracle

ROWS = {
    "mixed documents": (5, 1, 23, 2, 40, 9),
    "one document over every rank": (75,),
    "padding-only rank": (-45, 7, -5, 6),  # rank 0 of 2 and ranks 0-1 of 3 (contiguous): padding alone
}
HK, HV, DK, DV = 2, 4, 4, 3  # delta rule: key heads, value heads, key and value sizes
G, H, P, N = 2, 4, 3, 5  # scan: groups, heads, head size, state size
A_SSD = -torch.tensor([0.5, 1.0, 2.0, 0.25], dtype=torch.float64)


class DeltaRule:
    """The gated delta rule: inputs q, k, v, g, beta."""

    sizes = (HK * DK, HK * DK, HV * DV, HV, HV)
    shapes = ((HK, DK), (HK, DK), (HV, DV), (HV,), (HV,))

    decay_input = 3  # g

    @staticmethod
    def inputs(S, g, strength=1.0):
        q, k = (torch.randn(S, HK, DK, generator=g, dtype=torch.float64) for _ in range(2))
        v = torch.randn(S, HV, DV, generator=g, dtype=torch.float64)
        decay = -strength * torch.rand(S, HV, generator=g, dtype=torch.float64)  # log decays <= 0
        beta = torch.rand(S, HV, generator=g, dtype=torch.float64)
        return q, k, v, decay, beta

    @staticmethod
    def oracle(rows):
        return gated_delta_rule_oracle(*(t[None] for t in rows))[0][0]

    @staticmethod
    def across_ranks(state, rows):
        return piece_schedule(state).gated_delta_rule(*rows)


class Scan:
    """Mamba2's scan: inputs x, dt, B, C (A fixed)."""

    sizes = (H * P, H, G * N, G * N)
    shapes = ((H, P), (H,), (G, N), (G, N))

    decay_input = 1  # dt (the log-decay is dt A)

    @staticmethod
    def inputs(S, g, strength=1.0):
        x = torch.randn(S, H, P, generator=g, dtype=torch.float64)
        dt = strength * (torch.rand(S, H, generator=g, dtype=torch.float64) + 0.05)
        B, C = (torch.randn(S, G, N, generator=g, dtype=torch.float64) for _ in range(2))
        return x, dt, B, C

    @staticmethod
    def oracle(rows):
        x, dt, B, C = (t[None] for t in rows)
        return ssd_oracle(x, dt, A_SSD.to(x.dtype), B, C)[0][0]

    @staticmethod
    def across_ranks(state, rows):
        x, dt, B, C = rows
        return piece_schedule(state).ssd(x, dt, A_SSD.to(x.dtype), B, C)


RULES = {"delta rule": DeltaRule, "scan": Scan}


def inputs(rule, segments, strength=1.0):
    return rule.inputs(sum(abs(n) for n in segments), torch.Generator().manual_seed(0), strength)


def oracle(rule, segments, tensors):
    """Each document alone, token by token; padding rows 0."""
    out, start = None, 0
    for n in segments:
        if n > 0:
            part = slice(start, start + n)
            o = rule.oracle([t[part] for t in tensors])
            out = torch.zeros((sum(abs(m) for m in segments), *o.shape[1:]), dtype=o.dtype) if out is None else out
            out[part] = o
        start += abs(n)
    return out


def recurrence_worker(rank, world, rule_name, segments, layout, dtype=torch.float64, strength=1.0):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp import CPConfig

    rule = RULES[rule_name]
    full = [t.to(dtype).requires_grad_(True) for t in inputs(rule, segments, strength)]
    S = full[0].shape[0]
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"] if world > 1 else None
    flat = torch.cat([t.reshape(S, -1) for t in full], dim=1)
    batch = {"inputs_embeds": flat.unsqueeze(0), "_packed_seq_ids": doc_ids_from_lengths(segments).unsqueeze(0)}
    ctx, batch = make_cp_blockdiag_batch_and_ctx(mesh, None, batch, config=CPConfig(layout=layout))
    local = batch["inputs_embeds"][0]
    rows = [t.reshape(-1, *shape) for t, shape in zip(torch.split(local, rule.sizes, dim=1), rule.shapes)]
    state = ctx.state  # the kernel takes the planned step itself (no model runs: no step entered)
    out = rule.across_ranks(state, rows)
    (out * out.detach().sign()).sum().backward()
    grads = [torch.zeros_like(t) if t.grad is None else t.grad for t in full]
    if world > 1:
        for grad in grads:
            dist.all_reduce(grad)
    return state.positions.tolist(), out.detach(), grads


@pytest.mark.parametrize("rule_name", list(RULES))
@pytest.mark.parametrize("world, layout", [(1, "contiguous"), (2, "contiguous"), (2, "balanced"), (3, "balanced"),
                                           pytest.param(3, "contiguous", marks=pytest.mark.slow)])
def test_each_document_recurs_alone_across_ranks(world, layout, rule_name, rank_pools):
    rule = RULES[rule_name]
    for name, segments in ROWS.items():
        full = [t.clone().requires_grad_(True) for t in inputs(rule, segments)]
        want = oracle(rule, segments, full)
        (want * want.detach().sign()).sum().backward()
        results = [recurrence_worker(0, 1, rule_name, segments, layout)] if world == 1 else \
            rank_pools(world).run(recurrence_worker, rule_name, segments, layout)
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


@pytest.mark.parametrize("length, chunk", [(70, 64), (5, 4), (33, 8), (1, 64), (130, 16)])
def test_the_chunked_scan_is_the_token_loop_from_any_state(length, chunk):
    g = torch.Generator().manual_seed(length)
    x = torch.randn(2, length, H, P, generator=g, dtype=torch.float64)
    dt = torch.rand(2, length, H, generator=g, dtype=torch.float64)
    B, C = (torch.randn(2, length, G, N, generator=g, dtype=torch.float64) for _ in range(2))
    start = torch.randn(2, H, P, N, generator=g, dtype=torch.float64)
    got = chunked_ssd(x, dt, A_SSD, B, C, initial_state=start, chunk=chunk)
    want = ssd_oracle(x, dt, A_SSD, B, C, initial_state=start)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_the_chunked_kernels_compute_half_precision_in_float32_and_return_its_dtype():
    """bfloat16 inputs: the outputs come back in bfloat16 (the final state in float32, as computed) and
    equal the float64 token loop on the same bfloat16 values to float32 accuracy, rounded once."""
    g = torch.Generator().manual_seed(0)
    T = 70
    bf = lambda *shape, scale=1.0: (scale * torch.randn(*shape, generator=g)).to(torch.bfloat16)  # noqa: E731
    q, k, v = bf(1, T, 2, 4), bf(1, T, 2, 4), bf(1, T, 4, 3)
    decay, beta = -bf(1, T, 4, scale=0.1).abs(), bf(1, T, 4).abs().clamp(max=1)
    o, state = chunked_gated_delta_rule(q, k, v, decay, beta)
    want_o, want_state = gated_delta_rule_oracle(*(t.double() for t in (q, k, v, decay, beta)))
    assert (o.dtype, state.dtype) == (torch.bfloat16, torch.float32)
    assert (o.double() - want_o).abs().max() <= 2 ** -8 * want_o.abs().max()
    assert (state.double() - want_state).abs().max() < 1e-5
    x, dt, B, C = bf(1, T, H, P), bf(1, T, H, scale=0.1).abs(), bf(1, T, G, N), bf(1, T, G, N)
    y, state = chunked_ssd(x, dt, A_SSD.float(), B, C)
    want_y, want_state = ssd_oracle(x.double(), dt.double(), A_SSD, B.double(), C.double())
    assert (y.dtype, state.dtype) == (torch.bfloat16, torch.float32)
    assert (y.double() - want_y).abs().max() <= 2 ** -8 * want_y.abs().max()
    assert (state.double() - want_state).abs().max() < 1e-5


def test_piece_buckets_run_the_chunks_each_piece_would_run_alone():
    """Pieces batched in one bucket are padded to its longest: each must run the chunk size and the number
    of chunks it would run alone (no piece pays for a longer one's chunks), and every piece is in one bucket."""
    from blockdiag_cp.mixers.chunked import CHUNK, _chunk_for
    from blockdiag_cp.mixers.recurrence import _buckets

    lengths = [1, 2, 3, 4, 5, 17, 32, 33, 63, 64, 65, 100, 128, 129, 200, 7, 1, 64]
    buckets = _buckets(lengths)
    assert sorted(i for bucket in buckets for i in bucket) == list(range(len(lengths)))

    def chunks(n, padded_to):
        size = _chunk_for(padded_to, CHUNK)
        return size, -(-padded_to // size) if n else 0

    for bucket in buckets:
        longest = max(lengths[i] for i in bucket)
        assert all(chunks(lengths[i], longest) == chunks(lengths[i], lengths[i]) for i in bucket), \
            [lengths[i] for i in bucket]
    assert len(buckets) == len({chunks(n, n) for n in lengths})  # and pieces that can share a bucket do


#: a packed row of long documents (several chunks of 64) that straddle the ranks at cp 2 and 3
LONG_ROW = (150, 40, 7, 90, 33)
#: log-decays of a trained model (Qwen3.5 initialises A up to 16, so g reaches -20 per token and more)
STRONG = 20.0


def decay_gradient_errors(rule, grads, want):
    """Relative errors of the log-decay input's gradient: per token, and summed per head against the input
    (a decay parameter's gradient, as A_log's: ``sum_t x_t dL/dx_t``, where terms cancel)."""
    i = rule.decay_input
    x = inputs(rule, LONG_ROW, STRONG)[i]
    got, exact = grads[i].double(), want[i].double()
    per_head = lambda d: (x * d).sum(0)  # noqa: E731
    return (float((got - exact).norm() / exact.norm()),
            float((per_head(got) - per_head(exact)).norm() / per_head(exact).norm()))


def loop_gradients(rule, dtype):
    """The token loop, each document alone, in `dtype` on the inputs rounded to float32: its input gradients
    (in float32 nothing cancels inside, so its error is float32's own)."""
    full = [t.float().to(dtype).requires_grad_(True) for t in inputs(rule, LONG_ROW, STRONG)]  # float32's values
    out = oracle(rule, LONG_ROW, full)
    (out * out.detach().sign()).sum().backward()
    return [t.grad for t in full]


@pytest.mark.parametrize("rule_name", list(RULES))
def test_float32_decay_gradients_across_ranks_are_as_close_as_the_token_loops(rule_name, rank_pools):
    """Note [Decays between tokens, summed between them]: with strong decays, the chunked kernels' float32
    gradients of the log-decay (and of a per-head decay parameter, where terms cancel) are within 4x of
    the float32 token loop's own error against float64, on one rank and at cp 2 (documents handed on
    between ranks). A difference of cumulative sums was 20-2000x off."""
    rule = RULES[rule_name]
    want = loop_gradients(rule, torch.float64)
    floor = decay_gradient_errors(rule, loop_gradients(rule, torch.float32), want)
    one_rank = recurrence_worker(0, 1, rule_name, LONG_ROW, "contiguous", torch.float32, STRONG)
    cp2 = rank_pools(2).run(recurrence_worker, rule_name, LONG_ROW, "balanced", torch.float32, STRONG)[0]
    for where, (_, _, grads) in {"one rank": one_rank, "cp 2": cp2}.items():
        got = decay_gradient_errors(rule, grads, want)
        assert got[0] <= 4 * floor[0] and got[1] <= 4 * floor[1], (where, got, floor)
