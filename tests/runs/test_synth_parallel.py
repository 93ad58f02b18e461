"""Synthesis over worker processes, and the fast evaluations of the phantoms, give the same bytes.

The files of a seed must not change when cases are written by several processes or when the maths is
arranged to do less work; these tests compare against the direct formulas bitwise.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from fedseg.cli import build_parser
from fedseg.data.parallel import MAX_WORKERS, WORKER_ENV, _worker_environment, default_workers, pool_size
from fedseg.data.synth import _grid, _vessels, split_sizes, synthesize
from fedseg.data.synth3d import AIR, CORTEX, CT_SITES, DISC, FAT, MARROW, METAL, SOFT, ct_grid, draw_anatomy, tissue_at
from fedseg.foundation.errors import ConfigError


def _tree(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_two_workers_write_the_same_bytes_as_one(tmp_path):
    # Execute: the same tiny federation by this process alone and by two spawned processes
    one = synthesize("fundus", tmp_path / "one", seed=4, scale=0.02, size=16, workers=1).parent
    two = synthesize("fundus", tmp_path / "two", seed=4, scale=0.02, size=16, workers=2).parent
    # Assert
    ref = _tree(one)
    assert len(ref) == 2 * sum(map(sum, split_sizes("fundus", 0.02))) + 6 + 1  # 2 PNG files a case, datalists, spec
    assert _tree(two) == ref


def test_two_workers_write_the_same_ct_bytes_as_one(tmp_path):
    one = synthesize("ct-lesion", tmp_path / "one", seed=2, scale=0.1, size=16, workers=1).parent
    two = synthesize("ct-lesion", tmp_path / "two", seed=2, scale=0.1, size=16, workers=2).parent
    assert _tree(two) == _tree(one)


def _vessels_direct(y, x, dcy, dcx, dr, theta, kappa, length, width):
    """All K curves over the whole image at once, then the strongest per pixel."""
    theta, kappa, length, width = (a.reshape(-1, 1, 1) for a in (theta, kappa, length, width))
    rho = np.hypot(x - dcx, y - dcy)[None]
    phi = np.arctan2(y - dcy, x - dcx)[None]
    delta = np.angle(np.exp(1j * (phi - theta - kappa * rho)))
    dist = np.abs(delta) * rho
    w = width * (1.0 - 0.5 * np.clip(rho / length, 0, 1))
    v = np.exp(-((dist / w) ** 2)) * np.clip((length - rho) / 0.05, 0, 1) * np.clip(rho / (0.5 * dr), 0, 1)
    return v.max(axis=0)


@pytest.mark.parametrize("size", [32, 96, 256])
def test_vessels_where_they_reach_darken_the_image_as_everywhere(size):
    """Beyond ``length_k`` curve k's term is 0 exactly (its clip factor is 0), and more than 6.7 widths off
    its centreline it is below exp(-44.9) < 2^-64; the image is multiplied by ``1 - v * c`` (c <= 0.6), which
    is exactly 1 for such v. So the darkening factor must equal the whole-image formula's bit for bit, and
    the terms kept must be the formula's own numbers."""
    y, x = _grid(size)
    c = np.array([0.35, 0.6, 0.6])
    for seed in range(6):
        rng = np.random.default_rng(seed)
        k = int(rng.integers(4, 12))
        args = (
            rng.uniform(0.3, 0.7),
            rng.uniform(0.3, 0.7),
            rng.uniform(0.09, 0.24),
            rng.uniform(-np.pi, np.pi, k),
            rng.uniform(-3.0, 3.0, k),
            rng.uniform(0.3, 0.8, k),
            rng.uniform(0.010, 0.018, k) * max(1.0, 64 / size) ** 0.5,
        )
        fast, direct = _vessels(y, x, *args), _vessels_direct(y, x, *args)
        assert np.array_equal(1 - fast[..., None] * c, 1 - direct[..., None] * c)
        kept = fast > 0
        assert np.array_equal(fast[kept], direct[kept]) and np.all(direct[~kept] < 1e-19)
        assert kept.mean() > 0.02  # the vessels are there


