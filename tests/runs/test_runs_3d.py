"""End to end on NIfTI: 3D volumes with patch training + sliding-window inference, and 3D cut into slices."""

from __future__ import annotations

import numpy as np
import pytest

from fedseg.simulation.runner import run

SMALL = ["model.channels=[4,8]", "model.strides=[2]", "model.num_res_units=0", "train.batch_size=2"]


def _volumes(n: int, seed: int, shape=(16, 16, 8)):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        img = rng.normal(0, 1, shape).astype(np.float32)
        lab = np.zeros(shape, np.uint8)
        lab[4:12, 4:12, 2:6] = 1
        img[lab == 1] += 3.0
        out.append((img, lab))
    return out


@pytest.mark.parametrize("mode", ["3d", "slices"])
def test_nifti_federation_runs(tmp_path, h, mode):
    # Prepare: two sites of tiny NIfTI volumes
    for k, site in enumerate(("a", "b")):
        h.write_site(
            tmp_path,
            site,
            {s: _volumes(2, 10 * k + i) for i, s in enumerate(("training", "validation", "testing"))},
            suffix=".nii.gz",
        )
    spec = h.write_spec(
        tmp_path,
        sites=("a", "b"),
        mode=mode,
        in_channels=1,
        labels={"prostate": [1]},
        foreground_only=True if mode == "slices" else None,
    )
    overrides = SMALL + (["model.roi_size=[8,8,8]"] if mode == "3d" else [])
    # Execute
    res = run(spec, out=tmp_path / "out", overrides=overrides, progress=False, method="fedavg", rounds=1)
    # Assert: every site tested; 3D keeps one case per volume, slices only foreground slices (z = 2..5)
    assert set(res["per_site_dice"]) == {"a", "b"}
    expected_cases = 2 if mode == "3d" else 2 * 4
    assert res["num_cases"] == {"a": expected_cases, "b": expected_cases}
    assert 0.0 <= res["global_dice"] <= 1.0
