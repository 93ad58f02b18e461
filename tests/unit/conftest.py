"""The ``unit`` tier: one module or package of ``src/fedseg`` at a time (this folder is laid out like it), on
hand-made inputs or tiny in-memory federations.  Every test here is marked ``unit``; its call phase must finish
within ``FEDSEG_UNIT_LIMIT_S`` seconds (tests/conftest.py)."""

import pytest


def pytest_itemcollected(item):
    item.add_marker(pytest.mark.unit)
