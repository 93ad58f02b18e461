"""GPU workload benchmark: seconds per round of FedAvg and FedSM, fp32 vs bf16, peak memory, checkpoint cost.

The synthetic fundus preset (6 sites, Table-1 case counts × ``--scale``) at each
``--sizes`` side, the default U-Net (or ``--channels``), a checkpoint after every round
(every site's models and Adam moments).  Per run it records:

* ``s/round``: mean wall time of the rounds after the first (warm-up: cuDNN plans,
  allocator) and before the last (which also validates);
* peak GPU memory (``torch.cuda.max_memory_allocated``; CUDA only);
* checkpoint cost per round: the time the round loop is blocked (snapshot to host
  memory, waiting for the previous write) and the time spent writing (in the background
  thread, overlapping the next round; with ``--sync-checkpoints`` in the loop, so it is
  part of the blocking time too).

Goal on an H100/H200: a FedSM round of the full-scale preset at 256² in ≤ 2 s.

    .venv/bin/python benchmarks/gpu.py --device cuda                      # the issue's setting
    .venv/bin/python benchmarks/gpu.py --device cuda --nondeterministic   # what determinism costs
    .venv/bin/python benchmarks/gpu.py --device cpu --scale 0.05 --sizes 32 --channels 8,16,32 --rounds 3   # CPU smoke size
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

from fedseg.algorithms import get_algorithm
from fedseg.data.synth import synthesize
from fedseg.execution.engine import Engine
from fedseg.foundation.config import EvalConfig, ModelConfig, RunConfig, TrainConfig
from fedseg.foundation.device import describe, resolve_device
from fedseg.simulation.runner import build_transport, load_federation_data
from fedseg.site.workload import segmentation_workload


def one_run(spec: Path, data, fed, method: str, precision: str, args, out: Path, rounds: int | None = None) -> dict:
    model = (
        ModelConfig()
        if not args.channels
        else ModelConfig(channels=tuple(args.channels), strides=(2,) * (len(args.channels) - 1))
    )
    rounds = rounds or args.rounds
    cfg = RunConfig(
        federation=str(spec),
        method=method,
        rounds=rounds,
        seed=0,
        device=args.device,
        checkpoint_every=1,
        deterministic=not args.nondeterministic,
        checkpoint_background=not args.sync_checkpoints,
        model=model,
        train=TrainConfig(batch_size=args.batch_size, precision=precision),
        eval=EvalConfig(every=rounds),
    )
    workload = segmentation_workload(fed.spatial_dims, fed.in_channels, list(fed.labels), cfg.model, cfg.train)
    algorithm = get_algorithm(cfg)
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    engine = Engine(
        cfg,
        algorithm,
        build_transport(cfg, workload, data, algorithm),
        workload,
        out=out,
        progress=False,
        log=lambda m: None,
    )
    t0 = time.perf_counter()
    engine.run()
    wall = time.perf_counter() - t0
    times = [e["time_s"] for e in engine.history]
    steady = times[1:-1] or times[-1:]
    return {
        "method": method,
        "precision": precision,
        "s_per_round": statistics.mean(steady),
        "rounds": rounds,
        "wall_s": wall,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "ckpt_blocking_s": engine.checkpoint_s / rounds,
        "ckpt_write_s": engine.writer.write_s / rounds,
        "ckpt_mb": sum(p.stat().st_size for p in (out / "checkpoints").rglob("*") if p.is_file()) / 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of Table 1's case counts (1.0 = full scale)")
    ap.add_argument("--sizes", default="128,256")
    ap.add_argument("--methods", default="fedavg,fedsm")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument(
        "--rounds", type=int, default=4, help="rounds per run (>= 3: warm-up, measured rounds, last with validation)"
    )
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--channels", help="U-Net channels, e.g. 8,16,32 (default: the FedSM reference's 16…256)")
    ap.add_argument(
        "--nondeterministic",
        action="store_true",
        help="deterministic = false: cuDNN autotuner, TF32 convolutions (measures what determinism costs)",
    )
    ap.add_argument(
        "--sync-checkpoints",
        action="store_true",
        help="checkpoint_background = false: the round loop writes each checkpoint itself",
    )
    ap.add_argument(
        "--no-warmup", action="store_true", help="skip the discarded 2-round warm-up run of each method per size"
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--md", default=None, help="also write the Markdown table here")
    args = ap.parse_args()
    args.channels = [int(c) for c in args.channels.split(",")] if args.channels else None
    device = resolve_device(args.device)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="fedseg-gpu-"))
    rows, records = [], []
    for size in [int(s) for s in args.sizes.split(",")]:
        spec = synthesize("fundus", out / f"data{size}", seed=0, scale=args.scale, size=size)
        fed, data = load_federation_data(spec)
        n_train = sum(len(d.train) for d in data.values())
        if not args.no_warmup:  # one discarded run per size: lazy imports, kernel selection, allocator pools
            for method in args.methods.split(","):
                one_run(
                    spec,
                    data,
                    fed,
                    method,
                    args.precisions.split(",")[0],
                    args,
                    out / f"warmup-{method}-{size}",
                    rounds=2,
                )
        for method in args.methods.split(","):
            for precision in args.precisions.split(","):
                r = one_run(spec, data, fed, method, precision, args, out / f"{method}-{precision}-{size}")
                r.update(size=size, train_cases=n_train)
                records.append(r)
                print(
                    f"{size}² {method} {precision}: {r['s_per_round']:.2f} s/round, checkpoint {r['ckpt_blocking_s']:.3f} s blocking "
                    f"+ {r['ckpt_write_s']:.3f} s in the background ({r['ckpt_mb']:.0f} MB)",
                    flush=True,
                )
                rows.append(
                    [
                        f"{size}²",
                        str(n_train),
                        method,
                        precision,
                        f"{r['s_per_round']:.2f}",
                        "–" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}",
                        f"{r['ckpt_blocking_s']:.3f}",
                        f"{r['ckpt_write_s']:.3f}",
                        f"{r['ckpt_mb']:.0f}",
                    ]
                )
    machine = f"{describe(device)}, {platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads"
    kernels = "non-deterministic kernels" if args.nondeterministic else "deterministic kernels"
    writer = "checkpoints written in the round loop" if args.sync_checkpoints else "background checkpoint writer"
    md = [
        f"scale {args.scale}, U-Net {args.channels or 'default (16…256)'}, batch {args.batch_size}, {args.rounds} rounds, {kernels}, {writer}; {machine}",
        "",
    ]
    md += md_table(
        [
            "size",
            "train cases",
            "method",
            "precision",
            "s/round",
            "peak GPU GiB",
            "ckpt blocking s/round",
            "ckpt write s/round",
            "ckpt MB",
        ],
        rows,
    )
    emit(md, args.md, out, {"args": vars(args), "machine": machine, "runs": records})


if __name__ == "__main__":
    main()
