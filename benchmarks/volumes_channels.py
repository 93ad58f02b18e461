"""Intensities per channel and per site on two small synthetic volume federations, scored per site.

``--case channels`` — two MR-like channels in one file per case: T2 ~ N(1000, 100) with a brighter organ,
and ADC ~ N(10, 1) (``--same-scale``: N(1000, 100) too) in which alone a lesion shows (+3 sd); the label is
the lesion.  Normalized per channel, each channel keeps its contrast; pooled over both channels, ADC is a
near-constant.

``--case scanners`` — three scanners of one anatomy: a CT-like site storing integer HU with air at −1000
around the body, and two MR-like sites storing floats on scales 1 and 0.05; the lesion is brighter than
the organ at every site.  Per site, the CT-like site takes the CT scheme (its own pooled statistics) and
the others a z-score over their body; one scheme for all (a z-score over every non-zero voxel) takes the
air of the CT-like site into its statistics.

The same script runs on any fedseg checkout (``PYTHONPATH=<checkout>/src``), so a row measures the code it
runs on::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/volumes_channels.py --case channels
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/volumes_channels.py --case scanners

Writes ``OUT/data`` (the federation), ``OUT/plan.json`` and ``OUT/summary.json``; prints the per-site test
Dice of FedAvg.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import torch

from fedseg.algorithms import known_sections
from fedseg.data.datalist import SPLITS, load_datalist
from fedseg.data.spec import load_federation
from fedseg.data.volumes.load import load_volume_split, pad_to_common_shape, plan_federation, plan_for_run
from fedseg.execution.federation import validation_work
from fedseg.foundation.config import load_run_config
from fedseg.simulation.runner import simulate
from fedseg.site.runtime import SiteData, dataset_len
from fedseg.site.workload import workload_for

SHAPE = (32, 32, 16)
SPACING = (1.0, 1.0, 2.0)


def _anatomy(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(body, organ, lesion)`` masks: an ellipsoidal body, an organ inside it, a lesion inside the organ."""
    g = np.stack(np.meshgrid(*[np.arange(s, dtype=np.float64) for s in SHAPE], indexing="ij"), -1) * SPACING
    centre = np.asarray(SHAPE) * SPACING / 2
    body = (((g - centre) / (np.asarray(SHAPE) * SPACING * 0.45)) ** 2).sum(-1) <= 1
    oc = centre + rng.uniform(-3, 3, 3)
    organ = (((g - oc) / np.array([9.0, 8.0, 10.0])) ** 2).sum(-1) <= 1
    lc = oc + rng.uniform(-3, 3, 3)
    lesion = ((((g - lc) / rng.uniform(2.5, 4.0)) ** 2).sum(-1) <= 1) & organ
    return body, organ, lesion


def _channels_case(rng: np.random.Generator, same_scale: bool) -> tuple[np.ndarray, np.ndarray]:
    _body, organ, lesion = _anatomy(rng)
    t2 = rng.normal(1000, 100, SHAPE) + 300 * organ
    adc = rng.normal(10, 1, SHAPE) + 3 * lesion
    if same_scale:
        adc = 1000 + (adc - 10) * 100
    return np.stack([t2, adc], -1).astype(np.float32), lesion.astype(np.uint8)


def _scanner_case(rng: np.random.Generator, site: int) -> tuple[np.ndarray, np.ndarray]:
    body, organ, lesion = _anatomy(rng)
    if site == 0:  # CT-like: integer HU, air at -1000
        hu = np.where(body, 20 + rng.normal(0, 15, SHAPE), -1000.0) + 40 * organ + 40 * lesion
        return np.round(hu).astype(np.int16), lesion.astype(np.uint8)
    scale = 1.0 if site == 1 else 0.05
    mr = np.where(body, 300 + rng.normal(0, 30, SHAPE), 0.0) + 150 * organ + 150 * lesion
    return (scale * np.clip(mr, 0, None)).astype(np.float32), lesion.astype(np.uint8)


