"""Engine overhead: a fedseg FedAvg simulation vs a bare PyTorch loop doing the same work.

Both do, per round, the same local steps at 6 sites (same data, same batch sizes,
the same U-Net, Adam moments kept per site) and the same sample-weighted average;
both evaluate once after the last round (Dice on every site's validation and test
split), so evaluation is included in both.  fedseg additionally checkpoints every
``--checkpoint-every`` rounds (server state, best models, every site's models and
Adam moments) and validates on schedule.

    .venv/bin/python benchmarks/engine_overhead.py --rounds 5 --repeats 3
    .venv/bin/python benchmarks/engine_overhead.py --device cuda --rounds 20 --checkpoint-every 10

Prints the wall times and their ratio (goal: at most 1.05 on the CPU, 1.10 on a GPU with a
checkpoint every 10 rounds) and a Markdown line.  With ``--device cuda`` both loops keep
models, optimizer state, data and the average on the GPU (the bare loop moves each site's
data there once, as fedseg does) and synchronize before the clock stops; a one-round run of
each, discarded, comes first (without it the first timed run, fedseg's, paid CUDA's start-up:
an H100 run with one repeat measured 2.31 that way).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import platform
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from fedseg.data.synth import synthesize
from fedseg.execution.federation import load_federation_data
from fedseg.foundation.config import EvalConfig, RunConfig, SimulationConfig, TrainConfig
from fedseg.foundation.device import describe, resolve_device
from fedseg.simulation.runner import simulate
from fedseg.site.workload import segmentation_workload


def bare_loop(data, workload, rounds: int, batch_size: int, seed: int, device: torch.device | None = None) -> float:
    """FedAvg written directly in PyTorch; returns wall seconds."""
    device = device or torch.device("cpu")
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    if device.type != "cpu":
        data = {
            s: SimpleNamespace(
                **{
                    name: SimpleNamespace(images=split.images.to(device), labels=split.labels.to(device))
                    for name, split in (("train", d.train), ("val", d.val), ("test", d.test))
                }
            )
            for s, d in data.items()
        }
    global_model = workload.build_model().to(device)
    state = {k: v.clone() for k, v in global_model.state_dict().items()}
    models = {s: workload.build_model().to(device) for s in data}
    opts = {s: torch.optim.Adam(models[s].parameters(), lr=1e-3, betas=(0.9, 0.999)) for s in data}
    n = {s: site_data.train.images.shape[0] for s, site_data in data.items()}
    total = sum(n.values())
    for r in range(rounds):
        new = None
        for k, (s, d) in enumerate(data.items()):
            m, opt = models[s], opts[s]
            m.load_state_dict(state)
            m.train()
            g = torch.Generator().manual_seed(seed * 1000 + r * 10 + k)
            perm = torch.randperm(n[s], generator=g)
            for start in range(0, n[s], batch_size):
                idx = perm[start : start + batch_size]
                x, y = d.train.images[idx], d.train.labels[idx]
                opt.zero_grad(set_to_none=True)
                loss = workload.loss(m(x), y)
                loss.backward()
                opt.step()
            sd = m.state_dict()
            w = n[s] / total
            if new is None:
                new = {key: v.detach().double() * w for key, v in sd.items()}
            else:
                for key, v in sd.items():
                    new[key] += v.detach().double() * w
        state = {k: v.float() for k, v in new.items()}
    global_model.load_state_dict(state)
    global_model.eval()
    with torch.no_grad():
        for d in data.values():
            for split in (d.val, d.test):
                for start in range(0, split.images.shape[0], 16):
                    x, y = split.images[start : start + 16], split.labels[start : start + 16]
                    workload.metric(global_model(x), y).cpu()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scale", type=float, default=0.1)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument(
        "--sync-checkpoints",
        action="store_true",
        help="write checkpoints in the round loop (checkpoint_background = false)",
    )
    ap.add_argument(
        "--vectorize",
        default="off",
        help="fedseg's simulation.vectorize; 'off' (default) trains the sites in turn, as the bare loop does",
    )
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (both loops run there)")
    ap.add_argument(
        "--checkpoint-every", type=int, default=1, help="0 = no output folder, no checkpoints (pure engine overhead)"
    )
    args = ap.parse_args()
    device = resolve_device(args.device)
    tmp = Path(tempfile.mkdtemp(prefix="fedseg-overhead-"))
    spec = synthesize("fundus", tmp / "data", seed=0, scale=args.scale, size=args.size)
    fed, data = load_federation_data(spec)
    cfg = RunConfig(
        federation=str(spec),
        method="fedavg",
        rounds=args.rounds,
        checkpoint_every=max(1, args.checkpoint_every),
        device=args.device,
        checkpoint_background=not args.sync_checkpoints,
        train=TrainConfig(batch_size=args.batch_size),
        eval=EvalConfig(every=args.rounds),
        simulation=SimulationConfig(vectorize=args.vectorize),
    )
    workload = segmentation_workload(2, fed.in_channels, fed.labels, cfg.model, cfg.train)
    steps = sum(math.ceil(len(d.train) / args.batch_size) for d in data.values())
    engine_t, bare_t = [], []
    if device.type == "cuda":  # discarded: CUDA context, cuDNN handles and plans, lazy kernel loading
        simulate(dataclasses.replace(cfg, rounds=1), workload, data, out=None, progress=False, log=lambda m: None)
        bare_loop(data, workload, 1, args.batch_size, seed=0, device=device)
    for rep in range(args.repeats):
        t0 = time.perf_counter()
        simulate(
            cfg,
            workload,
            data,
            out=tmp / f"run{rep}" if args.checkpoint_every > 0 else None,
            progress=False,
            log=lambda m: None,
        )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        engine_t.append(time.perf_counter() - t0)
        bare_t.append(bare_loop(data, workload, args.rounds, args.batch_size, seed=rep, device=device))
        print(f"repeat {rep}: fedseg {engine_t[-1]:.2f} s, bare loop {bare_t[-1]:.2f} s")
    e, b = statistics.median(engine_t), statistics.median(bare_t)
    print(
        f"\n6 sites, {args.rounds} rounds, {steps} local steps per round, {args.size}x{args.size}, batch {args.batch_size}"
    )
    print(f"median fedseg {e:.2f} s, median bare loop {b:.2f} s, ratio {e / b:.3f}")
    ckpt = f"checkpoint every {args.checkpoint_every}" if args.checkpoint_every > 0 else "no checkpoints"
    if args.checkpoint_every > 0:
        ckpt += " (written in the round loop)" if args.sync_checkpoints else " (background writer)"
    print(
        f"\n| scale {args.scale}, {args.rounds} rounds × {steps} steps, {ckpt} | {e:.2f} s | {b:.2f} s | {e / b:.3f} | "
        f"{describe(device)}, {platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads |"
    )


if __name__ == "__main__":
    main()
