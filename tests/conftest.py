import os

import pytest
import torch

# Keep spawned gloo ranks and the test process from oversubscribing a small machine.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def rank_pools():
    """``rank_pools(world)``: long-lived gloo ranks of that world, started once per session.

    Spawning ranks costs 2.5 s (2 ranks) to 8 s (6 ranks) here, mostly importing torch;
    tests whose workers end every collective they start share these. Tests that make
    ranks fail, hang or measure a fresh process keep `spawn`.
    """
    from blockdiag_cp.testing import RankPool

    pools = {}

    def get(world):
        if world in pools and pools[world].broken:  # a rank died or hung: start fresh ranks
            pools.pop(world).close()
        if world not in pools:
            pools[world] = RankPool(world, timeout=600)
        return pools[world]

    yield get
    for pool in pools.values():
        pool.stop()  # every pool's ranks tear down at once
    for pool in pools.values():
        pool.close()


@pytest.fixture
def own_pools():
    """``own_pools(world)``: gloo rank pools for this test only (closed at its end): for runs that leave process-wide
    state behind (DeepSpeed's communication backend, transformers' ZeRO-3 flag, accelerate's shared state)."""
    from blockdiag_cp.testing import RankPool

    pools = {}

    def get(world):
        if world not in pools:
            pools[world] = RankPool(world, timeout=900)
        return pools[world]

    yield get
    for pool in pools.values():
        pool.close()
