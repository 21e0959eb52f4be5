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
    # a leaf per rank's rows: each backward below frees its own graph (a compiled FlexAttention
    # backward refuses retain_graph=True)
    batch = {**batch, "inputs_embeds": batch["inputs_embeds"].detach().requires_grad_(True)}
    with train_ctx() as state:
        _layer(batch).float().sum().backward()  # warm-up (compilation, lazy imports)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            outs = [_layer(batch) for _ in range(3)]
            torch.stack([o.float().sum() for o in outs]).sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert state.kernel.name == kernel


@pytest.mark.parametrize("kernel", ["sdpa", "flex", "auto"])
@pytest.mark.parametrize("feature", [{"window": 500}, {"softcap": 30.0}, {"sinks": True}],
                         ids=["window", "softcap", "sinks"])
def test_model_features_match_oracle_on_cuda(kernel, feature):
    """Sliding windows, logit softcapping and sinks in bf16 (a kernel without one falls back or refuses)."""
    case = ParityCase(SEGMENTS, heads=8, kv_heads=2, head_dim=64, kernel=kernel, dtype="bfloat16", device="cuda",
                      **feature)
    try:
        result = run_parity_case(case, None)
    except ValueError as exc:  # an explicit kernel that lacks the feature refuses by name
        assert kernel != "auto" and kernel in str(exc), exc
        return
    ref_out, ref_grad = reference_error(case)
    assert result.out_err <= 2 * ref_out + 1e-3, (result.out_err, ref_out)
    assert result.grad_err <= 2 * ref_grad + 1e-3, (result.grad_err, ref_grad)


def test_transformers_bf16_autocast_step_on_cuda_matches_documents_alone():
    """A tiny Llama under CUDA bf16 autocast: packed logits and gradients equal each document run alone."""
    transformers = pytest.importorskip("transformers")
    import blockdiag_cp.hf  # noqa: F401  (registers the attention)

    lengths = (300, 17, 700, 1)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=100, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048)
    ids = torch.randint(0, 100, (1, sum(lengths)), device="cuda")
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).cuda()

    def run(attn, rows):
        model = transformers.LlamaForCausalLM(config).cuda()
        model.load_state_dict(state)
        model.config._attn_implementation = attn
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = torch.cat([model(input_ids=ids[:, a:b], position_ids=pos[:, a:b], use_cache=False).logits
                                for a, b in rows], dim=1)
        logits.float().square().mean().backward()
        return logits.float(), [p.grad.float() for p in model.parameters()]

    state = transformers.LlamaForCausalLM(config).state_dict()
    bounds = torch.tensor((0, *lengths)).cumsum(0).tolist()
    packed, packed_grads = run("blockdiag_cp", [(0, sum(lengths))])
    alone, alone_grads = run("sdpa", list(zip(bounds[:-1], bounds[1:])))
    assert (packed - alone).abs().max() < 5e-2 * alone.abs().max()
    for g, h in zip(packed_grads, alone_grads):
        assert (g - h).abs().max() <= 5e-2 * h.abs().max() + 1e-6
