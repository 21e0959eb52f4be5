"""The Trainer's and TRL's loss paths outside the model's own forward, the MoE router loss, NEFTune and
the evaluation plumbing under the mixin, each against the same stack without CP.

In-process runs (tests/trainer_runs.py): the CP runs on the rank pool's gloo ranks; the runs
without CP here (one replica: cp 2 against one process) or on pool ranks as plain DDP (dp 2 x cp 2
against DDP on 2 processes, where per-micro-batch means and the router loss are per process).
Float64 tiny Llama (its losses in float32, as transformers computes them); Mixtral in float32.
Several options share a run where they touch different parts; the label says which.
"""

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import trainer_runs as tr  # noqa: E402

SFT = {"trainer": "sft"}
METRICS_ACCUMULATED = {"eval_accumulation_steps": 1, "include_for_metrics": ["inputs", "loss"]}


def compare(pool, label, changes, reference_pool=None, tol=1e-6, param_tol=1e-6, eval_tol=None):
    """The CP run of `changes` on `pool` (cp 2) against the run without CP (here, or DDP on `reference_pool`)."""
    got = pool.run(tr.pool_run, tr.spec(cp=2, **changes))[0]
    reference = tr.spec(cp=0, **changes)
    want = tr.run(reference) if reference_pool is None else reference_pool.run(tr.pool_run, reference)[0]
    tr.assert_same(got, want, tol=tol, param_tol=param_tol, label=label, eval_tol=eval_tol)
    for key, value in want["metrics"].items():
        rel = tol if eval_tol is None else eval_tol
        assert got["metrics"].get(key) == pytest.approx(value, rel=rel), (label, key, got["metrics"], want["metrics"])


@pytest.mark.slow
def test_trainer_loss_paths_equal_the_run_without_cp(rank_pools):
    """transformers' Trainer at cp 2: label smoothing, two compute_loss_func (transformers' ForCausalLMLoss, and
    a mean over rows of squared row means: no token sum), Qwen3-VL on text rows (accepts_loss_kwargs=False: its
    loss a per-micro-batch mean); eval loss, compute_metrics' inputs, and the samplers and collators named."""
    pool = rank_pools(2)
    compare(pool, "label_smoothing_factor, group_by_length, eval_accumulation_steps, include_for_metrics",
            {"metrics": True, "args": {"label_smoothing_factor": 0.1, "train_sampling_strategy": "group_by_length",
                                       **METRICS_ACCUMULATED}})
    compare(pool, "compute_loss_func=row_mean, padding-free rows, sequential, eval_use_gather_object",
            {"loss_func": "row_mean", "collator": "flatten", "metrics": True,
             "args": {"train_sampling_strategy": "sequential", "eval_use_gather_object": True}})
    compare(pool, "compute_loss_func=ForCausalLMLoss, batch_eval_metrics, eval_do_concat_batches=False",
            {"loss_func": "causal_lm", "metrics": True,
             "args": {"batch_eval_metrics": True, "eval_do_concat_batches": False}})
    compare(pool, "Qwen3-VL text rows (accepts_loss_kwargs=False), average_tokens_across_devices=False, bf16_full_eval",
            {"model": "qwen3_vl", "args": {"average_tokens_across_devices": False, "bf16_full_eval": True}},
            eval_tol=1e-4)  # the evaluation in bf16: its rounding


@pytest.mark.slow
def test_sft_loss_paths_equal_the_run_without_cp(rank_pools):
    """TRL's SFTTrainer at cp 2: label smoothing, compute_loss_func, the DFT loss, completion-only loss on packed
    rows, a model with accepts_loss_kwargs=False (TRL's fused loss a per-micro-batch mean)."""
    pytest.importorskip("trl")
    pool = rank_pools(2)
    compare(pool, "SFT label_smoothing_factor", {**SFT, "args": {"label_smoothing_factor": 0.1}})
    compare(pool, "SFT compute_loss_func, completion_only_loss, packing (wrapped)",
            {**SFT, "loss_func": "causal_lm", "sft": {"completion_only_loss": True, "packing": True,
                                                       "packing_strategy": "wrapped", "max_length": 64}})
    compare(pool, "SFT loss_type=dft, accepts_loss_kwargs=False",
            {**SFT, "accepts_loss_kwargs": False, "sft": {"loss_type": "dft"}})


@pytest.mark.slow
def test_moe_router_loss_equals_the_run_without_cp(rank_pools):
    """Mixtral with output_router_logits=True (router_aux_loss_coef 0.5) at cp 2: the Trainer (the model's loss,
    multiplied by num_processes), the Trainer with accepts_loss_kwargs=False (not multiplied), SFTTrainer (TRL's
    fused loss plus the router loss it adds, and its logged aux_loss). Float32: 1e-5."""
    pool = rank_pools(2)
    compare(pool, "Mixtral, Trainer", {"model": "mixtral"}, tol=1e-5, param_tol=1e-5)
    compare(pool, "Mixtral, Trainer, accepts_loss_kwargs=False", {"model": "mixtral", "accepts_loss_kwargs": False},
            tol=1e-5, param_tol=1e-5)
    pytest.importorskip("trl")
    got = pool.run(tr.pool_run, tr.spec(cp=2, model="mixtral", **SFT))[0]
    want = tr.run(tr.spec(cp=0, model="mixtral", **SFT))
    tr.assert_same(got, want, keys=("loss", "grad_norm", "aux_loss"), tol=1e-5, param_tol=1e-5, label="Mixtral, SFT")


@pytest.mark.slow
def test_neftune_noise_is_the_run_without_cps(rank_pools):
    """neftune_noise_alpha=5 at cp 2: the Trainer's padded rows (B > 1 flattened into one row), SFTTrainer's
    padding-free packed rows. Each token's noise is the run without CP's, so float64 agrees to rounding
    (tests/unit/test_neftune_under_cp.py places it on every layout)."""
    pool = rank_pools(2)
    compare(pool, "NEFTune, padded rows", {"args": {"neftune_noise_alpha": 5.0}})
    pytest.importorskip("trl")
    compare(pool, "NEFTune, SFT, padding-free packed rows",
            {**SFT, "args": {"neftune_noise_alpha": 5.0}, "sft": {"packing": True, "max_length": 64}})


@pytest.mark.slow
def test_loss_normalization_at_dp2_cp2_equals_plain_ddp(rank_pools):
    """dp 2 x cp 2 (4 ranks) against plain DDP on 2 processes: the replicas' batches differ, so each
    normalization is checked across replicas too (per-micro-batch means and the router loss are per process)."""
    pool, ddp = rank_pools(4), rank_pools(2)
    compare(pool, "dp2 label_smoothing_factor, include_for_metrics",
            {"metrics": True, "args": {"label_smoothing_factor": 0.1, **METRICS_ACCUMULATED}}, ddp)
    compare(pool, "dp2 compute_loss_func=row_mean", {"loss_func": "row_mean"}, ddp)
    compare(pool, "dp2 accepts_loss_kwargs=False", {"accepts_loss_kwargs": False}, ddp)
    compare(pool, "dp2 Mixtral, Trainer", {"model": "mixtral"}, ddp, tol=1e-5, param_tol=1e-5)
    pytest.importorskip("trl")
    compare(pool, "dp2 Mixtral, SFT, accepts_loss_kwargs=False",
            {**SFT, "model": "mixtral", "accepts_loss_kwargs": False}, ddp, tol=1e-5, param_tol=1e-5)
