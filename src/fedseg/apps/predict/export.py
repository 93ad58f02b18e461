"""``fedseg export``: a finished run's model for runtimes without fedseg.

* ``torchscript`` — ``model.ts`` (``torch.jit.load``), and ``preprocessing.json`` beside it.
* ``onnx`` — ``model.onnx`` (onnxruntime; batch and spatial axes dynamic), and ``preprocessing.json``.
* ``bundle`` — a MONAI bundle: ``configs/metadata.json`` (inputs, outputs, labels, the plan's spacing,
  orientation and intensity numbers), ``configs/inference.json`` (MONAI transforms and inferer that reproduce
  fedseg's preprocessing, the logits resampled back into each scan's grid by ``Invertd``, thresholded and
  written as a label map with the spec's values), ``models/model.ts`` and ``scripts/checks.py`` (the check
  that refuses a scan with NaN or infinite values, torch only); ``python -m monai.bundle run --config_file
  configs/inference.json`` segments a folder of scans.

FedSM's composite is exported as its parts (``selector``, ``global``, ``personal_<site>``, one file each) with
the routing rule and thresholds in ``preprocessing.json`` (``composite``).  Nothing is pickled: TorchScript
and ONNX files hold the weights, the rest is JSON (and the bundle's one check in plain Python).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedseg.algorithms.fedsm.selection import selector_role
from fedseg.apps.predict.model import Loaded, load_predictor
from fedseg.data import labelmap
from fedseg.data.volumes.intensity import channel_schemes
from fedseg.foundation.errors import ConfigError

__all__ = ["CHECKS_SOURCE", "FORMATS", "export_run", "label_map_expression", "preprocessing"]

FORMATS = ("bundle", "torchscript", "onnx")

NON_FINITE_RULE = (
    "refused: an input with NaN or infinite values is an error naming the file and how many there are "
    "(fedseg predict --nan-to-num VALUE replaces them, with a warning)"
)

CHECKS_SOURCE = '''"""The checks this bundle runs on its inputs before any preprocessing (torch only; fedseg is not needed)."""

import torch


def refuse_non_finite(data):
    """``data`` unchanged, or one ValueError naming the file, how many of its voxels are NaN or infinite and
    the fix: such a scan would be segmented as background, silently."""
    image = data["image"]
    x = torch.as_tensor(image)
    if x.is_floating_point() or x.is_complex():
        bad = int(x.numel() - int(torch.isfinite(x).sum()))
        if bad:
            meta = getattr(image, "meta", None) or {}
            name = meta.get("filename_or_obj", "an input")
            every = " (every one)" if bad == x.numel() else ""
            raise ValueError(
                f"{name}: {bad:,} of {x.numel():,} voxels are NaN or infinite{every} -> replace them (e.g. with "
                "the background value) and save the scan again"
            )
    return data
'''
"""``scripts/checks.py`` of an exported bundle: the check ``inference.json`` runs right after reading a scan."""


def preprocessing(loaded: Loaded) -> dict[str, Any]:
    """What a runtime must do around the network, as JSON (``preprocessing.json``, the bundle's metadata)."""
    lay, cfg, plan = loaded.layout, loaded.cfg, loaded.plan
    out: dict[str, Any] = {
        "mode": lay["mode"],
        "spatial_dims": lay["spatial_dims"],
        "in_channels": lay["in_channels"],
        "labels": lay["labels"],
        "output": "one logit per label channel; channel c is on where sigmoid(logit) > threshold",
        "threshold": loaded.threshold,
        "label_map": "channels painted in order, each lit pixel (sigmoid > threshold) taking the channel's value, a "
        "later channel overwriting (nested regions: outermost first); order: "
        + ", ".join(f"{list(lay['labels'])[c]}={v}" for c, v in labelmap.paint_order(lay["labels"])),
        "image_size": lay["image_size"],
        "intensity": {"mode": "uint8 / 255, other types min-max to [0, 1]"},
        "non_finite": NON_FINITE_RULE,
    }
    if plan is not None:
        spacing = list(plan.target_spacing)
        if lay["mode"] == "patches2d":
            spacing[2] = 0.0
        out.update(
            {
                "orientation": "RAS",
                "spacing": spacing,
                "intensity": channel_schemes(plan.intensity, loaded.intensity_site, int(lay["in_channels"])),
                "resample": "image: linear; logits back into the scan's grid: linear, then the threshold",
                "roi_size": list(cfg.model.roi_size or []),
                "sw_overlap": cfg.eval.sw_overlap,
                "sw_mode": cfg.eval.sw_weighting,
            }
        )
    if loaded.routing is not None:
        c = loaded.candidate.config
        out["composite"] = {
            "parts": ["selector", *[n.replace("/", "_") for n in loaded.route_names]],
            "mode": c.get("mode", "gate"),
            "gamma": c.get("gamma"),
            "gamma_per_model": c.get("gamma_per_model"),
            "rule": "p = softmax(selector(x)); gate: personal_<sites[k]> with k = argmax p when p[k] > its gamma, "
            "else global; argmax: parts[1 + argmax p]; mix: sum_k p[k] * part_k(x)",
            "sites": list(c.get("sites", [])),
        }
    return out


def label_map_expression(labels: dict[str, list[int]], threshold: float) -> str:
    """A MONAI-config (``$``) expression turning per-channel probabilities ``(L, ...)`` into the label map
    (``(1, ...)``) that :func:`fedseg.data.labelmap.label_map` makes and every metric scores: each channel's
    value painted where its probability exceeds ``threshold``, in :func:`fedseg.data.labelmap.paint_order`
    (the last painted is the outermost ``torch.where``)."""
    expr = "torch.zeros_like(x[0:1])"
    for c, v in labelmap.paint_order(labels):
        expr = f"torch.where(x[{c}:{c + 1}] > {threshold}, {float(v)}, {expr})"
    return f"$lambda x: {expr}"


def _parts(loaded: Loaded) -> dict[str, nn.Module]:
    site, cand = loaded.site, loaded.candidate
    if cand.predictor == "model":
        return {"model": site.models["eval"]}
    if loaded.routing is None:
        raise ConfigError(f"candidate {cand.name!r} ({cand.predictor}) cannot be exported; use --model global")
    parts = {"selector": site.models[selector_role(int(cand.config["num_classes"]), "fedsm-eval/")]}
    parts["global"] = site.models["fedsm-eval/global"]
    for j, s in enumerate(cand.config["sites"]):
        parts[f"personal_{s}"] = site.models[f"fedsm-eval/p{j}"]
    return parts


def _example(loaded: Loaded) -> torch.Tensor:
    lay = loaded.layout
    roi = loaded.cfg.model.roi_size
    if loaded.plan is not None and lay["mode"] == "3d":
        shape = list(roi or loaded.plan.patch_size)
    else:
        shape = list(roi or lay["image_size"] or [64, 64])[:2]
    return torch.zeros(1, int(lay["in_channels"]), *shape, dtype=torch.float32)


def _target(path: Path, force: bool) -> Path:
    """``path``, its folder made, unless it exists and ``force`` is off (one error naming the fix)."""
    if path.exists() and not force:
        raise ConfigError(f"{path} exists; export overwrites nothing -> choose another --out or add --force")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _write(path: Path, data: bytes | str, force: bool) -> Path:
    _target(path, force)
    path.write_bytes(data) if isinstance(data, bytes) else path.write_text(data)
    return path


def _torchscript(model: nn.Module, example: torch.Tensor, path: Path, force: bool) -> Path:
    _target(path, force)
    model = model.float().cpu().eval()
    with torch.no_grad():
        traced = torch.jit.trace(model, example, check_trace=False)
    traced.save(str(path))
    return path


def _onnx(model: nn.Module, example: torch.Tensor, path: Path, force: bool) -> Path:
    _target(path, force)
    model = model.float().cpu().eval()
    axes = {0: "batch", **{2 + a: f"s{a}" for a in range(example.dim() - 2)}}
    with torch.no_grad():
        torch.onnx.export(
            model,
            (example,),
            str(path),
            input_names=["image"],
            output_names=["logits"],
            dynamic_axes={"image": axes, "logits": axes},
            opset_version=17,
            dynamo=False,
        )
    return path


def _one_scheme(schemes: list[dict[str, Any]]) -> dict[str, Any]:
    """The one intensity scheme of every channel that MONAI's intensity transforms can express (they treat
    all channels alike); a plan with a scheme per channel, or a z-score over a body other than the non-zero
    voxels, gets one error naming the formats that carry it."""
    first = schemes[0]
    body = first.get("body")
    if any(s != first for s in schemes[1:]) or (first.get("mode") == "zscore" and body is not None):
        raise ConfigError(
            f"the run's intensity schemes ({schemes}) differ per channel or take a z-score over a body MONAI's "
            "NormalizeIntensityd cannot select; a bundle applies one scheme to all channels -> export "
            "--format torchscript or onnx, whose preprocessing.json lists each channel's scheme"
        )
    return first


def _bundle(loaded: Loaded, parts: dict[str, nn.Module], out: Path, force: bool) -> list[Path]:
    if set(parts) != {"model"}:
        raise ConfigError(
            "a MONAI bundle holds one network; FedSM's composite is exported as its parts with "
            "--format torchscript or onnx (or export --model global / --model personal --site NAME as a bundle)"
        )
    pre = preprocessing(loaded)
    written = [_torchscript(parts["model"], _example(loaded), out / "models" / "model.ts", force)]
    written.append(_write(out / "scripts" / "__init__.py", "", force))
    written.append(_write(out / "scripts" / "checks.py", CHECKS_SOURCE, force))
    lay = loaded.layout
    volumes = loaded.plan is not None
    keys = "image"
    transforms: list[dict[str, Any]] = [
        {"_target_": "LoadImaged", "keys": keys, "image_only": False},
        {"_target_": "EnsureChannelFirstd", "keys": keys},
        # NaN or infinite values refused, naming the file (scripts/checks.py; not invertible, so Invertd skips it)
        {"_target_": "scripts.checks.refuse_non_finite", "_mode_": "callable"},
    ]
    if volumes:  # fedseg's order: intensities in file units first, then orientation and spacing
        inten = _one_scheme(pre["intensity"])
        pad_value: float | None = None  # the lowest value of every normalized scan, where the scheme fixes one
        if inten["mode"] == "ct":
            lo, hi, m, sd = (float(inten[k]) for k in ("lo", "hi", "mean", "sd"))
            pad_value = (lo - m) / sd
            transforms.append(
                {
                    "_target_": "ScaleIntensityRanged",
                    "keys": keys,
                    "a_min": lo,
                    "a_max": hi,
                    "b_min": (lo - m) / sd,
                    "b_max": (hi - m) / sd,
                    "clip": True,
                }
            )
        elif inten["mode"] == "window":
            lo, hi = (float(v) for v in inten["window"])
            pad_value = 0.0
            transforms.append(
                {
                    "_target_": "ScaleIntensityRanged",
                    "keys": keys,
                    "a_min": lo,
                    "a_max": hi,
                    "b_min": 0.0,
                    "b_max": 1.0,
                    "clip": True,
                }
            )
        elif inten["mode"] == "zscore":
            transforms.append({"_target_": "NormalizeIntensityd", "keys": keys, "nonzero": True})
        else:
            transforms.append({"_target_": "ScaleIntensityd", "keys": keys, "minv": 0.0, "maxv": 1.0})
        transforms.append({"_target_": "Orientationd", "keys": keys, "axcodes": "RAS"})
        transforms.append(
            {
                "_target_": "Spacingd",
                "keys": keys,
                "pixdim": pre["spacing"],
                "mode": "bilinear",
                "padding_mode": "border",
            }
        )
        if pad_value is not None:  # as fedseg: a scan smaller than the window padded at its far end, lowest value
            transforms.append(
                {
                    "_target_": "SpatialPadd",
                    "keys": keys,
                    "spatial_size": pre["roi_size"],
                    "method": "end",
                    "value": pad_value,
                }
            )
        inferer = {
            "_target_": "SlidingWindowInferer",
            "roi_size": pre["roi_size"],
            "sw_batch_size": 4,
            "overlap": pre["sw_overlap"],
            "mode": pre["sw_mode"],
        }
    else:  # MONAI reads pictures transposed (reverse_indexing); fedseg's arrays are (H, W): transposed back
        transforms.append({"_target_": "Transposed", "keys": keys, "indices": [0, 2, 1]})
        transforms.append(
            {"_target_": "ScaleIntensityRanged", "keys": keys, "a_min": 0.0, "a_max": 255.0, "b_min": 0.0, "b_max": 1.0}
        )
        if lay["image_size"] is not None:
            transforms.append(
                {"_target_": "Resized", "keys": keys, "spatial_size": lay["image_size"], "mode": "bilinear"}
            )
        inferer = {"_target_": "SimpleInferer"}
    transforms.append({"_target_": "EnsureTyped", "keys": keys, "dtype": "$torch.float32"})
    post = [
        {
            "_target_": "Invertd",
            "keys": "pred",
            "transform": "@preprocessing",
            "orig_keys": "image",
            "nearest_interp": False,
            "to_tensor": True,
        },
        {"_target_": "Activationsd", "keys": "pred", "sigmoid": True},
        {"_target_": "Lambdad", "keys": "pred", "func": label_map_expression(lay["labels"], loaded.threshold)},
        {
            "_target_": "SaveImaged",
            "keys": "pred",
            "output_dir": "@output_dir",
            "output_postfix": "seg",
            "output_dtype": "$numpy.uint8",
            "resample": False,
            "separate_folder": False,
            "squeeze_end_dims": True,
            **({"output_ext": ".png", "scale": None} if not volumes and lay["mode"] == "2d" else {}),
        },
    ]
    inference = {
        "imports": ["$import glob", "$import numpy", "$import torch"],
        "bundle_root": ".",
        "output_dir": "$@bundle_root + '/eval'",
        "dataset_dir": "$@bundle_root + '/data'",
        "device": "$torch.device('cpu')",
        "datalist": "$[{'image': f} for f in sorted(glob.glob(@dataset_dir + '/*'))]",
        "network": "$torch.jit.load(@bundle_root + '/models/model.ts', map_location=@device)",
        "preprocessing": {"_target_": "Compose", "transforms": transforms},
        "dataset": {"_target_": "Dataset", "data": "@datalist", "transform": "@preprocessing"},
        "dataloader": {
            "_target_": "DataLoader",
            "dataset": "@dataset",
            "batch_size": 1,
            "shuffle": False,
            "num_workers": 0,
        },
        "inferer": inferer,
        "postprocessing": {"_target_": "Compose", "transforms": post},
        "initialize": ["$torch.set_grad_enabled(False)"],
        "run": [
            "$[@postprocessing({**d, 'pred': @inferer(d['image'][None].to(@device), @network)[0]}) for d in @dataset]"
        ],
    }
    import monai

    metadata = {
        "version": "0.1.0",
        "changelog": {"0.1.0": "exported by fedseg export"},
        "monai_version": monai.__version__,
        "pytorch_version": torch.__version__.split("+")[0],
        "name": f"fedseg {loaded.cfg.method} {loaded.candidate.name}",
        "task": "segmentation",
        "description": "a fedseg run's best model; preprocessing and inversion as fedseg predict does them",
        "authors": "fedseg",
        "copyright": "see the run's data",
        "network_data_format": {
            "inputs": {
                "image": {
                    "type": "image",
                    "format": "magnitude",
                    "num_channels": lay["in_channels"],
                    "spatial_shape": pre.get("roi_size") or lay["image_size"],
                    "dtype": "float32",
                    "value_range": [],
                    "is_patch_data": volumes,
                    "channel_def": {},
                }
            },
            "outputs": {
                "pred": {
                    "type": "image",
                    "format": "segmentation",
                    "num_channels": len(lay["labels"]),
                    "spatial_shape": pre.get("roi_size") or lay["image_size"],
                    "dtype": "float32",
                    "value_range": [],
                    "is_patch_data": volumes,
                    "channel_def": {str(i): n for i, n in enumerate(lay["labels"])},
                }
            },
        },
        "fedseg": pre,
    }
    written.append(_write(out / "configs" / "metadata.json", json.dumps(metadata, indent=2), force))
    written.append(_write(out / "configs" / "inference.json", json.dumps(inference, indent=2), force))
    return written


def export_run(
    run_dir: str | Path,
    fmt: str,
    out: str | Path,
    site: str | None = None,
    model: str | None = None,
    force: bool = False,
    spec: str | Path | None = None,
) -> list[Path]:
    """Export the run's model (chosen as ``fedseg predict`` chooses it, its data layout from the run folder
    or ``spec``) in format ``fmt``; returns the files."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r} is not known; use one of {', '.join(FORMATS)}")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; export writes a folder of files -> give a folder path")
    loaded = load_predictor(run_dir, site=site, model=model, device="cpu", precision="fp32", spec=spec)
    parts = _parts(loaded)
    if fmt == "bundle":
        return _bundle(loaded, parts, out, force)
    if fmt == "onnx":
        if importlib.util.find_spec("onnx") is None:  # torch's exporter imports it
            raise ConfigError("--format onnx needs onnx and onnxruntime -> pip install 'fedseg[export]'")
    example = _example(loaded)
    written = []
    for name, net in parts.items():
        ex = example
        if fmt == "torchscript":
            written.append(_torchscript(net, ex, out / f"{name}.ts", force))
        else:
            written.append(_onnx(net, ex, out / f"{name}.onnx", force))
    written.append(_write(out / "preprocessing.json", json.dumps(preprocessing(loaded), indent=2), force))
    return written
