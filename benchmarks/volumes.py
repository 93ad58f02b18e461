"""Volumes on the synthetic ``ct-lesion`` federation: methods scored in each scan's own grid, and what the
federated plan's exact pooled intensity statistics buy over per-site and averaged statistics.

1. Centralized, local, FedAvg and Auto-FedAvg (the rows of Auto-FedAvg's Table 2), every test case scored
   in its scan's own grid: Dice and the 95th-percentile Hausdorff distance (mm) per site.
2. FedAvg under three CT intensity normalizations (clip to the foreground 0.5 / 99.5 percentiles,
   z-score with the foreground mean and sd), differing only in where the statistics come from:
   * the federated plan: pooled over every site's training foreground, exactly (mean, sd, and the
     percentiles of the integer HU), without pooling a voxel (``fedseg plan``);
   * each site's own statistics (each site normalizes with its own training foreground);
   * averaged site statistics: each site's percentiles, mean and sd averaged with weights equal to its
     training cases, one set for all (FednnU-Net's rule).
   The table gives the statistics, how far the averaged ones are from the pooled voxels', and the test
   Dice and HD95 per site.

    .venv/bin/python benchmarks/volumes.py --md volumes.md      # the tables of docs/results/volumes.md

The default (``--size 48 --scale 0.5``, 30 rounds of 16 steps) takes a few minutes on 2 CPU cores with
one torch thread; ``--size 64 --scale 1 --rounds 50 --patch-voxels 32768`` is the preset's full size.
Writes ``OUT/data`` (the federation), ``OUT/<row>/results.json`` and ``OUT/summary.json``.
"""

from __future__ import annotations

import argparse
import copy
import math
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _report import emit, md_table

from fedseg.algorithms import known_sections
from fedseg.data.datalist import SPLITS, load_datalist
from fedseg.data.spec import load_federation
from fedseg.data.synth3d import synthesize_ct
from fedseg.data.volumes.fingerprint import site_fingerprint
from fedseg.data.volumes.geometry import read_case
from fedseg.data.volumes.load import load_volume_split, pad_to_common_shape, plan_federation, plan_for_run, plan_path
from fedseg.data.volumes.plan import PERCENTILES, Plan, save_plan
from fedseg.execution.federation import validation_work
from fedseg.execution.results import write_results
from fedseg.foundation.config import load_run_config
from fedseg.simulation.runner import simulate
from fedseg.site.runtime import SiteData, dataset_len
from fedseg.site.workload import workload_for

METHODS = {"centralized": "Centralized", "local": "Local (own site)", "fedavg": "FedAvg", "autofedavg": "Auto-FedAvg"}


def site_statistics(fed, site) -> dict[str, float]:
    """What a site computes on its own training foreground (label > 0): 0.5 / 99.5 percentiles, mean and
    sd (population, as nnU-Net's ``np.std``), and its number of training cases."""
    cases = [
        read_case(e["image"], e["label"], fed.in_channels, fed.label_values)
        for e in load_datalist(site.datalist, site=site.name)["training"]
    ]
    fg = np.concatenate([img[0][lab > 0].astype(np.float64) for img, lab, _ in cases])
    fp = site_fingerprint(cases)["channels"][0]["foreground"]
    lo, hi = np.percentile(fg, PERCENTILES)
    return {
        "lo": float(lo),
        "hi": float(hi),
        "mean": fp["mean"],
        "sd": math.sqrt(fp["m2"] / fp["count"]),
        "n": len(cases),
    }


def averaged_statistics(stats: dict[str, dict[str, float]]) -> dict[str, float]:
    """FednnU-Net's rule: each statistic averaged over the sites, weighted by their training cases."""
    n = sum(s["n"] for s in stats.values())
    return {k: sum(s[k] * s["n"] for s in stats.values()) / n for k in ("lo", "hi", "mean", "sd")}


def pooled_voxel_statistics(fed) -> dict[str, float]:
    """The reference: the statistics of every site's training foreground voxels pooled (what the plan
    reproduces without pooling them)."""
    fg = []
    for site in fed.sites:
        for e in load_datalist(site.datalist, site=site.name)["training"]:
            img, lab, _ = read_case(e["image"], e["label"], fed.in_channels, fed.label_values)
            fg.append(img[0][lab > 0].astype(np.float64))
    v = np.concatenate(fg)
    lo, hi = np.percentile(v, PERCENTILES)
    return {"lo": float(lo), "hi": float(hi), "mean": float(v.mean()), "sd": float(v.std())}


