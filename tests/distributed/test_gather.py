"""gather_sequence round trips; verify under torchrun (gloo). The training examples: tests/integrations/test_trainer.py."""

import pathlib
import subprocess
import sys

import pytest
import torch

from blockdiag_cp.testing import doc_ids_from_lengths, hang_timeout

ROOT = pathlib.Path(__file__).resolve().parents[2]
SEGMENTS = (7, -2, 12, 1, 5)  # S = 27


def gather_worker(rank, world, layout):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp import CPConfig, gather_sequence, make_cp_blockdiag_batch_and_ctx

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    x = torch.randn(1, 27, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64, requires_grad=True)
    weight = torch.randn(1, 27, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    batch = {"inputs_embeds": x, "_packed_seq_ids": doc_ids_from_lengths(SEGMENTS).unsqueeze(0)}
    train_ctx, batch = make_cp_blockdiag_batch_and_ctx(mesh["cp"], None, batch, config=CPConfig(layout=layout))
    # the planned step, not entered (an entered one must serve a model's attention: Note [A step the model
    # never reached]); gather_sequence finding the active step: test_hf.py, test_model_zoo.py
    full = gather_sequence(batch["inputs_embeds"], state=train_ctx.state)
    (full * weight).sum().backward()  # every rank uses the whole gathered row
    grad = x.grad.clone()
    dist.all_reduce(grad)
    return torch.equal(full.detach(), x.detach()), grad, weight


@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
def test_gather_sequence_round_trips_values_and_gradients(layout, rank_pools):
    world = 3
    for same, grad, weight in rank_pools(world).run(gather_worker, layout):
        assert same
        # each rank's shard receives the gradient of every rank's use of its rows
        assert torch.allclose(grad, world * weight, rtol=0, atol=1e-12)


def test_gather_sequence_needs_a_step():
    from blockdiag_cp import gather_sequence

    with pytest.raises(ValueError, match="train_ctx"):
        gather_sequence(torch.zeros(1, 4, 2))


def torchrun(nproc, *args, timeout=300):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=hang_timeout(timeout), cwd=ROOT)


@pytest.mark.slow
def test_verify_under_torchrun_uses_the_launched_group():
    result = torchrun(2, "-m", "blockdiag_cp", "verify", "--segments", "40,-3,55,9", "--heads", "4", "--kv-heads", "2",
                      "--head-dim", "16", "--exchange", "a2a")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS" in result.stdout and result.stdout.count("[ok]") == 2
