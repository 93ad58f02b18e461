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

``--profile`` adds, per run, one more run of 3 rounds under ``torch.profiler`` and reports how busy
the GPU was in its second round: the union of the kernel, copy and memset intervals that start inside
the round, over the round's wall time; with the kernel count and their median duration (many short
kernels mean the round is bound by launches, not arithmetic).  ``--vectorize auto,off`` compares the
vectorized sites (``simulation.vectorize``; auto = on on CUDA with ≥ 4 sites) with sites in turn.

    .venv/bin/python benchmarks/gpu.py --device cuda                      # the issue's setting
    .venv/bin/python benchmarks/gpu.py --device cuda --nondeterministic   # what determinism costs
    .venv/bin/python benchmarks/gpu.py --device cuda --sizes 256 --profile --vectorize auto,off
    .venv/bin/python benchmarks/gpu.py --device cpu --scale 0.05 --sizes 32 --channels 8,16,32 --rounds 3   # CPU smoke size
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _operators import OperatorCounter, total
from _operators import table as operator_table
from _report import emit, md_table

from fedseg.algorithms import get_algorithm
from fedseg.data.synth import synthesize
from fedseg.execution.engine import Engine
from fedseg.execution.federation import load_federation_data
from fedseg.foundation.config import EvalConfig, ModelConfig, RunConfig, SimulationConfig, TrainConfig
from fedseg.foundation.device import describe, resolve_device
from fedseg.simulation.runner import build_transport
from fedseg.site.workload import segmentation_workload


def busy_share(trace: Path, label: str) -> dict:
    """GPU busy share of the span of the ``label`` annotation in a Chrome trace of torch.profiler: the union
    of device intervals (kernels, copies, memsets) that start inside it, over its length."""
    events = json.loads(trace.read_text())["traceEvents"]
    span = [e for e in events if e.get("name") == label and e.get("cat") == "user_annotation"]
    if not span:
        return {"busy": None, "kernels": 0, "median_kernel_us": None}
    t0, t1 = span[0]["ts"], span[0]["ts"] + span[0]["dur"]
    dev = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and t0 <= e["ts"] < t1
    )
    busy, end = 0.0, t0
    for a, b in dev:
        if b > end:
            busy += b - max(a, end)
            end = b
    kernels = sorted(
        e["dur"] for e in events if e.get("cat") == "kernel" and t0 <= e["ts"] < t1
    )  # the span ends after torch.cuda.synchronize(), so every kernel of the round ends inside it
    return {
        "busy": min(1.0, busy / (t1 - t0)),
        "round_ms": (t1 - t0) / 1e3,
        "kernels": len(kernels),
        "median_kernel_us": statistics.median(kernels) if kernels else None,
    }


