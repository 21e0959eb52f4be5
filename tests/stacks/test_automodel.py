"""NeMo AutoModel 0.7.0 under blockdiag-cp (issue #55, docs/automodel.md), in a venv of its own
(``bash tests/stacks/run.sh automodel``: AutoModel installs with ``--no-deps``).

Everything runs AutoModel's own code on CPU gloo ranks (tests/stacks/automodel_runs.py): its device mesh, its packed
collator's rows (pre-shifted labels, restarting positions, a 4-D block-causal or indexed mask, ``_packed_seq_ids``),
its sharder resolution (``ContextParallelSharder(model, device_mesh, batch)``: the model-owned hook first), its token
verbs, its loss, and its fine-tuning recipe's train step (``_run_train_optim_step``) with its FSDP2 infrastructure.

* the sharder, two families at cp 2 and cp 3 (float64): logits gathered by AutoModel's verb, the loss and every
  parameter's gradient equal each document run alone (1e-12); the layout's indices are this library's balanced plan;
  AutoModel's token verbs shard the full labels and positions exactly as the step did; AutoModel's own blockdiag
  reference (its kernel, its contiguous sharder) on the same row and weights gives the same numbers;
* Mistral's sliding window at cp 2: exact, where AutoModel's reference kernel attends past the window;
* cp 1 (AutoModel calls no hook and hands the model the collator's row): exact with both of its masks, where its
  reference kernel lets documents see each other under the indexed mask;
* the recipe's train step at cp 2 (llama) and cp 3 (qwen3), and at dp 2 x cp 2 under FSDP2, two steps: losses and
  grad norms equal the same recipe without CP (one rank, the rows as micro-batches): the first step to 1e-12, after
  AdamW's step 1e-8, then the recipe's validation forward (at world 3 the float32 rule: AutoModel's FSDP2 over 3 ranks
  differs that much without CP too);
* refusals by name, before any collective.
"""

import pytest
import torch

pytest.importorskip("nemo_automodel")

import automodel_runs as runs  # noqa: E402

from blockdiag_cp import CPConfig, make_cp_blockdiag_batch_and_ctx, plan_shards  # noqa: E402
from blockdiag_cp.integrations import automodel  # noqa: E402
from blockdiag_cp.testing.oracle import doc_ids_from_lengths  # noqa: E402

#: interior padding, a 1-token document, a document straddling ranks; 55 tokens: CP pads the row at cp 2 and 3
SEGMENTS = (13, -5, 20, 9, 1, 7)
TOL = 1e-12
#: after an AdamW step: its update divides by sqrt(v) + 1e-8, so a gradient's last bits (1e-16) move a parameter by up
#: to lr * 1e-16 / 1e-8
TOL_STEPS = 1e-8
#: AutoModel's FSDP2 over 3 gloo ranks is float32-exact only, with or without CP: at dp 3 x cp 1 (no CP) its
#: gradients differ from the one-rank run by 1e-9 (7e-8 relative), its parameters after one AdamW step by 9e-6. At
#: world 3 the recipe is held to the float32 rule (losses 1e-5 relative, parameters 1e-4); the sharder's test holds
#: cp 3 itself to 1e-12.
TOL_WORLD3 = {"first": 1e-7, "steps": 1e-5, "params": 1e-4}


def assert_equals_alone(result: dict, alone: runs.Alone, segments=SEGMENTS) -> None:
    real = doc_ids_from_lengths(segments) != 0
    assert runs.max_error(result["logits"], alone.logits, real) < TOL
    assert abs(result["loss"] - alone.loss) < TOL
    assert runs.grad_error(result["grads"], alone.grads) < TOL


@pytest.mark.slow
@pytest.mark.parametrize("family,world", [("llama", 2), ("qwen3", 3)])
def test_sharder_exact_and_equal_to_automodel_reference(rank_pools, family, world):
    alone = runs.each_document_alone(family, SEGMENTS)
    pool = rank_pools(world)
    ours = pool.run(runs.sharder_worker, family, SEGMENTS, "blockdiag_cp")
    reference = pool.run(runs.sharder_worker, family, SEGMENTS, "automodel")
    plan = plan_shards(doc_ids_from_lengths(SEGMENTS), world, "balanced")
    for rank, (mine, theirs) in enumerate(zip(ours, reference)):
        assert_equals_alone(mine, alone)
        assert_equals_alone(theirs, alone)
        assert torch.equal(mine["indices"], plan.rank_positions(rank))
        assert mine["labels_by_verb"] and mine["positions_by_verb"]
        assert "attention_mask" not in mine["keys"] and "padding_mask" in mine["keys"]


@pytest.mark.slow
def test_automodel_own_llama_at_cp3(rank_pools):
    """AutoModel's own Llama implementation (``backend.attn="sdpa"``: it calls transformers' attention interface)."""
    alone = runs.each_document_alone("automodel_llama", SEGMENTS)
    for result in rank_pools(3).run(runs.sharder_worker, "llama", SEGMENTS, "automodel_llama"):
        assert_equals_alone(result, alone)


