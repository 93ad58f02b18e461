"""Time of one training step of fedseg's U-Net on this machine: how fast a CPU is for fedseg's work.

One step = forward, the workload's Dice loss, backward, Adam step, on random images (3 channels, 2 label
channels, as the fundus preset).  Each configuration: 3 warm-up steps, then the median of ``--repeats``
timings of ``--steps`` steps.  Sizes the demo and the benchmarks use, e.g.

    .venv/bin/python benchmarks/step_time.py                     # default U-Net and the demo's, 64² and 32²
    .venv/bin/python benchmarks/step_time.py --threads 1 --batch 8

Prints one Markdown row per configuration (ms per step) with the machine.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from fedseg.foundation.config import ModelConfig, TrainConfig
from fedseg.site.workload import segmentation_workload

CONFIGS = {
    "default U-Net 16…256, 2 residual units": ModelConfig(),
    "demo U-Net 8…128, 1 residual unit": ModelConfig(channels=(8, 16, 32, 64, 128), num_res_units=1),
    "benchmark U-Net 8…64, 1 residual unit": ModelConfig(channels=(8, 16, 32, 64), strides=(2, 2, 2), num_res_units=1),
}


def step_ms(model_cfg: ModelConfig, size: int, batch: int, steps: int, repeats: int) -> float:
    """Median milliseconds per training step (forward, Dice loss, backward, Adam) over ``repeats`` timings."""
    wl = segmentation_workload(2, 3, {"disc": [1, 2], "cup": [2]}, model_cfg, TrainConfig(batch_size=batch))
    g = torch.Generator().manual_seed(0)
    model = wl.build_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.rand(batch, 3, size, size, generator=g)
    y = (torch.rand(batch, 2, size, size, generator=g) > 0.5).float()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        wl.loss(model(x), y).backward()
        opt.step()

    for _ in range(3):
        step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        times.append((time.perf_counter() - t0) / steps * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64,32")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    machine = (
        f"{platform.machine()} ({platform.processor() or 'cpu'}), torch {torch.__version__}, {args.threads} threads"
    )
    print("| model | size | batch | ms per step | machine |")
    print("|---|---|---|---|---|")
    for size in (int(s) for s in args.sizes.split(",")):
        for name, cfg in CONFIGS.items():
            ms = step_ms(cfg, size, args.batch, args.steps, args.repeats)
            print(f"| {name} | {size}² | {args.batch} | {ms:.1f} | {machine} |", flush=True)


if __name__ == "__main__":
    main()
