"""Llama 4's attention temperature (NoPE layers) at each token's position in its document.

transformers scales a NoPE layer's queries by ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1`` with ``p``
from ``arange`` over the call: under CP the shard's positions, on a packed row the row's. Prepared models get the
document's positions (Note [Query temperature by document position]); unprepared ones are refused where ``p`` would
be wrong. Rows run past a small temperature floor (4), so the scale changes inside every document but the 1-token one.
Llama 4's norms compute in float32 inside the float64 model, which turns float64 rounding (1e-17) into
differences of up to 1e-8 between two ways of running the same tokens (its query/key L2 norm, off here, to 1e-7):
`TOL`. A wrong temperature is off by 1e-4 and more.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import blockdiag_cp.hf as bhf  # noqa: E402
from blockdiag_cp import make_cp_blockdiag_batch_and_ctx  # noqa: E402
from blockdiag_cp.errors import ModelRefusal  # noqa: E402

#: logits and gradients within this of each document alone (Llama 4's norms compute in float32)
TOL = 1e-8
#: documents of 11 and 9 tokens cross the floor (4) twice; at cp 2 the 11-token one straddles the ranks
LENGTHS = (11, 1, 9, 6)
VOCAB = 64


def build(attn="blockdiag_cp", floor_scale=4, tuning=True, prepared=True):
    config = transformers.Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2, max_position_embeddings=16384,
        attention_chunk_size=None, no_rope_layers=[1, 0], floor_scale=floor_scale, attn_scale=0.5,
        attn_temperature_tuning=tuning, use_qk_norm=False, attn_implementation=attn)  # its L2 norm runs in float32
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(config).to(torch.float64).eval()
    if prepared and attn == "blockdiag_cp":
        bhf.prepare_model(model)
    return model


def packed_row(lengths=LENGTHS):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (1, sum(lengths)), generator=g)
    return ids, torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)


def each_document_alone(lengths=LENGTHS, floor_scale=4, grads=True):
    """Logits ``[1, S, V]`` and parameter gradients of each document run alone through transformers' sdpa."""
    model = build("sdpa", floor_scale)
    ids, _ = packed_row(lengths)
    logits, loss, start = [], 0.0, 0
    for n in lengths:
        with torch.set_grad_enabled(grads):
            out = model(input_ids=ids[:, start:start + n], use_cache=False).logits
        logits.append(out.detach())
        if grads:
            loss = loss + torch.nn.functional.cross_entropy(out[0, :-1], ids[0, start + 1:start + n], reduction="sum")
        start += n
    if grads:
        loss.backward()
    return torch.cat(logits, 1), [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def test_the_nope_layer_tunes_its_queries_and_the_prepared_module_is_hooked():
    model = build()
    nope = model.model.layers[1].self_attn
    assert nope.attn_temperature_tuning and not nope.use_rope  # the condition transformers tests (use_rope is 0)
    assert getattr(nope, "blockdiag_cp_query_temperature").floor_scale == 4.0
    assert getattr(model.model.layers[0].self_attn, "blockdiag_cp_query_temperature", None) is None  # a RoPE layer


def test_a_prepared_llama4_on_a_packed_row_outside_a_step_equals_each_document_alone():
    want, _ = each_document_alone(grads=False)
    ids, positions = packed_row()
    with torch.no_grad():
        got = build()(input_ids=ids, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=0, atol=TOL)


def test_an_unprepared_llama4_is_refused_where_its_positions_would_be_wrong():
    model = build(prepared=False)
    ids, positions = packed_row()
    with pytest.raises(ModelRefusal, match="attn_temperature_tuning.*prepare_model"):
        model(input_ids=ids, position_ids=positions, use_cache=False)  # a packed row
    ctx, batch = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": ids, "position_ids": positions})
    with pytest.raises(ModelRefusal, match="inside a CP step.*attn_temperature_tuning"), ctx():
        model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    one = ids[:, :11]  # one document from position 0: transformers' own positions are its document's
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=one, use_cache=False).logits,
                                   build("sdpa")(input_ids=one, use_cache=False).logits, rtol=0, atol=TOL)


def test_untuned_llama4_needs_no_preparation_and_its_row_documents_come_from_the_mask_function():
    """Without the tuning an unprepared Llama 4 is exact on a packed row: its decoder layers hand their attention
    no position_ids, so the documents come from transformers' mask function (Note [Rows whose layers are not
    handed positions])."""
    ids, positions = packed_row()
    model, plain = build(tuning=False, prepared=False), build("sdpa", tuning=False)
    want, start = [], 0
    with torch.no_grad():
        for n in LENGTHS:
            want.append(plain(input_ids=ids[:, start:start + n], use_cache=False).logits)
            start += n
        got = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(got, torch.cat(want, 1), rtol=0, atol=TOL)


def test_generation_with_a_cache_keeps_transformers_positions():
    """Decoding from a cache is transformers' own sdpa path: the tuning at the cached offset, as transformers has it."""
    ids, _ = packed_row()
    prompt = ids[:, :9]  # past the floor: positions 8..11 decode at scale > 1
    ours = build().generate(prompt, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    theirs = build("sdpa").generate(prompt, max_new_tokens=4, do_sample=False, output_logits=True,
                                    return_dict_in_generate=True)
    assert torch.equal(ours.sequences, theirs.sequences)
    torch.testing.assert_close(torch.stack(ours.logits), torch.stack(theirs.logits), rtol=0, atol=TOL)


def cp_worker(rank, world, layout, lengths, floor_scale, grads):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp import CPConfig, gather_sequence
    from blockdiag_cp.loss import add_shift_labels

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"]
    model = build(floor_scale=floor_scale)
    ids, positions = packed_row(lengths)
    batch = add_shift_labels({"input_ids": ids, "position_ids": positions})
    ctx, batch = make_cp_blockdiag_batch_and_ctx(mesh, None, batch, config=CPConfig(layout=layout))
    with ctx(), torch.set_grad_enabled(grads):
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        if grads:
            torch.nn.functional.cross_entropy(logits[0], batch["shift_labels"][0], reduction="sum").backward()
        full = gather_sequence(logits.detach())
    out = []
    for p in model.parameters() if grads else ():
        grad = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        dist.all_reduce(grad, group=mesh.get_group())
        out.append(grad)
    return full, out


@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
def test_llama4_rows_past_the_temperature_floor_under_cp_equal_each_document_alone(layout, rank_pools):
    want, want_grads = each_document_alone()
    for logits, grads in rank_pools(2).run(cp_worker, layout, LENGTHS, 4, True):
        torch.testing.assert_close(logits, want, rtol=0, atol=TOL)
        for got, ref in zip(grads, want_grads):
            torch.testing.assert_close(got, torch.zeros_like(got) if ref is None else ref, rtol=0, atol=10 * TOL)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
def test_the_shipped_floor_8192_on_an_8600_token_row_under_cp(layout, rank_pools):
    """The issue's measurement: floor_scale 8192, documents of 8,300 and 300 tokens (the first crosses the floor
    and the ranks); logits were off by 3.7e-3 past position 8,191."""
    lengths = (8300, 300)
    want, _ = each_document_alone(lengths, 8192, grads=False)
    for logits, _ in rank_pools(2).run(cp_worker, layout, lengths, 8192, False):
        torch.testing.assert_close(logits, want, rtol=0, atol=TOL)
