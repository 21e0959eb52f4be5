"""The mixin's ``linear_ce=True`` on sharded stacks: under DeepSpeed ZeRO-2 and ZeRO-3 and accelerate's FSDP2 (the
CPU stand-in of tests/trainer_runs.py) it trains as the plain loss on the same stack does (losses, grad norms, final
parameters). Under ZeRO-3 the loss reads the LM head's weight outside the head's own forward and backward, which
is all DeepSpeed gathers it for: the loss leaves the model as its output and the head's weight is an external
parameter of the model (Note [A loss outside the modules under ZeRO-3] in hf/parallelism.py)."""

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import trainer_runs as tr  # noqa: E402
from trainer_runs import fsdp2, zero  # noqa: E402

#: ZeRO-3 releasing every parameter after each module's forward and backward (no persistent small parameters, no
#: reuse window): the head's weight is partitioned between the head's forward and the loss's backward on every step
RELEASING = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}


@pytest.fixture
def pool():
    from blockdiag_cp.testing import RankPool

    pool = RankPool(2, timeout=900)  # DeepSpeed keeps process-wide state: a pool of this test's own
    yield pool
    pool.close()


def lean_against_plain(pool, label: str, wrapper: str, **changes) -> None:
    """dp 1 x cp 2, 2 accumulated micro-batches, clipping: the linear-CE loss against the plain one, both under the
    mixin on the same stack, trained by `wrapper`."""
    plain = pool.run(tr.pool_run, tr.spec(cp=2, **changes))[0]
    got = pool.run(tr.pool_run, tr.spec(cp=2, linear_ce=True, **changes))[0]
    assert got["wrapper"] == plain["wrapper"] == wrapper, (label, got["wrapper"], plain["wrapper"])
    tr.assert_same(got, plain, tol=1e-6, param_tol=1e-5, label=f"linear_ce under {label}")


@pytest.mark.slow
def test_linear_ce_under_deepspeed_equals_the_plain_loss_on_it(pool):
    """ZeRO-2 (float64), and ZeRO-3 (float32: DeepSpeed partitions float32, bfloat16 and float16 parameters only)
    with a separate and a tied head (the input embeddings' weight: its gradients from the loss and from the
    embeddings are reduced once). float32: losses observed within 8.6e-8, grad norms 8.0e-7 (tied), parameters
    4.0e-6 (tied); the plain loss at cp 2 against the run without CP differs as much."""
    pytest.importorskip("deepspeed")
    clip = {"max_grad_norm": 0.5}
    lean_against_plain(pool, "ZeRO-2", "DeepSpeedEngine ZeRO-2", args={"deepspeed": zero(2), **clip})
    for model in ("llama", "llama_tied"):
        lean_against_plain(pool, f"ZeRO-3, {model}", "DeepSpeedEngine ZeRO-3", model=model, dtype="float32",
                           args={"deepspeed": zero(3, zero_optimization=RELEASING), **clip})


@pytest.mark.slow
def test_linear_ce_under_fsdp2_equals_the_plain_loss_on_it(pool):
    lean_against_plain(pool, "FSDP2", "FSDPLlamaForCausalLM", args={**fsdp2(), "max_grad_norm": 0.5})
