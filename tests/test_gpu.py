"""Each kernel against the float64 oracle on CUDA, in bf16 and fp16, forward and backward.

Skipped without CUDA. The tolerance is relative to the dense reference's own error in
the same dtype (2x, plus a small absolute slack).
"""

import importlib.util

import pytest
import torch

from blockdiag_cp.verify import ParityCase, reference_error, run_parity_case

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
