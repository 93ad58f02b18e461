"""The 95th-percentile Hausdorff distance of volumes: hand-derived distances, the empty-mask rule, the
scan's own grid of a flipped, permuted and anisotropic case, and its place in results and tables."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fedseg.data.volumes.geometry import Geometry, to_original_grid, to_plan_grid
from fedseg.data.volumes.load import VolumeDataset
from fedseg.evaluation.summary import summarize
from fedseg.evaluation.tables import table3
from fedseg.foundation.config import RunConfig
from fedseg.site.workload import hd95_metric


def _logits(mask: np.ndarray | torch.Tensor) -> torch.Tensor:
    """(1, 1, *spatial) logits that threshold back to ``mask``."""
    m = torch.as_tensor(np.asarray(mask), dtype=torch.float32)
    return (m * 20 - 10)[None, None]


def _target(mask) -> torch.Tensor:
    return torch.as_tensor(np.asarray(mask), dtype=torch.float32)[None, None]


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_hd95_of_two_parallel_plates_is_their_offset_in_mm(axis):
    """Two plates one voxel thick, normal to ``axis``, ``d`` voxels apart.  A plate has no interior, so
    every voxel is a surface voxel; each voxel of one plate is nearest to the voxel of the other at the same
    in-plane index, at d · spacing[axis] mm (any other voxel of the plate adds an in-plane component).
    Every surface distance in both directions is d · spacing[axis], so is their 95th percentile."""
    spacing, d = (1.2, 0.8, 3.0), 3
    a, b = np.zeros((16, 14, 12), dtype=np.uint8), np.zeros((16, 14, 12), dtype=np.uint8)
    plate = [slice(3, 10)] * 3
    plate[axis] = 4
    a[tuple(plate)] = 1
    plate[axis] = 4 + d
    b[tuple(plate)] = 1
    hd = hd95_metric()(_logits(a), _target(b), spacing)
    assert hd.shape == (1, 1)
    assert float(hd) == pytest.approx(d * spacing[axis], rel=1e-6)
    assert float(hd95_metric()(_logits(a), _target(b), None)) == pytest.approx(d)  # no spacing: voxels


def test_hd95_of_two_voxels_is_their_euclidean_distance_in_mm():
    """One voxel each, offset (1, 2, 1) voxels at spacing (1.2, 0.8, 3.0): every surface distance is
    sqrt(1.2² + 1.6² + 3²) mm."""
    a, b = np.zeros((8, 8, 8)), np.zeros((8, 8, 8))
    a[2, 2, 2] = 1
    b[3, 4, 3] = 1
    hd = float(hd95_metric()(_logits(a), _target(b), (1.2, 0.8, 3.0)))
    assert hd == pytest.approx(math.sqrt(1.2**2 + 1.6**2 + 3.0**2), rel=1e-6)


def test_hd95_empty_masks_score_zero_or_the_field_of_view_diagonal():
    """Both empty: 0 (nothing there, nothing predicted).  One empty: the diagonal of the grid's field of
    view, sqrt((8·1.2)² + (6·0.8)² + (4·3)²) mm, the largest distance the grid holds."""
    spacing = (1.2, 0.8, 3.0)
    empty, full = np.zeros((8, 6, 4)), np.zeros((8, 6, 4))
    full[2:5, 2:4, 1:3] = 1
    diagonal = math.sqrt((8 * 1.2) ** 2 + (6 * 0.8) ** 2 + (4 * 3.0) ** 2)
    metric = hd95_metric()
    assert float(metric(_logits(empty), _target(empty), spacing)) == 0.0
    assert float(metric(_logits(empty), _target(full), spacing)) == pytest.approx(diagonal)
    assert float(metric(_logits(full), _target(empty), spacing)) == pytest.approx(diagonal)


def test_hd95_in_the_original_grid_of_a_flipped_permuted_anisotropic_case():
    """A case stored with permuted and flipped axes at spacings (0.8, 1.2, 3.0) mm per array axis: a plate
    normal to array axis 1 is the label, the same plate 2 voxels further along axis 1 the prediction.  Both
    are carried into the plan's grid (RAS, the case's own spacing: only the orientation changes, so exactly)
    and the prediction, as logits, back through ``VolumeDataset.original_grid``; scored with the original
    grid's spacing, HD95 is 2 · 1.2 mm.  Scored in the plan's grid without spacing it would be 2 voxels, and
    with the spacing of the wrong axis 1.6 or 6 mm."""
    affine = np.array([[0, 1.2, 0, -5.0], [-0.8, 0, 0, 7.0], [0, 0, -3.0, 20.0], [0, 0, 0, 1]])
    shape = (20, 16, 10)
    label, pred = np.zeros(shape, dtype=np.int64), np.zeros(shape, dtype=np.int64)
    label[4:15, 7, 2:8] = 1
    pred[4:15, 9, 2:8] = 1
    original = Geometry(affine, shape)
    assert original.spacing == pytest.approx((0.8, 1.2, 3.0))
    ras_spacing = (1.2, 0.8, 3.0)  # array axis 1 runs along x, axis 0 along y
    image = np.zeros((1, *shape), dtype=np.float32)
    _x, lab_plan, plan_affine = to_plan_grid(image, label, affine, ras_spacing)
    _x, pred_plan, _ = to_plan_grid(image, pred, affine, ras_spacing)
    assert lab_plan.shape == (16, 20, 10)
    ds = VolumeDataset(
        torch.zeros(1, 1, *lab_plan.shape),
        torch.from_numpy(lab_plan[None, None]).float(),
        ["case0"],
        [plan_affine],
        [original],
        [torch.from_numpy(label[None]).float()],
    )
    p, t = ds.original_grid(0, _logits(pred_plan)[0])
    assert torch.equal(t, torch.from_numpy(label[None]).float())
    assert torch.equal((p > 0).float(), torch.from_numpy(pred[None]).float())  # orientation only: exact
    hd = float(hd95_metric()(p[None], t[None], original.spacing))
    assert hd == pytest.approx(2 * 1.2, rel=1e-6)
    # the plan-grid label carried back is the label itself: HD95 0
    back = to_original_grid(_logits(lab_plan)[0], plan_affine, original)
    assert float(hd95_metric()(back[None], t[None], original.spacing)) == 0.0


def _results(test_metrics):
    best = {"global": SimpleNamespace(score=0.5, round=3, candidate=SimpleNamespace(home_site=None))}
    per_case = {"global": {"a": [[0.8, 0.6]], "b": [[0.4, 0.2], [1.0, 1.0]]}}
    return summarize(
        "fedavg",
        ["a", "b"],
        RunConfig(federation="fed.toml"),
        per_case,
        best,
        "global",
        ["organ", "lesion"],
        [],
        test_metrics=test_metrics,
    )


def test_results_and_tables_carry_hd95_per_case_site_and_client_average():
    """Per case the mean over channels; per site the mean over its cases; the client average the mean of
    the sites': a (2 + 4)/2 = 3; b ((10 + 20)/2 + 0)/2 = 7.5; client average 5.25; global (3 + 15 + 0)/3 = 6."""
    hd = {"hd95": {"global": {"a": [[2.0, 4.0]], "b": [[10.0, 20.0], [0.0, 0.0]]}}}
    res = _results(hd)
    assert res["per_case_hd95"]["global"] == {"a": [3.0], "b": [15.0, 0.0]}
    assert res["per_site_hd95"] == {"a": 3.0, "b": 7.5}
    assert res["per_site_channel_hd95"]["b"] == {"organ": 5.0, "lesion": 10.0}
    assert res["client_avg_hd95"] == 5.25 and res["global_hd95"] == 6.0
    assert res["rows"][0]["client_avg_hd95"] == 5.25
    md = table3([res])
    assert "| Method | a | b | Client Avg HD95 (mm) | Global HD95 (mm) |" in md
    assert "| FedAvg | 3.00 | 7.50 | 5.25 | 6.00 |" in md or "| fedavg | 3.00 | 7.50 | 5.25 | 6.00 |" in md
    plain = _results(None)
    assert "client_avg_hd95" not in plain and "HD95" not in table3([plain])


