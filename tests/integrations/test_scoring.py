"""Scoring forwards under CP (`hf.scoring.ScoringSession`): TRL's fused-head calls on padded rows
(right-padded like DPO's chosen/rejected, left-padded prompts like GRPO's) run as one packed row
sharded over gloo ranks. Against the same model on the padded rows without CP (float64 model;
TRL's head computes in float32): per-token fields, a DPO-style loss's gradients, and a leak probe."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
trl_utils = pytest.importorskip("trl.trainer.utils")

VOCAB, FIELDS = 50, ("log_probs", "entropy", "is_top1", "mean_logits", "label_mask")
#: (left padding, prompt, completion, right padding) per row; rows 0-1 / 2-3 are chosen / rejected pairs
ROWS = ((0, 5, 9, 0), (0, 5, 4, 5), (3, 4, 7, 0), (0, 7, 6, 1))


def make_model(attn):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attn_implementation=attn)
    model = transformers.LlamaForCausalLM(config).to(torch.float64)
    trl_utils.add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    return model


def padded_rows(edit=None):
    """``input_ids``, ``attention_mask``, ``labels`` ``[4, 18]`` (labels: the completion only)."""
    T = sum(ROWS[0])
    ids = torch.randint(1, VOCAB, (len(ROWS), T), generator=torch.Generator().manual_seed(3))
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for r, (left, prompt, completion, _) in enumerate(ROWS):
        mask[r, left : left + prompt + completion] = 1
        labels[r, left + prompt : left + prompt + completion] = ids[r, left + prompt : left + prompt + completion]
    ids = ids.masked_fill(mask == 0, 0)
    if edit is not None:
        r, t = edit
        ids[r, t] = ids[r, t] % (VOCAB - 1) + 1
        labels[r, t] = ids[r, t] if labels[r, t] != -100 else -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def pair_loss(log_probs):
    sums = log_probs.sum(dim=1)
    return -torch.nn.functional.logsigmoid(0.5 * (sums[0::2] - sums[1::2])).mean()


def without_cp():
    model = make_model("sdpa")
    out = model(**padded_rows(), fused_lm_head=True)
    pair_loss(out.log_probs).backward()
    return {f: getattr(out, f).detach() for f in (*FIELDS, "loss")}, [p.grad.clone() for p in model.parameters()]


def cp_worker(rank, world, edit=None, checkpointing=False):
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp import CPConfig
    from blockdiag_cp.hf.scoring import ScoringSession
    from blockdiag_cp.parallel import reduce_gradients

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    model = make_model("blockdiag_cp")
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
        model.train()
    session = ScoringSession(mesh["cp"], CPConfig())
    session.install(model)
    with session():
        out = model(**padded_rows(edit), fused_lm_head=True)
        with torch.no_grad():  # a reference forward on the same rows reuses the pending step
            again = model(**padded_rows(edit), fused_lm_head=True)
        pair_loss(out.log_probs).backward()
    reduce_gradients(model.parameters(), mesh["cp"], average=True)  # as DDP averages over the CP ranks
    assert torch.equal(again.log_probs, out.log_probs.detach())
    return {f: getattr(out, f).detach() for f in (*FIELDS, "loss")}, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("world, checkpointing", [(2, True), pytest.param(3, False, marks=pytest.mark.slow)])
def test_scoring_forwards_equal_the_padded_rows_without_cp(world, checkpointing, rank_pools):
    ref_fields, ref_grads = without_cp()
    for fields, grads in rank_pools(world).run(cp_worker, None, checkpointing):
        for name in FIELDS:
            assert fields[name].shape == ref_fields[name].shape == (len(ROWS), sum(ROWS[0]) - 1), name
            assert fields[name].dtype == ref_fields[name].dtype, name
        assert torch.equal(fields["label_mask"], ref_fields["label_mask"])
        assert torch.equal(fields["is_top1"], ref_fields["is_top1"])
        for name in ("log_probs", "entropy", "mean_logits", "loss"):
            assert (fields[name] - ref_fields[name]).abs().max() < 1e-5, name  # float32 inside TRL's head
        assert max(float((g - r).abs().max()) for g, r in zip(grads, ref_grads)) < 1e-6


def test_editing_one_completion_moves_only_its_own_log_probs(rank_pools):
    before = rank_pools(2).run(cp_worker)[0][0]["log_probs"]
    after = rank_pools(2).run(cp_worker, (2, 3 + 4 + 2))[0][0]["log_probs"]  # a completion token of row 2
    moved = (before != after).any(dim=1).tolist()
    assert moved == [False, False, True, False], moved
    assert torch.equal(before[2, : 3 + 4], after[2, : 3 + 4])  # nothing before the edit moves either


def test_a_second_forward_on_other_rows_while_gradients_are_pending_is_refused():
    from blockdiag_cp import CPConfig
    from blockdiag_cp.hf.scoring import ScoringSession

    model = make_model("blockdiag_cp")
    session = ScoringSession(None, CPConfig())
    session.install(model)
    with session():
        model(**padded_rows(), fused_lm_head=True)
        with pytest.raises(ValueError, match="other rows"):
            model(**padded_rows((0, 6)), fused_lm_head=True)
    with session(), pytest.raises(ValueError, match=r"input_ids \[B, T\] and labels"):
        model(input_ids=padded_rows()["input_ids"], fused_lm_head=True)
    rows = padded_rows()
    with session(), pytest.raises(ValueError, match="do not pass shift_labels"):
        model(**rows, shift_labels=rows["labels"], fused_lm_head=True)
    with session(), torch.no_grad():  # the loss divides as TRL's head does: by num_items_in_batch when given
        scored = model(**rows, num_items_in_batch=torch.tensor(10), fused_lm_head=True)
    assert torch.allclose(scored.loss, -scored.log_probs.sum() / 10)
    plain = model(**padded_rows(), fused_lm_head=True)  # outside a session: TRL's own forward
    assert plain.log_probs.shape == (len(ROWS), sum(ROWS[0]) - 1)


def test_rows_with_images_are_refused():
    from blockdiag_cp import CPConfig
    from blockdiag_cp.hf.scoring import ScoringSession

    model = make_model("blockdiag_cp")
    session = ScoringSession(None, CPConfig())
    session.install(model)
    with session(), pytest.raises(ValueError, match="cannot shard pixel_values"):
        model(**padded_rows(), pixel_values=torch.zeros(1, 3, 4, 4), fused_lm_head=True)


def test_the_loss_divides_by_the_rows_next_token_targets_as_trls_head_does():
    """Rows labelled from their first token (as an SFT-style scorer labels them): TRL's own head, outside a
    session, counts targets of the shifted labels; the session's loss divides by the same count."""
    from blockdiag_cp import CPConfig
    from blockdiag_cp.hf.scoring import ScoringSession

    model = make_model("blockdiag_cp")
    rows = padded_rows()
    rows["labels"] = rows["input_ids"].masked_fill(rows["attention_mask"] == 0, -100)  # every real token
    with torch.no_grad():
        theirs = model(**rows, fused_lm_head=True)
        session = ScoringSession(None, CPConfig())
        session.install(model)
        with session():
            mine = model(**rows, fused_lm_head=True)
    assert torch.allclose(mine.log_probs, theirs.log_probs, atol=1e-5)
    assert torch.allclose(mine.loss, theirs.loss, atol=1e-5)
    assert torch.allclose(mine.loss, -mine.log_probs.sum() / (rows["labels"][:, 1:] != -100).sum())


