"""A site's preprocessed volumes, kept between runs: one safetensors file and one JSON sidecar per case.

Bringing a case into the plan's grid (read, normalize, reorient, resample) costs far more than reading its
result back, so :func:`fedseg.data.volumes.load.load_volume_split` keeps each case's result in the site's
cache and later runs read it instead.

**Where.** ``volume_cache`` (a run setting): ``"auto"`` puts each site's cache in a folder
``.fedseg-cache`` beside its datalist (next to the site's data, where the next run of any output folder
finds it; a deployed site's on its own machine), a folder path puts it in ``<folder>/<site>``, ``"off"``
preprocesses every case on every run.  A cache folder that cannot be written is logged and the run goes
on without it.

**Key.** ``<cache>/<plan key>/<case>-<path hash>.{safetensors,json}``.  The plan key hashes what changes
the preprocessing: the plan's target spacing and intensity scheme (with its pooled statistics), the
declared channels and label values, MONAI's version (its resampling) and :data:`CACHE_VERSION`; a patch
size or network edited in the plan leaves it unchanged (padding and patches come after the cache).  The
sidecar records each source file's resolved path, size and modification time (nanoseconds): a file that is
replaced, rewritten or touched no longer matches and its case is preprocessed again.  (Reading the
sources to hash their contents would cost most of what the cache saves; a file rewritten in place with the
same size within the file system's time resolution is the one change this does not see.)

**Integrity.** The sidecar is written last (each file to a temporary name, then renamed), so a case
interrupted mid-write has no valid sidecar and is preprocessed again.  It also records the SHA-256 and
byte size of the safetensors file and the name, dtype and shape of every array; a truncated or corrupted
file fails one of these checks, is logged and rebuilt.  Nothing is unpickled: the arrays are safetensors,
the rest JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

__all__ = [
    "CACHE_DIR",
    "CACHE_VERSION",
    "CachedCase",
    "VolumeCache",
    "plan_key",
    "source_record",
]

CACHE_VERSION = 1
"""Bumped when what a cache entry holds, or how a case is preprocessed, changes."""
CACHE_DIR = ".fedseg-cache"
"""The folder beside a site's datalist that ``volume_cache = "auto"`` uses."""


@dataclass
class CachedCase:
    """One case in the plan's grid, as :func:`~fedseg.data.volumes.load.load_volume_split` needs it."""

    image: np.ndarray
    """``(C, X, Y, Z)`` float32, normalized, in the plan's grid."""
    label: np.ndarray
    """``(X, Y, Z)`` int64 in the plan's grid."""
    affine: np.ndarray
    """The plan-grid affine (4 × 4, float64)."""
    original_affine: np.ndarray
    """The scan's own affine."""
    original_shape: tuple[int, int, int]
    """The scan's own spatial shape."""
    original_label: np.ndarray | None = None
    """``(X₀, Y₀, Z₀)`` int64 in the scan's own grid (kept for validation and test cases)."""


