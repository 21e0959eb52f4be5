"""Multi-head latent attention (MLA) models under CP: values of another head dim than queries and keys.

Tiny random float64 DeepSeek-V2, DeepSeek-V3 (with and without YaRN's ``mscale_all_dim``, which changes the
softmax scale), a Kimi-K2-shaped DeepSeek-V3, MiniCPM3, MiMo-V2-Flash (sliding windows, sinks, grouped K/V
heads), Youtu, GLM-4-MoE-Lite and LongCat-Flash, on a packed row of documents [37, 1, 90, 5, 61] at cp 2 and 3,
both layouts: logits, loss and every parameter gradient equal each document run alone (Note [Unequal head dims]
in kernels/base.py).

The reference attention is the float64 oracle on one document (`reference_attention`: causal, the layer's
window, sinks and scale), itself checked against the models' own ``sdpa`` / ``eager`` attention.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AttentionInterface  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402

import blockdiag_cp.hf as bhf  # noqa: E402  (registers "blockdiag_cp")
from blockdiag_cp.testing import oracle_attention  # noqa: E402
from blockdiag_cp.testing import zoo as sweep  # noqa: E402

LENGTHS = (37, 1, 90, 5, 61)  # a 1-token document; at cp 2 and 3 documents straddle ranks
VOCAB = 64
REFERENCE = "mla_fp64_reference"
RECORDING = "mla_recording_blockdiag_cp"
#: relative to the model's scale. transformers runs MoE routers in float32 (a GEMM that rounds differently for
#: other row counts: a shard, a document), so MoE families move by up to ~2e-8 (logits) and ~2e-9 (gradients)
#: under CP, as a packed row outside a step does (2e-16 with the MoE layers made dense); dense MiniCPM3, Youtu exact
TOL_MOE, TOL_DENSE = 1e-7, 1e-12

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 32,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}  # DeepSeek-V3's mscales
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=4, max_position_embeddings=1280)
LATENT = dict(kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)  # Dk 24, Dv 12
MOE = dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16, first_k_dense_replace=1)
#: name -> (config class, kwargs, query/key head dim, value head dim)
FAMILIES = {
    "deepseek_v2": ("DeepseekV2Config", COMMON | LATENT | MOE | dict(q_lora_rank=None, topk_method="greedy"), 24, 12),
    "deepseek_v3": ("DeepseekV3Config", COMMON | LATENT | MOE | dict(n_group=2, topk_group=1), 24, 12),
    "deepseek_v3_yarn": ("DeepseekV3Config", COMMON | LATENT | MOE | dict(n_group=2, topk_group=1, rope_parameters=YARN),
                         24, 12),
    # Kimi K2's ratios (64 heads; q/kv LoRA ranks 1536/512; qk 128 + 64, v 128; YaRN factor 32), scaled down
    "kimi_k2": ("DeepseekV3Config", COMMON | MOE | dict(
        hidden_size=64, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=48, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_group=1, topk_group=1,
        rope_parameters=YARN | {"factor": 32.0, "rope_theta": 50000.0, "original_max_position_embeddings": 40}), 24, 16),
    "minicpm3": ("MiniCPM3Config", COMMON | LATENT, 24, 12),
    "youtu": ("YoutuConfig", COMMON | LATENT | dict(bos_token_id=0, eos_token_id=1), 24, 12),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", COMMON | LATENT | MOE | dict(n_group=1, topk_group=1, first_k_dense_replace=None,
                                                                         mlp_layer_types=["dense", "sparse"]), 24, 12),
    # two attention sublayers per layer, "zero" (identity) experts beside the routed ones
    "longcat_flash": ("LongcatFlashConfig", dict(
        vocab_size=VOCAB, hidden_size=32, num_layers=1, num_attention_heads=4, num_key_value_heads=4, ffn_hidden_size=48,
        max_position_embeddings=1280, head_dim=8, n_routed_experts=4, moe_topk=2, zero_expert_num=2,
        expert_ffn_hidden_size=16) | LATENT, 24, 12),
    # alternating full and sliding-window layers (window 6 < most documents), sinks and doubled K/V heads on the
    # sliding ones, values scaled; grouped K/V heads 4:2 (4:4 on the sliding layer)
    "mimo_v2_flash": ("MiMoV2FlashConfig", COMMON | dict(
        num_key_value_heads=2, head_dim=24, v_head_dim=12, sliding_window=6, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, layer_types=["full_attention", "sliding_attention"], mlp_layer_types=["dense", "sparse"]),
        24, 12),
}


def reference_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """One document alone (no mask is built for this name): the float64 oracle, causal under the layer's
    sliding window, with its sinks and scale. ``[1, H, S, Dk]``, ... -> ``([1, S, H, Dv], None)``."""
    assert query.shape[0] == 1 and attention_mask is None and dropout == 0.0
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    ones = torch.ones(query.shape[2], dtype=torch.long)
    out = oracle_attention(query[0], key[0], value[0], ones, scaling, window, kwargs.get("softcap"), kwargs.get("s_aux"))
    return out.transpose(0, 1).unsqueeze(0), None


def recording_attention(module, query, key, value, attention_mask, *args, **kwargs):
    """`blockdiag_cp`, noting the head dims each layer passes and gets back."""
    out, weights = bhf.blockdiag_cp_attention(module, query, key, value, attention_mask, *args, **kwargs)
    module.mla_seen = (query.shape[-1], key.shape[-1], value.shape[-1], out.shape[-1])
    return out, weights


AttentionInterface.register(REFERENCE, reference_attention)
AttentionInterface.register(RECORDING, recording_attention)
AttentionMaskInterface.register(RECORDING, bhf.blockdiag_cp_mask)


def make_model(name, attn):
    config_cls, kwargs, _, _ = FAMILIES[name]
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn,
                                                          experts_implementation="eager")  # grouped_mm: no float64
    model = model.to(torch.float64)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.normal_()  # make MiMo's sinks matter
    return model


def packed_row():
    return sweep.packed_row(LENGTHS, VOCAB)


def per_document_logits(model, ids):
    out, start = [], 0
    for n in LENGTHS:
        out.append(model(input_ids=ids[:, start : start + n], use_cache=False).logits)
        start += n
    return torch.cat(out, 1)


def reference(name):
    """Each document alone through the float64 reference attention: logits, mean loss, parameter gradients."""
    model = make_model(name, REFERENCE)
    ids, _ = packed_row()
    logits = per_document_logits(model, ids)
    loss = mean_next_token_loss(logits, ids)
    loss.backward()
    return logits.detach(), loss.item(), [p.grad.clone() for p in model.parameters()]


def mean_next_token_loss(logits, ids):
    """The mean next-token loss of the documents of a full (unsharded) row."""
    total, start = 0.0, 0
    for n in LENGTHS:
        total = total + torch.nn.functional.cross_entropy(logits[0, start : start + n - 1], ids[0, start + 1 : start + n],
                                                          reduction="sum")
        start += n
    return total / sum(n - 1 for n in LENGTHS)


def relative(got, want):
    """Largest error over the tensor's scale (1 at least)."""
    return sweep.relative(got, want, floor=1.0)


