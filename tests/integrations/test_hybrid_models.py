"""Hybrid models routed per document (`blockdiag_cp.hf.prepare_model`): LFM2's short convolutions,
the Gated DeltaNet of Qwen3-Next and Qwen3.5, the Mamba2 mixers of Nemotron-H, Falcon-H1, Bamba
and Granite-4 hybrid.

A packed row through the prepared model equals each document run alone (logits, loss, every
parameter's gradient, float64): outside a step (one process, documents marked by
``position_ids``), in a world-1 step, and on real gloo ranks at cp 2 (contiguous) and 3
(balanced, with activation checkpointing); documents shorter than the convolution and 1-token
documents included. Two references: each document alone through transformers' own layers
(their recurrences run in float32 inside, so those families agree to its rounding), and each
document alone through the prepared model in a step of its own (float64-exact up to the
``A_log.float()`` decay transformers computes: packing and CP change nothing).
"""

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import blockdiag_cp.hf  # noqa: E402,F401  (registers "blockdiag_cp")
from blockdiag_cp import make_cp_blockdiag_batch_and_ctx  # noqa: E402
from blockdiag_cp.hf import prepare_model  # noqa: E402
from blockdiag_cp.mixers.routing import ROW_MARKS  # noqa: E402

LENGTHS = (2, 9, 1, 14, 3, 6)
VOCAB = 64

SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
DELTA = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
             head_dim=8, linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention", "linear_attention"])
#: Mamba2 sizes: 4 heads of 16 (= 2 x hidden), 2 groups of state 8, conv 4, chunks of 8 tokens
MAMBA = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=8)
#: family -> (config class, model class, config overrides, tolerance against transformers' own layers,
#: tolerance against each document through the library). The recurrent families compute their decay
#: from ``A_log.float()`` (as transformers does), so A_log's gradient carries float32 rounding.
FAMILIES = {
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(SMALL, layer_types=["conv", "full_attention", "conv"], conv_L_cache=3),
             1e-10, 1e-10),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(SMALL, **DELTA, num_experts=0, mlp_only_layers=[0, 1, 2]), 1e-5, 1e-8),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(SMALL, **DELTA), 1e-5, 1e-8),
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM",
                   dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, mamba_num_heads=4,
                        mamba_head_dim=16, ssm_state_size=8, n_groups=2, conv_kernel=4, chunk_size=8,
                        layers_block_type=["linear_attention", "full_attention", "mlp"]), 1e-5, 1e-8),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM",  # its muP multipliers away from 1: the mixer applies them
                  dict(SMALL, head_dim=8, mamba_d_ssm=64, ssm_in_multiplier=0.7, ssm_multipliers=[1.3, 0.8, 1.1, 0.9, 1.2],
                       **MAMBA), 1e-5, 1e-8),
    "bamba": ("BambaConfig", "BambaForCausalLM", dict(SMALL, attn_layer_indices=[1], **MAMBA), 1e-5, 1e-8),
    "granite_hybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
                       dict(SMALL, num_local_experts=0, shared_intermediate_size=64,
                            layer_types=["mamba", "attention", "mamba"], **MAMBA), 1e-5, 1e-8),
}
#: families whose decoder layers are handed position_ids (Granite-4 hybrid's get cu_seq_lens_q only)
GIVEN_POSITIONS = sorted(set(FAMILIES) - {"granite_hybrid"})
#: the families the fast loop runs across ranks (the others: -m slow)
FAST_ACROSS_RANKS = {"nemotron_h"}


def build(family="lfm2", attn="blockdiag_cp"):
    config_name, model_name, extra, *_ = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**extra)
    config._attn_implementation = attn
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(transformers, model_name)(config).double()


def packed_row():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, sum(LENGTHS)), generator=g)
    positions = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    return ids, positions


def cu_seq_lens():
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(LENGTHS), "max_length_k": max(LENGTHS)}


def loss_of(logits_1SV, ids):
    """Token-mean next-token loss of the packed row, every document's last token unlabelled."""
    labels, start = ids[0].clone(), 0
    for n in LENGTHS:
        labels[start : start + n - 1] = ids[0, start + 1 : start + n]
        labels[start + n - 1] = -100
        start += n
    return torch.nn.functional.cross_entropy(logits_1SV[0], labels, ignore_index=-100)


def each_document_alone(family="lfm2", through_the_library=False):
    """Logits, token-mean loss and gradients of every document run on its own: through transformers'
    own layers, or through the prepared model in a one-document step of its own."""
    model = build(family, "blockdiag_cp" if through_the_library else "sdpa")
    if through_the_library:
        prepare_model(model)
    ids, _ = packed_row()
    logits, start = [], 0
    for n in LENGTHS:
        doc = ids[:, start : start + n]
        if through_the_library:
            ctx, batch = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": doc})
            with ctx():
                out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        else:
            out = model(input_ids=doc, use_cache=False).logits
        logits.append(out)
        start += n
    logits = torch.cat(logits, 1)
    loss = loss_of(logits, ids)
    loss.backward()
    return logits.detach(), float(loss.detach()), [p.grad.clone() for p in model.parameters()]


