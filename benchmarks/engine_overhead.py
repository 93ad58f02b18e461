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


def timed(fn) -> tuple[float, float, float]:
    """``fn()``'s wall seconds, CPU seconds of the calling thread (the round loop's own work, which other
    jobs on the machine do not add to; the background checkpoint writer's is not in it) and CPU seconds of
    the whole process (every thread)."""
    t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.thread_time() - c0, time.process_time() - p0


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} (min {min(xs):.3f}, max {max(xs):.3f})"


def profile(engine_run, bare_run, folder: Path, top: int) -> None:
    """cProfile of one fedseg run and one bare run, timed by the main thread's CPU clock; prints fedseg's
    functions (and torch's module calls) by cumulative time and writes both profiles to ``folder``."""
    import cProfile
    import pstats

    folder.mkdir(parents=True, exist_ok=True)
    for name, fn in (("fedseg", engine_run), ("bare", bare_run)):
        prof = cProfile.Profile(time.thread_time)
        prof.runcall(fn)
        prof.dump_stats(str(folder / f"{name}.prof"))
        stats = pstats.Stats(prof)
        print(f"\n{name}: {stats.total_tt:.2f} s of main-thread CPU; top {top} fedseg functions by cumulative time")
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][3])  # type: ignore[attr-defined]
        shown = 0
        for (file, line, func), (_, calls, own, cum, _) in rows:
            if "/fedseg/" not in file and "engine_overhead" not in file:
                continue
            print(f"  {cum:8.3f} s  {own:7.3f} s own  {calls:6d}×  {file.split('/fedseg/')[-1]}:{line} {func}")
            shown += 1
            if shown >= top:
                break


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scale", type=float, default=0.1)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
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
    ap.add_argument(
        "--profile", type=Path, help="also profile one run of each (cProfile, main-thread CPU) into this folder"
    )
    ap.add_argument("--top", type=int, default=30, help="fedseg functions --profile prints")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
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

    def engine_run(rep: int, rounds: int = args.rounds) -> None:
        out = tmp / f"run{rep}" if args.checkpoint_every > 0 else None
        simulate(dataclasses.replace(cfg, rounds=rounds), workload, data, out=out, progress=False, log=lambda m: None)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def bare_run(rep: int, rounds: int = args.rounds) -> None:
        bare_loop(data, workload, rounds, args.batch_size, seed=rep, device=device)

    # discarded: one round of each first (CUDA: context, cuDNN plans, lazy kernel loading; CPU: first-use
    # allocations and imports), so that neither timed series pays a start-up the other does not
    engine_run(-1, 1)
    bare_run(-1, 1)
    runs: dict[str, list[tuple[float, float, float]]] = {"fedseg": [], "bare": []}
    for rep in range(args.repeats):
        order = [("fedseg", engine_run), ("bare", bare_run)]
        for name, fn in order if rep % 2 == 0 else order[::-1]:  # alternating, so that drift in the load cancels
            runs[name].append(timed(lambda fn=fn, rep=rep: fn(rep)))
        (ew, ec, ep), (bw, bc, bp) = runs["fedseg"][-1], runs["bare"][-1]
        print(
            f"repeat {rep}: fedseg {ew:.2f} s (main thread CPU {ec:.2f} s, process CPU {ep:.2f} s), "
            f"bare loop {bw:.2f} s (CPU {bc:.2f} s, {bp:.2f} s): ratio {ew / bw:.3f} wall, {ec / bc:.3f} main-thread CPU"
        )
    wall = [e[0] / b[0] for e, b in zip(runs["fedseg"], runs["bare"])]
    cpu = [e[1] / b[1] for e, b in zip(runs["fedseg"], runs["bare"])]
    proc = [e[2] / b[2] for e, b in zip(runs["fedseg"], runs["bare"])]
    e = statistics.median(r[0] for r in runs["fedseg"])
    b = statistics.median(r[0] for r in runs["bare"])
    print(
        f"\n6 sites, {args.rounds} rounds, {steps} local steps per round, {args.size}x{args.size}, batch {args.batch_size}, "
        f"{torch.get_num_threads()} torch threads"
    )
    print(
        f"median fedseg {e:.2f} s ({e / args.rounds:.3f} s/round), median bare loop {b:.2f} s ({b / args.rounds:.3f} s/round)"
    )
    print(
        f"ratio per repeat, median (spread): wall {spread(wall)}; main-thread CPU {spread(cpu)}; process CPU {spread(proc)}"
    )
    ckpt = f"checkpoint every {args.checkpoint_every}" if args.checkpoint_every > 0 else "no checkpoints"
    if args.checkpoint_every > 0:
        ckpt += " (written in the round loop)" if args.sync_checkpoints else " (background writer)"
    print(
        f"\n| scale {args.scale}, {args.rounds} rounds × {steps} steps, {ckpt} | {e:.2f} s | {b:.2f} s | "
        f"{statistics.median(wall):.3f} ({min(wall):.3f}–{max(wall):.3f}) | "
        f"{statistics.median(cpu):.3f} ({min(cpu):.3f}–{max(cpu):.3f}) | "
        f"{describe(device)}, {platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads |"
    )
    if args.profile is not None:
        profile(lambda: engine_run(-2), lambda: bare_run(-2), args.profile, args.top)


if __name__ == "__main__":
    main()
