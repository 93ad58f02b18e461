"""``fedseg predict`` measured: what test-time mirroring (``--tta``) and keep-largest-component
(``--postprocess``) change on held-back validation, throughput, and peak memory of a large volume.

1. FedAvg on the synthetic fundus (2D) and ct-lesion (3D) presets, a small run each; the best global model
   predicts every site's validation split four ways (plain, TTA, post-processing, both), the masks are
   re-read from disk and scored against the labels (numpy Dice per label channel, mean over cases).
2. Throughput: cases/s of ``predict_files`` (read, preprocess, predict, invert, write) for 256 × 256 PNGs and
   for ct-lesion volumes, on this machine's CPU (one torch thread) — and on CUDA when there is one.
3. Peak memory: one 512 × 512 × 300 int16 CT volume predicted by the ct-lesion run in a child process, its
   peak resident set size (``ru_maxrss``) beside the bytes of the volume itself.  Its voxels are small
   (0.185 × 0.185 × 0.25 mm) so that the plan's grid, and the sliding windows over it, stay small on a CPU:
   what is measured is reading the scan and writing its mask in its own 512 × 512 × 300 grid (the inversion,
   slab by slab), not the network over a full-size plan grid.

    .venv/bin/python benchmarks/predict.py --md predict.md

About two minutes on 2 CPU cores with one torch thread (``--rounds`` and ``--scale`` make it longer).
Writes ``OUT/summary.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _report import emit, md_table

from fedseg.apps.predict import load_predictor, predict_files
from fedseg.data.readers import read_array
from fedseg.data.spec import load_federation
from fedseg.data.synth import synthesize
from fedseg.data.synth3d import synthesize_ct
from fedseg.simulation.runner import run

UNET2D = ["model.channels=[8,16,32]", "model.strides=[2,2]", "model.num_res_units=1"]
VARIANTS = {
    "plain": {},
    "tta": {"tta": True},
    "postprocess": {"postprocess": True},
    "both": {"tta": True, "postprocess": True},
}


def _read(path: Path) -> np.ndarray:
    if path.name.endswith((".nii", ".nii.gz")):
        import nibabel as nib

        return np.asarray(nib.load(str(path)).dataobj)
    return read_array(path)


def dice(mask: np.ndarray, label: np.ndarray, labels: dict) -> list[float]:
    out = []
    for values in labels.values():
        p, t = np.isin(mask, values), np.isin(label, values)
        s = p.sum() + t.sum()
        out.append(1.0 if s == 0 else float(2.0 * (p & t).sum() / s))
    return out


def quality(run_dir: Path, spec: Path, out: Path) -> dict[str, float]:
    """Mean validation Dice (over sites' cases and label channels) of each variant."""
    fed = load_federation(spec)
    loaded = load_predictor(run_dir, device="cpu")
    res = {}
    for name, opts in VARIANTS.items():
        scores = []
        for site in fed.sites:
            masks = out / name / site.name
            predict_files(
                loaded,
                [site.datalist],
                masks,
                split="validation",
                progress=False,
                force=True,
                log=lambda m: None,
                **opts,
            )
            for e in json.loads(site.datalist.read_text())["validation"]:
                stem = e["image"]
                m = masks / (stem if stem.endswith(".nii.gz") else stem.rsplit(".", 1)[0] + ".png")
                scores.append(np.mean(dice(_read(m), _read(site.datalist.parent / e["label"]), fed.labels)))
        res[name] = float(np.mean(scores))
    return res


def throughput(run_dir: Path, inputs: list[Path], out: Path, device: str) -> float:
    loaded = load_predictor(run_dir, device=device)
    predict_files(loaded, inputs[:1], out / "warm", progress=False, force=True, log=lambda m: None)
    t = time.perf_counter()
    predict_files(loaded, inputs, out / device, progress=False, force=True, log=lambda m: None)
    return len(inputs) / (time.perf_counter() - t)


def _peak_child(run_dir: str, path: str, out: str) -> None:
    torch.set_num_threads(1)
    loaded = load_predictor(run_dir, device="cpu")
    predict_files(loaded, [path], out, progress=False, force=True, log=lambda m: None)
    print(json.dumps({"maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def peak_memory(run_dir: Path, out: Path, shape=(512, 512, 300)) -> dict[str, Any]:
    import nibabel as nib

    rng = np.random.default_rng(0)
    vol = np.full(shape, -1000, dtype=np.int16)
    x, y = np.ogrid[: shape[0], : shape[1]]
    body = (x - shape[0] / 2) ** 2 + (y - shape[1] / 2) ** 2 < (shape[0] * 0.4) ** 2
    vol[body] = 40
    vol += rng.integers(-20, 20, size=shape, dtype=np.int16)
    path = out / "big.nii.gz"
    nib.save(nib.Nifti1Image(vol, np.diag([0.185, 0.185, 0.25, 1.0])), path)
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import predict as p; p._peak_child({str(run_dir)!r}, {str(path)!r}, {str(out / 'big')!r})"
    t = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    peak = json.loads(res.stdout.strip().splitlines()[-1])
    return {
        "shape": list(shape),
        "volume_mib": vol.nbytes / 2**20,
        "peak_rss_mib": peak["maxrss_mib"],
        "seconds": time.perf_counter() - t,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/bench-predict")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--md")
    ap.add_argument("--stages", default="quality,throughput,memory", help="comma-separated subset")
    args = ap.parse_args()
    stages = set(args.stages.split(","))
    torch.set_num_threads(1)
    out = Path(args.out)
    summary: dict[str, Any] = {"machine": f"{platform.machine()} CPU, {torch.get_num_threads()} torch thread"}
    if (out / "summary.json").is_file():  # stages run one at a time add to one summary
        summary = {**json.loads((out / "summary.json").read_text()), **summary}
    t0 = time.perf_counter()
    fundus, ct = out / "fundus" / "federation.toml", out / "ct" / "federation.toml"
    if "quality" in stages:  # 2D fundus at 64 px and 3D ct-lesion, a small FedAvg run each
        fundus = synthesize("fundus", out / "fundus", scale=0.1, size=64)
        run(
            fundus,
            out=out / "fundus-run",
            overrides=["method=fedavg", f"rounds={args.rounds}", "train.batch_size=8", *UNET2D],
            progress=False,
            log=lambda m: None,
        )
        summary["fundus"] = quality(out / "fundus-run", fundus, out / "fundus-masks")
        ct = synthesize_ct(out / "ct", scale=0.25, size=32, workers=1)
        run(
            ct,
            out=out / "ct-run",
            overrides=[
                "method=fedavg",
                f"rounds={args.rounds}",
                "train.local_steps=4",
                "train.batch_size=2",
                "model.num_res_units=0",
            ],
            progress=False,
            log=lambda m: None,
        )
        summary["ct-lesion"] = quality(out / "ct-run", ct, out / "ct-masks")
        summary["quality_s"] = time.perf_counter() - t0
    if "throughput" in stages:
        big = synthesize("fundus", out / "fundus256", scale=0.05, size=256)
        spec256 = load_federation(big)
        pngs = [
            spec256.sites[0].datalist.parent / e["image"]
            for e in json.loads(spec256.sites[0].datalist.read_text())["testing"]
        ]
        pngs = pngs * max(1, 8 // len(pngs))
        cts = load_federation(ct)
        vols = [
            cts.sites[0].datalist.parent / e["image"] for e in json.loads(cts.sites[0].datalist.read_text())["testing"]
        ]
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        summary["throughput"] = {
            d: {
                "png256_cases_per_s": throughput(out / "fundus-run", pngs, out / "tp2d", d),
                "ct_cases_per_s": throughput(out / "ct-run", vols, out / "tp3d", d),
            }
            for d in devices
        }
        summary["ct_volume_shape"] = list(_read(vols[0]).shape)
    if "memory" in stages:
        summary["peak_memory"] = peak_memory(out / "ct-run", out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if not {"fundus", "throughput", "peak_memory"} <= set(summary):
        return
    md = ["## fedseg predict", "", f"`benchmarks/predict.py`, this machine: {summary['machine']}.", ""]
    md += md_table(
        ["preset (validation)", "plain", "TTA", "largest component", "both"],
        [[k, *(f"{summary[k][v]:.4f}" for v in VARIANTS)] for k in ("fundus", "ct-lesion")],
    )
    md += [""]
    md += md_table(
        ["device", "256² PNG cases/s", f"ct-lesion volume {'×'.join(map(str, summary['ct_volume_shape']))} cases/s"],
        [[d, f"{v['png256_cases_per_s']:.1f}", f"{v['ct_cases_per_s']:.2f}"] for d, v in summary["throughput"].items()],
    )
    if "peak_memory" in summary:
        pm = summary["peak_memory"]
        md += [
            "",
            f"Peak memory, one {'×'.join(map(str, pm['shape']))} int16 volume ({pm['volume_mib']:.0f} MiB): {pm['peak_rss_mib']:.0f} MiB resident, {pm['seconds']:.0f} s.",
        ]
    emit(md, args.md, out, summary)


if __name__ == "__main__":
    main()