def test_a_frozen_models_forward_leaves_nothing_pending():
    """A reference model with frozen parameters, scored with gradients enabled, has no backward to wait for:
    a forward on other rows afterwards is not refused."""
    from blockdiag_cp import CPConfig
    from blockdiag_cp.hf.scoring import ScoringSession

    frozen = make_model("blockdiag_cp").requires_grad_(False)
    session = ScoringSession(None, CPConfig())
    session.install(frozen)
    with session():
        first = frozen(**padded_rows(), fused_lm_head=True)
        other = frozen(**padded_rows((0, 6)), fused_lm_head=True)  # other rows
    assert not first.log_probs.requires_grad and not torch.equal(first.log_probs, other.log_probs)


def test_a_moe_load_balancing_loss_is_refused_across_cp_ranks():
    """The router's auxiliary loss is not a sum over shards: a scoring forward under CP that returns one is
    a ValueError (the session's output hook, as it sees a world-2 step's output)."""
    from types import SimpleNamespace

    from blockdiag_cp import CPConfig
    from blockdiag_cp.hf.scoring import ScoringSession

    session = ScoringSession(None, CPConfig())
    with session():
        session._step = SimpleNamespace(ctx=SimpleNamespace(state=SimpleNamespace(world=2)))
        with pytest.raises(ValueError, match="load-balancing loss"):
            session._post_hook(None, (), {"fused_lm_head": True}, SimpleNamespace(aux_loss=torch.tensor(0.1)))
