"""Token mixers outside attention (Gated DeltaNet, Mamba2, short convolutions): found by structure, refused clearly.

A hybrid model on a packed row, under CP or outside it, must raise a `ValueError` naming the
layer before any work (every rank alike); attention-only models must pass untouched.
"""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import blockdiag_cp.hf  # noqa: E402,F401  (registers "blockdiag_cp")
from blockdiag_cp import make_cp_blockdiag_batch_and_ctx  # noqa: E402
from blockdiag_cp.mixers import find_unrouted_mixers, refuse_unrouted_mixers, unrouted_config_mixers  # noqa: E402

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)

#: (config class, model class, config overrides): the hybrid families of transformers 5.x, tiny
HYBRIDS = {
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, head_dim=8, num_experts=0, mlp_only_layers=[0, 1])),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, head_dim=8)),
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        layers_block_type=["mamba", "attention"], mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=1,
        head_dim=8)),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", dict(
        mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, head_dim=8)),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(layer_types=["conv", "full_attention"])),
}
#: attention-only families the library supports: nothing may be flagged
ATTENTION_ONLY = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=8)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=8)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(num_local_experts=2, num_experts_per_tok=1, head_dim=8)),
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", {}),
}


def build(spec, attn="blockdiag_cp"):
    config_name, model_name, extra = spec
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if config_name == "Qwen2VLConfig":
            config = transformers.Qwen2VLConfig(
                text_config=dict(SMALL), vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2))
        else:
            config = getattr(transformers, config_name)(**SMALL, **extra)
        config._attn_implementation = attn
        return getattr(transformers, model_name)(config).double().eval()


@pytest.mark.parametrize("family", sorted(HYBRIDS))
def test_every_hybrid_family_is_found_by_its_structure(family):
    model = build(HYBRIDS[family])
    found = find_unrouted_mixers(model)
    module_hits = [m for m in found if not m.where.startswith("config.")]
    assert module_hits, found  # a layer of the model itself is named, not only its config
    with pytest.raises(ValueError, match=module_hits[0].kind):
        refuse_unrouted_mixers(model, "in a test")
    assert unrouted_config_mixers(model.config), "the config alone (what the attention call sees) must tell too"


@pytest.mark.parametrize("family", sorted(ATTENTION_ONLY))
def test_attention_only_families_are_not_flagged(family):
    model = build(ATTENTION_ONLY[family])
    assert find_unrouted_mixers(model) == ()
    refuse_unrouted_mixers(model, "in a test")


