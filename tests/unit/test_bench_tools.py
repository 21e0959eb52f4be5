"""The benchmark helpers: the seed's reference is found where it is installed."""

import importlib.util

import pytest

from blockdiag_cp.tools.bench import seed_available


@pytest.mark.skipif(importlib.util.find_spec("nemo_automodel") is None, reason="nemo-automodel not installed")
def test_seed_reference_is_found_when_installed():
    # the house refactor (#22) once renamed the seed's own module path in this probe; every table then
    # silently skipped the reference column
    assert seed_available()