def _inside_direct(p, ellipsoid):
    d = p - ellipsoid[0]
    if len(ellipsoid) == 3:
        d = d @ ellipsoid[2]
    return np.einsum("ni,ni->n", d / ellipsoid[1], d / ellipsoid[1]) < 1.0


def _tissue_direct(anat, site, p, lesion_hu):
    """Every tissue test over every point, broadcasting (N, 3) arrays."""
    hu = np.full(len(p), AIR)
    bc, bs = anat.body
    hu[_inside_direct(p, anat.body)] = FAT
    hu[_inside_direct(p, (bc, np.maximum(bs - anat.fat, anat.u)))] = SOFT
    sx, sy, sr = anat.spine
    r = np.hypot(p[:, 0] - sx, p[:, 1] - sy)
    disc = np.mod(p[:, 2] - anat.disc_phase, 6.0 * anat.u) < 1.0 * anat.u
    hu = np.where(r < sr, np.where(disc, DISC, np.where(r > 0.7 * sr, CORTEX, MARROW)), hu)
    organ = _inside_direct(p, anat.organ)
    lab = (organ.astype(np.uint8) + (organ & _inside_direct(p, anat.lesion))).astype(np.uint8)
    hu[lab == 1] = site.organ_hu
    hu[lab == 2] = lesion_hu
    for rx, ry in anat.rods:
        hu[np.hypot(p[:, 0] - rx, p[:, 1] - ry) < anat.rod_radius] = METAL
    return hu, lab


def test_ct_tissue_equals_the_direct_tests_slice_by_slice():
    """Skipping the organ and lesion on slices beyond their bounding spheres, and subtracting and dividing
    one coordinate at a time, give the direct evaluation's HU and labels bit for bit, on every slice of
    every site's grid (the slices through the organ and lesion included)."""
    for s, site in enumerate(CT_SITES):
        anat = draw_anatomy(site, np.random.default_rng([9, s]), 32)
        shape, affine = ct_grid(site, 32)
        ax = site.slice_axis
        plane = [a for a in range(3) if a != ax]
        ii, jj = np.meshgrid(np.arange(shape[plane[0]]), np.arange(shape[plane[1]]), indexing="ij")
        organ_slices = 0
        for k in np.arange(shape[ax]) + 0.25:
            vox = np.empty((ii.size, 3))
            vox[:, plane[0]], vox[:, plane[1]], vox[:, ax] = ii.ravel(), jj.ravel(), k
            world = vox @ affine[:3, :3].T + affine[:3, 3]
            hu, lab = tissue_at(anat, site, world, 33.0)
            hu_ref, lab_ref = _tissue_direct(anat, site, world, 33.0)
            assert np.array_equal(hu, hu_ref) and np.array_equal(lab, lab_ref)
            organ_slices += bool(lab_ref.any())
        assert 0 < organ_slices < shape[ax]  # both branches: slices through the organ and slices skipped


def test_pool_size():
    # Execute / Assert: a small federation stays in this process; an explicit count is capped by the jobs
    assert pool_size(None, 100, serial_seconds=0.5) == 1
    assert pool_size(None, 1000, serial_seconds=1e4) == default_workers() <= MAX_WORKERS
    assert pool_size(3, 2, serial_seconds=0.0) == 2 and pool_size(1, 50, 1e4) == 1
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ConfigError, match="workers must be a positive integer"):
            pool_size(bad, 10, 1.0)


def test_cli_takes_workers():
    args = build_parser().parse_args(["synth", "--preset", "fundus", "--out", "x", "--workers", "3"])
    assert args.workers == 3
    assert build_parser().parse_args(["synth", "--preset", "fundus", "--out", "x"]).workers is None


def test_worker_environment_is_set_for_the_pool_only(monkeypatch):
    # Prepare: the caller chose its own OpenMP threads; OpenBLAS's are unset
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    # Execute / Assert
    with _worker_environment():
        assert os.environ["OMP_NUM_THREADS"] == "3"  # never overridden
        assert os.environ["OPENBLAS_NUM_THREADS"] == WORKER_ENV["OPENBLAS_NUM_THREADS"] == "1"
    assert os.environ["OMP_NUM_THREADS"] == "3" and "OPENBLAS_NUM_THREADS" not in os.environ
