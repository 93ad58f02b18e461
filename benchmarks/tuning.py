"""Tuned comparison benchmark: FedAvg and FedSM on the synthetic fundus preset with the learning rate of each
chosen on validation (``fedseg compare --tune train.lr=…``), beside the same methods at the default learning
rate (1e-3, a point of the grid: its runs are the untuned comparison).

    .venv/bin/python benchmarks/tuning.py --md runs/bench-tuning/tuning.md

Defaults are sized for a few minutes on a shared 2-core CPU with one torch thread (a small U-Net at 32²,
local steps instead of epochs); the FedSM paper tunes at 256² over 150 rounds and reports 3 seeds.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from _report import emit, unet_overrides

from fedseg.apps.studies.compare import compare
from fedseg.apps.studies.jobs import StudyOptions
from fedseg.data.synth import synthesize
from fedseg.evaluation.tables import table3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/bench-tuning")
    p.add_argument("--md")
    p.add_argument("--methods", default="fedavg,fedsm")
    p.add_argument("--lrs", default="1e-3,3e-3,1e-2")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=5, help="local steps per round")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--scale", type=float, default=0.1)
    p.add_argument("--channels", default="8,16,32")
    p.add_argument("--jobs", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(1)
    out = Path(a.out)
    t0 = time.perf_counter()
    spec = synthesize("fundus", out / "data", seed=0, scale=a.scale, size=a.size, progress=False)
    channels = [int(c) for c in a.channels.split(",")]
    overrides = [*unet_overrides(channels, a.steps, a.batch, 1, a.rounds), "device=cpu"]
    seeds = [int(s) for s in a.seeds.split(",")]
    t1 = time.perf_counter()
    _runs, table = compare(
        spec,
        a.methods.split(","),
        out / "tuned",
        StudyOptions(
            seeds=tuple(seeds),
            rounds=a.rounds,
            overrides=tuple(overrides),
            jobs=a.jobs,
            progress=False,
            log=lambda m: None,
        ),
        tune=[f"train.lr={a.lrs}"],
    )
    wall = time.perf_counter() - t1
    record = json.loads((out / "tuned" / "tuning.json").read_text())
    default = []  # the untuned comparison: every method at the default lr, a point of the grid
    for m in record["methods"]:
        pt = next(p for p in m["points"] if float(p["point"]["train.lr"]) == 1e-3)
        for f in pt["folders"]:
            res = json.loads((out / "tuned" / f / "results.json").read_text())
            res["label"] = res["label"].split(" [")[0] + " (lr 1e-3, untuned)"
            default.append(res)
    n_runs = sum(len(m["points"]) for m in record["methods"]) * len(seeds)
    md = [
        f"**Command:** `python benchmarks/tuning.py --methods {a.methods} --lrs {a.lrs} --seeds {a.seeds} "
        f"--rounds {a.rounds} --steps {a.steps} --batch {a.batch} --size {a.size} --scale {a.scale} "
        f"--channels {a.channels} --jobs {a.jobs}`",
        "",
        f"**Machine:** {platform.machine()} CPU, torch {torch.__version__}, 1 torch thread per run, "
        f"{a.jobs} process(es); {n_runs} runs in {wall:.0f} s (synthesis {t1 - t0:.0f} s).",
        "",
        "Untuned (every method at the default learning rate 1e-3):",
        "",
        table3(default).rstrip(),
        "",
        "Tuned (each method's learning rate chosen on validation, test Dice of the chosen one):",
        "",
        table.rstrip(),
        "",
    ]
    emit(md, a.md, out, {"wall_s": wall, "runs": n_runs, "tuning": record})


if __name__ == "__main__":
    main()