def outside_a_step(family, marks="position_ids", checkpointing=False):
    """The packed row through the prepared model with no step: documents marked by `marks`."""
    model = build(family)
    prepare_model(model)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    ids, positions = packed_row()
    extra = cu_seq_lens() if marks == "cu_seq_lens_q" else {}
    logits = model(input_ids=ids, position_ids=positions, use_cache=False, **extra).logits
    # each decoder layer took its row marks back from its mixers: none is left for a later call to read
    assert all(getattr(m, ROW_MARKS, None) is None for m in model.modules())
    loss = loss_of(logits, ids)
    loss.backward()
    return logits.detach(), float(loss.detach()), [p.grad.clone() for p in model.parameters()]


def step_worker(rank, world, layout, checkpointing, family="lfm2", exchange="auto"):
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
    ctx, batch = make_cp_blockdiag_batch_and_ctx(mesh, None, batch, config=CPConfig(layout=layout, kv_exchange=exchange))
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
    assert len(grads) == len(ref_grads)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=tolerance)


def assert_both_references(result, family):
    assert_matches(result, each_document_alone(family), FAMILIES[family][3])
    assert_matches(result, each_document_alone(family, through_the_library=True), FAMILIES[family][4])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_prepared_hybrid_in_a_one_process_step_equals_each_document_alone(family):
    assert_both_references(step_worker(0, 1, "contiguous", False, family), family)


@pytest.mark.parametrize("family", GIVEN_POSITIONS)
def test_a_prepared_hybrid_on_a_packed_row_outside_a_step_equals_each_document_alone(family):
    assert_both_references(outside_a_step(family), family)


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_5", "granite_hybrid"])
def test_outside_a_step_documents_marked_by_cu_seq_lens_with_checkpointing(family):
    assert_both_references(outside_a_step(family, "cu_seq_lens_q", checkpointing=True), family)


def test_a_model_whose_layers_get_no_position_ids_takes_the_model_calls_on_a_packed_row():
    """Granite-4 hybrid's decoder layers are not handed position_ids: the prepared model lends its layers
    (mixers and attention alike) the model call's, so a row marked only by them is attended per document."""
    assert_matches(outside_a_step("granite_hybrid"), each_document_alone("granite_hybrid"),
                   FAMILIES["granite_hybrid"][3])


#: every family at cp 3 balanced with checkpointing (pieces alternate ranks, documents cross two
#: boundaries); cp 2 contiguous for one family per mixer kind
ACROSS_RANKS = [(family, 3, "balanced", True) for family in sorted(FAMILIES)] + [
    (family, 2, "contiguous", False) for family in ("lfm2", "qwen3_5", "nemotron_h")]


@pytest.mark.parametrize("family, world, layout, checkpointing", [
    case if case[0] in FAST_ACROSS_RANKS and case[1] == 2 else pytest.param(*case, marks=pytest.mark.slow)
    for case in ACROSS_RANKS])
def test_a_prepared_hybrid_under_cp_equals_each_document_alone(family, world, layout, checkpointing, rank_pools):
    own, alone = each_document_alone(family), each_document_alone(family, through_the_library=True)
    for result in rank_pools(world).run(step_worker, layout, checkpointing, family):
        assert_matches(result, own, FAMILIES[family][3])
        assert_matches(result, alone, FAMILIES[family][4])


@pytest.mark.parametrize("exchange", [pytest.param(e, marks=pytest.mark.slow) for e in ("a2a", "allgather", "halo", "ring")])
def test_every_cpu_exchange_carries_a_hybrids_attention_layers(exchange, rank_pools):
    """cp 3 balanced with checkpointing (documents cross two boundaries, pieces alternate ranks)."""
    alone = each_document_alone("nemotron_h", through_the_library=True)
    for result in rank_pools(3).run(step_worker, "balanced", True, "nemotron_h", exchange):
        assert_matches(result, alone, FAMILIES["nemotron_h"][4])


