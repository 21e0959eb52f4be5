"""Every token mixer verified, or the model refused by name: at load, at `prepare_model`, before the first layer,
at the first affected attention call, and when a step ends that the model never reached (Note [Every token mixer
verified], Note [A step the model never reached]). Refusals inside a step are raised alike on every rank.
"""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import blockdiag_cp.hf as bhf  # noqa: E402
from blockdiag_cp import make_cp_blockdiag_batch_and_ctx  # noqa: E402
from blockdiag_cp.errors import ModelRefusal  # noqa: E402
from blockdiag_cp.mixers import check_model  # noqa: E402
from blockdiag_cp.mixers.verify import config_problem, reaches_interface  # noqa: E402

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)


def tiny(config_name, model_name, attn="blockdiag_cp", **extra):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = getattr(transformers, config_name)(**extra)
        config._attn_implementation = attn
        return getattr(transformers, model_name)(config).double().eval()


def llama(attn="blockdiag_cp"):
    return tiny("LlamaConfig", "LlamaForCausalLM", attn, **TINY)


def bloom():
    return tiny("BloomConfig", "BloomForCausalLM", vocab_size=64, hidden_size=32, n_layer=2, n_head=4)


def packed():
    g = torch.Generator().manual_seed(0)
    return torch.randint(1, 64, (1, 17), generator=g), torch.cat([torch.arange(n) for n in (9, 1, 7)]).unsqueeze(0)


# -- the structure: what is verified -----------------------------------------------------------------------------

def test_llama_is_verified_and_bloom_is_not_by_structure():
    check = check_model(llama())
    assert check.reason is None and check.attention == ("layers.0.self_attn", "layers.1.self_attn")
    check = check_model(bloom())
    assert "own attention" in check.reason and "h.0.self_attention (BloomAttention)" in check.own_attention
    assert check.attention == ()


class OwnAttention(torch.nn.Module):
    """Attention-named, and computing its scores itself."""

    def forward(self, x):
        return torch.softmax(x @ x.transpose(-1, -2), -1) @ x


class InterfaceAttention(torch.nn.Module):
    def forward(self, x):
        return ALL_ATTENTION_FUNCTIONS["sdpa"](self, x, x, x, None)  # noqa: F821  (read by name only)


class AttentionBlock(torch.nn.Module):
    """A wrapper named as attention, holding one that reaches the interface: verified through what it holds."""

    def __init__(self):
        super().__init__()
        self.inner = InterfaceAttention()


def test_attention_named_modules_must_reach_the_interface_themselves_or_through_what_they_hold():
    assert reaches_interface(InterfaceAttention) and not reaches_interface(OwnAttention)
    assert not reaches_interface(AttentionBlock)
    check = check_model(torch.nn.ModuleDict({"a": AttentionBlock(), "b": OwnAttention()}))
    assert check.attention == ("a.inner",) and check.own_attention == ("b (OwnAttention)",)
    assert check_model(torch.nn.ModuleDict({"a": AttentionBlock()})).reason is None
    assert "no layer calls the attention interface" in check_model(torch.nn.Linear(2, 2)).reason


def test_a_decorated_forward_is_read_through_its_decorators():
    from transformers.models.llama4.modeling_llama4 import Llama4TextAttention

    assert "__wrapped__" in vars(Llama4TextAttention.forward) or Llama4TextAttention.forward.__closure__
    assert reaches_interface(Llama4TextAttention)


def test_config_problems_come_from_the_config_s_modeling_module():
    bloom()  # its modeling module is imported
    assert "BloomAttention" in config_problem(transformers.BloomConfig())
    assert config_problem(transformers.LlamaConfig()) is None
    transformers.BartForCausalLM  # noqa: B018  imports modeling_bart
    assert "BartDecoder" in config_problem(transformers.BartConfig()) and "position_ids" in config_problem(
        transformers.BartConfig())


# -- where the refusals fire ---------------------------------------------------------------------------------------

