"""FedSM personalization ablation (FedSM paper Section 4.3, Table 6 layout).

FedSM with its personalized models made by FT, APFL, Per-FedAvg, pFedMe, Ditto or
SoftPull (``fedsm.personalization``), everything else fixed (global model, selector,
γ), on a synthetic preset.  Rows: the FedSM composite (selector-routed) per
personalization; columns: per-site Dice, Client Avg Dice, Global Dice.  A second
table gives, per row, the personalized models on their own site (mean of the
diagonal of the model × site matrix), the global model's Client Avg Dice, the γ
used and the selector's routing accuracy, to separate the personalization's quality
from the routing.  Runs whose ``results.json`` exists under ``--out`` are read, not re-run.

    .venv/bin/python benchmarks/fedsm_personalization.py --md runs/bench-fedsm-personalization/table6.md

Each method runs at its default settings (``--set ditto.lam=0.5`` etc. to change
them).  Defaults are sized for a shared 2-core CPU; the paper's setting is
150 rounds × 1 epoch at 256², the fundus (low similarity) task.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import torch
from _report import emit, unet_overrides

from fedseg.algorithms import known_sections
from fedseg.data.synth import synthesize
from fedseg.evaluation.tables import table3
from fedseg.execution.federation import load_federation_data
from fedseg.foundation.config import load_run_config
from fedseg.simulation.runner import simulate
from fedseg.site.workload import segmentation_workload

#: Table 6 rows, in the paper's order: (fedsm.personalization, label)
ROWS = (
    ("ft", "FT"),
    ("apfl", "APFL"),
    ("perfedavg", "Per-FedAvg"),
    ("pfedme", "pFedMe"),
    ("ditto", "Ditto"),
    ("softpull", "SoftPull"),
)


def own_site_dice(res: dict) -> float:
    """Mean Dice of each personal/<site> candidate on its own site (diagonal of the model × site matrix)."""
    vals = [
        r["per_site_dice"][r["home_site"]]
        for r in res["rows"]
        if r.get("home_site") and r["home_site"] in r["per_site_dice"]
    ]
    return sum(vals) / len(vals) if vals else float("nan")


def global_avg(res: dict) -> float:
    return next((r["client_avg_dice"] for r in res["rows"] if r["name"] == "global"), float("nan"))


def routing(res: dict, folder: Path) -> tuple[float | None, float]:
    """(γ of the best "fedsm" candidate, mean over sites of the last recorded selector routing accuracy on validation)."""
    best = folder / "checkpoints" / "best.json"
    gamma = json.loads(best.read_text()).get("fedsm", {}).get("config", {}).get("gamma") if best.is_file() else None
    accs = next((e["routing_acc"] for e in reversed(res["history"]) if e.get("routing_acc")), {})
    vals = [v for v in accs.values() if v is not None]
    return gamma, (sum(vals) / len(vals) if vals else float("nan"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench-fedsm-personalization")
    ap.add_argument("--md", default=None, help="write the Markdown fragment here")
    ap.add_argument("--preset", default="fundus")
    ap.add_argument("--personalizations", default=",".join(p for p, _ in ROWS))
    ap.add_argument("--scale", type=float, default=0.06, help="fraction of the paper's per-site case counts")
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=4, help="local steps per round (train.local_steps)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--channels", default="8,16,32")
    ap.add_argument("--selector-width", type=float, default=0.0625)
    ap.add_argument("--selector-steps", type=int, default=1)
    ap.add_argument("--gamma", default="auto", help="fedsm.gamma: a number or 'auto'")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], help="extra overrides, e.g. --set ditto.lam=0.5")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    chans = [int(c) for c in args.channels.split(",")]
    common = [
        *unet_overrides(chans, args.steps, args.batch, args.eval_every, args.rounds, lr=args.lr),
        f"fedsm.selector_width={args.selector_width}",
        f"fedsm.selector_steps={args.selector_steps}",
        f"fedsm.gamma={args.gamma}",
        *args.set,
    ]
    labels = dict(ROWS)
    chosen = args.personalizations.split(",")
    unknown = [p for p in chosen if p not in labels]
    if unknown:
        ap.error(f"unknown personalization(s) {unknown}; choose from {list(labels)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out)
    t_all = time.perf_counter()
    spec = synthesize(args.preset, out / "data" / args.preset, seed=0, scale=args.scale, size=args.size)
    base = load_run_config(spec, common, known_sections(), rounds=args.rounds)
    fed, data = load_federation_data(spec)
    workload = segmentation_workload(
        fed.spatial_dims, fed.in_channels, fed.labels, base.model, base.train, base.eval.threshold
    )
    runs, extra, summary = [], [], []
    for p in chosen:
        for seed in seeds:
            cfg = load_run_config(spec, [*common, f"fedsm.personalization={p}"], known_sections(), rounds=args.rounds)
            cfg = dataclasses.replace(cfg, method="fedsm", seed=seed)
            folder = out / p / f"seed{seed}"
            t0 = time.perf_counter()
            if (folder / "results.json").is_file():  # an interrupted benchmark continues where it stopped
                res = json.loads((folder / "results.json").read_text())
                dt = float(res.get("wall_time_s", float("nan")))
            else:
                res = simulate(cfg, workload, data, out=folder, progress=False, log=lambda m: None)
                dt = time.perf_counter() - t0
            res["label"] = labels[p]
            runs.append(res)
            extra.append((labels[p], seed, own_site_dice(res), global_avg(res), *routing(res, folder), dt))
            print(
                f"{p} seed {seed}: client avg {res['client_avg_dice']:.4f} global {res['global_dice']:.4f} in {dt:.0f}s",
                flush=True,
            )
            summary.append(
                {
                    "personalization": p,
                    "seed": seed,
                    "client_avg_dice": res["client_avg_dice"],
                    "global_dice": res["global_dice"],
                    "wall_s": dt,
                }
            )
    sizes = {s: (len(d.train), len(d.val), len(d.test)) for s, d in data.items()}
    md = [
        f"Command: `.venv/bin/python benchmarks/fedsm_personalization.py {' '.join(sys.argv[1:])}`\n",
        f"Machine: {platform.machine()} CPU, {torch.get_num_threads()} torch thread(s), shared 2-core host.\n",
        f"Setting: {args.preset} preset, {args.size}×{args.size} px, scale {args.scale}, {args.rounds} rounds × {args.steps} steps × batch {args.batch}, "
        f"lr {args.lr}, U-Net channels {chans}, selector width {args.selector_width}, {args.selector_steps} selector step(s)/round, "
        f"γ = {args.gamma}, seeds {seeds}, every method at its default settings.\n",
        f"Sites (train, val, test): {sizes}\n",
        "FedSM (selector-routed composite) with each personalization (Table 6 layout):\n",
        table3(runs),
        "\nSame runs, the models the selector chooses from: personalized models on their own site "
        "(mean Dice, diagonal of the model × site matrix) and the global model (Client Avg Dice):\n",
        "γ: the threshold of the reported composite (`auto`: chosen on validation); routing accuracy: the selector's "
        "last validation routing accuracy, mean over sites (1/K = chance).\n",
        "| personalization | seed | personalized, own site | global model | γ | routing acc | wall s |\n|---|---|---|---|---|---|---|",
        *(f"| {m} | {s} | {d:.4f} | {g:.4f} | {ga} | {ra:.3f} | {t:.0f} |" for m, s, d, g, ga, ra, t in extra),
        f"\nTotal wall time: {time.perf_counter() - t_all:.0f} s\n",
    ]
    emit(md, args.md, out, {"args": vars(args), "runs": summary})


if __name__ == "__main__":
    main()
