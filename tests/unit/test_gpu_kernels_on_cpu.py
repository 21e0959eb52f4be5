"""GPU kernels on CPU: the exact varlen metadata flash-attn and TransformerEngine receive
(through fake modules that also compute the attention), and FlexAttention's forward."""

import sys
import types

import pytest
import torch

from blockdiag_cp.exchange.base import items_over_buffer
from blockdiag_cp.plan.geometry import StepGeometry
from blockdiag_cp.kernels import CallOptions, DenseKernel, FlashKernel, FlexKernel, TEKernel
from blockdiag_cp.kernels.varlen import varlen_calls
from blockdiag_cp.plan import plan_shards
from blockdiag_cp.testing import doc_ids_from_lengths

CPU = torch.device("cpu")


def reference_segment(q, k, v, causal, scale):
    """q [l, H, D], k/v [m, Hk, D]: bottom-right causal or full softmax attention."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = torch.einsum("lhd,mhd->hlm", q, k) * scale
    if causal:
        l, m = q.shape[0], k.shape[0]
        s = s.masked_fill(~torch.ones(l, m, dtype=torch.bool).tril(m - l), float("-inf"))
    return torch.einsum("hlm,mhd->lhd", torch.softmax(s, -1), v)


def run_segments(q, k, v, cu_q, cu_k, causal, scale):
    out = []
    for i in range(cu_q.numel() - 1):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        out.append(reference_segment(q[qs], k[ks], v[ks], causal, scale))
    return torch.cat(out)


@pytest.fixture
def fake_flash(monkeypatch):
    calls = []
    module = types.ModuleType("flash_attn")

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False):
        if not q.shape[-1] == k.shape[-1] == v.shape[-1]:  # flash-attn 2's check
            raise RuntimeError("v must have shape (total_k, num_heads_k, head_size_og)")
        calls.append(dict(cu_q=cu_q.tolist(), cu_k=cu_k.tolist(), max_q=max_q, max_k=max_k, causal=causal,
                          dtype=(cu_q.dtype, cu_k.dtype), q_shape=tuple(q.shape), k_shape=tuple(k.shape)))
        return run_segments(q, k, v, cu_q, cu_k, causal, softmax_scale)

    module.flash_attn_varlen_func = flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    return calls


@pytest.fixture
def fake_te(monkeypatch):
    calls = []
    te = types.ModuleType("transformer_engine")
    te_pt = types.ModuleType("transformer_engine.pytorch")

    class DotProductAttention:
        def __init__(self, num_attention_heads, kv_channels, num_gqa_groups, attention_dropout, qkv_format, softmax_scale):
            self.scale = softmax_scale
            calls.append(dict(init=(num_attention_heads, kv_channels, num_gqa_groups, qkv_format)))

        def __call__(self, q, k, v, qkv_format, attn_mask_type, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv):
            calls.append(dict(mask=attn_mask_type, cu_q=cu_seqlens_q.tolist(), cu_k=cu_seqlens_kv.tolist(),
                              max_q=max_seqlen_q, max_k=max_seqlen_kv))
            causal = attn_mask_type == "padding_causal_bottom_right"
            out = run_segments(q, k, v, cu_seqlens_q, cu_seqlens_kv, causal, self.scale)
            return out.reshape(out.shape[0], -1)  # TE returns [T, H * D]

    te_pt.DotProductAttention = DotProductAttention
    te.pytorch = te_pt
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te_pt)
    return calls


def rank_items(segments, world, rank, layout="contiguous"):
    ids = doc_ids_from_lengths(segments)
    geometry = StepGeometry.build(plan_shards(ids, world, layout), ids)
    pieces = geometry.pieces(rank)
    return items_over_buffer(pieces, geometry.needed_positions(rank), geometry.plan.local_len), pieces


def tensors(items, H=4, Hk=2, D=8, Dv=None):
    """q ``[H, L, D]``, k ``[Hk, N, D]``, v ``[Hk, N, Dv]`` (Dv None: D)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(H, items.num_q_rows, D, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(Hk, items.num_k_rows, d, generator=g, dtype=torch.float64, requires_grad=True)
            for d in (D, D if Dv is None else Dv))
    return q, k, v


def dense_reference(items, q, k, v, softcap=None):
    dense = DenseKernel()
    return dense.attend(dense.prepare(items, CPU), q, k, v, CallOptions(0.35, 0.0, softcap))


