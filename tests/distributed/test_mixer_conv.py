"""The per-document causal convolution (mixers/conv.py) against each document convolved alone, on real gloo ranks.

Rows with documents shorter than the kernel, 1-token documents, a document over every
rank, interior padding and ranks of only padding; both layouts; forward and the
gradients of the input, the weight and the bias, in float64.
"""

import pytest
import torch
import torch.nn.functional as F

from blockdiag_cp import make_cp_blockdiag_batch_and_ctx
from blockdiag_cp.mixers.conv import conv_plan
from blockdiag_cp.testing import doc_ids_from_lengths

ROWS = {
    "short documents": (2, 1, 7, 3, 1, 12),
    "one document over every rank": (61,),
    "padding inside and at the end": (9, -3, 14, 1, -6),
    "padding-only rank": (5, -40, 4),
}
C, WIDTH = 6, 4


def oracle(segments, x_SC, weight_CK, bias_C):
    """Each document convolved alone (zeros before its start); padding rows 0."""
    ids = doc_ids_from_lengths(segments)
    out = torch.zeros_like(x_SC)
    start = 0
    for n in segments:
        length = abs(n)
        if n > 0:
            doc = x_SC[start : start + length].t().unsqueeze(0)
            y = F.conv1d(doc, weight_CK.unsqueeze(1), bias_C, padding=WIDTH - 1, groups=C)[0, :, :length]
            out[start : start + length] = y.t()
        start += length
    return out * (ids != 0).unsqueeze(1)


def inputs(segments):
    g = torch.Generator().manual_seed(0)
    S = sum(abs(n) for n in segments)
    return (torch.randn(S, C, generator=g, dtype=torch.float64), torch.randn(C, WIDTH, generator=g, dtype=torch.float64),
            torch.randn(C, generator=g, dtype=torch.float64))


def conv_worker(rank, world, segments, layout):
    """This rank's output rows and the summed input / parameter gradients of the per-document conv."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp import CPConfig

    x, w, b = inputs(segments)
    ids = doc_ids_from_lengths(segments).unsqueeze(0)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"] if world > 1 else None
    x_full = x.clone().requires_grad_(True)
    w, b = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
    batch = {"inputs_embeds": x_full.unsqueeze(0), "_packed_seq_ids": ids}
    ctx, batch = make_cp_blockdiag_batch_and_ctx(mesh, None, batch, config=CPConfig(layout=layout))
    state = ctx.state  # the kernel takes the planned step itself (no model runs: no step entered)
    y = conv_plan(state, WIDTH)(batch["inputs_embeds"][0], w, b)
    (y * y.detach().sign()).sum().backward()
    grads = [torch.zeros_like(t) if t.grad is None else t.grad for t in (x_full, w, b)]  # a rank may not use w
    if world > 1:
        for grad in grads:
            dist.all_reduce(grad)
    return state.positions.tolist(), y.detach(), grads


@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_document_is_convolved_alone_across_ranks(world, layout, rank_pools):
    for name, segments in ROWS.items():
        x, w, b = (t.clone().requires_grad_(True) for t in inputs(segments))
        want = oracle(segments, x, w, b)
        (want * want.detach().sign()).sum().backward()
        if world == 1:
            results = [conv_worker(0, 1, segments, layout)]
        else:
            results = rank_pools(world).run(conv_worker, segments, layout)
        S = x.shape[0]
        for positions, y, _ in results:
            real = [i for i, p in enumerate(positions) if p < S]
            torch.testing.assert_close(y[real], want.detach()[[positions[i] for i in real]], rtol=0, atol=1e-12,
                                       msg=f"{name}: outputs")
        for got, expected in zip(results[0][2], (x.grad, w.grad, b.grad)):
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-11, msg=f"{name}: gradients")