class UnknownHybrid(torch.nn.Module):
    """A made-up hybrid no list of model names knows: a depthwise causal convolution before attention."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Conv1d(8, 8, 4, groups=8, padding=3)])


class Decay(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.A_log = torch.nn.Parameter(torch.zeros(4))


def test_an_unknown_hybrid_is_refused_by_structure_alone():
    with pytest.raises(ValueError, match=r"Conv1d at layers\.1"):
        refuse_unrouted_mixers(UnknownHybrid(), "in a test")
    found = find_unrouted_mixers(torch.nn.Sequential(torch.nn.Linear(4, 4), Decay()))
    assert [m.kind for m in found] == ["Decay"] and "A_log" in found[0].why
    config = transformers.LlamaConfig(**SMALL)
    config.layer_types = ["full_attention", "retention"]  # an attention-free kind nobody listed
    (mixer,) = unrouted_config_mixers(config)
    assert mixer.kind == "retention" and mixer.where == "config.layer_types[1]"
    config.layer_types = ["full_attention", "sliding_attention"]
    assert unrouted_config_mixers(config) == ()


class StepBias(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.dt_bias = torch.nn.Parameter(torch.zeros(4))


def test_every_sign_of_a_mixer_is_read():
    """Each layer-type field, a module owning only ``dt_bias``, and the text config inside a composite one."""
    for field in ("layer_types", "layers_block_type", "block_types"):
        config = transformers.LlamaConfig(**SMALL)
        setattr(config, field, ["attention", "mamba"])
        (mixer,) = unrouted_config_mixers(config)
        assert (mixer.kind, mixer.where) == ("mamba", f"config.{field}[1]"), field
    (found,) = find_unrouted_mixers(torch.nn.Sequential(torch.nn.Linear(4, 4), StepBias()))
    assert found.kind == "StepBias" and "dt_bias" in found.why
    composite = transformers.Qwen2VLConfig(text_config=dict(SMALL))
    assert unrouted_config_mixers(composite) == ()
    composite.text_config.layer_types = ["full_attention", "linear_attention"]
    (mixer,) = unrouted_config_mixers(composite)
    assert mixer.kind == "linear_attention"


def packed_batch(model, lengths=(9, 5, 11)):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, model.config.get_text_config().vocab_size, (1, sum(lengths)), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    return ids, positions


@pytest.mark.parametrize("family", ["qwen3_next", "lfm2", "nemotron_h"])
def test_a_hybrid_inside_a_step_is_refused_before_its_first_layer(family):
    model = build(HYBRIDS[family])
    ids, positions = packed_batch(model)
    ran = []
    model.model.layers[0].register_forward_pre_hook(lambda *_: ran.append(True))
    ctx, batch = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": ids, "position_ids": positions})
    with ctx(), pytest.raises(ValueError, match="inside a CP step"):
        model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    assert not ran, "the refusal must come before any layer runs"


@pytest.mark.parametrize("family", ["qwen3_5", "falcon_h1"])
def test_a_hybrid_on_a_packed_row_outside_a_step_is_refused(family):
    model = build(HYBRIDS[family])
    ids, positions = packed_batch(model)
    with pytest.raises(ValueError, match="on a packed row"):
        model(input_ids=ids, position_ids=positions, use_cache=False)


def test_a_hybrid_on_one_document_outside_a_step_runs_as_with_sdpa():
    model = build(HYBRIDS["qwen3_next"])
    ids, _ = packed_batch(model)
    ours = model(input_ids=ids, use_cache=False).logits
    model.set_attn_implementation("sdpa")
    torch.testing.assert_close(ours, model(input_ids=ids, use_cache=False).logits, rtol=0, atol=1e-12)


def refuse_under_cp(rank, world, family):
    """Every rank of a real CP group: the hybrid's forward raises ValueError, no collective is left open."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    model = build(HYBRIDS[family])
    ids, positions = packed_batch(model, lengths=(13, 4, 9, 6))
    ctx, batch = make_cp_blockdiag_batch_and_ctx(mesh["cp"], None, {"input_ids": ids, "position_ids": positions})
    try:
        with ctx():
            model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    except ValueError as exc:
        torch.distributed.barrier()  # every rank got here: nothing is left waiting in a collective
        return str(exc)
    return None


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_two_hybrid_families_are_refused_on_every_rank_under_cp(family, rank_pools):
    messages = rank_pools(2).run(refuse_under_cp, family)
    assert all(m is not None and "inside a CP step" in m for m in messages), messages
    assert messages[0] == messages[1]


def test_the_attention_call_itself_refuses_inside_a_step_without_the_mask_function():
    """A model that calls the attention interface without transformers' mask function is caught there."""
    from blockdiag_cp.hf import blockdiag_cp_attention

    layer = torch.nn.Module()
    layer.config, layer.is_causal = build(HYBRIDS["lfm2"]).config, True
    q = torch.randn(1, 2, 6, 4, dtype=torch.float64)
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": torch.ones(1, 6, dtype=torch.long)})
    with ctx(), pytest.raises(ValueError, match="Lfm2Config|conv"):
        blockdiag_cp_attention(layer, q, q, q, None)
    layer.config = build(ATTENTION_ONLY["llama"]).config
    with ctx():
        assert blockdiag_cp_attention(layer, q, q, q, None)[0].shape == (1, 6, 2, 4)