@pytest.mark.parametrize("family", ["nemotron_h", *(pytest.param(f, marks=pytest.mark.slow) for f in ("lfm2", "qwen3_5"))])
def test_preparing_changes_nothing_for_one_document_batches_and_generation(family):
    model, plain = build(family), build(family, "sdpa")
    kinds = prepare_model(model)
    assert prepare_model(model) == kinds  # idempotent
    ids, _ = packed_row()
    ids = ids.clamp(min=1)  # no pad token (id 0): generate() would mask it
    one_document = ids[:, :14]
    torch.testing.assert_close(model(input_ids=one_document, use_cache=False).logits,
                               plain(input_ids=one_document, use_cache=False).logits, rtol=0, atol=0)
    two_rows = torch.cat([ids[:, :10], ids[:, 10:20]])
    torch.testing.assert_close(model(input_ids=two_rows, use_cache=False).logits,
                               plain(input_ids=two_rows, use_cache=False).logits, rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mine = model.generate(one_document, max_new_tokens=5, do_sample=False)
        theirs = plain.generate(one_document, max_new_tokens=5, do_sample=False)
    assert torch.equal(mine, theirs)


def test_an_unprepared_hybrid_is_still_refused_and_a_copy_keeps_its_own_weights():
    ids, positions = packed_row()
    ctx, batch = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": ids, "position_ids": positions})
    with ctx(), pytest.raises(ValueError, match="Lfm2|conv"):
        build("lfm2")(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    with pytest.raises(ValueError, match="prepare_model"):
        build("nemotron_h")(input_ids=ids, position_ids=positions, use_cache=False)  # outside a step
    model = build("nemotron_h")
    prepare_model(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.model.layers[0].mixer.conv1d.weight.mul_(2.0)
    mine = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    theirs = twin(input_ids=ids, position_ids=positions, use_cache=False).logits
    assert not torch.allclose(mine, theirs)  # the copy's routed forward reads the copy's weights
    assert_matches(outside_a_step("nemotron_h")[:1] + (0.0, []), (mine.detach(), 0.0, []), 1e-12)


def test_the_trainer_mixin_prepares_a_supported_hybrid(tmp_path):
    pytest.importorskip("accelerate")
    from blockdiag_cp.trainer import BlockDiagCPTrainer

    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    trainer = BlockDiagCPTrainer(model=build("nemotron_h"), args=args, cp_size=1)
    assert "linear_attention" in getattr(trainer.model, "blockdiag_cp_routed_kinds")


def test_loading_through_blockdiag_cp_hf_sets_the_implementation_and_prepares():
    config_name, model_name, extra, *_ = FAMILIES["falcon_h1"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = blockdiag_cp.hf.from_config(getattr(transformers, config_name)(**extra))
    assert type(model).__name__ == model_name and model.config._attn_implementation == "blockdiag_cp"
    assert "state_space" in model.blockdiag_cp_routed_kinds
    with pytest.raises(ValueError, match="attn_implementation"):
        blockdiag_cp.hf.from_config(getattr(transformers, config_name)(**extra), attn_implementation="sdpa")


def bytes_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp import CPConfig
    from blockdiag_cp.mixers import MixerShape
    from blockdiag_cp.testing import doc_ids_from_lengths

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"]
    out = {}
    for name, lengths in {"one long document": (4000,), "many short ones": (9,) * 444 + (4,)}.items():
        batch = {"input_ids": torch.zeros(1, sum(lengths), dtype=torch.long),
                 "_packed_seq_ids": doc_ids_from_lengths(lengths).unsqueeze(0)}
        ctx, _ = make_cp_blockdiag_batch_and_ctx(mesh, None, batch, config=CPConfig(layout="contiguous"))
        state = ctx.state  # the plan, no step entered
        delta = MixerShape("gated_delta", conv_width=4, conv_channels=2 * 2 * 8 + 4 * 8, heads=4, key_heads=2,
                           key_dim=8, value_dim=8)
        out[name] = state.mixer_bytes_per_layer(delta, torch.float32)
        # Mamba2 (4 heads of 8, 2 groups of state 8: conv over x, B, C) and LFM2's conv, in bfloat16
        mamba = MixerShape("mamba2", conv_width=4, conv_channels=4 * 8 + 2 * 2 * 8, heads=4, key_heads=2,
                           key_dim=8, value_dim=8)
        out[name, "mamba2"] = state.mixer_bytes_per_layer(mamba, torch.bfloat16)
        out[name, "conv"] = state.mixer_bytes_per_layer(MixerShape("conv", 3, 64), torch.bfloat16)
    return out


def test_mixer_bytes_do_not_grow_with_the_documents_and_are_far_below_head_parallelism(rank_pools):
    """cp 2, contiguous: one boundary, so one straddling piece: up to 3 halo rows of 64 channels and one
    (P, B) of 4 x 8 x 16 in float32, each way; head parallelism moves half of every row."""
    for out in rank_pools(2).run(bytes_worker):
        for name in ("one long document", "many short ones"):
            got = out[name]
            halo_rows = 3 if name == "one long document" else 2  # that document starts 2 tokens before the cut
            assert got.halo.sent_fwd == halo_rows * 64 * 4, name
            assert got.state.sent_fwd == 4 * 8 * 16 * 4, name
            assert got.head_parallel.sent_fwd == 1000 * (64 + 8 + 32) * 4, name  # (W - 1) / W of 2000 rows
            assert got.sent == 2 * (halo_rows * 64 * 4 + 4 * 8 * 16 * 4)
            # Mamba2 in bfloat16: halo rows in bf16; per head one log transition and a [P, N] state, in float32;
            # head parallelism: x, B, C and dt in, y out
            mamba = out[name, "mamba2"]
            assert mamba.halo.sent_fwd == halo_rows * 64 * 2 and mamba.state.sent_fwd == 4 * (1 + 8 * 8) * 4, name
            assert mamba.head_parallel.sent_fwd == 1000 * ((64 + 4) + 4 * 8) * 2, name
            # a width-3 conv: 2 halo rows, no state; head parallelism: its channels in and out
            conv = out[name, "conv"]
            assert (conv.halo.sent_fwd, conv.state.sent_fwd) == (2 * 64 * 2, 0), name
            assert conv.head_parallel.sent_fwd == 1000 * (64 + 64) * 2 and conv.halo.recv_bwd == 2 * 64 * 2, name


@pytest.mark.parametrize("family", ["nemotron_h", pytest.param("lfm2", marks=pytest.mark.slow)])
def test_a_left_padded_prompt_generates_as_without_the_library(family):
    """One prompt with padding and a cache is the layer's own forward, which fills the cache."""
    model, plain = build(family), build(family, "sdpa")
    prepare_model(model)
    ids = packed_row()[0].clamp(min=1)[:, :12]
    ids[:, :3] = 0  # pad_token_id
    mask = (ids != 0).long()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mine = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
        theirs = plain.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(mine, theirs)


def test_continuing_from_a_cache_a_packed_row_filled_is_refused():
    model = build("nemotron_h")
    prepare_model(model)
    ids, positions = packed_row()
    out = model(input_ids=ids, position_ids=positions, use_cache=True)
    with pytest.raises(ValueError, match="packed row of several documents"):
        model(input_ids=ids[:, -1:], position_ids=positions[:, -1:] + 1, past_key_values=out.past_key_values,
              use_cache=True)


def grouped_bytes_worker(rank, world):
    """This rank's mixer bytes under the grouped layout (point-to-point routes) and the route's own counts."""
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp import CPConfig, PlanOptions
    from blockdiag_cp.mixers import MixerShape
    from blockdiag_cp.mixers.conv import conv_plan
    from blockdiag_cp.testing import doc_ids_from_lengths
    from blockdiag_cp.testing.world_parity import TINY_ROW_COSTS

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"]
    lengths = (90, 3, 2, 61, 5)
    batch = {"input_ids": torch.zeros(1, sum(lengths), dtype=torch.long),
             "_packed_seq_ids": doc_ids_from_lengths(lengths).unsqueeze(0)}
    config = CPConfig(layout="grouped", plan=PlanOptions(costs=TINY_ROW_COSTS))
    ctx, _ = make_cp_blockdiag_batch_and_ctx(mesh, None, batch, config=config)
    state = ctx.state
    delta = MixerShape("gated_delta", conv_width=4, conv_channels=2 * 2 * 8 + 4 * 8, heads=4, key_heads=2,
                       key_dim=8, value_dim=8)
    got = state.mixer_bytes_per_layer(delta, torch.float32)
    route = conv_plan(state, 4).route
    return got, route.peers, sum(route.send_splits), sum(route.recv_splits)


def test_grouped_mixer_bytes_send_back_what_came_in(rank_pools):
    """Grouped layout, world 3: conv halos and states go point-to-point; backward returns each received row's
    gradient to its sender, so a rank sends backward what it received forward (ranks here hand on
    different numbers of states)."""
    out = rank_pools(3).run(grouped_bytes_worker)
    assert all(peers for _, peers, _, _ in out)
    entry = (2 * 2 * 8 + 4 * 8) * 4
    for got, _, sent_rows, recv_rows in out:
        assert (got.halo.sent_fwd, got.halo.recv_fwd) == (sent_rows * entry, recv_rows * entry)
        for traffic in (got.halo, got.state):
            assert (traffic.sent_bwd, traffic.recv_bwd) == (traffic.recv_fwd, traffic.sent_fwd)
    assert any(got.state.sent_fwd != got.state.recv_fwd for got, *_ in out)
    for part in ("halo", "state"):  # what is sent is received
        assert sum(getattr(g, part).sent_fwd for g, *_ in out) == sum(getattr(g, part).recv_fwd for g, *_ in out) > 0