def with_intensity(plan: Plan, stats: dict[str, float]) -> Plan:
    out = copy.deepcopy(plan)
    out.intensity = {"mode": "ct", **{k: float(stats[k]) for k in ("lo", "hi", "mean", "sd")}}
    return out


def train(spec: Path, fed, plans: dict[str, Plan], method: str, overrides: list[str], seed: int, out: Path):
    """One run with each site's splits in the grid of its own plan (one plan for all sites but for the
    per-site-statistics row), as ``fedseg run`` does."""
    cfg = load_run_config(spec, overrides, known_sections(), method=method, seed=seed)
    data = {s.name: SiteData(*(load_volume_split(fed, s, split, plans[s.name]) for split in SPLITS)) for s in fed.sites}
    data = pad_to_common_shape(data)
    work = validation_work(cfg, {s: (dataset_len(d.val), dataset_len(d.train)) for s, d in data.items()})
    volume = list(next(iter(data.values())).val.images.shape[2:])
    cfg = plan_for_run(cfg, plans[fed.sites[0].name], log=lambda m: None, sites=work, volume=volume)
    t0 = time.perf_counter()
    res = simulate(cfg, workload_for(fed, cfg), data, out=None, progress=False, log=lambda m: None)
    res["wall_time_s"] = time.perf_counter() - t0
    res["plan"] = plans[fed.sites[0].name].to_json()
    write_results(res, out)
    return res


def planned_federation(out: Path, seed: int, scale: float, size: int, patch_voxels: int):
    """``(spec, federation, plan)`` of the ct-lesion preset under ``out/data`` (synthesized once, reused after),
    planned as ``fedseg plan`` does with ``patch_voxels``, the plan written beside the spec."""
    spec = out / "data" / "federation.toml"
    if not spec.is_file():
        synthesize_ct(out / "data", seed=seed, scale=scale, size=size)
    fed = load_federation(spec)
    # voxel-weighted, as the reference statistics of the pooled voxels below
    plan = plan_federation(fed, patch_voxels=patch_voxels, weighting="voxel", log=lambda m: None)
    save_plan(plan, plan_path(fed))
    return spec, fed, plan


