"""Per-token log-probabilities on each rank's shard and per-document sums over the CP group
(`loss.token_log_probs`, `loss.sum_per_document`): what preference and RL losses need, without
gathering logits. Against each document run alone (fp64), forward and backward."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import blockdiag_cp.hf  # noqa: E402,F401

VOCAB, LENGTHS, BETA = 40, (9, 14, 6, 11, 7), 0.5


def make_model(attn):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      attn_implementation=attn)
    return transformers.LlamaForCausalLM(config).to(torch.float64)


def row(edit=None):
    ids = torch.randint(0, VOCAB, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(2))
    if edit is not None:
        ids[0, edit] = (ids[0, edit] + 1) % VOCAB
    return ids, torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)


def pair_loss(sums):
    """A DPO-style loss over the pairs (doc 1, doc 2) and (doc 3, doc 4); doc 5 only its entropy's mean."""
    return -(torch.nn.functional.logsigmoid(BETA * (sums[0] - sums[1]))
             + torch.nn.functional.logsigmoid(BETA * (sums[2] - sums[3]))) / 2


def alone():
    """Each document alone through transformers' SDPA: per-document log-prob and entropy sums, grads."""
    from blockdiag_cp.loss import token_log_probs

    model = make_model("sdpa")
    ids, _ = row()
    sums, entropies, start = [], [], 0
    for n in LENGTHS:
        doc = ids[:, start : start + n]
        logits = model(input_ids=doc, use_cache=False).logits
        targets = torch.cat([doc[:, 1:], torch.full((1, 1), -100)], 1)
        logp, entropy = token_log_probs(logits, targets, temperature=0.7, with_entropy=True)
        sums.append(logp.sum())
        entropies.append(entropy.sum())
        start += n
    sums, entropies = torch.stack(sums), torch.stack(entropies)
    (pair_loss(sums) + 0.1 * entropies[4]).backward()
    return sums.detach(), entropies.detach(), [p.grad.clone() for p in model.parameters()]


def cp_worker(rank, world, layout, edit=None):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp import CPConfig, make_cp_blockdiag_batch_and_ctx
    from blockdiag_cp.loss import add_shift_labels, sum_per_document, token_log_probs
    from blockdiag_cp.parallel import reduce_gradients

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    model = make_model("blockdiag_cp")
    ids, pos = row(edit)
    batch = add_shift_labels({"input_ids": ids, "position_ids": pos})
    train_ctx, batch = make_cp_blockdiag_batch_and_ctx(mesh["cp"], None, batch, config=CPConfig(layout=layout))
    with train_ctx():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        logp, entropy = token_log_probs(logits, batch["shift_labels"], temperature=0.7, with_entropy=True)
        sums, entropies = sum_per_document(logp), sum_per_document(entropy)
        (pair_loss(sums) + 0.1 * entropies[4]).backward()
    reduce_gradients(model.parameters(), mesh["cp"])
    del dist
    return sums.detach(), entropies.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("world, layout", [(2, "balanced"), pytest.param(3, "contiguous", marks=pytest.mark.slow)])
def test_per_document_log_probs_and_their_gradients_equal_each_document_alone(world, layout, rank_pools):
    ref_sums, ref_entropies, ref_grads = alone()
    for sums, entropies, grads in rank_pools(world).run(cp_worker, layout):
        assert sums.shape == (len(LENGTHS),)  # what crossed ranks: one number per document
        assert (sums - ref_sums).abs().max() < 1e-10 and (entropies - ref_entropies).abs().max() < 1e-10
        assert max(float((g - r).abs().max()) for g, r in zip(grads, ref_grads)) < 1e-10


def test_editing_one_document_moves_only_its_own_log_prob(rank_pools):
    before = rank_pools(2).run(cp_worker, "balanced")[0][0]
    after = rank_pools(2).run(cp_worker, "balanced", LENGTHS[0] + 3)[0][0]  # a token inside document 2
    changed = (before != after).tolist()
    assert changed == [False, True, False, False, False], changed


def test_bad_shapes_are_clear_errors():
    from blockdiag_cp import make_cp_blockdiag_batch_and_ctx
    from blockdiag_cp.loss import sum_per_document, token_log_probs

    with pytest.raises(ValueError, match="same shard"):
        token_log_probs(torch.zeros(1, 4, 5), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        token_log_probs(torch.zeros(1, 4, 5), torch.zeros(1, 4, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="needs a CP step"):
        sum_per_document(torch.zeros(1, 4))
    train_ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": torch.zeros(1, 6, dtype=torch.long)})
    with pytest.raises(ValueError, match=r"\[1, 6\] shard"), train_ctx():  # (a step no model ran is refused too)
        sum_per_document(torch.zeros(1, 5))