@pytest.mark.slow
def test_sliding_window_at_cp2(rank_pools):
    """Mistral (every layer a sliding window of 7): exact; AutoModel's reference kernel drops the window."""
    alone = runs.each_document_alone("mistral", SEGMENTS)
    pool = rank_pools(2)
    for result in pool.run(runs.sharder_worker, "mistral", SEGMENTS, "blockdiag_cp"):
        assert_equals_alone(result, alone)
    real = doc_ids_from_lengths(SEGMENTS) != 0
    for result in pool.run(runs.sharder_worker, "mistral", SEGMENTS, "automodel"):
        assert runs.max_error(result["logits"], alone.logits, real) > 1e-2


@pytest.mark.slow
def test_indexed_mask_at_cp2(rank_pools):
    """AutoModel's other packed mask (the indexed ``[1, S]`` one) reaches the step's document ids."""
    alone = runs.each_document_alone("llama", SEGMENTS, "document_ids")
    for result in rank_pools(2).run(runs.sharder_worker, "llama", SEGMENTS, "blockdiag_cp", "document_ids"):
        assert_equals_alone(result, alone)


@pytest.mark.slow
@pytest.mark.parametrize("mask", ["block_causal", "document_ids"])
def test_cp1_keeps_documents_apart(rank_pools, mask):
    """At cp 1 AutoModel resolves its identity sharder (no hook, no step) and the model gets the collator's row."""
    alone = runs.each_document_alone("llama", SEGMENTS, mask)
    pool = rank_pools(1)
    (ours,) = pool.run(runs.sharder_worker, "llama", SEGMENTS, "blockdiag_cp", mask)
    assert_equals_alone(ours, alone)
    (theirs,) = pool.run(runs.sharder_worker, "llama", SEGMENTS, "automodel", mask)
    real = doc_ids_from_lengths(SEGMENTS) != 0
    leak = runs.max_error(theirs["logits"], alone.logits, real)
    if mask == "block_causal":  # transformers applies the collator's 4-D mask
        assert leak < TOL
    else:  # the indexed mask is a padding mask to transformers: the reference kernel attends across documents
        assert leak > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("family,world,cp", [("llama", 2, 2), ("qwen3", 3, 3), ("llama", 4, 2)])
def test_recipe_train_step_equals_without_cp(rank_pools, family, world, cp):
    tol = TOL_WORLD3 if world == 3 else {"first": TOL, "steps": TOL_STEPS, "params": TOL_STEPS}
    reference = rank_pools(1).run(runs.recipe_worker, family, 1, 2)[0]
    assert reference["mask"] == "document_ids"  # enable() asked AutoModel's collator for [B, S] ids
    for result in rank_pools(world).run(runs.recipe_worker, family, cp, 2):
        for key in ("losses", "grad_norms"):
            assert result[key][0] == pytest.approx(reference[key][0], rel=tol["first"], abs=0)
            assert result[key] == pytest.approx(reference[key], rel=tol["steps"], abs=0)
        assert runs.grad_error(result["params"], reference["params"]) < tol["params"]
        assert result["eval_loss"] == pytest.approx(reference["eval_loss"], rel=tol["steps"], abs=0)


def test_refusals_by_name():
    batch = runs.packed_batch(SEGMENTS)
    with pytest.raises(ValueError, match="shard_primary=False"):
        make_cp_blockdiag_batch_and_ctx(None, None, dict(batch), shard_primary=False)
    with pytest.raises(ValueError, match="shard_primary=False"):
        automodel.shard_batch(None, None, dict(batch), shard_primary=False)
    with pytest.raises(ValueError, match="equal shards"):
        automodel.make_sharder(CPConfig(layout="grouped"))
    model = automodel.enable(runs.build("llama"))
    with pytest.raises(ValueError, match="num_chunks=2"):
        model.prepare_model_inputs_for_cp(batch, num_chunks=2)
    with pytest.raises(ValueError, match="already"):
        automodel.enable(model)
    other = runs.build("llama")
    other.backend = type("BackendConfig", (), {"attn": "te"})()
    with pytest.raises(ValueError, match="backend.attn"):
        automodel.enable(other)
    vlm = runs.build("llama")
    vlm.config.vision_config = {"depth": 1}
    with pytest.raises(ValueError, match="vision-language"):
        automodel.enable(vlm)


def test_three_output_form_at_world_one():
    """AutoModel's form: ``(train_ctx, batch, ShardLayout)``; the seed's entry keeps its two outputs."""
    from nemo_automodel.components.distributed.context_parallel.sharder import ShardLayout

    train_ctx, batch, layout = automodel.shard_batch(None, None, runs.packed_batch(SEGMENTS))
    assert isinstance(layout, ShardLayout)
    S = sum(abs(n) for n in SEGMENTS)
    assert layout.original_seq_len == layout.padded_seq_len == S
    assert torch.equal(layout.local_token_global_indices, torch.arange(S))
    assert batch["input_ids"].shape == (1, S) and callable(train_ctx)
    assert len(make_cp_blockdiag_batch_and_ctx(None, None, runs.packed_batch(SEGMENTS))) == 2