def f(v: Any, digits: int = 3) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=48, help="in-plane voxels of the ct-lesion preset")
    ap.add_argument("--scale", type=float, default=0.5, help="cases per split relative to the preset")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=16, help="local steps per round")
    ap.add_argument("--lr", type=float, default=0.01, help="Adam learning rate (train.lr)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--patch-voxels", type=int, default=24 * 24 * 16, help="the plan's patch budget")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated, of " + ", ".join(METHODS))
    ap.add_argument("--no-intensity", action="store_true", help="skip the intensity-statistics table")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="extra config overrides")
    ap.add_argument("--out", default="runs/bench_volumes")
    ap.add_argument("--md", default=None, help="also write the Markdown fragment here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    out = Path(args.out)
    spec, fed, plan = planned_federation(out, args.seed, args.scale, args.size, args.patch_voxels)
    base = [
        f"rounds={args.rounds}",
        f"train.local_steps={args.steps}",
        "train.local_epochs=none",
        f"train.batch_size={args.batch}",
        f"train.lr={args.lr}",
        f"checkpoint_every={args.rounds}",
        *args.overrides,
    ]
    pooled = {s.name: plan for s in fed.sites}
    sites = [s.name for s in fed.sites]
    summary: dict[str, Any] = {"args": vars(args), "plan": plan.to_json(), "methods": {}, "intensity": {}}

    rows = []
    for method in [m for m in args.methods.split(",") if m]:
        res = train(spec, fed, pooled, method, base, args.seed, out / method)
        summary["methods"][method] = {
            k: res.get(k) for k in ("per_site_dice", "client_avg_dice", "per_site_hd95", "client_avg_hd95")
        }
        summary["methods"][method]["wall_time_s"] = res["wall_time_s"]
        rows.append(
            [METHODS.get(method, method)]
            + [f(res["per_site_dice"][s]) for s in sites]
            + [f(res["client_avg_dice"])]
            + [f(res.get("per_site_hd95", {}).get(s), 1) for s in sites]
            + [f(res.get("client_avg_hd95"), 1), f"{res['wall_time_s']:.0f}"]
        )
        print(f"{method}: client avg Dice {res['client_avg_dice']:.3f}, HD95 {res.get('client_avg_hd95')}", flush=True)
    every = res["config"]["eval"]["every"] if rows else None

    md = [
        "### Methods on ct-lesion, scored in each scan's own grid\n",
        *md_table(
            [
                "Method",
                *[f"Dice {s}" for s in sites],
                "Client Avg Dice",
                *[f"HD95 {s} (mm)" for s in sites],
                "Client Avg HD95 (mm)",
                "Time (s)",
            ],
            rows,
        ),
        "",
        f"Test Dice and HD95 (mean over the organ and lesion channels per case, then over a site's cases) after "
        f"the prediction is resampled back into each scan's own grid. Plan: target spacing "
        f"{[round(v, 3) for v in plan.target_spacing]} mm, patch {plan.patch_size}, U-Net channels "
        f"{plan.channels}, strides {plan.strides}; intensity `ct` (pooled). Training: {args.rounds} rounds of "
        f"{args.steps} local steps, batch {args.batch}, Adam lr {args.lr}, validation every {every} round(s) (derived), seed "
        f"{args.seed}. Local = each site's own model on its own test set.\n",
    ]

    if not args.no_intensity:
        own = {s.name: site_statistics(fed, s) for s in fed.sites}
        avg = averaged_statistics(own)
        ref = pooled_voxel_statistics(fed)
        schemes = {
            "Federated plan (pooled, exact)": ({s: plan for s in sites}, plan.intensity),
            "Each site's own statistics": ({s: with_intensity(plan, own[s]) for s in sites}, None),
            "Averaged site statistics (FednnU-Net)": ({s: with_intensity(plan, avg) for s in sites}, avg),
        }
        irows = []
        for label, (plans, stats) in schemes.items():
            name = "intensity_" + label.split()[0].lower()
            if label.startswith("Federated") and "fedavg" in summary["methods"]:
                res = summary["methods"]["fedavg"]  # the FedAvg run above: the plan's pooled statistics
            else:
                res = train(spec, fed, plans, "fedavg", base, args.seed, out / name)
            if stats is None:
                cells = [" / ".join(f"{own[s][k]:.1f}" for s in sites) for k in ("lo", "hi", "mean", "sd")]
                miss = max(abs(own[s][k] - ref[k]) for s in sites for k in ("lo", "hi", "mean", "sd"))
            else:
                cells = [f"{stats[k]:.1f}" for k in ("lo", "hi", "mean", "sd")]
                miss = max(abs(stats[k] - ref[k]) for k in ("lo", "hi", "mean", "sd"))
            summary["intensity"][label] = {
                "stats": own if stats is None else stats,
                "max_abs_diff_to_pooled_voxels_hu": miss,
                **{k: res.get(k) for k in ("per_site_dice", "client_avg_dice", "per_site_hd95", "client_avg_hd95")},
            }
            irows.append(
                [label, *cells, f"{miss:.2f}"]
                + [f(res["per_site_dice"][s]) for s in sites]
                + [f(res["client_avg_dice"]), f(res.get("client_avg_hd95"), 1)]
            )
            print(f"{label}: client avg Dice {res['client_avg_dice']:.3f}", flush=True)
        summary["intensity_reference"] = ref
        md += [
            "### Intensity statistics: pooled exactly vs per site vs averaged (FedAvg)\n",
            *md_table(
                [
                    "Statistics",
                    "p0.5 (HU)",
                    "p99.5 (HU)",
                    "mean (HU)",
                    "sd (HU)",
                    "max |Δ| to pooled voxels (HU)",
                    *[f"Dice {s}" for s in sites],
                    "Client Avg Dice",
                    "Client Avg HD95 (mm)",
                ],
                irows,
            ),
            "",
            f"Foreground (organ and lesion) statistics of the training cases in file HU; per-site values listed "
            f"{' / '.join(sites)}. Reference: the pooled voxels of every site, p0.5 {ref['lo']:.2f}, p99.5 "
            f"{ref['hi']:.2f}, mean {ref['mean']:.2f}, sd {ref['sd']:.2f} HU. The same FedAvg run otherwise "
            "(plan grid, patch, network, seed); only the intensity normalization differs.\n",
        ]
    wall = time.perf_counter() - t_start
    shown = ("size", "scale", "rounds", "steps", "batch", "lr", "patch_voxels", "seed")
    flags = " ".join(f"--{k.replace('_', '-')} {getattr(args, k)}" for k in shown)
    md.append(
        f"Settings: `{flags}`. Machine: {platform.machine()}, {torch.get_num_threads()} torch thread(s). "
        f"Wall {wall:.0f} s.\n"
    )
    summary["wall_s"] = wall
    emit(md, args.md, out, summary)


if __name__ == "__main__":
    main()
