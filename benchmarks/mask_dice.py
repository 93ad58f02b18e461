"""The Dice a run reports against the Dice of the masks ``fedseg predict`` writes for its test cases.

    .venv/bin/python benchmarks/mask_dice.py runs/demo/fedavg/seed0 runs/demo/fedsm/seed0

For each finished run: its primary model predicts every site's test split with ``predict_files`` (into a
temporary folder), the masks are re-read from disk and scored against the label files with numpy (Dice per
label channel through ``isin`` of the spec's values, mean over channels per case), and the per-site and
client-average Dice are printed beside ``results.json``'s, with the largest per-case difference.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from fedseg.apps.predict import load_predictor, predict_files
from fedseg.data.readers import read_array
from fedseg.data.spec import load_federation
from fedseg.foundation.config import load_run_config


def _read(path: Path) -> np.ndarray:
    if path.name.endswith((".nii", ".nii.gz")):
        import nibabel as nib

        return np.asarray(nib.load(str(path)).dataobj)
    return read_array(path)


def case_dice(mask: np.ndarray, label: np.ndarray, labels: dict) -> float:
    out = []
    for values in labels.values():
        p, t = np.isin(mask, values), np.isin(label, values)
        s = p.sum() + t.sum()
        out.append(1.0 if s == 0 else float(2.0 * (p & t).sum() / s))
    return float(np.mean(out))


def rescore(run_dir: Path) -> dict:
    fed = load_federation(load_run_config(run_dir / "config.toml").federation)
    results = json.loads((run_dir / "results.json").read_text())
    loaded = load_predictor(run_dir, device="cpu")
    name = loaded.candidate.name
    per_site, worst = {}, 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for site in fed.sites:
            out = Path(tmp) / site.name
            res = predict_files(loaded, [site.datalist], out, split="testing", progress=False, log=lambda m: None)
            entries = json.loads(site.datalist.read_text())["testing"]
            by_name = {Path(p).name.split(".")[0]: p for p in res["written"]}  # one mask per image, its name
            got = [
                case_dice(
                    _read(Path(by_name[Path(e["image"]).name.split(".")[0]])),
                    _read(site.datalist.parent / e["label"]),
                    fed.labels,
                )
                for e in entries
            ]
            want = results["per_case_dice"][name][site.name]
            worst = max([worst, *(abs(a - b) for a, b in zip(got, want))])
            per_site[site.name] = (float(np.mean(got)), results["per_site_dice"][site.name])
    return {
        "run": str(run_dir),
        "model": name,
        "per_site": per_site,
        "client_avg": (float(np.mean([v[0] for v in per_site.values()])), results["client_avg_dice"]),
        "largest_case_difference": worst,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for run_dir in args.runs:
        r = rescore(run_dir)
        print(
            f"{r['run']} ({r['model']}): client avg Dice, masks {r['client_avg'][0]:.4f}, reported {r['client_avg'][1]:.4f}"
        )
        for s, (m, rep) in r["per_site"].items():
            print(f"  {s}: masks {m:.4f}, reported {rep:.4f}")
        print(f"  largest per-case difference: {r['largest_case_difference']:.2e}")


if __name__ == "__main__":
    main()
