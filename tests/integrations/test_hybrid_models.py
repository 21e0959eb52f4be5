"""Hybrid models routed per document (`blockdiag_cp.mixers.prepare_model`): LFM2's short convolutions,
Qwen3-Next's and Qwen3.5's Gated DeltaNet.

A packed row through the prepared model inside a CP step equals each document run alone
(logits, loss, every parameter's gradient, float64), in one process and on real gloo ranks
at cp 2 (contiguous) and 3 (balanced, with activation checkpointing); documents shorter than
the convolution and 1-token documents included. Two references: each document alone
through transformers' own layers (its gated delta rule runs in float32 inside, so those
families agree to its rounding), and each document alone through the prepared model in a
step of its own (float64-exact: packing and CP change nothing). Unsupported mixers stay refused.
"""

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import blockdiag_cp.hf  # noqa: E402,F401  (registers "blockdiag_cp")
from blockdiag_cp import make_cp_blockdiag_batch_and_ctx  # noqa: E402
from blockdiag_cp.mixers import prepare_model  # noqa: E402

LENGTHS = (2, 9, 1, 14, 3, 6)
VOCAB = 64


SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
DELTA = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
             head_dim=8, linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention", "linear_attention"])
#: family -> (config class, model class, config overrides, tolerance against transformers' own layers,
#: tolerance against each document through the library). The delta-rule families compute their decay
#: from ``A_log.float()`` (as transformers does), so A_log's gradient carries float32 rounding.
FAMILIES = {
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(layer_types=["conv", "full_attention", "conv"], conv_L_cache=3),
             1e-10, 1e-10),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(DELTA, num_experts=0, mlp_only_layers=[0, 1, 2]),
                   1e-5, 1e-8),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", DELTA, 1e-5, 1e-8),
}


def build(family="lfm2", attn="blockdiag_cp"):
    config_name, model_name, extra, *_ = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**SMALL, **extra)
    config._attn_implementation = attn
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(transformers, model_name)(config).double()


def lfm2(attn="blockdiag_cp"):
    return build("lfm2", attn)


def packed_row():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, sum(LENGTHS)), generator=g)
    positions = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    return ids, positions


def each_document_alone(family="lfm2", through_the_library=False):
    """Logits, token-mean loss and gradients of every document run on its own: through transformers'
    own layers, or through the prepared model in a one-document step of its own."""
    model = build(family, "blockdiag_cp" if through_the_library else "sdpa")
    if through_the_library:
        prepare_model(model)
    ids, _ = packed_row()
    logits, loss_sum, start = [], 0.0, 0
    for n in LENGTHS:
        doc = ids[:, start : start + n]
        if through_the_library:
            ctx, batch = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": doc})
            with ctx():
                out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        else:
            out = model(input_ids=doc, use_cache=False).logits
        logits.append(out.detach())
        loss_sum = loss_sum + torch.nn.functional.cross_entropy(out[0, :-1], ids[0, start + 1 : start + n], reduction="sum")
        start += n
    loss = loss_sum / sum(n - 1 for n in LENGTHS)
    loss.backward()
    return torch.cat(logits, 1), float(loss.detach()), [p.grad.clone() for p in model.parameters()]


def step_worker(rank, world, layout, checkpointing, family="lfm2"):
    """This model's logits (gathered), loss and summed gradients for the packed row under CP."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp import CPConfig, gather_sequence
    from blockdiag_cp.loss import add_shift_labels

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"] if world > 1 else None
    model = build(family)
    assert prepare_model(model)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    ids, positions = packed_row()
    batch = add_shift_labels({"input_ids": ids, "position_ids": positions, "labels": ids.clone()})
    ctx, batch = make_cp_blockdiag_batch_and_ctx(mesh, None, batch, config=CPConfig(layout=layout))
    count = sum(n - 1 for n in LENGTHS)
    with ctx():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[0], batch["shift_labels"][0], reduction="sum") / count
        loss.backward()
        full = gather_sequence(logits.detach()) if world > 1 else logits.detach()
    grads = [p.grad.clone() for p in model.parameters()]
    total = loss.detach().clone()
    if world > 1:
        dist.all_reduce(total)
        for grad in grads:
            dist.all_reduce(grad)
    return full, float(total), grads


def assert_matches(result, reference, tolerance=1e-10):
    (logits, loss, grads), (ref_logits, ref_loss, ref_grads) = result, reference
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=tolerance)
    assert abs(loss - ref_loss) < max(tolerance, 1e-12)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=tolerance)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_prepared_hybrid_in_one_process_equals_each_document_alone(family):
    result = step_worker(0, 1, "contiguous", False, family)
    assert_matches(result, each_document_alone(family), FAMILIES[family][3])
    assert_matches(result, each_document_alone(family, through_the_library=True), FAMILIES[family][4])


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("world, layout, checkpointing", [(2, "contiguous", False), (3, "balanced", True)])
def test_a_prepared_hybrid_under_cp_equals_each_document_alone(family, world, layout, checkpointing, rank_pools):
    own, alone = each_document_alone(family), each_document_alone(family, through_the_library=True)
    for result in rank_pools(world).run(step_worker, layout, checkpointing, family):
        assert_matches(result, own, FAMILIES[family][3])
        assert_matches(result, alone, FAMILIES[family][4])


def test_preparing_changes_nothing_outside_a_step_and_refuses_packed_rows_there():
    model, plain = lfm2(), lfm2()
    prepare_model(model)
    assert prepare_model(model) == {"conv"}  # idempotent
    ids, positions = packed_row()
    one_document = ids[:, :14]
    torch.testing.assert_close(model(input_ids=one_document, use_cache=False).logits,
                               plain(input_ids=one_document, use_cache=False).logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="prepare_model"):
        model(input_ids=ids, position_ids=positions, use_cache=False)  # outside a step: not per document


def test_an_unprepared_hybrid_is_still_refused_inside_a_step_and_a_copy_keeps_its_own_weights():
    ids, positions = packed_row()
    ctx, batch = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": ids, "position_ids": positions})
    with ctx(), pytest.raises(ValueError, match="Lfm2|conv"):
        lfm2()(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    model = lfm2()
    prepare_model(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.model.layers[0].conv.conv.weight.mul_(2.0)
    with ctx():
        mine = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        theirs = twin(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    assert not torch.allclose(mine, theirs)  # the copy's routed forward reads the copy's weights


def test_the_trainer_mixin_prepares_a_supported_hybrid_and_still_refuses_others(tmp_path):
    pytest.importorskip("accelerate")
    from blockdiag_cp.trainer import BlockDiagCPTrainer

    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    trainer = BlockDiagCPTrainer(model=lfm2(), args=args, cp_size=1)
    assert getattr(trainer.model, "blockdiag_cp_routed_kinds") == {"conv"}
