"""DP-SGD benchmark: Dice against ε for FedAvg and FedSM on the synthetic fundus preset.

Each (method, ε) pair is one run with ``privacy.dp = "sample"`` and ``privacy.epsilon = ε`` (the noise
multiplier derived per site so that the planned rounds spend ε at ``privacy.delta``); ε = inf is the run
without DP.  The table gives the client-average Dice of the method's row, the largest ε any site spent
(Opacus' RDP accountant, the Poisson-subsampling ε: docs/privacy.md) and the sites' noise multipliers.

    .venv/bin/python benchmarks/dp.py --md runs/bench-dp/dp.md

Local work is counted in steps (``train.local_steps``), so every site takes the same privatized steps per
round and the plan is exact.  Defaults are sized for a shared 2-core CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import platform
import sys
import time
import warnings
from pathlib import Path

import torch
from _report import emit, md_table, unet_overrides

from fedseg.algorithms import known_sections
from fedseg.data.synth import synthesize
from fedseg.execution.federation import load_federation_data
from fedseg.foundation.config import load_run_config
from fedseg.simulation.runner import simulate
from fedseg.site.workload import segmentation_workload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench-dp")
    ap.add_argument("--md", default=None, help="write the Markdown fragment here")
    ap.add_argument("--methods", default="fedavg,fedsm")
    ap.add_argument("--epsilons", default="1,4,8,inf", help="targets ε per site; inf = no DP")
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--scale", type=float, default=0.05, help="fraction of the paper's per-site case counts")
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=4, help="local steps per round (train.local_steps)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--channels", default="8,16,32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], help="extra overrides, e.g. --set privacy.accountant=prv")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
    chans = [int(c) for c in args.channels.split(",")]
    common = [
        *unet_overrides(chans, args.steps, args.batch, args.rounds, args.rounds, lr=args.lr),
        f"privacy.delta={args.delta}",
        f"privacy.clip={args.clip}",
        *args.set,
    ]
    out = Path(args.out)
    spec = synthesize("fundus", out / "data", seed=0, scale=args.scale, size=args.size)
    fed, data = load_federation_data(spec)
    t_all = time.perf_counter()
    rows, summary = [], []
    for method in args.methods.split(","):
        for text in args.epsilons.split(","):
            eps = float(text)
            dp = [] if math.isinf(eps) else ["privacy.dp=sample", f"privacy.epsilon={eps}"]
            cfg = load_run_config(spec, [*common, *dp], known_sections(), rounds=args.rounds)
            cfg = dataclasses.replace(cfg, method=method, seed=args.seed)
            workload = segmentation_workload(
                fed.spatial_dims, fed.in_channels, fed.labels, cfg.model, cfg.train, cfg.eval.threshold
            )
            t0 = time.perf_counter()
            res = simulate(cfg, workload, data, out=out / method / f"eps{text}", progress=False, log=lambda m: None)
            dt = time.perf_counter() - t0
            priv = res.get("privacy", {}).get("sites", {})
            spent = max((v["epsilon"] for v in priv.values()), default=math.inf)
            sigmas = [v["noise_multiplier"] for v in priv.values()]
            sig = f"{min(sigmas):.2f}–{max(sigmas):.2f}" if sigmas else "–"
            print(
                f"{method} ε={text}: client avg Dice {res['client_avg_dice']:.4f}, ε spent {spent:.3g}, σ {sig}, {dt:.0f}s"
            )
            rows.append([method, text, f"{res['client_avg_dice']:.4f}", f"{spent:.3g}", sig, f"{dt:.0f}"])
            summary.append(
                {
                    "method": method,
                    "epsilon": text,
                    "client_avg_dice": res["client_avg_dice"],
                    "epsilon_spent": spent,
                    "noise_multipliers": sigmas,
                    "wall_s": dt,
                }
            )
    sizes = {s: len(d.train) for s, d in data.items()}
    md = [
        f"Command: `.venv/bin/python benchmarks/dp.py {' '.join(sys.argv[1:])}`\n",
        f"Machine: {platform.machine()} CPU, {torch.get_num_threads()} torch thread(s), shared 2-core host.\n",
        f"Fundus preset, {args.size}×{args.size} px, scale {args.scale} (training cases per site {sizes}), "
        f"{args.rounds} rounds × {args.steps} steps × batch {args.batch}, lr {args.lr}, channels {chans}, "
        f"clip {args.clip}, δ {args.delta}, seed {args.seed}.\n",
        *md_table(["method", "target ε", "client avg Dice", "largest ε spent", "σ (sites)", "wall s"], rows),
        f"\nTotal wall time: {time.perf_counter() - t_all:.0f} s\n",
    ]
    emit(md, args.md, out, {"args": vars(args), "runs": summary})


if __name__ == "__main__":
    main()
