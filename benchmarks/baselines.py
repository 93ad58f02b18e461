"""Baselines benchmark: FedSM Table 3 rows of FedAvg, FedProx, SCAFFOLD and the
personalization methods FT, APFL, Per-FedAvg, pFedMe, Ditto on the synthetic fundus
(low similarity) and prostate (high similarity) presets.

For a personalization method the method's row is each site's personalized model on
its own test set; the table adds its global model as "<method> (global)", and a
second table shows how the personalized models fare on the *other* sites (mean of
the off-diagonal of the model × site matrix vs the diagonal).

    .venv/bin/python benchmarks/baselines.py --md runs/bench-baselines/baselines.md

Local work is counted in steps (``train.local_steps``).  Defaults are sized for a
shared 2-core CPU; the paper's setting is 150 rounds × 1 epoch at 256², 3 seeds.
"""

from __future__ import annotations

import argparse
import dataclasses
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

METHODS = (
    "fedavg",
    "fedprox",
    "scaffold",
    "scaffold:correction=gradient",
    "ft",
    "apfl",
    "perfedavg",
    "pfedme",
    "ditto",
)
PERSONAL = ("ft", "apfl", "perfedavg", "pfedme", "ditto")


def parse_entry(entry: str) -> tuple[str, dict]:
    """``"scaffold:correction=gradient;server_lr=1"`` → ("scaffold", {"correction": "gradient", "server_lr": "1"})."""
    method, _, rest = entry.partition(":")
    params = {}
    for item in filter(None, rest.split(";")):
        k, _, v = item.partition("=")
        params[k] = v
    return method, params


def global_row(res: dict) -> dict | None:
    """The global model's row of a personalization run, shaped like a run's results for ``table3``."""
    for r in res["rows"]:
        if r["name"] == "global":
            return {
                "method": f"{res.get('label', res['method'])} (global)",
                "sites": res["sites"],
                "seed": res["seed"],
                **{k: r[k] for k in ("per_site_dice", "client_avg_dice", "global_dice")},
            }
    return None


def generalization(res: dict) -> tuple[float, float]:
    """Mean Dice of personal/<s> on its own site (diagonal) and on the other sites (off-diagonal)."""
    diag, off = [], []
    for r in res["rows"]:
        home = r.get("home_site")
        if home is None:
            continue
        for s, d in r["per_site_dice"].items():
            (diag if s == home else off).append(d)
    return sum(diag) / len(diag), sum(off) / len(off)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench-baselines")
    ap.add_argument("--md", default=None, help="write the Markdown fragment here")
    ap.add_argument("--presets", default="fundus,prostate")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--scale", type=float, default=0.05, help="fraction of the paper's per-site case counts")
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=4, help="local steps per round (train.local_steps)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--channels", default="8,16,32")
    ap.add_argument("--eval-every", type=int, default=2)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], help="extra overrides, e.g. --set fedprox.mu=0.1")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    chans = [int(c) for c in args.channels.split(",")]
    common = [
        *unet_overrides(chans, args.steps, args.batch, args.eval_every, args.rounds, lr=args.lr),
        *args.set,
    ]
    methods = args.methods.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out)
    t_all = time.perf_counter()
    md = [
        f"Command: `.venv/bin/python benchmarks/baselines.py {' '.join(sys.argv[1:])}`\n",
        f"Machine: {platform.machine()} CPU, {torch.get_num_threads()} torch thread(s), shared 2-core host.\n",
    ]
    summary = []
    for preset in args.presets.split(","):
        spec = synthesize(preset, out / "data" / preset, seed=0, scale=args.scale, size=args.size)
        base = load_run_config(spec, common, known_sections(), rounds=args.rounds)
        fed, data = load_federation_data(spec)
        workload = segmentation_workload(
            fed.spatial_dims, fed.in_channels, fed.labels, base.model, base.train, base.eval.threshold
        )
        runs, gen, times = [], [], {}
        t_preset = time.perf_counter()
        for entry in methods:
            method, extra = parse_entry(entry)
            for seed in seeds:
                overrides = [*common, *(f"{method}.{k}={v}" for k, v in extra.items())]
                cfg = dataclasses.replace(
                    load_run_config(spec, overrides, known_sections(), rounds=args.rounds), method=method, seed=seed
                )
                t0 = time.perf_counter()
                res = simulate(
                    cfg,
                    workload,
                    data,
                    out=out / preset / entry.replace(":", "_").replace(";", "_") / f"seed{seed}",
                    progress=False,
                    log=lambda m: None,
                )
                res["label"] = entry
                dt = time.perf_counter() - t0
                times.setdefault(entry, []).append(dt)
                print(
                    f"{preset} {entry} seed {seed}: client avg {res['client_avg_dice']:.4f} global {res['global_dice']:.4f} in {dt:.0f}s",
                    flush=True,
                )
                runs.append(res)
                if method in PERSONAL:
                    g = global_row(res)
                    if g is not None:
                        runs.append(g)
                    gen.append((entry, seed, *generalization(res)))
                summary.append(
                    {
                        "preset": preset,
                        "method": entry,
                        "seed": seed,
                        "client_avg_dice": res["client_avg_dice"],
                        "global_dice": res["global_dice"],
                        "wall_s": dt,
                    }
                )
        sizes = {s: (len(d.train), len(d.val), len(d.test)) for s, d in data.items()}
        md.append(
            f"\n### {preset} ({'low' if preset == 'fundus' else 'high'} similarity) — {args.size}×{args.size} px, scale {args.scale}, "
            f"{args.rounds} rounds × {args.steps} steps × batch {args.batch}, lr {args.lr}, channels {chans}, seeds {seeds}, "
            f"wall {time.perf_counter() - t_preset:.0f} s\n"
        )
        md.append(f"Sites (train, val, test): {sizes}\n")
        md.append(
            "Method rows: personalization methods report each site's personalized model on its own test set; "
            "'(global)' rows are their global model.\n"
        )
        md.append(table3(runs))
        if gen:
            md.append(
                "\nPersonalized models on their own site vs on the other sites (mean Dice over the model × site matrix):\n"
            )
            md.append("| method | seed | own site (diagonal) | other sites (off-diagonal) |\n|---|---|---|---|")
            for m, s, d, o in gen:
                md.append(f"| {m} | {s} | {d:.4f} | {o:.4f} |")
        md.append(
            "\nWall time per run (s): " + ", ".join(f"{m} {sum(v) / len(v):.0f}" for m, v in times.items()) + "\n"
        )
    md.append(f"\nTotal wall time: {time.perf_counter() - t_all:.0f} s\n")
    emit(md, args.md, out, {"args": vars(args), "runs": summary})


if __name__ == "__main__":
    main()