def test_prepare_model_refuses_what_it_cannot_verify_and_names_it():
    with pytest.raises(ModelRefusal, match="in prepare_model, BloomForCausalLM is refused: its own attention.*Bloom"):
        bhf.prepare_model(bloom())
    mamba = tiny("MambaConfig", "MambaForCausalLM", vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=8)
    with pytest.raises(ModelRefusal, match="mixes tokens outside the attention interface.*Mamba"):
        bhf.prepare_model(mamba)
    assert bhf.prepare_model(llama()) == frozenset()


def test_loading_an_own_attention_model_is_refused_before_transformers_builds_it():
    """transformers itself fails inside Falcon's constructor (KeyError: 'blockdiag_cp'); the loader refuses first."""
    config = transformers.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    with pytest.raises(ModelRefusal, match="from_config, Falcon is refused: its own attention") as caught:
        bhf.from_config(config)
    assert not isinstance(caught.value.__context__, KeyError)
    assert caught.value.reason.startswith("its own attention")


def test_from_pretrained_refuses_from_the_saved_config_and_prepares_what_it_loads(tmp_path):
    bloom().save_pretrained(tmp_path / "bloom")
    with pytest.raises(ModelRefusal, match="in blockdiag_cp.hf.from_pretrained, Bloom is refused"):
        bhf.from_pretrained(str(tmp_path / "bloom"))
    llama("sdpa").save_pretrained(tmp_path / "llama")
    model = bhf.from_pretrained(str(tmp_path / "llama"))
    assert model.config._attn_implementation == "blockdiag_cp" and getattr(model, "blockdiag_cp_prepared").reason is None


def test_an_own_attention_model_is_refused_before_its_first_layer_even_outside_a_step():
    """Bloom with blockdiag_cp would run its own attention unmasked: the mask function refuses its config."""
    model = bloom()
    ran = []
    model.transformer.h[0].register_forward_pre_hook(lambda *_: ran.append(True))
    ids, _ = packed()
    with pytest.raises(ModelRefusal, match="on a row outside a CP step, Bloom is refused"):
        model(input_ids=ids[:, :9], use_cache=False)  # one document
    assert not ran


def test_a_prepared_model_switched_to_another_attention_is_refused_at_step_entry():
    model = llama()
    bhf.prepare_model(model)
    model.set_attn_implementation("sdpa")
    ran = []
    model.model.layers[0].register_forward_pre_hook(lambda *_: ran.append(True))
    ids, positions = packed()
    ctx, batch = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": ids, "position_ids": positions})
    with pytest.raises(ModelRefusal, match="start of its forward inside a CP step.*attn_implementation='sdpa'"), ctx():
        model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    assert not ran


def test_a_step_the_model_never_reached_is_refused_when_it_ends():
    """An unprepared model on sdpa inside a step: every rank computes its shard alone; leaving the step refuses,
    after the backward and before an optimizer step. A step left by an error keeps that error."""
    from blockdiag_cp import gather_sequence

    model = llama("sdpa")
    ids, positions = packed()
    ctx, batch = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": ids, "position_ids": positions})
    with pytest.raises(ModelRefusal, match="train_ctx\\(\\) ended without the model calling") as caught:
        with ctx():
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
            gather_sequence(logits).sum().backward()  # reading the step is not the model reaching it
    assert caught.value.reason == "no call reached blockdiag-cp inside the step"
    with pytest.raises(KeyError, match="mine"), ctx():
        raise KeyError("mine")
    with ctx():  # a model that calls the library's attention
        llama()(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)


def _read_by_sum_per_document(logits, batch):
    from blockdiag_cp.loss import sum_per_document, token_log_probs

    log_probs, _ = token_log_probs(logits, batch["shift_labels"])
    return sum_per_document(log_probs).sum()


def _read_by_current_step(logits, batch):
    from blockdiag_cp.step.slot import current_step

    assert current_step() is not None
    return logits.sum()


def _read_by_gather(logits, batch):
    from blockdiag_cp import gather_sequence

    return gather_sequence(logits).sum()


