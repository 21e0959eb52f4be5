"""Outside a CP step, ``attn_implementation="blockdiag_cp"`` is transformers' ``sdpa`` for every call
that is not one packed row: greedy generation (static, dynamic and no cache, one row and left-padded
rows, with and without a mask, chunked prefill) and manual forwards that continue a cache give the
same tokens and scores as ``sdpa`` with the same weights. A packed row still attends per document,
with a fresh cache too.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import blockdiag_cp.hf  # noqa: E402,F401  (registers "blockdiag_cp")

VOCAB = 64
PROMPT = 7
NEW_TOKENS = 6
PAD = 3  # left padding of the padded rows
IMPLS = ("sdpa", "blockdiag_cp")
#: name -> (config class, model class, config kwargs): windows of 4 cut the 7-token prompt
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=4)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
}


@pytest.fixture(scope="module", params=tuple(ARCHS))
def model(request):
    """A tiny float64 decoder of `request.param`; tests switch its attention implementation."""
    config_cls, model_cls, extra = ARCHS[request.param]
    config = getattr(transformers, config_cls)(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, eos_token_id=None, bos_token_id=None,
        attn_implementation="sdpa", **extra)
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(config).to(torch.float64).eval()


def prompt(rows: int, mask: str) -> dict:
    """``input_ids [rows, PROMPT]`` and, unless `mask` is "none", an ``attention_mask [rows, PROMPT]``:
    "ones" (nothing padded) or "left" (the last row left-padded by PAD tokens)."""
    g = torch.Generator().manual_seed(rows)
    inputs = {"input_ids": torch.randint(1, VOCAB, (rows, PROMPT), generator=g)}
    if mask != "none":
        inputs["attention_mask"] = torch.ones(rows, PROMPT, dtype=torch.long)
    if mask == "left":
        inputs["attention_mask"][-1, :PAD] = 0
        inputs["input_ids"][-1, :PAD] = 0
    return inputs


def under_each(model, fn):
    """``{impl: fn(model)}`` with `model` switched to each implementation of IMPLS in turn."""
    out = {}
    for impl in IMPLS:
        model.set_attn_implementation(impl)
        with torch.no_grad():
            out[impl] = fn(model)
    model.set_attn_implementation("sdpa")
    return out


def assert_same_generation(model, inputs: dict, **generate_kwargs) -> None:
    """Greedy generation under both implementations: equal tokens ``[B, PROMPT + NEW_TOKENS]`` and
    scores (NEW_TOKENS of ``[B, VOCAB]``)."""
    def run(m):
        return m.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                          output_scores=True, return_dict_in_generate=True, **generate_kwargs)

    out = under_each(model, run)
    ref, got = out["sdpa"], out["blockdiag_cp"]
    scores_ref, scores_got = torch.stack(ref.scores), torch.stack(got.scores)
    assert float((scores_got - scores_ref).abs().max()) < 1e-6  # float32 scores of float64 logits
    assert torch.equal(got.sequences, ref.sequences)


CACHES = {
    "static": dict(cache_implementation="static"),
    "dynamic": dict(cache_implementation="dynamic"),
    "no_cache": dict(use_cache=False),
}


@pytest.mark.parametrize("cache", tuple(CACHES))
@pytest.mark.parametrize("rows, mask", [(1, "none"), (1, "ones"), (1, "left"), (2, "left")])
def test_generate_matches_sdpa(model, cache, rows, mask):
    assert_same_generation(model, prompt(rows, mask), **CACHES[cache])


@pytest.mark.parametrize("cache", ("static", "dynamic"))
@pytest.mark.parametrize("rows, mask", [(1, "none"), (2, "left")])
def test_chunked_prefill_matches_sdpa(model, cache, rows, mask):
    assert_same_generation(model, prompt(rows, mask), prefill_chunk_size=3, **CACHES[cache])


def make_cache(model, kind: str):
    """An empty cache of `kind` ("static" or "dynamic") for `model`."""
    if kind == "static":
        return transformers.StaticCache(config=model.config, max_cache_len=PROMPT + NEW_TOKENS)
    return transformers.DynamicCache(config=model.config)


@pytest.mark.parametrize("cache", ("static", "dynamic"))
@pytest.mark.parametrize("rows, mask", [(1, "none"), (2, "left")])
def test_forward_continuing_a_cache_matches_sdpa(model, cache, rows, mask):
    """Two forwards into one cache, the second with explicit ``position_ids``: logits ``[B, n, VOCAB]``
    of the real (unpadded) tokens equal sdpa's."""
    inputs, split = prompt(rows, mask), 4
    ids, attention = inputs["input_ids"], inputs.get("attention_mask")

    def run(m):
        kv = make_cache(m, cache)
        first = m(input_ids=ids[:, :split], attention_mask=None if attention is None else attention[:, :split],
                  cache=kv, use_cache=True).logits
        positions = torch.arange(split, PROMPT).expand(rows, -1)
        if attention is not None:  # positions count real tokens, as generate's do
            positions = attention.cumsum(-1)[:, split:] - 1
        second = m(input_ids=ids[:, split:], attention_mask=attention, position_ids=positions, cache=kv,
                   use_cache=True).logits
        return first, second

    out = under_each(model, run)
    (first_ref, second_ref), (first_got, second_got) = out["sdpa"], out["blockdiag_cp"]
    real = torch.ones(rows, split, dtype=torch.bool) if attention is None else attention[:, :split].bool()
    assert float((first_got - first_ref)[real].abs().max()) < 1e-10
    assert float((second_got - second_ref).abs().max()) < 1e-10


def test_packed_row_with_a_fresh_cache_is_attended_per_document(model):
    """One row of three documents (``position_ids`` restarting at each), no mask, and a fresh
    DynamicCache (``use_cache`` left on): logits ``[1, S, VOCAB]`` equal each document run alone.
    (tests/integrations/test_hf.py checks the same row without a cache.)"""
    lengths = (5, 7, 4)
    ids = torch.randint(1, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(3))
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    docs = torch.split(ids, lengths, dim=1)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        alone = torch.cat([model(input_ids=doc, use_cache=False).logits for doc in docs], dim=1)
        model.set_attn_implementation("blockdiag_cp")
        packed = model(input_ids=ids, position_ids=positions, use_cache=True).logits
    model.set_attn_implementation("sdpa")
    assert float((packed - alone).abs().max()) < 1e-10
