"""``fedseg predict``: a finished run's predictor over new scans, one case at a time.

Each scan goes through the run's own preprocessing (2D: intensities to [0, 1] and the spec's resize; volumes:
the plan's intensity scheme, RAS orientation and spacing), through the predictor evaluation runs
(:mod:`fedseg.site.predict`, over the case's own extent as evaluation predicts it), and back into the scan's
own grid (volumes: :func:`fedseg.data.volumes.geometry.to_original_grid`, slab by slab, so memory stays bounded
by the plan grid and one slab of the scan; 2D: the logits resized to the input's size), where the logits are
thresholded into a label map with the spec's label values.

Every input is read and checked before any mask is written; ``predictions.json`` beside the masks records
the run, model, round and options that made them and each input's SHA-256.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn import functional
from tqdm.auto import tqdm

from fedseg import __version__
from fedseg.apps.predict.model import Loaded
from fedseg.apps.predict.scans import (
    Scan,
    find_inputs,
    input_sha256,
    kind_of,
    mask_path,
    read_scan,
    write_mask,
    write_probabilities,
)
from fedseg.data.loading import normalize, resize_pair
from fedseg.data.volumes.geometry import Geometry, to_original_grid, to_plan_grid
from fedseg.data.volumes.intensity import normalize_case
from fedseg.data.volumes.load import plan_spacing
from fedseg.foundation.errors import ConfigError, DataError
from fedseg.seams.checkpoint import save_json
from fedseg.site import extent
from fedseg.site import predict as prediction

__all__ = ["EXIT_SKIPPED", "PREDICTIONS_NAME", "Segmented", "keep_largest", "predict_files", "segment"]

PREDICTIONS_NAME = "predictions.json"
"""The record of a ``fedseg predict`` beside its masks."""
EXIT_SKIPPED = 3
"""``fedseg predict``'s exit status when inputs were skipped (0: every input written; 2: refused, nothing
written)."""

SLAB_BYTES = 256 * 2**20
"""Bytes of one slab of a volume's logits resampled into the scan's grid at a time (float64 in MONAI)."""


@dataclasses.dataclass
class Segmented:
    """One case's result in its scan's own grid."""

    labels: np.ndarray
    probabilities: np.ndarray | None = None
    route: int | None = None
    route_probs: list[float] | None = None


def _device_batch(loaded: Loaded, x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x))[None].to(device=loaded.site.device, dtype=loaded.site.dtype)


def _route(loaded: Loaded, xt: torch.Tensor) -> tuple[int | None, list[float] | None]:
    if loaded.routing is None:
        return None, None
    idx, probs = loaded.routing(xt)
    return int(idx[0]), [float(p) for p in probs[0].tolist()]


def _segment_2d(loaded: Loaded, image: np.ndarray, tta: bool, keep_probs: bool) -> Segmented:
    """One 2D image (C, H, W) in file units."""
    x = normalize(image)
    size = loaded.layout["image_size"]
    if size is not None:
        x, _ = resize_pair(x, np.zeros(x.shape[1:], dtype=np.int64), tuple(size))
    xt = _device_batch(loaded, x)
    route, probs = _route(loaded, xt)
    out = prediction.logits(loaded.site, loaded.predict, xt, tta)[0].float()
    if tuple(out.shape[1:]) != tuple(image.shape[1:]):
        out = functional.interpolate(out[None], size=tuple(image.shape[1:]), mode="bilinear", align_corners=False)[0]
    labels = prediction.label_map(out, loaded.layout["labels"], loaded.threshold).cpu().numpy()
    p = prediction.probabilities(out).cpu().numpy() if keep_probs else None
    return Segmented(labels, p, route, probs)


def _segment_volume(loaded: Loaded, scan: Scan, tta: bool, keep_probs: bool) -> Segmented:
    """One volume (C, X, Y, Z) with its affine, predicted in the plan's grid over its own extent and resampled
    back into the scan's grid slab by slab."""
    plan = loaded.plan
    assert plan is not None and scan.affine is not None
    x = normalize_case(scan.image, plan.intensity, loaded.intensity_site)
    spacing = plan_spacing(types.SimpleNamespace(mode=loaded.layout["mode"]), plan)  # type: ignore[arg-type]
    x, _, affine = to_plan_grid(x, None, scan.affine, spacing)
    ext = tuple(int(s) for s in x.shape[1:])
    xt = _device_batch(loaded, x)
    del x
    xt, _ = extent.pad_far_end(xt, xt[:, :0], extent.window_shape(ext, loaded.cfg.model.roi_size))
    route, probs = _route(loaded, xt)
    out = extent.crop_to_extent(prediction.logits(loaded.site, loaded.predict, xt, tta)[0], ext).float().cpu()
    del xt
    shape = tuple(int(s) for s in scan.image.shape[1:])
    top = max((int(v) for vs in loaded.layout["labels"].values() for v in vs), default=0)
    labels = np.zeros(shape, dtype=np.uint8 if top < 256 else np.int32)  # the mask's own type, not int64
    p = np.zeros((out.shape[0], *shape), dtype=np.float16) if keep_probs else None
    per_slice = max(1, shape[0] * shape[1] * out.shape[0] * 8)
    step = max(1, SLAB_BYTES // per_slice)
    for z0 in range(0, shape[2], step):
        z1 = min(shape[2], z0 + step)
        shift = np.eye(4)
        shift[2, 3] = z0
        slab = Geometry(scan.affine @ shift, (shape[0], shape[1], z1 - z0))
        logits = to_original_grid(out, affine, slab, mode="bilinear")
        labels[..., z0:z1] = prediction.label_map(logits, loaded.layout["labels"], loaded.threshold).numpy()
        if p is not None:
            p[..., z0:z1] = prediction.probabilities(logits).numpy()
    return Segmented(labels, p, route, probs)


def _segment_slices(loaded: Loaded, image: np.ndarray, tta: bool, keep_probs: bool) -> Segmented:
    """A NIfTI of 2D slices (C, X, Y, Z): every slice along the last axis segmented as a 2D image."""
    parts = [_segment_2d(loaded, image[..., z], tta, keep_probs) for z in range(image.shape[-1])]
    labels = np.stack([s.labels for s in parts], axis=-1)
    probs = np.stack([s.probabilities for s in parts], axis=-1) if keep_probs else None  # type: ignore[misc]
    return Segmented(labels, probs)


def segment(loaded: Loaded, scan: Scan, tta: bool = False, keep_probs: bool = False) -> Segmented:
    """One scan segmented in its own grid (module docstring)."""
    mode = loaded.layout["mode"]
    if loaded.volumes:
        return _segment_volume(loaded, scan, tta, keep_probs)
    if mode == "slices":
        return _segment_slices(loaded, scan.image, tta, keep_probs)
    return _segment_2d(loaded, scan.image, tta, keep_probs)


def keep_largest(labels: np.ndarray, label_spec: dict[str, Sequence[int]]) -> np.ndarray:
    """Keep-largest-connected-component per label channel (SciPy's ``ndimage.label``, face connectivity): each
    channel (``isin(labels, values)``) keeps its largest component, and the map is rebuilt from the channels
    with :func:`fedseg.site.predict.from_channels`."""
    from scipy import ndimage

    on = np.stack([np.isin(labels, list(vs)) for vs in label_spec.values()])
    for c in range(on.shape[0]):
        comp, n = ndimage.label(on[c])
        if n > 1:
            sizes = np.bincount(comp.ravel())[1:]
            on[c] = comp == (int(np.argmax(sizes)) + 1)
    return prediction.from_channels(torch.from_numpy(on), label_spec).numpy()


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text}"


