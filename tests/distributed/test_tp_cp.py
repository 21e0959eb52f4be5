"""Tensor parallelism x block-diagonal CP (examples/train_tp_cp.py's recipe) against one process
without any parallelism, and the checks at the door: `tp_mesh`, `reduce_gradients`."""

import pytest
import torch

pytest.importorskip("transformers")

STEPS, SEQ_LEN, LR = 2, 96, 1e-2


def recipe():
    from examples_module import example

    return example("train_tp_cp")


def tp_cp_worker(rank, world, order, layout, ulysses):
    """cp=2 x tp=2 (mesh dimensions in `order`, after dp=1), fp64: the example's own `train`."""
    import argparse

    from torch.distributed.device_mesh import init_device_mesh

    example = recipe()
    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp", *order))
    args = argparse.Namespace(steps=STEPS, seq_len=SEQ_LEN, lr=LR, layout=layout, ulysses_degree=ulysses)
    result = example.train(args, mesh, torch.device("cpu"), torch.float64)
    model = example.make_model("blockdiag_cp", torch.float64)
    example.tensor_parallel(model, mesh["tp"])  # the plan `train` applies: both kinds of parameter
    return result, {type(p).__name__ for p in model.parameters()}


@pytest.mark.parametrize("order, layout, ulysses", [
    (("cp", "tp"), "balanced", 1),
    pytest.param(("tp", "cp"), "contiguous", 1, marks=pytest.mark.slow),
    pytest.param(("cp", "tp"), "balanced", 2, marks=pytest.mark.slow),  # one head per rank: Ulysses inside TP
])
def test_tp2_x_cp2_trains_like_one_process(order, layout, ulysses, rank_pools):
    reference = recipe().single_process_run(dp=1, steps=STEPS, seq_len=SEQ_LEN, lr=LR, dtype=torch.float64)
    for result, kinds in rank_pools(4).run(tp_cp_worker, order, layout, ulysses):
        assert kinds == {"DTensor", "Parameter"}, kinds  # both kinds of parameter were reduced
        assert max(abs(a - b) for a, b in zip(result["losses"], reference["losses"])) < 1e-10
        for key in ("grads", "params"):
            assert max(float((result[key][n] - t).abs().max()) for n, t in reference[key].items()) < 1e-10, key


def value_error(fn, *args):
    """The message of the `ValueError` that ``fn(*args)`` raises, or None if it returns."""
    try:
        fn(*args)
    except ValueError as exc:
        return str(exc)
    return None


def overlap_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp import make_cp_blockdiag_batch_and_ctx

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    batch = {"input_ids": torch.zeros(1, 8, dtype=torch.long)}
    return value_error(make_cp_blockdiag_batch_and_ctx, mesh["cp"], mesh["cp"], batch)


def test_a_tp_mesh_over_the_cp_group_is_refused_on_every_rank(rank_pools):
    for message in rank_pools(2).run(overlap_worker):
        assert message is not None and "share the ranks [0, 1]" in message, message


def reduce_worker(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    from blockdiag_cp.parallel import reduce_gradients

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    plain = torch.nn.Parameter(torch.zeros(3))
    plain.grad = torch.full((3,), float(rank + 1))
    half = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    half.grad = torch.full((2,), 10.0 * (rank + 1), dtype=torch.float64)  # another dtype: its own bucket
    sharded = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)]))
    sharded.grad = DTensor.from_local(torch.full((2, 2), rank + 1.0), mesh, [Shard(0)])  # reduced shard by shard
    none = torch.nn.Parameter(torch.zeros(1))
    count = reduce_gradients([plain, half, sharded, none], dist.group.WORLD)
    out = (count, plain.grad.tolist(), half.grad.tolist(), sharded.grad.to_local().tolist())
    reduce_gradients([plain], mesh, average=True)
    partial = torch.nn.Parameter(DTensor.from_local(torch.zeros(1), mesh, [Partial()]))
    partial.grad = DTensor.from_local(torch.zeros(1), mesh, [Partial()])
    return out, plain.grad.tolist(), value_error(reduce_gradients, [partial], mesh)


def test_reduce_gradients_sums_plain_and_dtensor_gradients(rank_pools):
    for (count, plain, half, sharded), averaged, refused in rank_pools(2).run(reduce_worker):
        assert count == 3
        assert plain == [3.0] * 3 and half == [30.0] * 2 and sharded == [[3.0, 3.0], [3.0, 3.0]]
        assert averaged == [3.0] * 3  # the average of two ranks holding 3
        assert refused is not None and "Partial" in refused


def mismatch_worker(rank, world):
    import torch.distributed as dist

    from blockdiag_cp.parallel import reduce_gradients

    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(2)]
    params[0].grad = torch.ones(2)
    if rank == 1:  # this rank also has the second gradient: the buffers would differ
        params[1].grad = torch.ones(2)
    return value_error(reduce_gradients, params, dist.group.WORLD)


def test_ranks_holding_other_gradients_fail_together(rank_pools):
    for message in rank_pools(2).run(mismatch_worker):
        assert message is not None and "disagree on the gradients to reduce" in message, message