SCENARIOS = {
    # (segments, world, rank) -> this rank's (query lengths, key lengths) per segment
    "straddling": ((5, 9, -2, 13, 4), (3, 1)),
    "tiny documents": ((1, 2, 3, 1, 1, 2, 3, 2), (3, 1)),
    "interior padding": ((4, -3, 6, -2, 5, -4), (2, 1)),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_flash_receives_bottom_right_segments_and_matches_dense(fake_flash, name):
    segments, (world, rank) = SCENARIOS[name]
    items, pieces = rank_items(segments, world, rank)
    kernel = FlashKernel()
    plan = kernel.prepare(items, CPU)
    q, k, v = tensors(items)
    out = kernel.attend(plan, q, k, v, CallOptions(0.35))
    ref = dense_reference(items, q, k, v)
    assert (out - ref).abs().max() < 1e-12
    g_out = torch.autograd.grad(out.square().sum(), (q, k, v))
    g_ref = torch.autograd.grad(ref.square().sum(), (q, k, v))
    assert all((a - b).abs().max() < 1e-12 for a, b in zip(g_out, g_ref))
    (call,) = fake_flash
    q_lens = pieces.length.tolist()
    k_lens = (pieces.global_start + pieces.length - pieces.doc_start).tolist()
    assert call["causal"] is True and call["dtype"] == (torch.int32, torch.int32)
    assert call["cu_q"] == [0] + torch.cumsum(torch.tensor(q_lens), 0).tolist()
    assert call["cu_k"] == [0] + torch.cumsum(torch.tensor(k_lens), 0).tolist()
    assert call["max_q"] == max(q_lens) and call["max_k"] == max(k_lens)
    assert call["q_shape"] == (sum(q_lens), 4, 8) and call["k_shape"] == (sum(k_lens), 2, 8)


@pytest.mark.parametrize("kernel_name", ["flash", "te"])
@pytest.mark.parametrize("v_dim", [5, 12])
def test_varlen_kernels_pad_another_value_head_dim_and_match_dense(fake_flash, fake_te, kernel_name, v_dim):
    """Note [Unequal head dims]: flash-attn 2 (and TE) get one head dim, max(Dk, Dv), the narrower side zero-padded;
    the output is cut back to Dv and equals dense attention, forward and backward."""
    segments, (world, rank) = SCENARIOS["straddling"]
    items, _ = rank_items(segments, world, rank)
    kernel = FlashKernel() if kernel_name == "flash" else TEKernel()
    plan = kernel.prepare(items, CPU)
    q, k, v = tensors(items, Dv=v_dim)
    out = kernel.attend(plan, q, k, v, CallOptions(0.35))
    ref = dense_reference(items, q, k, v)
    assert out.shape == (4, items.num_q_rows, v_dim) and (out - ref).abs().max() < 1e-12
    upstream = torch.randn_like(ref)
    for got, want in zip(torch.autograd.grad((out * upstream).sum(), (q, k, v)),
                         torch.autograd.grad((ref * upstream).sum(), (q, k, v))):
        assert got.shape == want.shape and (got - want).abs().max() < 1e-12
    if kernel_name == "flash":
        assert fake_flash and all(c["q_shape"][-1] == c["k_shape"][-1] == max(8, v_dim) for c in fake_flash)
    else:
        assert fake_te[0]["init"] == (4, max(8, v_dim), 2, "thd")


def test_straddling_piece_sees_its_document_from_its_start(fake_flash):
    items, pieces = rank_items((5, 9, -2, 13, 4), 3, 1)  # L = 11: rank 1 holds positions 11..21
    assert pieces.global_start.tolist()[0] == 11 and pieces.doc_start.tolist()[0] == 5
    segs = varlen_calls(items, CPU)
    first_k = segs[0].cu_seqlens_k[1].item()
    assert first_k == 14 - 5  # document 2 spans 5..13: its piece on rank 1 (11..13) sees keys 5..13


def test_all_padding_rank_calls_no_kernel(fake_flash):
    items, pieces = rank_items((6, -31), 4, 2)
    assert pieces.count == 0
    kernel = FlashKernel()
    plan = kernel.prepare(items, CPU)
    assert plan == ()
    q, k, v = tensors(items)
    out = kernel.attend(plan, q, k, v, CallOptions(0.35))
    assert torch.equal(out, torch.zeros_like(out)) and fake_flash == []


def test_two_pieces_of_one_document_repeat_shared_keys(fake_flash):
    items, pieces = rank_items((64,), 2, 0, layout="balanced")  # head and tail of one document
    assert pieces.count == 2
    (seg,) = varlen_calls(items, CPU)
    assert seg.k_rows.numel() > items.num_k_rows  # the shared prefix is packed twice


def test_flash_refuses_float32_before_any_collective(fake_flash):
    with pytest.raises(ValueError, match="float16/bfloat16"):
        FlashKernel().check(torch.zeros(2, 3, 4), 0.0)


def test_gpu_kernels_need_their_packages(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    with pytest.raises(ValueError, match="pip install"):
        FlashKernel()


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_te_receives_thd_bottom_right_segments_and_matches_dense(fake_te, name):
    segments, (world, rank) = SCENARIOS[name]
    items, pieces = rank_items(segments, world, rank)
    kernel = TEKernel()
    plan = kernel.prepare(items, CPU)
    q, k, v = tensors(items)
    out = kernel.attend(plan, q, k, v, CallOptions(0.35))
    assert (out - dense_reference(items, q, k, v)).abs().max() < 1e-12
    init, call = fake_te
    assert init["init"] == (4, 8, 2, "thd")
    assert call["mask"] == "padding_causal_bottom_right"
    assert call["cu_q"] == [0] + torch.cumsum(pieces.length, 0).tolist()


def test_ring_refuses_kernels_without_log_sum_exp(fake_flash):
    from blockdiag_cp.exchange.base import ExchangeSetup
    from blockdiag_cp.exchange.ring import RingExchange

    ids = doc_ids_from_lengths((10, 7))
    geometry = StepGeometry.build(plan_shards(ids, 2), ids)
    with pytest.raises(ValueError, match="log-sum-exp"):
        RingExchange(ExchangeSetup(geometry, 0, None, (FlashKernel(),), CPU))


@pytest.mark.parametrize("name", sorted(SCENARIOS))
@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")
def test_flex_forward_on_cpu_matches_dense(name, softcap):
    segments, (world, rank) = SCENARIOS[name]
    items, _ = rank_items(segments, world, rank)
    kernel = FlexKernel()
    plan = kernel.prepare(items, CPU)
    q, k, v = (t.detach().float() * 3 for t in tensors(items))  # scores large enough for the cap to bite
    with torch.no_grad():
        out = kernel.attend(plan, q, k, v, CallOptions(0.35, 0.0, softcap))
        ref = dense_reference(items, q, k, v, softcap)
        uncapped = dense_reference(items, q, k, v)
    assert (out - ref).abs().max() < 1e-5
    if softcap is not None:
        assert (uncapped - ref).abs().max() > 1e-2  # the cap changes the result: the test can see it dropped


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")
def test_flex_forward_on_cpu_takes_another_value_head_dim():
    """FlexAttention sizes the value dim apart (no padding): ``[H, L, Dv]`` equal to dense attention."""
    segments, (world, rank) = SCENARIOS["straddling"]
    items, _ = rank_items(segments, world, rank)
    kernel = FlexKernel()
    q, k, v = (t.detach().float() for t in tensors(items, Dv=4))
    with torch.no_grad():
        out = kernel.attend(kernel.prepare(items, CPU), q, k, v, CallOptions(0.35))
        assert out.shape == (4, items.num_q_rows, 4)
        assert (out - dense_reference(items, q, k, v)).abs().max() < 1e-5
        no_keys = kernel.attend(None, q, k[:, :0], v[:, :0], CallOptions(0.35))  # an empty buffer: no kernel call
        assert no_keys.shape == (4, items.num_q_rows, 4) and not no_keys.any()


def test_flex_refuses_float64():
    with pytest.raises(ValueError, match="not torch.float64"):
        FlexKernel().check(torch.zeros(2, 3, 4, dtype=torch.float64), 0.0)


def test_flex_refuses_training_on_cpu():
    q = torch.zeros(2, 3, 4, requires_grad=True)
    with pytest.raises(ValueError, match="no FlexAttention backward"):
        FlexKernel().check(q, 0.0)


@pytest.mark.parametrize("installed, need_lse, expected", [
    ({"triton"}, False, "flex"),  # 0.97-1.01x the per-document flash limit on an H200; sdpa 2.4-2.5x
    ({"triton"}, True, "sdpa"),  # the ring merges by log-sum-exp, which flex does not return
    (set(), False, "sdpa"),
])
def test_auto_kernel_on_cuda_follows_what_is_installed(monkeypatch, installed, need_lse, expected):
    import blockdiag_cp.kernels as kernels
    import blockdiag_cp.kernels.choose as choose

    monkeypatch.setattr(choose, "_installed", lambda module: module in installed)
    kernel, reason = kernels.select_kernel("auto", torch.device("cuda"), need_lse=need_lse)
    assert kernel.name == expected and reason.startswith("auto")
    chain = [k.name for k in kernels.fallback_kernels("auto", kernel, torch.device("cuda"))]
    assert chain == (["dense"] if expected == "sdpa" else ["sdpa", "dense"])
