"""One dp replica's view (`hf/replica.py`) on a (dp 2, cp 2) mesh of gloo ranks: the accelerator's
gathers and reductions span the replicas once each, and CP rank 0's completions and RNG state
reach every CP rank of its replica."""

import pytest
import torch

pytest.importorskip("accelerate")


class FakeAccelerator:
    """What `ReplicaAccelerator` delegates to: a world process index and a gradient state."""

    class gradient_state:  # noqa: N801  (an attribute bag, as accelerate's)
        end_of_dataloader, remainder = False, -1

    def __init__(self, rank):
        self.process_index, self.num_processes, self.device = rank, 4, torch.device("cpu")


def replica_worker(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp.hf.replica import ReplicaAccelerator, first_cp_rank_rows, share_from_cp_rank0

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    dp_rank, cp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("cp")
    view = ReplicaAccelerator(FakeAccelerator(rank), mesh["dp"].get_group(), 2, dp_rank)
    values = torch.tensor([10.0 * dp_rank, 10.0 * dp_rank + 1])  # the same on both CP ranks of a replica
    gathered = view.gather({"v": values, "n": torch.tensor(3.0 + dp_rank)})
    world_gathered = [torch.empty(2) for _ in range(world)]
    dist.all_gather(world_gathered, values)
    torch.manual_seed(100 + rank)  # the CP ranks' generators differ before sharing
    shared = share_from_cp_rank0({"completion": [rank, dp_rank]}, mesh["cp"].get_group())
    return {
        "index": (view.process_index, view.num_processes, view.device.type),
        "gathered": gathered, "sum": view.reduce(values), "mean": view.reduce(values, "mean"),
        "dedup": first_cp_rank_rows(torch.cat(world_gathered), 2, 2), "shared": shared,
        "draw": torch.rand(3), "cp_rank": cp_rank,
    }


@pytest.mark.slow  # a world of 4 importing accelerate: 7 s of the fast loop
def test_the_replica_view_gathers_over_replicas_and_shares_cp_rank0(rank_pools):
    results = rank_pools(4).run(replica_worker)
    for rank, r in enumerate(results):
        dp_rank = rank // 2
        assert r["index"] == (dp_rank, 2, "cpu")
        assert torch.equal(r["gathered"]["v"], torch.tensor([0.0, 1.0, 10.0, 11.0]))
        assert torch.equal(r["gathered"]["n"], torch.tensor([3.0, 4.0]))
        assert torch.equal(r["sum"], torch.tensor([10.0, 12.0])) and torch.equal(r["mean"], torch.tensor([5.0, 6.0]))
        assert torch.equal(r["dedup"], torch.tensor([0.0, 1.0, 10.0, 11.0]))
        assert r["shared"] == {"completion": [2 * dp_rank, dp_rank]}  # CP rank 0's value
        assert torch.equal(r["draw"], results[2 * dp_rank]["draw"])  # and its generator state
    assert not torch.equal(results[0]["draw"], results[2]["draw"])  # replicas keep their own


def test_bad_reductions_are_clear_errors():
    from blockdiag_cp.hf.replica import ReplicaAccelerator

    view = ReplicaAccelerator(FakeAccelerator(0), None, 1, 0)
    with pytest.raises(ValueError, match="reduction"):
        view.reduce(torch.ones(2), "max")
    with pytest.raises(ValueError, match="use_gather_object"):
        view.gather_for_metrics([1], use_gather_object=True)
    assert torch.equal(view.gather(torch.tensor(2.0)), torch.tensor([2.0]))


def test_first_cp_rank_rows_keeps_cp_rank_0_of_each_replica_in_replica_order():
    from blockdiag_cp.hf.replica import first_cp_rank_rows

    dp, cp, n = 3, 2, 2
    # what each world rank (dp rank * cp + cp rank) contributed: n rows of [rank, row, 0/1]
    gathered = torch.tensor([[[rank, row, c] for c in (0, 1)] for rank in range(dp * cp) for row in range(n)])
    kept = first_cp_rank_rows(gathered, dp, cp)
    assert kept.shape == (dp * n, 2, 3)
    assert kept[:, 0, :2].tolist() == [[0, 0], [0, 1], [2, 0], [2, 1], [4, 0], [4, 1]]
    assert torch.equal(first_cp_rank_rows(torch.arange(8.0), 2, 4), torch.tensor([0.0, 4.0]))  # one row per rank


def test_one_replicas_gather_reduce_and_last_batch_trim():
    from blockdiag_cp.hf.replica import ReplicaAccelerator

    accelerator = FakeAccelerator(0)
    view = ReplicaAccelerator(accelerator, None, 1, 0)
    assert (view.num_processes, view.process_index, view.device) == (1, 0, accelerator.device)
    values = torch.tensor([1.0, 2.0, 3.0])
    assert torch.equal(view.reduce(values, "sum", scale=2.0), values * 2)
    assert torch.equal(view.reduce({"a": values}, "mean")["a"], values)
    gathered = view.gather(values)
    assert torch.equal(gathered, values) and gathered.data_ptr() != values.data_ptr()  # a copy, as a gather makes

    class Trimmed(FakeAccelerator.gradient_state):
        end_of_dataloader, remainder = True, 2

    accelerator.gradient_state = Trimmed
    assert torch.equal(view.gather_for_metrics({"v": values})["v"], values[:2])  # the dataset's last 2 samples
    Trimmed.end_of_dataloader = False
    assert torch.equal(view.gather_for_metrics(values), values)


@pytest.mark.parametrize("end_of_dataloader", [False, True])
@pytest.mark.parametrize("remainder", [-1, 0, 1, 3])
def test_the_kept_replicas_are_those_accelerates_gather_for_metrics_keeps(end_of_dataloader, remainder):
    """accelerate's own `gather_for_metrics` is the oracle: at the end of the dataloader it trims to a known
    remainder (> 0) and keeps everything when the remainder is 0 or unknown (-1: a dataset without a length, or
    `dataloader_drop_last=True`); the replica view and the mixin's metric sums keep the same replicas."""
    import types

    import accelerate

    from blockdiag_cp.hf.metrics import kept_replicas, kept_totals
    from blockdiag_cp.hf.replica import ReplicaAccelerator

    dp = 4
    state = types.SimpleNamespace(end_of_dataloader=end_of_dataloader, remainder=remainder)
    gathered = torch.arange(float(dp))  # replica d's value is d
    stand_in = types.SimpleNamespace(gradient_state=state, gather=lambda data: gathered)
    expected = accelerate.Accelerator.gather_for_metrics(stand_in, torch.zeros(1))
    kept = kept_replicas(state)
    assert gathered[: dp if kept is None else kept].tolist() == expected.tolist()
    # the mixin's per-replica sums (no process group: the sums are this process's), one row per value
    replica_of_row = torch.tensor([0, 1, -1, 2, 3, 3])
    rows = torch.tensor([[1.0, 10.0, 1000.0, 100.0, 500.0, 500.0]])
    assert kept_totals(rows, replica_of_row, dp, state).tolist() == [sum([1.0, 10.0, 100.0, 1000.0][:len(expected)])]

    class Accelerator(FakeAccelerator):
        gradient_state = state

    view = ReplicaAccelerator(Accelerator(0), None, 1, 0)
    assert view.gather_for_metrics(torch.arange(float(dp))).tolist() == expected.tolist()  # dp 1: no collective
