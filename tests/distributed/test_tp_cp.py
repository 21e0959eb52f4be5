"""Tensor parallelism x block-diagonal CP (examples/train_tp_cp.py's recipe) against one process
without any parallelism, and the checks at the door: `tp_mesh`, `reduce_gradients`."""

import pytest
import torch

pytest.importorskip("transformers")

STEPS, SEQ_LEN = 2, 96


def rows():
    from blockdiag_cp.tools.demo import pack_rows, stdlib_documents

    return pack_rows(stdlib_documents(), STEPS, SEQ_LEN, seed=5)


def single_process():
    """No parallelism: transformers' SDPA on the packed row (float64), AdamW. Losses, last grads, params."""
    from blockdiag_cp.tools.demo import make_model

    model = make_model("sdpa", torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for row in rows():
        logits = model(input_ids=row.input_ids, position_ids=row.position_ids, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[0], row.targets[0], ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.grad for n, p in model.named_parameters()}, {n: p.detach() for n, p in model.named_parameters()}


def tp_cp_worker(rank, world, order, layout, ulysses):
    """cp=2 x tp=2 (mesh dimensions in `order`), float64: the example's plan, loss and gradient reduction."""
    import torch.nn.functional as F
    from examples_module import example
    from torch.distributed.device_mesh import init_device_mesh

    import blockdiag_cp.hf  # noqa: F401
    from blockdiag_cp import CPConfig, make_cp_blockdiag_batch_and_ctx
    from blockdiag_cp.loss import add_shift_labels, token_mean_loss
    from blockdiag_cp.parallel import reduce_gradients
    from blockdiag_cp.tools.demo import make_model

    recipe = example("train_tp_cp")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=order)
    model = make_model("blockdiag_cp", torch.float64)
    recipe.tensor_parallel(model, mesh["tp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for row in rows():
        batch = add_shift_labels({"input_ids": row.input_ids, "position_ids": row.position_ids})
        train_ctx, batch = make_cp_blockdiag_batch_and_ctx(mesh["cp"], mesh["tp"], batch,
                                                           config=CPConfig(layout=layout, ulysses_degree=ulysses))
        with train_ctx():
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
            targets = batch["shift_labels"][0]
            loss_sum = F.cross_entropy(logits[0], targets, ignore_index=-100, reduction="sum")
            loss, value = token_mean_loss(loss_sum, (targets != -100).sum(), group=mesh["cp"].get_group())
            opt.zero_grad()
            loss.backward()
        reduce_gradients(model.parameters(), mesh["cp"])
        opt.step()
        losses.append(value.item())
    kinds = {type(p).__name__ for p in model.parameters()}
    return (losses, {n: recipe.full(p.grad) for n, p in model.named_parameters()},
            {n: recipe.full(p.detach()) for n, p in model.named_parameters()}, kinds)


@pytest.mark.parametrize("order, layout, ulysses", [
    (("cp", "tp"), "balanced", 1),
    pytest.param(("tp", "cp"), "contiguous", 1, marks=pytest.mark.slow),
    pytest.param(("cp", "tp"), "balanced", 2, marks=pytest.mark.slow),  # one head per rank: Ulysses inside TP
])
def test_tp2_x_cp2_trains_like_one_process(order, layout, ulysses, rank_pools):
    ref_losses, ref_grads, ref_params = single_process()
    for losses, grads, params, kinds in rank_pools(4).run(tp_cp_worker, order, layout, ulysses):
        assert kinds == {"DTensor", "Parameter"}, kinds  # both kinds of parameter were reduced
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-10, (losses, ref_losses)
        assert max(float((grads[n] - g).abs().max()) for n, g in ref_grads.items()) < 1e-10
        assert max(float((params[n] - p).abs().max()) for n, p in ref_params.items()) < 1e-10


def overlap_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp import make_cp_blockdiag_batch_and_ctx

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    batch = {"input_ids": torch.zeros(1, 8, dtype=torch.long)}
    try:
        make_cp_blockdiag_batch_and_ctx(mesh["cp"], mesh["cp"], batch)
    except ValueError as exc:
        return str(exc)
    return None


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
    try:
        reduce_gradients([partial], mesh)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    return out, plain.grad.tolist(), refused


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
    try:
        reduce_gradients(params, dist.group.WORLD)
    except ValueError as exc:
        return str(exc)
    return None


def test_ranks_holding_other_gradients_fail_together(rank_pools):
    for message in rank_pools(2).run(mismatch_worker):
        assert message is not None and "disagree on the gradients to reduce" in message, message