def test_eval_interval_keeps_validation_at_a_fifth_of_the_computation():
    """Volume 64 × 64 × 32, window 32 × 32 × 16, overlap 0.5: steps 16, 16, 8, so 3 × 3 × 3 = 27 windows.
    A site with 4 validation volumes spends V = 108 window passes per validation; 2 steps of 4 patches a
    round cost 3 × 8 = 24.  k rounds then validate at V / (V + 24 k): 108 / (108 + 24 · 18) = 0.2 exactly,
    and k = 17 gives 0.209 > 0.2, so k = 18.  The site with more work per validation sets the interval; a
    40-round run keeps 4 validations (k ≤ 10); a run without validation volumes validates every round."""
    from fedseg.data.volumes.plan import eval_interval, sliding_windows

    assert sliding_windows((64, 64, 32), (32, 32, 16), 0.5) == 27
    assert sliding_windows((32, 32, 16), (32, 32, 16), 0.75) == 1
    sites = {"a": (4, 8), "b": (1, 8)}
    assert eval_interval(sites, (64, 64, 32), (32, 32, 16), 0.5, rounds=100) == 18
    assert eval_interval(sites, (64, 64, 32), (32, 32, 16), 0.5, rounds=40) == 10
    assert eval_interval({"a": (0, 8)}, (64, 64, 32), (32, 32, 16), 0.5, rounds=100) == 1


@pytest.mark.parametrize(
    "extra, reason",
    [
        ({"hd95": {"global": [[-1.0]]}}, "not a list of finite non-negative numbers"),
        ({"hd95": {"global": [[float("nan")]]}}, "not a list of finite non-negative numbers"),
        ({"hd95": {"global": [[1.0], [2.0]]}}, "one entry per scored case"),
        ({"hd95": {"other": [[1.0]]}}, "does not score exactly the candidates"),
        ([1.0], "not a mapping"),
    ],
)
def test_a_deployed_site_sending_forged_distances_is_rejected(extra, reason):
    """A reply's test metrics must score the asked candidates, one finite non-negative number per case and
    channel; an honest reply passes."""
    from fedseg.deployment.params import DeployParams
    from fedseg.deployment.transport import RemoteTransport
    from fedseg.foundation.errors import PayloadError
    from fedseg.foundation.messages import Reply, Task

    tr = RemoteTransport(["s"], lambda *a: b"", DeployParams(), log=lambda m: None, num_metrics=1)
    task = Task("evaluate", {}, {"split": "testing", "candidates": [{"name": "global"}]})
    ok = Reply(metrics={"per_case": {"global": [[0.5]]}, "test_metrics": {"hd95": {"global": [[3.2]]}}})
    tr._check_scores("s", task, ok, "site s")
    bad = Reply(metrics={"per_case": {"global": [[0.5]]}, "test_metrics": extra})
    with pytest.raises(PayloadError, match=reason):
        tr._check_scores("s", task, bad, "site s")
