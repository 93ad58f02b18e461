"""What every dataset reader of ``fedseg prepare`` is made of: cases, datasets, federations, checks.

A *dataset* is one site of a federation: it knows where its files lie under ``--raw``
(:attr:`Dataset.folder` and :attr:`Dataset.layout`), lists its cases (``discover``: cheap, reads no
pixels) and converts one case into 2D units (``convert``: image and label arrays, one per fundus
image or per prostate slice). A *case* belongs to one patient; the pipeline splits by patient.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedseg.foundation.errors import ConfigError, DataError

EXTRA = "pip install 'fedseg[prepare]'"


@dataclass(frozen=True)
class Case:
    """One case found under ``--raw``.

    Attributes
    ----------
    case_id : str
        Unique within its dataset, safe as a file name (the output files are named after it).
    patient : str
        The patient the case belongs to; every case of a patient goes to the same split.
    sources : tuple of Path
        Every raw file the case is converted from (hashed for the manifest).
    info : dict
        Reader-specific details (which annotator files, which half of a stereo image...); ``info["notes"]``
        collects the remarks of :func:`note`.
    """

    case_id: str
    patient: str
    sources: tuple[Path, ...]
    info: dict[str, Any] = field(default_factory=dict, compare=False)


#: One converted 2D unit: (suffix of the output name, "" for a single image; image array; label array).
Unit = tuple[str, np.ndarray, np.ndarray]


@dataclass(frozen=True)
class Dataset:
    """One site of a federation and how to read its public release.

    Attributes
    ----------
    site : str
        Site name in the federation spec (``[A-Za-z0-9_.-]+``).
    title : str
        The dataset's name as its authors write it.
    folder : str
        The folder under ``--raw`` that holds it (its expected layout is :attr:`layout`).
    source : str
        Where to download it.
    licence : str
        Its licence / terms of use, in a few words.
    citation : str
        The reference to cite.
    layout : str
        The expected layout under ``--raw``, one path pattern per line.
    discover : callable
        ``discover(root) -> list[Case]`` with ``root = raw / folder``; raises :class:`DataError`
        naming the missing sub-folder.
    convert : callable
        ``convert(case) -> iterable of Unit``.
    steps : str
        The preprocessing, one line (shown by ``fedseg prepare --list`` and in the manifest).
    excluded : dict
        Case ids left out on purpose -> why (known defects of a release).
    needs : tuple of str
        The optional libraries it reads with (``SimpleITK``, ``pydicom``, ``highdicom``).
    """

    site: str
    title: str
    folder: str
    source: str
    licence: str
    citation: str
    layout: str
    discover: Callable[[Path], list[Case]]
    convert: Callable[[Case], Iterable[Unit]]
    steps: str
    excluded: dict[str, str] = field(default_factory=dict)
    needs: tuple[str, ...] = ()

    def missing(self, root: Path, what: Path | None = None) -> DataError:
        """The error for a missing folder or file of this dataset: what, where, from where."""
        where = what or root
        return DataError(
            f"{self.title} ({self.site}): {where} not found; expected layout under --raw:\n"
            + "\n".join(f"    {line}" for line in self.layout.splitlines())
            + f"\n-> download it from {self.source} and unpack it as above (docs/datasets.md), "
            f"or leave the site out with --sites"
        )


@dataclass(frozen=True)
class Federation:
    """A federation ``fedseg prepare`` builds.

    Attributes
    ----------
    name : str
        The command's argument (``fedsm-fundus``).
    paper : str
        Where its sites and counts come from.
    datasets : tuple of Dataset
        Its sites, in the paper's client order.
    labels : dict
        ``[data.labels]`` of the spec written.
    in_channels : int
        Image channels.
    image_size : tuple of int or None
        ``data.image_size`` of the spec (resize at load time); None keeps the native size.
    paper_counts : dict
        Site -> (train, validation, test) as the paper's table gives them.
    unit : str
        What the counts count ("images", "slices").
    fractions : tuple of float
        Train / validation / test shares of the patients.
    rest : int
        The split (0, 1, 2) that takes the patients left after rounding the others' shares.
    mode : str
        ``data.mode`` of the spec: "2d" (PNG images or slices) or "3d" (NIfTI volumes).
    note : str
        Why counts may differ from the paper's (printed under the table when they do).
    """

    name: str
    paper: str
    datasets: tuple[Dataset, ...]
    labels: dict[str, list[int]]
    in_channels: int
    image_size: tuple[int, ...] | None
    paper_counts: dict[str, tuple[int, int, int]]
    unit: str
    fractions: tuple[float, float, float] = (0.5, 0.25, 0.25)
    rest: int = 2
    mode: str = "2d"
    note: str = ""

    def dataset(self, site: str) -> Dataset:
        for d in self.datasets:
            if d.site == site:
                return d
        raise ConfigError(
            f"prepare {self.name}: no site {site!r} -> use some of {[d.site for d in self.datasets]} in --sites"
        )


class LabelValueError(DataError):
    """A label file holds values its dataset's documented encoding does not have."""


def check_values(array: np.ndarray, allowed: Iterable[int], path: Path, encoding: str) -> None:
    """Raise :class:`LabelValueError` naming ``path`` if ``array`` holds values outside ``allowed``."""
    values = np.unique(array)
    bad = sorted(set(values.tolist()) - set(allowed))
    if bad:
        raise LabelValueError(
            f"{path}: label values {bad[:8]} are not in the documented encoding ({encoding}) "
            f"-> check that the file is the dataset's original mask (docs/datasets.md)"
        )


def require(module: str, dataset: str) -> Any:
    """Import an optional reader library, or raise one ConfigError naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(
            f"{dataset}: reading it needs the Python package {module!r}, which is not installed -> {EXTRA}"
        ) from None


def files(folder: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """The files of ``folder`` (not recursive) with one of ``suffixes`` (case-insensitive), sorted,
    without macOS resource forks (``._name``) that some archives carry."""
    if not folder.is_dir():
        return []
    return sorted(
        p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in suffixes and not p.name.startswith("._")
    )


def safe_id(text: str) -> str:
    """A case id safe as a file name: spaces and path separators become '_'."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in text)


def image_beside(image: Path, label: Path) -> None:
    """DataError naming ``image`` when it is missing beside its ``label`` (a label whose image is missing is a
    reported case, not a silent drop)."""
    if not image.is_file():
        raise DataError(
            f"{image}: image missing beside its label {label.name} -> unpack the images as docs/datasets.md lays "
            "out, or remove the label"
        )


def note(case: Case, text: str) -> None:
    """Record a remark on ``case`` (a quirk read around, not an error): printed under the summary table and
    kept in the manifest."""
    if text:
        case.info.setdefault("notes", []).append(text)


def all_files(folder: Path) -> list[Path]:
    """Every file under ``folder`` (any depth), sorted, without hidden files; [] if it is missing."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))
