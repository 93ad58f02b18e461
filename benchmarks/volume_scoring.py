"""Peak memory and time of scoring one two-label CT in its own grid: the whole grid resampled on the host in
float64 (``to_original_grid``, then Dice and HD95) against the region either mask can reach, in float32 on
the prediction's device (``region_scores``: what ``Site.score_cases`` runs).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/volume_scoring.py --shape 512 512 600 --paths region
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/volume_scoring.py --shape 256 256 300

The case (built one slab at a time, so that the process holds only what a site holds when it scores: the
plan-grid logits in float32 and the label channels in the scan's grid, one byte a voxel): a scan stored LPS at 0.8 × 0.8 × 1.0 mm, its plan grid RAS at the same spacing (so every voxel
moves), an organ ellipsoid of about 1/8 of the field of view with a lesion of 2 % of it, and logits that
agree with the label but for a shifted lesion.  Each path runs in its own process and reports its own peak
resident memory (``ru_maxrss``) before scoring (the held logits and labels, Python and the libraries) and
after, the scoring's wall time, and the Dice and HD95 it computes.  Writes ``OUT/summary.json``
and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from _report import emit, md_table

CHILD = r"""
import json, resource, sys, time
import numpy as np, torch
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[3])
from volume_scoring import case
from fedseg.data.volumes.geometry import region_scores, to_original_grid
from fedseg.site.workload import dice_metric, hd95_metric
shape, path = [int(v) for v in sys.argv[1].split(",")], sys.argv[2]
logits, plan_affine, original, label = case(shape)
held = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t0 = time.perf_counter()
if path == "whole":
    p, t = to_original_grid(logits, plan_affine, original), label.float()
    fov = {}
else:
    p, t = region_scores(logits, plan_affine, original, label, 0.5)
    fov = {"field_of_view": original.shape}
dice = dice_metric(0.5)(p[None], t[None])
hd = hd95_metric(0.5)(p[None], t[None], original.spacing, **fov)
wall = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"wall": wall, "peak_mib": peak, "held_mib": held, "dice": dice[0].tolist(), "hd95": hd[0].tolist(),
                  "region": list(p.shape[1:])}))
"""


def case(shape: list[int]):
    """``(logits (2, *plan grid), plan affine, original Geometry, label channels (2, *shape))``."""
    from fedseg.data.volumes.geometry import Geometry

    spacing = (0.8, 0.8, 1.0)
    original = np.diag([-spacing[0], -spacing[1], spacing[2], 1.0])  # LPS storage
    original[:3, 3] = [spacing[0] * (shape[0] - 1), spacing[1] * (shape[1] - 1), 0.0]
    plan = np.diag([*spacing, 1.0])  # RAS: the same field of view, every axis but z reversed
    label = torch.empty(2, *shape, dtype=torch.uint8)  # one byte a voxel, as a site holds it; built a slab at a time
    logits = torch.empty(2, *shape)
    y = (torch.arange(shape[1], dtype=torch.float32) / shape[1] - 0.5)[:, None]
    z = (torch.arange(shape[2], dtype=torch.float32) / shape[2] - 0.5)[None, :]
    shift = max(1, shape[2] // 60)
    for i in range(shape[0]):
        x = i / shape[0] - 0.5
        label[0, i] = (x / 0.25) ** 2 + (y / 0.25) ** 2 + (z / 0.25) ** 2 <= 1
        label[1, i] = ((x - 0.08) / 0.07) ** 2 + (y / 0.07) ** 2 + (z / 0.07) ** 2 <= 1
        j = shape[0] - 1 - i  # the plan grid reverses x and y
        logits[0, j] = label[0, i].flip(0).float() * 12.0 - 6.0
        logits[1, j] = (label[1, i].flip(0).float() * 12.0 - 6.0).roll(shifts=shift, dims=1)  # the lesion a little off
    return logits, plan, Geometry(original, tuple(shape)), label


def run(shape: list[int], path: str) -> dict:
    here = str(Path(__file__).resolve().parent)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, ",".join(map(str, shape)), path, here],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=int, nargs=3, default=[256, 256, 300])
    ap.add_argument("--paths", nargs="+", default=["whole", "region"], choices=["whole", "region"])
    ap.add_argument("--out", default="bench-volume-scoring")
    ap.add_argument("--md", default=None)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {p: run(a.shape, p) for p in a.paths}
    rows = [
        [
            p,
            "×".join(map(str, a.shape)),
            f"{r['held_mib']:.0f}",
            f"{r['peak_mib']:.0f}",
            f"{r['wall']:.1f}",
            ", ".join(f"{v:.4f}" for v in r["dice"]),
            ", ".join(f"{v:.2f}" for v in r["hd95"]),
            "×".join(map(str, r["region"])),
        ]
        for p, r in results.items()
    ]
    machine = f"{platform.processor() or platform.machine()}, torch threads 1"
    summary = {"shape": a.shape, "results": results, "machine": machine, "when": time.strftime("%Y-%m-%d")}
    md = [
        f"Scoring one two-label case in its own grid ({machine}):",
        "",
        *md_table(
            [
                "path",
                "scan",
                "RSS before scoring (MiB)",
                "peak RSS (MiB)",
                "wall (s)",
                "Dice",
                "HD95 (mm)",
                "scored region",
            ],
            rows,
        ),
    ]
    emit(md, a.md, out, summary)


if __name__ == "__main__":
    main()
