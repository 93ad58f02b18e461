"""The ``deploy`` tier: deployed runs (the server's and the sites' apps over the in-process byte channel, and over
NVIDIA FLARE processes on 127.0.0.1) and the attacks of a server on deployed sites.  A test file with such a run
lives here whole, its smaller tests with it.  Every test here is marked ``deploy`` and ``slow``."""

import pytest


def pytest_itemcollected(item):
    item.add_marker(pytest.mark.deploy)
    item.add_marker(pytest.mark.slow)
