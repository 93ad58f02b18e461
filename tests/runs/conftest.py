"""The ``runs`` tier: tests that drive whole engine runs end to end, in process (simulations, the command line's
verbs, studies).  Every test here is marked ``runs`` and ``slow``."""

import pytest


def pytest_itemcollected(item):
    item.add_marker(pytest.mark.runs)
    item.add_marker(pytest.mark.slow)
