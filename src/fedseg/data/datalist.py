"""Datalists: one JSON file per site listing its cases per split.

The format is the Medical Segmentation Decathlon / nnU-Net / NVFlare-FedSM
style::

    {
      "training":   [{"image": "images/train_0.png", "label": "labels/train_0.png"}, ...],
      "validation": [{"image": "...", "label": "..."}, ...],
      "testing":    [{"image": "...", "label": "..."}, ...]
    }

An image stored as one file per channel is a list of paths, in channel order (nnU-Net's
``case_0000.nii.gz``, ``case_0001.nii.gz``; MONAI's list of images)::

      {"image": ["images/c1_0000.nii.gz", "images/c1_0001.nii.gz"], "label": "labels/c1.nii.gz"}

Paths are relative to the datalist's folder (absolute paths are kept). A
``"test"`` key is accepted in place of ``"testing"`` (MSD spelling), but every
entry must carry a label: fedseg evaluates on the test split.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fedseg.foundation.errors import DataError
from fedseg.foundation.messages import SPLIT_KEYS as SPLITS

_ALIASES = {"testing": ("testing", "test")}


def _where(site: str | None, path: Path) -> str:
    return f"{site}: {path}" if site else str(path)


def _is_image(v: object) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and bool(v) and all(isinstance(p, str) and p for p in v))


def load_datalist(path: str | Path, *, site: str | None = None) -> dict[str, list[dict[str, Any]]]:
    """Read a datalist JSON file.

    Parameters
    ----------
    path : str or Path
        The datalist file.
    site : str, optional
        Site name, used only in error messages.

    Returns
    -------
    dict
        ``{"training": [...], "validation": [...], "testing": [...]}``; each
        entry is ``{"image": Path, "label": Path}`` with absolute paths (``image``
        a list of Paths, one per channel, where the datalist lists several).

    Raises
    ------
    DataError
        If the file is missing, is not JSON, lacks a split key, or an entry
        lacks ``image``/``label`` strings. The message names the file and fix.
    """
    path = Path(path).expanduser().resolve()
    where = _where(site, path)
    if not path.is_file():
        raise DataError(
            f"{where}: datalist file not found -> check the datalist path in the "
            "federation spec (relative to the spec file) or create the file"
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{where}: datalist is not valid JSON ({e}) -> fix the JSON syntax") from None
    if not isinstance(raw, dict):
        raise DataError(
            f"{where}: datalist must be a JSON object with keys {list(SPLITS)} "
            '-> wrap the lists in {"training": [...], ...}'
        )
    out: dict[str, list[dict[str, Any]]] = {}
    for split in SPLITS:
        key = next((k for k in _ALIASES.get(split, (split,)) if k in raw), None)
        if key is None:
            raise DataError(
                f'{where}: datalist has no {split!r} key -> add "{split}": '
                '[{"image": ..., "label": ...}] (it may not be empty)'
            )
        entries = raw[key]
        if not isinstance(entries, list):
            raise DataError(f"{where}: {key!r} must be a list of {{image, label}} objects -> fix the JSON")
        for i, entry in enumerate(entries):
            if not (isinstance(entry, dict) and _is_image(entry.get("image")) and isinstance(entry.get("label"), str)):
                raise DataError(
                    f"{where}: {key}[{i}] must be an object with an 'image' path (or a list of paths, one per "
                    f"channel) and a 'label' path, got {entry!r} -> add the missing path(s)"
                )
        # MONAI resolves the paths relative to base_dir exactly as MSD/nnU-Net do (imported here:
        # importing MONAI costs seconds and pulls in matplotlib).
        from monai.data import load_decathlon_datalist

        items = (
            load_decathlon_datalist(str(path), is_segmentation=True, data_list_key=key, base_dir=str(path.parent))
            if entries
            else []
        )
        out[split] = [{"image": _resolve(it["image"]), "label": Path(it["label"]).resolve()} for it in items]
    return out


def _resolve(image: str | list[str]) -> Path | list[Path]:
    return [Path(p).resolve() for p in image] if isinstance(image, list) else Path(image).resolve()


def write_datalist(path: str | Path, splits: dict[str, list[dict[str, Any]]]) -> Path:
    """Write a datalist JSON file with paths relative to its folder.

    Parameters
    ----------
    path : str or Path
        File to write; its folder is created if needed.
    splits : dict
        ``{"training": [{"image": p, "label": q}, ...], "validation": ..., "testing": ...}``
        (``p`` a path, or a list of paths, one per channel). Relative input paths are taken relative to the current directory.

    Returns
    -------
    Path
        The absolute path written.
    """
    path = Path(path).expanduser().resolve()
    path.parent.mkdir(parents=True, exist_ok=True)

    def rel(p: str | Path | list) -> str | list[str]:
        if isinstance(p, (list, tuple)):
            return [str(rel(q)) for q in p]
        return Path(os.path.relpath(Path(p).resolve(), path.parent)).as_posix()

    doc = {
        split: [{"image": rel(e["image"]), "label": rel(e["label"])} for e in splits.get(split, [])] for split in SPLITS
    }
    path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return path