def profiled_round(spec: Path, data, fed, method: str, precision: str, vectorize: str, args, out: Path) -> dict:
    """Run 3 rounds; torch.profiler records round 2 alone (round 1 is its warm-up); see :func:`busy_share`."""
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    out.mkdir(parents=True, exist_ok=True)
    trace = out / "trace.json"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])]
    prof = profile(
        activities=activities,
        schedule=schedule(wait=0, warmup=1, active=1, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(str(trace)),
    )

    def wrap(algorithm):
        inner = algorithm.server_round

        def server_round(ctx, state, rnd):
            with record_function(f"fedseg_round_{rnd}"):
                result = inner(ctx, state, rnd)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
            prof.step()
            return result

        algorithm.server_round = server_round

    with prof:
        one_run(spec, data, fed, method, precision, args, out, rounds=3, vectorize=vectorize, hook=wrap)
    share = busy_share(trace, "fedseg_round_2")
    trace.unlink()
    return share


def counted_rounds(spec: Path, data, fed, method: str, precision: str, vectorize: str, args, out: Path) -> dict:
    """Run 3 rounds, each validating, under :class:`_operators.OperatorCounter`: operators per round of rounds 2
    and 3 by role and phase (what stands for kernel launches), and the most dispatched operators per role."""
    counter = OperatorCounter()
    one_run(spec, data, fed, method, precision, args, out, rounds=3, vectorize=vectorize, counter=counter, eval_every=1)
    per = counter.per_round()
    views = counter.per_round(views=True)
    top = {f"{phase}/{role}": counter.top_ops(phase, role) for role, by in per.items() for phase, n in by.items() if n}
    return {
        "operators": per,
        "operators_per_round": total(per),
        "views_per_round": total(views),
        "top_operators": top,
    }


def one_run(
    spec: Path,
    data,
    fed,
    method: str,
    precision: str,
    args,
    out: Path,
    rounds: int | None = None,
    vectorize: str = "auto",
    hook=None,
    counter: OperatorCounter | None = None,
    eval_every: int | None = None,
) -> dict:
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
        eval=EvalConfig(every=eval_every or rounds),
        simulation=SimulationConfig(vectorize=vectorize),
    )
    workload = segmentation_workload(fed.spatial_dims, fed.in_channels, fed.labels, cfg.model, cfg.train)
    algorithm = get_algorithm(cfg)
    if hook is not None:
        hook(algorithm)
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
    if counter is not None:
        with counter.attach(engine):
            engine.run()
    else:
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
    ap.add_argument("--vectorize", default="auto", help="simulation.vectorize values to compare, e.g. auto,off")
    ap.add_argument(
        "--runs", help="method:precision:vectorize triples instead of the product, e.g. fedavg:fp32:off,fedsm:bf16:auto"
    )
    ap.add_argument("--profile", action="store_true", help="GPU busy share of a round under torch.profiler")
    ap.add_argument(
        "--count-operators",
        action="store_true",
        help="operators dispatched per round by role and phase (3 more rounds per run under a TorchDispatchMode)",
    )
    ap.add_argument(
        "--count-only", action="store_true", help="with --count-operators: only the counted rounds, no timed run"
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--md", default=None, help="also write the Markdown table here")
    args = ap.parse_args()
    args.channels = [int(c) for c in args.channels.split(",")] if args.channels else None
    device = resolve_device(args.device)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="fedseg-gpu-"))
    rows, records = [], []
    role_tables: list[str] = []
    for size in [int(s) for s in args.sizes.split(",")]:
        t_start = time.perf_counter()
        spec = out / f"data{size}" / "federation.toml"
        if not spec.is_file():  # a folder from an earlier call of this script with the same --out is reused
            spec = synthesize("fundus", out / f"data{size}", seed=0, scale=args.scale, size=size)
        fed, data = load_federation_data(spec)
        n_train = sum(len(d.train) for d in data.values())
        print(f"{size}²: {n_train} training cases ready after {time.perf_counter() - t_start:.0f} s", flush=True)
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
        combos = (
            [tuple(r.split(":")) for r in args.runs.split(",")]
            if args.runs
            else itertools.product(args.methods.split(","), args.precisions.split(","), args.vectorize.split(","))
        )
        for method, precision, vec in combos:
            name = f"{method}-{precision}-{vec}-{size}"
            if args.count_only:
                c = counted_rounds(spec, data, fed, method, precision, vec, args, out / f"ops-{name}")
                records.append({"method": method, "precision": precision, "size": size, "vectorize": vec, **c})
                role_tables += [f"Operators per round, {size}² {method} {precision} vectorize={vec}:", ""]
                role_tables += operator_table(c["operators"])
                role_tables += ["", f"(and {c['views_per_round']:,.0f} views per round, which launch no kernel)", ""]
                print(f"{size}² {method}: {c['operators_per_round']:,.0f} operators per round", flush=True)
                continue
            r = one_run(spec, data, fed, method, precision, args, out / name, vectorize=vec)
            r.update(size=size, train_cases=n_train, vectorize=vec)
            if args.profile:
                r.update(profiled_round(spec, data, fed, method, precision, vec, args, out / f"prof-{name}"))
            if args.count_operators:
                r.update(counted_rounds(spec, data, fed, method, precision, vec, args, out / f"ops-{name}"))
                role_tables += [f"Operators per round, {size}² {method} {precision} vectorize={vec}:", ""]
                role_tables += operator_table(r["operators"])
                role_tables += ["", f"(and {r['views_per_round']:,.0f} views per round, which launch no kernel)", ""]
            records.append(r)
            busy = f", GPU busy {r['busy']:.0%} ({r['kernels']} kernels)" if r.get("busy") is not None else ""
            print(
                f"{size}² {method} {precision} vectorize={vec}: {r['s_per_round']:.2f} s/round{busy}, checkpoint "
                f"{r['ckpt_blocking_s']:.3f} s blocking + {r['ckpt_write_s']:.3f} s in the background ({r['ckpt_mb']:.0f} MB)",
                flush=True,
            )
            rows.append(
                [
                    f"{size}²",
                    str(n_train),
                    method,
                    precision,
                    vec,
                    f"{r['s_per_round']:.2f}",
                    "–" if r.get("busy") is None else f"{r['busy']:.0%}",
                    "–" if r.get("median_kernel_us") is None else f"{r['kernels']} / {r['median_kernel_us']:.0f}",
                    "–" if r.get("operators_per_round") is None else f"{r['operators_per_round']:,.0f}",
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
    md += (
        []
        if args.count_only
        else md_table(
            [
                "size",
                "train cases",
                "method",
                "precision",
                "vectorize",
                "s/round",
                "GPU busy",
                "kernels / median µs",
                "operators/round",
                "peak GPU GiB",
                "ckpt blocking s/round",
                "ckpt write s/round",
                "ckpt MB",
            ],
            rows,
        )
    )
    if role_tables:
        md += ["", *role_tables]
    emit(md, args.md, out, {"args": vars(args), "machine": machine, "runs": records})


if __name__ == "__main__":
    main()
