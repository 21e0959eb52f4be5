"""The mixin's whole-batch mode (``whole_batch=True``, Note [The whole-batch mode of the mixin]): each global
micro-batch planned over all dp x cp ranks equals the run without CP (plain DDP on the replicas): logged losses
and grad norms, TRL's logged metrics, the eval loss and metrics, the final parameters; with gradient
accumulation, a partial last batch and label smoothing; per-replica losses refused by name."""

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import trainer_runs as tr  # noqa: E402
from blockdiag_cp.hf.whole_batch import refuse_per_replica_losses  # noqa: E402

#: one epoch of 23 documents at 3 per device, dp 2, 2 accumulated: the last micro-batches partial
EPOCH = {"num_train_epochs": 1}


def compare(pool, ddp, label, changes, keys=("loss", "grad_norm"), tol=1e-6, whole_batch=True):
    got = pool.run(tr.pool_run, tr.spec(cp=2, whole_batch=whole_batch, **changes))[0]
    want = ddp.run(tr.pool_run, tr.spec(cp=0, **changes))[0]
    tr.assert_same(got, want, keys=keys, tol=tol, param_tol=tol, label=label)
    assert got["planning_threads_after_train"] == [], (label, "the planning thread outlives train()")
    for key, value in want["metrics"].items():
        assert got["metrics"].get(key) == pytest.approx(value, rel=tol), (label, key, got["metrics"], want["metrics"])
    return got


@pytest.mark.slow
def test_the_trainer_on_whole_batches_equals_ddp_without_cp(rank_pools):
    pool, ddp = rank_pools(4), rank_pools(2)
    compare(pool, ddp, "whole batches, label smoothing, metrics, accumulation, partial last batch",
            {"docs": 23, "eval_docs": 7, "metrics": True, "steps": -1,
             "args": {**EPOCH, "label_smoothing_factor": 0.1, "include_for_metrics": ["inputs", "loss"]}})
    compare(pool, ddp, "whole batches, padding-free rows", {"collator": "flatten"})


@pytest.mark.slow
@pytest.mark.parametrize("whole_batch", [True, False])
def test_sft_logs_the_metrics_of_ddp_without_cp(whole_batch, rank_pools):
    """TRL's entropy and token accuracy (Note [TRL's token metrics under CP]), with whole batches and with each
    replica's rows on its CP group: the last micro-batch of the epoch keeps what the replicas' processes keep."""
    pytest.importorskip("trl")
    pool, ddp = rank_pools(4), rank_pools(2)
    keys = ("loss", "grad_norm", "mean_token_accuracy", "entropy", "num_tokens")
    compare(pool, ddp, f"SFT whole_batch={whole_batch}, packing, completion-only loss, metrics",
            {"trainer": "sft", "sft": {"packing": True, "max_length": 64, "completion_only_loss": True}},
            keys=keys, whole_batch=whole_batch)
    # 19 rows, 3 per device, dp 2: the epoch's last global batch holds one row, and accelerate keeps the first
    # process's values only (remainder 1): the replicas' sums must be trimmed the same way
    compare(pool, ddp, f"SFT whole_batch={whole_batch}, an epoch of 19 rows (remainder 1)",
            {"trainer": "sft", "docs": 19, "steps": -1, "accum": 1, "args": EPOCH}, keys=keys, whole_batch=whole_batch)


@pytest.mark.parametrize("options, accepts, router, named", [
    ({"average_tokens_across_devices": False}, True, False, "average_tokens_across_devices=False"),
    ({}, False, False, "accepts_loss_kwargs=False"),
    ({}, True, True, "output_router_logits"),
    ({"neftune_noise_alpha": 5.0}, True, False, "neftune_noise_alpha"),
])
def test_per_replica_losses_are_refused_by_name(options, accepts, router, named):
    from types import SimpleNamespace

    args = SimpleNamespace(**{"average_tokens_across_devices": True, "neftune_noise_alpha": None, **options})
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        refuse_per_replica_losses(args, None, accepts, router)
    with pytest.raises(ValueError, match="compute_loss_func"):
        refuse_per_replica_losses(SimpleNamespace(average_tokens_across_devices=True), lambda *a: 0, True, False)
    refuse_per_replica_losses(SimpleNamespace(average_tokens_across_devices=True, label_smoothing_factor=0.1),
                              None, True, False)  # label smoothing: a sum over tokens, kept


def test_scoring_trainers_are_refused_in_the_whole_batch_mode():
    """DPO and GRPO score their rows per replica: their strategy refuses whole_batch=True when it is adopted."""
    from types import SimpleNamespace

    from blockdiag_cp import CPConfig
    from blockdiag_cp.hf.trainer_scoring import GeneratingStrategy, ScoringStrategy

    for strategy in (ScoringStrategy, GeneratingStrategy):
        trainer = SimpleNamespace(cp_mesh=None, cp_config=CPConfig(), cp_size=1, whole_batch=True, dp_rank=0,
                                  linear_ce=False)
        with pytest.raises(ValueError, match="DPO and GRPO"):
            strategy(trainer).adopt([], "in a test")
