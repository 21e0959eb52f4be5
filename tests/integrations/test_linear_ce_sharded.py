"""The mixin's ``linear_ce=True`` on sharded stacks: under DeepSpeed ZeRO-2 and accelerate's FSDP2 (the CPU
stand-in of tests/trainer_runs.py) it trains as the plain loss on the same stack does (losses, grad norms, final
parameters); under ZeRO-3, which gathers the LM head's weight only inside the head's own forward and backward, it
is refused by name before any step."""

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import trainer_runs as tr  # noqa: E402
from trainer_runs import fsdp2, zero  # noqa: E402


@pytest.fixture
def pool():
    from blockdiag_cp.testing import RankPool

    pool = RankPool(2, timeout=900)  # DeepSpeed keeps process-wide state: a pool of this test's own
    yield pool
    pool.close()


def refused(rank: int, world: int, s: dict) -> str:
    try:
        tr.pool_run(rank, world, s)
    except ValueError as e:
        return str(e)
    return "trained"


@pytest.mark.slow
@pytest.mark.parametrize("stack, wrapper", [("zero2", "DeepSpeedEngine ZeRO-2"), ("fsdp2", "FSDPLlamaForCausalLM")])
def test_linear_ce_on_a_sharded_stack_equals_the_plain_loss_on_it(pool, stack, wrapper):
    """dp 1 x cp 2, 2 accumulated micro-batches, clipping: the linear-CE loss against the plain one, both under
    the mixin on the same stack."""
    if stack == "zero2":
        pytest.importorskip("deepspeed")
    args = {"zero2": {"deepspeed": zero(2)}, "fsdp2": fsdp2()}[stack]
    args = {**args, "max_grad_norm": 0.5}
    plain = pool.run(tr.pool_run, tr.spec(cp=2, args=args))[0]
    got = pool.run(tr.pool_run, tr.spec(cp=2, args=args, linear_ce=True))[0]
    assert got["wrapper"] == plain["wrapper"] == wrapper
    tr.assert_same(got, plain, tol=1e-6, param_tol=1e-5, label=f"linear_ce under {stack}")


@pytest.mark.slow
def test_linear_ce_under_zero3_is_refused_by_name(pool):
    pytest.importorskip("deepspeed")
    message = pool.run(refused, tr.spec(cp=2, args={"deepspeed": zero(3)}, linear_ce=True))[0]
    assert "linear_ce=True is not verified with DeepSpeed ZeRO-3" in message, message
