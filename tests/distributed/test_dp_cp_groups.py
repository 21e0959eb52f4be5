"""Collectives over one dimension of a (dp 2, cp 2) mesh at world 4, where a group is not the world:
`parallel.reduce_gradients` (sum and average, over cp, dp, both flattened, or a plain process group),
`loss.sum_per_document` (each replica's own row, summed over its own CP group only) and
`hf.replica.share_from_cp_rank0` (CP rank 0 of each replica is global rank 0 or 2)."""

import torch

# each dp replica's row: document ids (0 = padding inside the row), 19 tokens, so the row pads to 20
ROWS = ([1] * 5 + [2] * 9 + [0] * 2 + [3] * 3, [1] * 2 + [2] * 11 + [3] * 6)


def groups_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp.parallel import reduce_gradients

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    reduced = {}
    groups = {"cp": mesh["cp"], "dp": mesh["dp"], "dp_cp": mesh["dp", "cp"], "cp_group": mesh["cp"].get_group()}
    for name, group in groups.items():
        for average in (False, True):
            param = torch.nn.Parameter(torch.zeros(3))
            param.grad = torch.full((3,), float(rank + 1))
            assert reduce_gradients([param], group, average=average) == 1
            reduced[name, average] = param.grad.tolist()
    return mesh.get_local_rank("dp"), mesh.get_local_rank("cp"), reduced, per_document_sums(mesh), shared(rank, mesh)


def shared(rank, mesh):
    """What `share_from_cp_rank0` gives this rank, and the next draws of its (shared) generator."""
    from blockdiag_cp.hf.replica import share_from_cp_rank0

    torch.manual_seed(100 + rank)  # every rank's generator differs before sharing
    value = share_from_cp_rank0({"from": rank}, mesh["cp"].get_group())
    return value, torch.rand(3)


def per_document_sums(mesh):
    """This replica's row under balanced CP: each token's value is its position + 1 (padding 1000); the
    per-document sums and the gradient of ``sum_d (d + 1) * sums[d]`` at this rank's positions."""
    from blockdiag_cp import CPConfig, make_cp_blockdiag_batch_and_ctx
    from blockdiag_cp.loss import sum_per_document

    ids = torch.tensor([ROWS[mesh.get_local_rank("dp")]])
    train_ctx, _ = make_cp_blockdiag_batch_and_ctx(mesh["cp"], None, {"input_ids": ids, "_packed_seq_ids": ids},
                                                   config=CPConfig(layout="balanced"))
    state = train_ctx.state  # the step's plan, no model run (entering the step without one is refused)
    positions = state.positions
    values = torch.where(positions < ids.shape[1], positions + 1.0, 1000.0).double()[None].requires_grad_()
    sums = sum_per_document(values, state=state)
    (sums * torch.arange(1.0, sums.numel() + 1, dtype=torch.float64)).sum().backward()
    return positions.tolist(), sums.tolist(), values.grad[0].tolist()


def test_reductions_over_one_mesh_dimension_use_that_group_alone(rank_pools):
    results = rank_pools(4).run(groups_worker)
    grads = [rank + 1.0 for rank in range(4)]  # rank = 2 * dp + cp
    for dp, cp, reduced, (positions, sums, value_grads), (value, draws) in results:
        assert value == {"from": 2 * dp}, value  # the replica's CP rank 0, with its generator state
        assert torch.equal(draws, results[2 * dp][4][1]) and not torch.equal(draws, results[2 - 2 * dp][4][1])
        cp_sum, dp_sum = grads[2 * dp] + grads[2 * dp + 1], grads[cp] + grads[2 + cp]
        want = {("cp", False): cp_sum, ("cp", True): cp_sum / 2, ("dp", False): dp_sum, ("dp", True): dp_sum / 2,
                ("dp_cp", False): 10.0, ("dp_cp", True): 2.5, ("cp_group", False): cp_sum, ("cp_group", True): cp_sum / 2}
        assert reduced == {key: [value] * 3 for key, value in want.items()}, (dp, cp, reduced)
        row = ROWS[dp]
        docs = max(row)
        assert sums == [float(sum(g + 1 for g, d in enumerate(row) if d == doc)) for doc in range(1, docs + 1)], sums
        # identity backward: each real token gets its document's weight on its own rank, padding nothing
        assert value_grads == [float(row[g]) if g < len(row) else 0.0 for g in positions], (positions, value_grads)
    # the two CP ranks of a replica hold complementary positions of its row, the replicas other rows
    for dp in range(2):
        held = sorted(g for d, _, _, (positions, _, _), _ in results if d == dp for g in positions)
        assert held == list(range(20))
