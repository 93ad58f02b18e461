"""Every registered method runs on a user-supplied task (a classifier on in-memory tensors), and the documented example runs."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from fedseg.algorithms import REGISTRY
from fedseg.foundation.config import EvalConfig, RunConfig, TrainConfig
from fedseg.simulation.runner import simulate
from fedseg.site.batches import SiteData
from fedseg.site.workload import Workload, accuracy_metric

DOC = Path(__file__).resolve().parents[2] / "docs" / "python-api.md"


def classifier() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4 * 4 * 4, 3)
    )


def workload() -> Workload:
    return Workload(
        build_model=classifier, loss=nn.CrossEntropyLoss(), metric=accuracy_metric, metric_names=("accuracy",)
    )


def sites(sizes=(6, 4, 5)) -> dict[str, SiteData]:
    """3 sites of 1×8×8 images, 3 classes (the class is the brightest of three image bands)."""
    g = torch.Generator().manual_seed(0)

    def split(n: int) -> TensorDataset:
        y = torch.randint(3, (n,), generator=g)
        x = 0.3 * torch.randn(n, 1, 8, 8, generator=g)
        for i, c in enumerate(y.tolist()):
            x[i, 0, 3 * c : 3 * c + 2] += 1.0
        return TensorDataset(x, y)

    return {f"site{k + 1}": SiteData(split(n), split(3), split(4)) for k, n in enumerate(sizes)}


@pytest.mark.parametrize("method", sorted(REGISTRY))
def test_every_method_runs_on_a_classification_task(method):
    """Two rounds of each method on a 3-class classifier; accuracy per site is a fraction of 4 test cases."""
    # Prepare
    cfg = RunConfig(
        federation="(in memory)",
        method=method,
        rounds=2,
        train=TrainConfig(batch_size=4, lr=1e-2),
        eval=EvalConfig(every=1),
    )
    # Execute
    res = simulate(cfg, workload(), sites(), progress=False)
    # Assert
    assert res["method"] == method and res["metric_names"] == ["accuracy"]
    assert set(res["per_site_dice"]) == {"site1", "site2", "site3"}
    for acc in res["per_site_dice"].values():
        assert 0.0 <= acc <= 1.0 and math.isclose(acc * 4, round(acc * 4), abs_tol=1e-9)
    assert len(res["history"]) == 2


def test_documented_example_runs(tmp_path, monkeypatch):
    """The first Python block of docs/python-api.md trains FGA on two sites and asserts > 90 % accuracy."""
    # Prepare
    code = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)[0]
    monkeypatch.chdir(tmp_path)
    # Execute
    exec(compile(code, str(DOC), "exec"), {"__name__": "docs_example"})
    # Assert: it wrote its run folder
    assert (tmp_path / "runs/fga-classifier/results.json").is_file()