def plan_key(
    plan: Any, in_channels: int, label_values: Collection[int] | None, spacing: Sequence[float] | None = None
) -> str:
    """Hash of everything that changes a case's preprocessing (module docstring), 16 hex digits; ``spacing``
    is the resampling's when it is not the plan's target spacing (``patches2d`` keeps each slice spacing)."""
    import monai  # deferred: the resampling's version is part of the key

    doc = {
        "version": CACHE_VERSION,
        "monai": monai.__version__,
        "target_spacing": [float(v) for v in (plan.target_spacing if spacing is None else spacing)],
        "intensity": plan.intensity,
        "in_channels": int(in_channels),
        "label_values": sorted(int(v) for v in label_values) if label_values is not None else None,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def source_record(path: str | Path | Sequence[str | Path]) -> Any:
    """What identifies a source file: resolved path, size in bytes and modification time in nanoseconds (a list
    of them for an image stored as one file per channel)."""
    if not isinstance(path, (str, Path)):
        return [source_record(p) for p in path]
    p = Path(path).resolve()
    st = p.stat()
    return {"path": str(p), "size": int(st.st_size), "mtime_ns": int(st.st_mtime_ns)}


def _int_dtype(a: np.ndarray) -> np.dtype:
    if a.size == 0 or (a.min() >= 0 and a.max() <= 255):
        return np.dtype(np.uint8)
    if a.min() >= -(2**15) and a.max() < 2**15:
        return np.dtype(np.int16)
    return np.dtype(np.int32)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


@dataclass
class VolumeCache:
    """One site's cache of preprocessed cases under one plan.

    Parameters
    ----------
    root
        The site's cache folder (``<datalist folder>/.fedseg-cache`` or ``<volume_cache>/<site>``).
    key
        :func:`plan_key` of the plan and data layout.
    log
        Where a corrupt entry or an unwritable folder is reported.
    """

    root: Path
    key: str
    log: Callable[[str], None] = print
    hits: int = 0
    """Cases read from the cache."""
    stored: int = 0
    """Cases preprocessed and written."""
    rebuilt: list[str] = field(default_factory=list)
    """Cases whose entry was corrupt (and so preprocessed again), with the reason."""
    disabled: str | None = None
    """Why the cache was turned off for this run (an unwritable folder), or None."""

    @property
    def folder(self) -> Path:
        return self.root / self.key

    def _paths(self, cid: str, image: str | Path | Sequence[str | Path], label: str | Path) -> tuple[Path, Path]:
        stem = re.sub(r"[^A-Za-z0-9_.-]", "_", cid)[-80:]
        for ext in (".nii.gz", ".nii", ".gz"):
            stem = stem.removesuffix(ext)
        images = image if isinstance(image, (list, tuple)) else [image]
        names = "\n".join(str(Path(p).resolve()) for p in [*images, label])
        h = hashlib.sha256(names.encode()).hexdigest()[:12]
        base = self.folder / f"{stem}-{h}"
        return base.with_suffix(".safetensors"), base.with_suffix(".json")

    def arrays_path(self, cid: str, image: str | Path | Sequence[str | Path], label: str | Path) -> Path:
        """The safetensors file of a case (whether or not it is there yet)."""
        return self._paths(cid, image, label)[0]

    def get(
        self, cid: str, image: str | Path | Sequence[str | Path], label: str | Path, keep_original: bool
    ) -> CachedCase | None:
        """The cached case, or None when it must be preprocessed (absent, stale or corrupt: the latter logged)."""
        if self.disabled:
            return None
        arrays_path, side_path = self._paths(cid, image, label)
        if not side_path.is_file():
            return None
        try:
            side = json.loads(side_path.read_text())
            if not isinstance(side, Mapping):
                raise ValueError("the sidecar is not a JSON object")
        except (OSError, ValueError) as e:
            self._corrupt(cid, side_path, f"unreadable sidecar ({e})")
            return None
        try:
            sources = {"image": source_record(image), "label": source_record(label)}
        except OSError:
            return None  # the source is gone: reading it fails with the reader's own error
        if side.get("version") != CACHE_VERSION or side.get("key") != self.key or side.get("sources") != sources:
            return None  # stale: the plan or a source file changed
        if keep_original and not side.get("original_label"):
            return None  # cached from a training split; a validation/test case also needs its own-grid label
        try:
            blob = arrays_path.read_bytes()
        except OSError as e:
            self._corrupt(cid, arrays_path, f"unreadable ({e})")
            return None
        if len(blob) != side.get("bytes") or hashlib.sha256(blob).hexdigest() != side.get("sha256"):
            self._corrupt(cid, arrays_path, f"{len(blob)} bytes whose SHA-256 differs from the sidecar's")
            return None
        try:
            arrays = load_safetensors(blob)
            layout = {
                k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape)} for k, v in arrays.items()
            }
            if layout != side.get("arrays"):
                raise ValueError(f"arrays {layout} differ from the sidecar's {side.get('arrays')}")
            case = CachedCase(
                image=arrays["image"].numpy(),
                label=arrays["label"].numpy().astype(np.int64),
                affine=arrays["affine"].numpy(),
                original_affine=arrays["original_affine"].numpy(),
                original_shape=cast(tuple[int, int, int], tuple(int(s) for s in side["original_shape"])),
                original_label=arrays["original_label"].numpy().astype(np.int64) if keep_original else None,
            )
        except Exception as e:  # any malformed content is a corrupt entry, never the end of the run
            self._corrupt(cid, arrays_path, f"{type(e).__name__}: {e}")
            return None
        self.hits += 1
        return case

    def _corrupt(self, cid: str, path: Path, why: str) -> None:
        self.rebuilt.append(f"{cid}: {why}")
        self.log(f"volume cache: {path}: {why}; the case is preprocessed again")
        return None

    def put(self, cid: str, image: str | Path | Sequence[str | Path], label: str | Path, case: CachedCase) -> None:
        """Store a preprocessed case (arrays first, sidecar last); an unwritable folder turns the cache off, logged."""
        if self.disabled:
            return
        arrays_path, side_path = self._paths(cid, image, label)
        arrays = {
            "image": torch.from_numpy(np.ascontiguousarray(case.image, dtype=np.float32)),
            "label": torch.from_numpy(np.ascontiguousarray(case.label.astype(_int_dtype(case.label)))),
            "affine": torch.from_numpy(np.ascontiguousarray(case.affine, dtype=np.float64)),
            "original_affine": torch.from_numpy(np.ascontiguousarray(case.original_affine, dtype=np.float64)),
        }
        if case.original_label is not None:
            lab = case.original_label
            arrays["original_label"] = torch.from_numpy(np.ascontiguousarray(lab.astype(_int_dtype(lab))))
        blob = save_safetensors(arrays)
        side = {
            "version": CACHE_VERSION,
            "key": self.key,
            "case": cid,
            "sources": {"image": source_record(image), "label": source_record(label)},
            "original_shape": [int(s) for s in case.original_shape],
            "original_label": case.original_label is not None,
            "bytes": len(blob),
            "sha256": hashlib.sha256(blob).hexdigest(),
            "arrays": {
                k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape)} for k, v in arrays.items()
            },
        }
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            _write_atomic(arrays_path, blob)
            _write_atomic(side_path, (json.dumps(side, indent=1) + "\n").encode())
        except OSError as e:
            self.disabled = f"{self.folder}: {e}"
            self.log(
                f"volume cache: cannot write {self.folder} ({e}); this run preprocesses its cases without a cache "
                "-> make the folder writable or set volume_cache to a writable folder (or 'off')"
            )
            return
        self.stored += 1

    def summary(self) -> str:
        """One line: where, how many cases were read and how many preprocessed."""
        if self.disabled:
            return f"volume cache off ({self.disabled})"
        extra = f", {len(self.rebuilt)} corrupt entries rebuilt" if self.rebuilt else ""
        return f"volume cache {self.folder}: {self.hits} cases read, {self.stored} preprocessed and stored{extra}"
