"""Each kernel against the float64 oracle on CUDA, in bf16 and fp16, forward and backward.

Skipped without CUDA. The tolerance is relative to the dense reference's own error in
the same dtype (2x, plus a small absolute slack).
"""

import importlib.util

import pytest
import torch

from blockdiag_cp.testing import ParityCase, reference_error, run_parity_case

pytestmark = pytest.mark.gpu

NEEDS = {"flash": "flash_attn", "te": "transformer_engine"}
SEGMENTS = (700, 1300, -40, 2100, 3, 5, 1, 1900)


@pytest.mark.parametrize("kernel", ["sdpa", "flash", "te", "flex", "dense"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_kernel_matches_oracle_on_cuda(kernel, dtype):
    if kernel in NEEDS and importlib.util.find_spec(NEEDS[kernel]) is None:
        pytest.skip(f"{NEEDS[kernel]} is not installed")
    case = ParityCase(SEGMENTS, heads=8, kv_heads=2, head_dim=64, kernel=kernel, dtype=dtype, device="cuda")
    result = run_parity_case(case, None)
    ref_out, ref_grad = reference_error(case)
    assert result.kernel == kernel
    assert result.out_err <= 2 * ref_out + 1e-3, (result.out_err, ref_out)
    assert result.grad_err <= 2 * ref_grad + 1e-3, (result.grad_err, ref_grad)
    torch.cuda.synchronize()


def _layer(batch, heads=8, kv_heads=2, head_dim=64):
    from blockdiag_cp import cp_blockdiag_sdpa

    x = batch["inputs_embeds"]
    q, k, v = torch.split(x, [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.reshape(1, t.shape[1], -1, head_dim).transpose(1, 2) for t in (q, k, v))
    return cp_blockdiag_sdpa(q, k, v, enable_gqa=True)


@pytest.mark.parametrize("kernel", ["sdpa", "flash", "te", "flex", "dense"])
def test_layer_calls_make_no_host_sync_on_cuda(kernel):
    """After one warm-up layer (forward and backward), layers run with the CUDA sync debugger set to error."""
    if kernel in NEEDS and importlib.util.find_spec(NEEDS[kernel]) is None:
        pytest.skip(f"{NEEDS[kernel]} is not installed")
    from blockdiag_cp import CPConfig, make_cp_blockdiag_batch_and_ctx
    from blockdiag_cp.testing import doc_ids_from_lengths

    ids = doc_ids_from_lengths(SEGMENTS).unsqueeze(0).cuda()
    x = torch.randn(1, ids.shape[1], 12 * 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    train_ctx, batch = make_cp_blockdiag_batch_and_ctx(
        None, None, {"inputs_embeds": x, "_packed_seq_ids": ids}, config=CPConfig(kernel=kernel)
    )
    with train_ctx() as state:
        _layer(batch).float().sum().backward(retain_graph=True)  # warm-up (compilation, lazy imports)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            outs = [_layer(batch) for _ in range(3)]
            torch.stack([o.float().sum() for o in outs]).sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert state.kernel.name == kernel
