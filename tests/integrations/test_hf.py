"""transformers integration: parity of logits, loss and parameter gradients with each document run alone."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import blockdiag_cp.hf as bhf  # noqa: E402  (registers "blockdiag_cp")

LENGTHS = (7, 12, 5, 9, 3, 14)
VOCAB = 50


def make_model(arch, attn="blockdiag_cp", **extra):
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, attn_implementation=attn, **extra)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[arch]
    return model_cls(config_cls(**common)).to(torch.float64)


def packed_row():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, sum(LENGTHS)), generator=g)
    pos = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    return ids, pos


def reference(arch):
    """Each document alone through transformers' own SDPA attention."""
    model = make_model(arch, attn="sdpa")
    ids, _ = packed_row()
    logits, loss_sum, count, start = [], 0.0, 0, 0
    for n in LENGTHS:
        x = ids[:, start : start + n]
        out = model(input_ids=x, use_cache=False).logits
        logits.append(out.detach())
        loss_sum = loss_sum + torch.nn.functional.cross_entropy(out[0, :-1], x[0, 1:], reduction="sum")
        count += n - 1
        start += n
    loss = loss_sum / count
    loss.backward()
    return torch.cat(logits, 1), loss.item(), [p.grad.clone() for p in model.parameters()]


def cp_worker(rank, world, arch, checkpointing, layout, ulysses=1):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp import CPConfig, HeadsConfig, gather_sequence, make_cp_blockdiag_batch_and_ctx
    from blockdiag_cp.loss import add_shift_labels

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    model = make_model(arch)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
        model.train()
    ids, pos = packed_row()
    batch = add_shift_labels({"input_ids": ids, "position_ids": pos, "labels": ids.clone()})
    config = CPConfig(layout=layout, heads=HeadsConfig(ulysses_degree=ulysses))
    train_ctx, batch = make_cp_blockdiag_batch_and_ctx(mesh["cp"], None, batch, config=config)
    n_global = sum(n - 1 for n in LENGTHS)
    with train_ctx():
        # transformers' own loss path (it upcasts logits to float32): shift_labels + global item count
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                    shift_labels=batch["shift_labels"], num_items_in_batch=torch.tensor(n_global), use_cache=False)
        hf_loss = out.loss.detach().clone()
        # the same loss in float64, backpropagated: this rank's token-loss sum / global token count
        targets = batch["shift_labels"][0]
        loss = torch.nn.functional.cross_entropy(out.logits[0], targets, reduction="sum") / n_global
        loss.backward()
        logits = gather_sequence(out.logits.detach())
    losses = torch.stack([loss.detach(), hf_loss.to(torch.float64)])
    dist.all_reduce(losses)
    grads = [p.grad.clone() for p in model.parameters()]
    for grad in grads:
        dist.all_reduce(grad)
    return logits, losses.tolist(), grads


@pytest.mark.parametrize(
    "arch, world, checkpointing, layout, ulysses",
    [
        ("llama", 2, None, "contiguous", 1),
        ("llama", 3, "non_reentrant", "balanced", 1),
        ("qwen2", 2, "reentrant", "balanced", 1),
        ("qwen2", 3, None, "contiguous", 1),
        ("llama", 4, None, "balanced", 2),  # hybrid: head all-to-all in pairs, needed-only K/V between pairs
        ("qwen2", 4, "reentrant", "contiguous", 4),  # pure Ulysses, 2 K/V heads over 4 ranks
    ],
)
@pytest.mark.slow
def test_cp_model_matches_documents_run_alone(arch, world, checkpointing, layout, ulysses, rank_pools):
    ref_logits, ref_loss, ref_grads = reference(arch)
    for logits, (loss, hf_loss), grads in rank_pools(world).run(cp_worker, arch, checkpointing, layout, ulysses):
        assert (logits - ref_logits).abs().max() < 1e-10
        assert abs(loss - ref_loss) < 1e-10
        assert abs(hf_loss - ref_loss) < 1e-6  # float32 inside transformers' loss
        assert max(float((g - r).abs().max()) for g, r in zip(grads, ref_grads)) < 1e-10


def test_outside_a_step_a_packed_row_is_attended_per_document():
    ref_logits, _, _ = reference("llama")
    model = make_model("llama")
    ids, pos = packed_row()
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    assert (logits - ref_logits).abs().max() < 1e-10


def test_flattening_collator_batch_without_cp():
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    ids, _ = packed_row()
    features, start = [], 0
    for n in LENGTHS:
        features.append({"input_ids": ids[0, start : start + n].tolist()})
        start += n
    batch = collator(features)
    assert "attention_mask" not in batch and "cu_seq_lens_q" in batch
    ref_logits, _, _ = reference("llama")
    model = make_model("llama")
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    assert (logits - ref_logits).abs().max() < 1e-10


def test_plain_unpacked_batches_still_work_outside_a_step():
    model_ours, model_sdpa = make_model("llama"), make_model("llama", attn="sdpa")
    x = torch.randint(0, VOCAB, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    a = model_ours(input_ids=x, attention_mask=mask, use_cache=False).logits
    b = model_sdpa(input_ids=x, attention_mask=mask, use_cache=False).logits
    assert (a[0] - b[0]).abs().max() < 1e-10 and (a[1, 3:] - b[1, 3:]).abs().max() < 1e-10


def test_registration_is_idempotent_and_public():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert bhf.register() == bhf.register() == "blockdiag_cp"
    assert AttentionInterface._global_mapping["blockdiag_cp"] is bhf.blockdiag_cp_attention
    assert AttentionMaskInterface._global_mapping["blockdiag_cp"] is bhf.blockdiag_cp_mask
    model = make_model("llama", attn="sdpa")
    model.set_attn_implementation("blockdiag_cp")
    assert model.config._attn_implementation == "blockdiag_cp"