def synthesize(root: Path, case: str, sites: int, n: tuple[int, int, int], seed: int, same_scale: bool) -> Path:
    """Write the federation under ``root`` (once) and return its spec."""
    spec = root / "federation.toml"
    if spec.is_file():
        return spec
    affine = np.diag([*SPACING, 1.0])
    lines = ['name = "channels"', "[data]", 'mode = "3d"', f"in_channels = {2 if case == 'channels' else 1}"]
    lines += ["[data.labels]", "lesion = [1]"]
    for s in range(sites):
        d = root / f"site{s + 1}"
        d.mkdir(parents=True, exist_ok=True)
        splits: dict[str, list] = {}
        for j, split in enumerate(SPLITS):
            splits[split] = []
            for i in range(n[j]):
                rng = np.random.default_rng([seed, s, j, i])
                img, lab = _channels_case(rng, same_scale) if case == "channels" else _scanner_case(rng, s)
                nib.save(nib.Nifti1Image(img, affine), str(d / f"{split}_{i}.nii.gz"))
                nib.save(nib.Nifti1Image(lab, affine), str(d / f"{split}_{i}_label.nii.gz"))
                splits[split].append({"image": f"{split}_{i}.nii.gz", "label": f"{split}_{i}_label.nii.gz"})
        (d / "datalist.json").write_text(json.dumps(splits))
        lines += ["[[sites]]", f'name = "site{s + 1}"', f'datalist = "site{s + 1}/datalist.json"']
    spec.write_text("\n".join(lines) + "\n")
    return spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=("channels", "scanners"), default="channels")
    ap.add_argument("--same-scale", action="store_true", help="channels: ADC stored on T2's scale")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=8, help="local steps per round")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--zscore-body",
        choices=("plan", "all"),
        default="plan",
        help="all: z-score the MR sites over every voxel (nnU-Net's rule where cropping to non-zero keeps >= 3/4)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out or f"runs/bench_channels_{args.case}{'_same' if args.same_scale else ''}")
    sites = 2 if args.case == "channels" else 3
    spec = synthesize(out / "data", args.case, sites, (4, 1, 3), args.seed, args.same_scale)
    fed = load_federation(spec)
    t0 = time.perf_counter()
    plan = plan_federation(fed, patch_voxels=24 * 24 * 16, log=print)
    if args.zscore_body == "all":  # every zscore scheme without a numeric body takes every voxel
        for entry in plan.intensity["channels"]:
            for scheme in [entry, *entry.get("sites", {}).values()]:
                if scheme["mode"] == "zscore" and "body" not in scheme:
                    scheme["body"] = "all"
    (out / "plan.json").write_text(json.dumps(plan.to_json(), indent=1))
    overrides = [
        f"rounds={args.rounds}",
        f"train.local_steps={args.steps}",
        "train.local_epochs=none",
        f"train.batch_size={args.batch}",
        f"train.lr={args.lr}",
        f"checkpoint_every={args.rounds}",
        f"eval.every={args.rounds}",
    ]
    cfg = load_run_config(spec, overrides, known_sections(), method="fedavg", seed=args.seed)
    data = {s.name: SiteData(*(load_volume_split(fed, s, split, plan) for split in SPLITS)) for s in fed.sites}
    data = pad_to_common_shape(data)
    work = validation_work(cfg, {s: (dataset_len(d.val), dataset_len(d.train)) for s, d in data.items()})
    volume = list(next(iter(data.values())).val.images.shape[2:])
    cfg = plan_for_run(cfg, plan, log=lambda m: None, sites=work, volume=volume)
    for s, d in data.items():
        x = d.train.images
        print(f"{s}: normalized training images, per channel mean / sd:", end="")
        for c in range(x.shape[1]):
            print(f" [{float(x[:, c].mean()):.3f} / {float(x[:, c].std()):.3f}]", end="")
        print()
    res = simulate(cfg, workload_for(fed, cfg), data, out=None, progress=False, log=lambda m: None)
    wall = time.perf_counter() - t0
    dice = {s: round(float(v), 3) for s, v in res["per_site_dice"].items()}
    summary = {
        "args": vars(args),
        "per_site_dice": dice,
        "client_avg_dice": round(float(res["client_avg_dice"]), 3),
        "wall_time_s": round(wall, 1),
        "machine": f"{platform.machine()} CPU, torch threads 1",
        "training_cases": len(load_datalist(fed.sites[0].datalist)["training"]),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
