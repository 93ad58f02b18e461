"""FedSM's traffic per site and training round against FedAvg's, for each way of training the
selector (``fedsm.selector_training``), with the benchmark's U-Net and the default U-Net.

Bytes do not depend on the image size, only on the arrays exchanged and how many selector
steps a round has, so each configuration runs 2 rounds of the real code paths (engine,
in-process transport, its byte counters) on a tiny in-memory federation of 6 sites with
32×32 images of 3 channels and 2 labels (the fundus preset's: disc, cup); the number reported is the mean over sites of the bytes sent + received in
round 2 (round 1 also carries the initial selector to the sites with ``fga``).

    .venv/bin/python benchmarks/fedsm_traffic.py --md runs/fedsm-traffic.md
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch
from _report import emit, md_table
from torch.utils.data import TensorDataset

from fedseg.algorithms.fedsm import FedSMParams
from fedseg.foundation.config import ModelConfig, RunConfig, TrainConfig
from fedseg.simulation.runner import simulate
from fedseg.site.batches import SiteData
from fedseg.site.workload import segmentation_workload

UNETS = {
    # benchmarks/fedsm.py's U-Net and selector width
    "benchmark": (ModelConfig(channels=(8, 16, 32, 64), strides=(2, 2, 2), num_res_units=1), 0.0625),
    # make demo's U-Net (fedseg.apps.studies.compare.DEMO_OVERRIDES) and the default selector
    "demo": (ModelConfig(channels=(8, 16, 32, 64, 128), num_res_units=1), FedSMParams().selector_width),
    # ModelConfig() and FedSMParams() defaults
    "default": (ModelConfig(), FedSMParams().selector_width),
    # the default U-Net with the selector of width 0.125 (--set fedsm.selector_width=0.125)
    "default-selector-0.125": (ModelConfig(), 0.125),
}


def federation(num_sites: int, n_train: int, size: int, channels: int, labels: int) -> dict[str, SiteData]:
    g = torch.Generator().manual_seed(0)

    def split(n: int) -> TensorDataset:
        x = torch.rand(n, channels, size, size, generator=g)
        return TensorDataset(x, (x[:, :1] > torch.linspace(0.3, 0.7, labels).view(1, labels, 1, 1)).float())

    return {f"site{k + 1}": SiteData(split(n_train), split(2), split(2)) for k in range(num_sites)}


def round_bytes(res: dict, rnd: int = 2) -> float:
    """Mean over sites of the bytes sent + received in training round ``rnd``."""
    b = next(e["bytes"] for e in res["history"] if e["round"] == rnd)
    return sum(v["sent"] + v["received"] for v in b.values()) / len(b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/fedsm-traffic")
    ap.add_argument("--md", default=None, help="write the Markdown fragment here")
    ap.add_argument("--unets", default="benchmark,demo,default", help=f"comma-separated, of: {', '.join(UNETS)}")
    ap.add_argument("--trainings", default="fga,fedavg,fedrs", help="fedsm.selector_training values")
    ap.add_argument("--steps", default="1,5,15", help="local steps per round (train.local_steps)")
    ap.add_argument("--sites", type=int, default=6)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--in-channels", type=int, default=3, help="image channels (fundus preset: 3)")
    ap.add_argument("--labels", type=int, default=2, help="label channels (fundus preset: 2)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t_all = time.perf_counter()
    data = federation(args.sites, 4, args.size, args.in_channels, args.labels)
    trainings = [t for t in args.trainings.split(",") if t]
    rows = []
    for unet in args.unets.split(","):
        model, width = UNETS[unet]
        workload = segmentation_workload(2, args.in_channels, [f"label{i}" for i in range(args.labels)], model)
        w_g = sum(p.numel() for p in workload.build_model().parameters())
        w_s = sum(p.numel() for p in workload.selector(args.sites, width=width, hidden=128).parameters())
        for steps in (int(s) for s in args.steps.split(",")):
            cfg = RunConfig(
                federation="(in memory)",
                method="fedavg",
                rounds=2,
                model=model,
                train=TrainConfig(batch_size=2, local_steps=steps, local_epochs=None),
                checkpoint_every=2,
            )
            fedavg = round_bytes(simulate(cfg, workload, data, progress=False, log=lambda m: None))
            cells = [unet, f"{w_g / 1e6:.3f} M", f"{w_s / 1e6:.3f} M", str(steps), f"{fedavg / 1e3:.0f} kB"]
            for training in trainings:
                c = RunConfig(
                    **{
                        **cfg.__dict__,
                        "method": "fedsm",
                        "params": {"fedsm": {"selector_width": width, "selector_training": training}},
                    }
                )
                b = round_bytes(simulate(c, workload, data, progress=False, log=lambda m: None))
                cells.append(f"{b / 1e3:.0f} kB = {b / fedavg:.2f}×")
            rows.append(cells)
            print(" | ".join(cells), flush=True)
    header = ["U-Net", "U-Net params", "selector params", "local steps / round", "FedAvg"]
    header += [f"FedSM, selector {t}" for t in trainings]
    md = [
        f"Command: `.venv/bin/python benchmarks/fedsm_traffic.py {' '.join(sys.argv[1:])}`\n",
        f"Machine: {platform.machine()} CPU, {torch.get_num_threads()} torch thread(s), shared 2-core host; "
        f"wall {time.perf_counter() - t_all:.0f} s.\n",
        f"Bytes sent + received per site in training round 2 (mean over {args.sites} sites; FedSM's default "
        "profile otherwise: selector steps = every local step with fga, 1 with fedavg; evaluation traffic not "
        "included):\n",
        *md_table(header, rows),
    ]
    emit(md, args.md, Path(args.out), {"args": vars(args)})


if __name__ == "__main__":
    main()
