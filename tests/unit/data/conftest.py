"""Helpers that write tiny federations (PNG or NIfTI) into tmp_path."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from PIL import Image


def write_png(path: Path, arr: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path)
    return path


def write_nifti(path: Path, arr: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(arr, np.eye(4)), str(path))
    return path


def disc_cup_pair(h: int = 16, w: int = 16, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """RGB uint8 image (h, w, 3) with a varying background, and label 0/1/2 (cup inside disc)."""
    rng = np.random.default_rng(seed)
    image = rng.integers(20, 200, (h, w, 3), dtype=np.uint8)
    label = np.zeros((h, w), np.uint8)
    label[2 : h - 2, 2 : w - 2] = 1
    label[4 : h - 4, 4 : w - 4] = 2
    return image, label


def write_spec(
    root: Path,
    *,
    sites=("site1",),
    mode="2d",
    in_channels=3,
    labels=None,
    image_size=None,
    foreground_only=None,
    spatial_dims=None,
    extra="",
) -> Path:
    labels = labels or {"disc": [1, 2], "cup": [2]}
    lines = [
        'name = "test"',
        "[data]",
        f'mode = "{mode}"',
        f"spatial_dims = {spatial_dims or (3 if mode == '3d' else 2)}",
        f"in_channels = {in_channels}",
    ]
    if image_size is not None:
        lines.append(f"image_size = {list(image_size)}")
    if foreground_only is not None:
        lines.append(f"foreground_only = {'true' if foreground_only else 'false'}")
    lines.append("[data.labels]")
    lines += [f"{k} = {json.dumps(v)}" for k, v in labels.items()]
    for s in sites:
        lines += ["[[sites]]", f'name = "{s}"', f'datalist = "{s}/datalist.json"']
    path = root / "federation.toml"
    path.write_text("\n".join(lines) + "\n" + extra)
    return path


def write_site(
    root: Path, site: str, cases: dict[str, list[tuple[np.ndarray, np.ndarray]]], suffix: str = ".png"
) -> Path:
    """Write cases {split: [(image, label), ...]} and the site's datalist; returns the datalist."""
    entries = {}
    for split, pairs in cases.items():
        entries[split] = []
        for i, (img, lab) in enumerate(pairs):
            write = write_png if suffix == ".png" else write_nifti
            write(root / site / "images" / f"{split}_{i}{suffix}", img)
            write(root / site / "labels" / f"{split}_{i}{suffix}", lab)
            entries[split].append({"image": f"images/{split}_{i}{suffix}", "label": f"labels/{split}_{i}{suffix}"})
    path = root / site / "datalist.json"
    path.write_text(json.dumps(entries))
    return path


@pytest.fixture
def png_federation(tmp_path: Path) -> Path:
    """A valid one-site 2D RGB federation, 2 cases per split; returns the spec path."""
    pairs = [disc_cup_pair(seed=i) for i in range(2)]
    write_site(tmp_path, "site1", {"training": pairs, "validation": pairs, "testing": pairs})
    return write_spec(tmp_path)


@pytest.fixture
def h():
    """The helper functions above, as a fixture (works under any pytest import mode)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        write_png=write_png,
        write_nifti=write_nifti,
        disc_cup_pair=disc_cup_pair,
        write_spec=write_spec,
        write_site=write_site,
    )
