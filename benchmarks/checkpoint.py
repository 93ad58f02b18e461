"""Checkpoint cost to the round loop: background writer vs writing in the loop.

Six sites with the default U-Net (16…256 channels) and their Adam moments (one local
step each, so every moment exists), the server state, then ``--checkpoints``
checkpoints through :meth:`fedseg.execution.engine.Engine.save_checkpoint`, separated by
``--gap`` seconds of sleep standing in for a round whose compute does not need the
CPU (a GPU round).  Reports per checkpoint: the time the round loop is blocked
(median) and the time spent writing; with the background writer the write overlaps
the gap.

    .venv/bin/python benchmarks/checkpoint.py --device cpu --checkpoints 5 --gap 1.0
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _report import emit, md_table
from torch.utils.data import TensorDataset

from fedseg.algorithms import get_algorithm
from fedseg.execution.engine import Engine
from fedseg.foundation.config import RunConfig, TrainConfig
from fedseg.foundation.device import describe, resolve_device
from fedseg.simulation.runner import build_transport
from fedseg.site.batches import SiteData
from fedseg.site.workload import segmentation_workload


def measure(background: bool, args, out: Path) -> dict:
    cfg = RunConfig(
        federation="(synthetic)",
        device=args.device,
        checkpoint_background=background,
        train=TrainConfig(batch_size=2, local_steps=1, local_epochs=None),
    )
    g = torch.Generator().manual_seed(0)
    x = torch.rand(4, 1, args.size, args.size, generator=g)
    data = {f"site{k + 1}": SiteData(TensorDataset(x, (x > 0.5).float())) for k in range(args.sites)}
    workload = segmentation_workload(2, 1, ["fg"], cfg.model, cfg.train)
    algorithm = get_algorithm(cfg)
    transport = build_transport(cfg, workload, data, algorithm)
    engine = Engine(cfg, algorithm, transport, workload, out=out, progress=False, log=lambda m: None)
    engine.state = algorithm.init_state(engine.ctx)
    for name in transport.sites:
        site = transport.site(name)
        site.now(site.fit("global", 1))
    blocked = []
    for i in range(args.checkpoints):
        engine.round = i + 1
        t0 = time.perf_counter()
        engine.save_checkpoint()
        blocked.append(time.perf_counter() - t0)
        time.sleep(args.gap)
    engine.writer.wait()
    mb = sum(p.stat().st_size for p in (out / "checkpoints").rglob("*") if p.is_file()) / 1e6
    return {
        "background": background,
        "blocked_s": blocked,
        "blocked_median_s": statistics.median(blocked),
        "write_s": engine.writer.write_s / args.checkpoints,
        "mb": mb,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sites", type=int, default=6)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--checkpoints", type=int, default=5)
    ap.add_argument(
        "--gap", type=float, default=1.0, help="seconds between checkpoints (a round that leaves the CPU idle)"
    )
    ap.add_argument("--md", default=None)
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="fedseg-ckpt-"))
    rows, runs = [], []
    for background in (False, True):
        r = measure(background, args, out / ("background" if background else "in-loop"))
        runs.append(r)
        rows.append(
            [
                "background thread" if background else "in the round loop",
                f"{r['mb']:.0f}",
                f"{r['blocked_median_s']:.3f}",
                f"{r['write_s']:.3f}",
            ]
        )
        print(f"{rows[-1][0]}: blocked {', '.join(f'{b:.3f}' for b in r['blocked_s'])} s", flush=True)
    machine = f"{describe(resolve_device(args.device))}, {platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads"
    md = [
        f"{args.sites} sites, default U-Net + Adam moments, {args.checkpoints} checkpoints {args.gap} s apart; {machine}",
        "",
    ]
    md += md_table(["writer", "checkpoint MB", "round loop blocked, s/checkpoint (median)", "write s/checkpoint"], rows)
    emit(md, args.md, out, {"args": vars(args), "machine": machine, "runs": runs})


if __name__ == "__main__":
    main()