def mla_worker(rank, world, names, layouts, checkpointing=None):
    """Per (family, layout): the worst relative error of logits, loss and parameter gradients under CP."""
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp import CPConfig

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"]
    worst = {}
    for name in names:
        ref_logits, ref_loss, ref_grads = reference(name)
        for layout in layouts:
            model = make_model(name, "blockdiag_cp")
            if checkpointing:
                model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
                model.train()
            run = sweep.run_row_under_cp(model, mesh, CPConfig(layout=layout), LENGTHS, VOCAB)
            worst[name, layout] = run.errors_against(ref_logits, ref_loss, ref_grads)
    return worst


def tolerance(name):
    return TOL_DENSE if name in ("minicpm3", "youtu") else TOL_MOE


def assert_close(per_rank, expected_keys):
    for worst in per_rank:
        assert set(worst) == expected_keys
        bad = {key: errors for key, errors in worst.items() if not max(errors) <= tolerance(key[0])}
        assert not bad, bad


def test_deepseek_v3_under_cp_matches_each_document_alone(rank_pools):
    """The fast subset: DeepSeek-V3 with YaRN's softmax scale at cp 2, balanced (documents straddle both ranks)."""
    per_rank = rank_pools(2).run(mla_worker, ("deepseek_v3_yarn",), ("balanced",))
    assert_close(per_rank, {("deepseek_v3_yarn", "balanced")})


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_every_mla_family_under_cp_matches_each_document_alone(world, rank_pools):
    names, layouts = tuple(FAMILIES), ("contiguous", "balanced")
    per_rank = rank_pools(world).run(mla_worker, names, layouts)
    assert_close(per_rank, {(name, layout) for name in names for layout in layouts})


