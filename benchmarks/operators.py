"""Operators dispatched per round, by role (global, personalized, selector, routing) and phase (training,
validation), on the CPU: what stands for a GPU's kernel launches where no GPU is at hand
(:mod:`_operators`).

A tiny synthetic fundus federation (6 sites, ``--scale`` of Table 1's case counts, ``--size``² images, a small
U-Net), each method's defaults otherwise, 3 rounds each validating; the counts are of rounds 2 and 3 (round 1
builds the models and optimizers).  Operator counts do not depend on the image size or the device (they are
the dispatches a GPU launches kernels for; views, which launch none, are counted apart), only on the number of batches, models and steps: the batches per
round scale with the training cases (``--scale``) and the batch size.

    .venv/bin/python benchmarks/operators.py --methods fedsm,fedavg          # about 1 min on a 2-core CPU
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

import torch
from _operators import table
from _report import emit
from gpu import counted_rounds

from fedseg.data.synth import synthesize
from fedseg.execution.federation import load_federation_data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", default="fedsm,fedavg", help="comma-separated methods (default fedsm,fedavg)")
    ap.add_argument("--scale", type=float, default=0.04, help="fraction of Table 1's case counts")
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--channels", default="8,16,32", help="U-Net channels")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--vectorize", default="off", help="simulation.vectorize (auto: on CUDA with >= 4 sites)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--md", default=None, help="also write the Markdown tables here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    args.channels = [int(c) for c in args.channels.split(",")]
    args.nondeterministic, args.sync_checkpoints = False, False
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="fedseg-operators-"))
    spec = out / "data" / "federation.toml"
    if not spec.is_file():
        spec = synthesize("fundus", out / "data", seed=0, scale=args.scale, size=args.size, progress=False)
    fed, data = load_federation_data(spec, progress=False)
    n_train = sum(len(d.train) for d in data.values())
    md = [
        f"Operators dispatched per round (mean of rounds 2–3, each validating), synthetic fundus federation: 6 sites, "
        f"{n_train} training cases, {args.size}², U-Net {args.channels}, batch {args.batch_size}, "
        f"simulation.vectorize={args.vectorize}; {args.device}, {platform.machine()}, torch {torch.__version__}",
        "",
    ]
    records = {}
    for method in args.methods.split(","):
        t0 = time.perf_counter()
        r = counted_rounds(spec, data, fed, method, "fp32", args.vectorize, args, out / method)
        records[method] = r
        md += [f"**{method}** ({time.perf_counter() - t0:.0f} s):", "", *table(r["operators"]), ""]
        md += [
            f"and {r['views_per_round']:,.0f} views per round (detach, view, select: no kernel); most dispatched "
            "over rounds 1–3:",
            "",
        ]
        for key, ops in r["top_operators"].items():
            md.append(f"- {key}: " + ", ".join(f"{op} {n:,}" for op, n in ops))
        md.append("")
    totals = {m: r["operators_per_round"] for m, r in records.items()}
    if "fedsm" in totals and "fedavg" in totals:
        md.append(f"FedSM / FedAvg operators per round: {totals['fedsm'] / totals['fedavg']:.2f}")
    emit(md, args.md, out, {"args": vars(args), "n_train": n_train, "runs": records})


if __name__ == "__main__":
    main()