@pytest.mark.parametrize("read", [_read_by_sum_per_document, _read_by_current_step, _read_by_gather])
def test_the_library_reading_the_step_is_not_the_model_reaching_it(read):
    """An unprepared model trained with a per-document loss (DPO/GRPO style) reads the step through the library's
    loss helpers, never through its attention: the step is still refused when it ends."""
    from blockdiag_cp.loss import add_shift_labels

    model = llama("sdpa")
    ids, positions = packed()
    batch = add_shift_labels({"input_ids": ids, "position_ids": positions})
    ctx, batch = make_cp_blockdiag_batch_and_ctx(None, None, batch)
    with pytest.raises(ModelRefusal, match="train_ctx\\(\\) ended without the model calling"), ctx():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        read(logits, batch).backward()


class Layer(torch.nn.Module):
    is_causal = True

    def __init__(self):
        super().__init__()
        self.config = transformers.LlamaConfig(**TINY)


def test_the_attention_refuses_a_mask_and_arguments_it_would_drop():
    q = torch.randn(1, 2, 6, 4, dtype=torch.float64)
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": torch.ones(1, 6, dtype=torch.long)})
    layer = Layer()
    with ctx():
        with pytest.raises(ModelRefusal, match="inside a CP step, Layer is refused: its attention gets a mask"):
            bhf.blockdiag_cp_attention(layer, q, q, q, torch.zeros(1, 2, 6, 6, dtype=torch.float64))
        with pytest.raises(ModelRefusal, match="gets position_bias, which blockdiag-cp does not apply"):
            bhf.blockdiag_cp_attention(layer, q, q, q, None, position_bias=torch.zeros(1, 2, 6, 6))
        out, _ = bhf.blockdiag_cp_attention(layer, q, q, q, None, position_ids=torch.arange(6)[None], use_cache=False,
                                            output_attentions=False, num_items_in_batch=torch.tensor(5))
        assert out.shape == (1, 6, 2, 4)
    with pytest.raises(ModelRefusal, match="on a packed row outside a CP step.*gets a mask the model built itself"):
        bhf.blockdiag_cp_attention(layer, q, q, q, torch.zeros(1, 2, 6, 6, dtype=torch.float64))  # not [1, 1, S, S]


def test_the_mask_function_reads_the_documents_and_hands_back_a_bidirectional_mask():
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function

    from blockdiag_cp.hf.interface import _read_mask_function

    def packed_causal(batch, head, q, kv):  # two documents: [0, 4) and [4, 9)
        return causal_mask_function(batch, head, q, kv) & ((q >= 4) == (kv >= 4))

    call = dict(q_length=9, device=torch.device("cpu"))
    assert _read_mask_function({**call, "mask_function": causal_mask_function}) == (False, None)
    bidirectional, cu = _read_mask_function({**call, "mask_function": packed_causal})
    assert not bidirectional and cu.tolist() == [0, 4, 9]
    assert _read_mask_function({**call, "mask_function": bidirectional_mask_function})[0]
    config = transformers.LlamaConfig(**TINY)
    mask = bhf.blockdiag_cp_mask(batch_size=1, q_length=9, kv_length=9, mask_function=bidirectional_mask_function,
                                 attention_mask=None, config=config)
    assert mask is not None and bool(mask.all())  # transformers' own: a layer that uses it is refused


def refuse_on_every_rank(rank, world, what):
    """Every rank of a real CP group refuses alike, and no collective is left open."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"]
    model = {"never reached": lambda: llama("sdpa"), "own mask": lambda: tiny(
        "DogeConfig", "DogeForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)}[what]()
    ids, positions = packed()
    ctx, batch = make_cp_blockdiag_batch_and_ctx(mesh, None, {"input_ids": ids, "position_ids": positions})
    try:
        with ctx():
            model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits.sum().backward()
    except ModelRefusal as exc:
        torch.distributed.barrier()  # every rank got here
        return exc.reason
    return None


@pytest.mark.parametrize("what", ["never reached", "own mask"])
def test_refusals_inside_a_step_are_raised_alike_on_every_rank(what, rank_pools):
    reasons = rank_pools(2).run(refuse_on_every_rank, what)
    assert reasons[0] is not None and reasons[0] == reasons[1], reasons