@pytest.mark.slow
def test_mla_under_cp_with_activation_checkpointing(rank_pools):
    per_rank = rank_pools(3).run(mla_worker, ("deepseek_v3", "mimo_v2_flash"), ("balanced",), "non_reentrant")
    assert_close(per_rank, {("deepseek_v3", "balanced"), ("mimo_v2_flash", "balanced")})


@pytest.mark.slow
def test_the_reference_attention_is_the_models_own():
    """The float64 oracle reference equals each family's own attention on each document alone: ``sdpa`` (exact)
    where the model has it, else ``eager`` (its softmax runs in float32: 1e-6)."""
    ids, _ = packed_row()
    for name in FAMILIES:
        own = "eager" if name == "mimo_v2_flash" else "sdpa"
        want = per_document_logits(make_model(name, own), ids).detach()
        got = per_document_logits(make_model(name, REFERENCE), ids).detach()
        assert relative(got, want) <= (1e-6 if own == "eager" else 1e-12), name


@pytest.mark.slow
def test_outside_a_step_a_packed_row_is_each_document_alone_and_values_arrive_unpadded():
    """Outside a step (one packed row through transformers): exact per document. Each layer hands blockdiag_cp
    values of the model's ``v_head_dim`` as they are (transformers pads them only for flash-attention) and gets
    back rows of that width, which its ``o_proj`` (heads x ``v_head_dim`` inputs) takes."""
    ids, pos = packed_row()
    for name, (_, _, k_dim, v_dim) in FAMILIES.items():
        want = reference(name)[0]
        model = make_model(name, RECORDING)
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits.detach()
        assert relative(logits, want) <= tolerance(name), name
        seen = {m.mla_seen for m in model.modules() if hasattr(m, "mla_seen")}
        assert seen == {(k_dim, k_dim, v_dim, v_dim)}, (name, seen)


@pytest.mark.slow
def test_the_compiled_drop_in_gives_the_values_head_dim():
    """Under torch.compile the attention is one opaque op (Note [One opaque op]): its fake output takes the values'
    head dim, so a compiled MLA call traces fullgraph and equals eager, forward and backward."""
    import torch._dynamo

    from blockdiag_cp import cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 4, 20, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    v = torch.randn(1, 4, 20, 5, generator=g, dtype=torch.float64, requires_grad=True)

    def attend(q, k, v):
        return cp_blockdiag_sdpa(q, k, v, sliding_window=6) * 1.0  # an op after it: the fake's shape is used

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    ids = torch.tensor([[1] * 7 + [2] * 9 + [3] * 4])
    train_ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": ids, "_packed_seq_ids": ids})
    results = []
    for fn in (attend, compiled):
        with train_ctx():
            out = fn(q, k, v)
            out.square().sum().backward()
        results.append((out.detach(), *(t.grad.clone() for t in (q, k, v))))
        for t in (q, k, v):
            t.grad = None
    assert results[1][0].shape == (1, 4, 20, 5)
    for eager, traced in zip(*results):
        assert (eager - traced).abs().max() < 1e-12