def _sites_of(loaded: Loaded) -> list[str]:
    """The sites a routing composite chooses among, in the selector's output order."""
    return [n.split("/", 1)[1] for n in loaded.route_names[1:]]


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError(
            f"--out {out} is a file; predict writes its masks (and {PREDICTIONS_NAME}) into a folder -> give a "
            "folder path (it is made when missing)"
        )


def predict_files(
    loaded: Loaded,
    inputs: Sequence[str | Path],
    out: str | Path,
    *,
    tta: bool = False,
    postprocess: bool = False,
    probabilities: bool = False,
    force: bool = False,
    strict: bool = False,
    split: str | None = None,
    nan_to_num: float | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Segment every scan ``inputs`` name into ``out``; returns ``{"written": [...], "skipped": [{file,
    reason}], "routing": csv path or None, "record": predictions.json path}``.

    Every input is read and checked first, and nothing is written unless all can be predicted: a file that
    cannot be read is listed and skipped (``strict``: it stops the command), a readable scan that cannot be
    predicted as it is (its dimensions or channels, NaN or infinite values without ``nan_to_num``) stops the
    command naming the file and the fix.  Nothing in ``out`` is overwritten without ``force``."""
    out = Path(out)
    _check_out(out)
    cases = list(find_inputs(list(inputs), split))
    if not cases:
        raise DataError(f"no scans found in {', '.join(map(str, inputs))} -> give image files, folders or a datalist")
    mode, channels = loaded.layout["mode"], int(loaded.layout["in_channels"])
    routing_csv = out / "routing.csv" if loaded.routing is not None else None
    record = out / PREDICTIONS_NAME
    targets: dict[Path, Path] = {}
    for path, name in cases:  # every output checked before any is written
        t = mask_path(out, name, kind_of(path), path)
        if t in targets:
            raise DataError(
                f"{targets[t]} and {path} would both be written to {t} -> predict them into separate --out folders"
            )
        targets[t] = path
    extra = [p.with_name(p.name.split(".")[0] + "_probabilities.npy") for p in targets] if probabilities else []
    existing = [t for t in [*targets, *extra, *([routing_csv] if routing_csv else []), record] if t.exists()]
    if existing and not force:
        raise ConfigError(
            f"{existing[0]} exists ({len(existing)} output(s) in all); predict overwrites nothing -> choose another "
            "--out or add --force"
        )
    # every input read and checked before any mask is written (the arrays are read again to predict)
    skipped: list[dict[str, str]] = []
    refused: list[str] = []
    ready: list[tuple[Path, str, str, int]] = []
    for path, name in tqdm(cases, desc="check", unit="case", disable=not progress):
        try:
            scan = read_scan(path, mode, channels, nan_to_num)
        except DataError as e:
            refused.append(str(e))
            continue
        except Exception as e:  # readers raise many kinds for a damaged file
            reason = f"cannot be read ({_one_line(e)})"
            if strict:
                refused.append(f"{path}: {reason} -> repair or remove it, or leave out --strict to skip it")
            else:
                skipped.append({"file": str(path), "reason": reason})
            continue
        if scan.replaced:
            log(
                f"predict: warning: {path}: {scan.replaced:,} of {scan.image.size:,} voxels were NaN or infinite; "
                f"replaced with {float(nan_to_num or 0.0):g} (--nan-to-num)"
            )
        ready.append((path, name, input_sha256(path), scan.replaced))
        del scan
    if refused:
        more = f" (and {len(refused) - 1} more input(s) refused; nothing was written)" if len(refused) > 1 else ""
        raise DataError(refused[0] + more)
    written: list[str] = []
    cases_out: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    sites = _sites_of(loaded)
    for path, name, digest, replaced in tqdm(ready, desc="predict", unit="case", disable=not progress):
        scan = read_scan(path, mode, channels, nan_to_num)
        target = mask_path(out, name, scan.kind, path)
        result = segment(loaded, scan, tta, probabilities)
        labels = keep_largest(result.labels, loaded.layout["labels"]) if postprocess else result.labels
        write_mask(target, labels, scan)
        if probabilities and result.probabilities is not None:
            write_probabilities(
                target.with_name(target.name.split(".")[0] + "_probabilities.npy"), result.probabilities
            )
        written.append(str(target))
        used = loaded.candidate.name
        if result.route is not None:
            used = loaded.route_names[result.route]
            row: dict[str, Any] = {"case": name, "model": used}
            row.update({f"p_{s}": p for s, p in zip(sites, result.route_probs or [])})
            rows.append(row)
        entry: dict[str, Any] = {"input": str(path), "sha256": digest, "mask": target.relative_to(out).as_posix()}
        entry["model"] = used
        if replaced:
            entry["non_finite_replaced"] = replaced
        cases_out.append(entry)
    if routing_csv is not None and rows:
        routing_csv.parent.mkdir(parents=True, exist_ok=True)
        with routing_csv.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    out.mkdir(parents=True, exist_ok=True)
    save_json(_record(loaded, cases_out, skipped, tta, postprocess, probabilities, split, nan_to_num, strict), record)
    log(f"predict: {len(written)} case(s) written to {out}, {len(skipped)} skipped")
    for s in skipped:
        log(f"  skipped {s['file']}: {s['reason']}")
    return {
        "written": written,
        "skipped": skipped,
        "routing": str(routing_csv) if rows else None,
        "record": str(record),
    }


def _record(
    loaded: Loaded,
    cases: list[dict[str, Any]],
    skipped: list[dict[str, str]],
    tta: bool,
    postprocess: bool,
    probabilities: bool,
    split: str | None,
    nan_to_num: float | None,
    strict: bool,
) -> dict[str, Any]:
    """``predictions.json``: what made the masks beside it."""
    cand = loaded.candidate
    return {
        "fedseg_version": __version__,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "run": str(loaded.run_dir.resolve()) if loaded.run_dir is not None else None,
        "method": loaded.cfg.method,
        "model": cand.name,
        "predictor": cand.predictor,
        "home_site": cand.home_site,
        "round": loaded.round,
        "data_layout": loaded.layout_source,
        "layout": loaded.layout,
        "threshold": loaded.threshold,
        "options": {
            **loaded.asked,
            "tta": tta,
            "postprocess": postprocess,
            "probabilities": probabilities,
            "split": split,
            "nan_to_num": nan_to_num,
            "strict": strict,
        },
        "routing": {"sites": _sites_of(loaded), "csv": "routing.csv"} if loaded.routing is not None else None,
        "cases": cases,
        "skipped": skipped,
    }
