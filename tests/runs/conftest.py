"""The ``runs`` tier: tests that run a whole engine run or a whole command end to end, in process (simulations,
resume, vectorized against sequential, ``prepare``, ``audit``, studies, tracking).  A test file with such a run
lives here whole, its smaller tests with it.  Every test here is marked ``runs`` and ``slow``."""

import pytest

from tests.unit.data.conftest import h  # noqa: F401  (the fixture that writes NIfTI federations: test_runs_3d.py)


def pytest_itemcollected(item):
    item.add_marker(pytest.mark.runs)
    item.add_marker(pytest.mark.slow)
