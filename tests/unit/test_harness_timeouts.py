"""The harness's timeouts only a hang exceeds: scaled by BLOCKDIAG_CP_TIMEOUT_SCALE (Note [Timeouts only a hang
exceeds] in testing/ranks.py)."""

import time

import pytest

from blockdiag_cp.testing import hang_timeout, spawn
from blockdiag_cp.testing.ranks import TIMEOUT_SCALE_VARIABLE


def test_every_timeout_is_scaled_by_the_environment(monkeypatch):
    monkeypatch.delenv(TIMEOUT_SCALE_VARIABLE, raising=False)
    assert hang_timeout(60) == 60
    monkeypatch.setenv(TIMEOUT_SCALE_VARIABLE, "4")
    assert hang_timeout(60) == 240
    for bad in ("0", "-1", "inf", "nan", "soon"):
        monkeypatch.setenv(TIMEOUT_SCALE_VARIABLE, bad)
        with pytest.raises(ValueError, match=TIMEOUT_SCALE_VARIABLE):
            hang_timeout(60)


def sleeper(rank, world, seconds):
    time.sleep(seconds)
    return rank


@pytest.mark.slow
def test_spawn_waits_for_the_scaled_timeout(monkeypatch):
    """A rank that outlives the scaled timeout is a hang (0.02 x 300 s = 6 s), named with the variable to raise."""
    monkeypatch.setenv(TIMEOUT_SCALE_VARIABLE, "0.02")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=f"within 6s .*{TIMEOUT_SCALE_VARIABLE}"):
        spawn(sleeper, 1, 600)
    assert time.monotonic() - start < 120
