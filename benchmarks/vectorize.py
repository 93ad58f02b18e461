"""Vectorized vs sequential simulation: seconds per round and peak memory for K sites.

K in-memory sites of random images (``--cases`` training cases each, or per site: ``fundus@0.1`` gives the
fundus preset's unequal sites; 3 channels, 2 labels), the MONAI U-Net (``--channels``, default the FedSM
reference's 16…256), Adam, batch ``--batch-size``, ``--local-steps`` local steps per round, or
``--local-epochs`` passes over each site's cases (epoch mode: unequal sites take unequal steps) (FGA: lockstep
steps; FedSM's default ``fga`` selector: as many selector steps), validation only after the last round.  Each run —
(size, method, K, simulation.vectorize) — is a fresh subprocess, so that its peak memory is its
own: peak resident memory of the process on the CPU (``ru_maxrss``, which includes the Python
interpreter and torch, ~0.3–0.5 GB), ``torch.cuda.max_memory_allocated`` on CUDA.
``s/round`` is the median over the rounds after the first (warm-up) and before the last (validation),
with the fastest such round beside it (the development machine is shared: the median and the
minimum are less disturbed by other jobs than the mean).  Beside the speed-up of the whole round
(the server's aggregation included) two more are reported: of the time inside the transport's asks
alone (the sites' local work, which is what vectorization changes), and of the process's CPU time
per round (all threads; less disturbed than wall time when other jobs share the machine).

Goals: on the CPU ≥ 2× faster at 32² with 6 sites; on a GPU a 6-site round at 64² in
≤ 1.5× the time of one site's round.

    .venv/bin/python benchmarks/vectorize.py --device cpu --sizes 32 --channels 8,16,32,64 --sites 2,6   # CPU, small
    .venv/bin/python benchmarks/vectorize.py --device cuda --sizes 64,128,256 --sites 1,2,6,12,24         # GPU
    .venv/bin/python benchmarks/vectorize.py --device cpu --threads 1 --sizes 64 --sites 6 --methods fedavg \
        --cases fundus@0.1 --local-epochs 1                                  # unequal sites, epoch mode
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _report import emit, md_table


def one(args: argparse.Namespace) -> dict:
    """One run in this process; returns its timings and peak memory."""
    from torch.utils.data import TensorDataset

    from fedseg.algorithms import get_algorithm
    from fedseg.execution.engine import Engine
    from fedseg.foundation.config import EvalConfig, ModelConfig, RunConfig, SimulationConfig, TrainConfig
    from fedseg.foundation.device import resolve_device
    from fedseg.simulation.runner import build_transport
    from fedseg.site.batches import SiteData
    from fedseg.site.workload import segmentation_workload

    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)

    def split(n: int) -> TensorDataset:
        x = torch.rand(n, 3, args.size, args.size, generator=g)
        return TensorDataset(x, (x[:, :2] > 0.5).float())

    cases = site_cases(args.cases, args.k)
    data = {f"site{k + 1}": SiteData(split(cases[k]), split(2), split(2)) for k in range(args.k)}
    model = (
        ModelConfig()
        if not args.channels
        else ModelConfig(channels=tuple(args.channels), strides=(2,) * (len(args.channels) - 1))
    )
    cfg = RunConfig(
        federation="(in memory)",
        method=args.method,
        rounds=args.rounds,
        seed=0,
        device=args.device,
        checkpoint_every=args.rounds,
        deterministic=not args.nondeterministic,
        model=model,
        train=TrainConfig(
            batch_size=args.batch_size,
            local_steps=None if args.local_epochs else args.local_steps,
            local_epochs=args.local_epochs,
        ),
        eval=EvalConfig(every=args.rounds),
        simulation=SimulationConfig(vectorize=args.vectorize, vectorize_group=args.group, cuda_graphs=args.cuda_graphs),
    )
    device = resolve_device(cfg.device)
    workload = segmentation_workload(2, 3, ["a", "b"], cfg.model, cfg.train)
    algorithm = get_algorithm(cfg)
    logs: list[str] = []
    transport = build_transport(cfg, workload, data, algorithm, log=logs.append)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    ask_s: list[float] = [0.0]  # seconds inside the transport's asks (the sites' work), per round
    cpu_s: list[float] = []  # process CPU seconds per round (all threads)
    inner_ask = transport.ask

    def timed_ask(*a, **kw):
        t = time.perf_counter()
        try:
            return inner_ask(*a, **kw)
        finally:
            ask_s[-1] += time.perf_counter() - t

    transport.ask = timed_ask
    cpu_mark = [0.0]

    def on_round(entry: dict) -> None:
        now = time.process_time()
        cpu_s.append(now - cpu_mark[0])
        cpu_mark[0] = now
        ask_s.append(0.0)

    engine = Engine(cfg, algorithm, transport, workload, out=None, progress=False, log=logs.append, on_round=on_round)
    t0 = time.perf_counter()
    cpu_mark[0] = time.process_time()
    if getattr(args, "profile", None):
        _profiled(engine.run, device, Path(args.profile))
    else:
        engine.run()
    wall = time.perf_counter() - t0
    times = [e["time_s"] for e in engine.history]

    def steady(xs: list[float]) -> list[float]:
        return xs[1:-1] or xs[-1:]

    peak = (
        torch.cuda.max_memory_allocated(device)
        if device.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return {
        "s_per_round": statistics.median(steady(times)),
        "min_s_per_round": min(steady(times)),
        "ask_s_per_round": statistics.median(steady(ask_s[: len(times)])),
        "cpu_s_per_round": statistics.median(steady(cpu_s)),
        "rounds_s": times,
        "wall_s": wall,
        "peak_gib": peak / 2**30,
        "vectorized": any("one vectorized computation" in m for m in logs),
        "plan": [m for m in logs if m.startswith("vectorize")],
        "graphed": any("captured CUDA graph" in m for m in logs),
    }


def site_cases(spec: str, k: int) -> list[int]:
    """Training cases of each of ``k`` sites from ``--cases``: one number for every site, a comma list (its first
    ``k`` entries), or ``PRESET@SCALE`` (a synthetic preset's training-set sizes at that scale, e.g. ``fundus@0.1``:
    5, 10, 5, 23, 8 and 40 cases — sites of unequal size)."""
    if "@" in spec:
        from fedseg.data.synth import split_sizes

        preset, scale = spec.split("@")
        cases = [train for train, _, _ in split_sizes(preset, float(scale))]
    else:
        cases = [int(c) for c in spec.split(",")]
    if len(cases) == 1:
        return cases * k
    if len(cases) < k:
        raise SystemExit(f"--cases {spec} gives {len(cases)} sites' sizes, fewer than K = {k}")
    return cases[:k]


def _profiled(run, device: torch.device, path: Path) -> None:
    """``run()`` under torch.profiler; writes the operators by self time on the device and on the host,
    and the device's busy time (the sum of kernel times) against the wall time, to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    wall = time.perf_counter() - t0
    ka = prof.key_averages()
    dev_key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    busy = sum(getattr(e, dev_key, 0.0) for e in ka) / 1e6 if device.type == "cuda" else float("nan")
    lines = [
        f"wall {wall:.3f} s under the profiler; device busy (sum of kernel self times) {busy:.3f} s",
        ka.table(sort_by=dev_key, row_limit=30),
        ka.table(sort_by="self_cpu_time_total", row_limit=30),
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--sizes", default="32,64")
    ap.add_argument("--sites", default="2,6,12,24")
    ap.add_argument("--methods", default="fedavg,fedsm,fga")
    ap.add_argument("--channels", help="U-Net channels, e.g. 8,16,32,64 (default: the FedSM reference's 16…256)")
    ap.add_argument("--rounds", type=int, default=4, help=">= 3: warm-up, measured rounds, last with validation")
    ap.add_argument("--local-steps", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument(
        "--cases",
        default="8",
        help="training cases per site: N, a comma list per site, or PRESET@SCALE (e.g. fundus@0.1: unequal sites)",
    )
    ap.add_argument(
        "--local-epochs",
        type=float,
        default=None,
        help="epoch mode (train.local_epochs) instead of --local-steps: unequal sites take unequal steps",
    )
    ap.add_argument("--group", type=int, default=0, help="simulation.vectorize_group")
    ap.add_argument(
        "--cuda-graphs", default="on", choices=("on", "off"), help="simulation.cuda_graphs (CUDA, vectorized runs)"
    )
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default=None)
    ap.add_argument("--md", default=None, help="also write the Markdown table here")
    ap.add_argument(
        "--nondeterministic",
        action="store_true",
        help="deterministic = false: cuDNN autotuner, TF32 (measures what determinism costs on CUDA)",
    )
    ap.add_argument("--profile", default=None, help="with --one: write a torch.profiler summary of the run here")
    ap.add_argument(
        "--one", default=None, help=argparse.SUPPRESS
    )  # internal: run one configuration (JSON) and print its result
    args = ap.parse_args()
    args.channels = [int(c) for c in args.channels.split(",")] if args.channels else None
    if args.one:
        for k, v in json.loads(args.one).items():
            setattr(args, k, v)
        print("RESULT " + json.dumps(one(args)), flush=True)
        return
    from fedseg.foundation.device import describe, resolve_device

    device = resolve_device(args.device)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="fedseg-vectorize-"))
    rows, records = [], []
    for size in [int(s) for s in args.sizes.split(",")]:
        for method in args.methods.split(","):
            for k in [int(s) for s in args.sites.split(",")]:
                res = {}
                for mode in ("off", "on"):
                    spec = {"size": size, "method": method, "k": k, "vectorize": mode}
                    proc = subprocess.run(
                        [sys.executable, __file__, *sys.argv[1:], "--one", json.dumps(spec)],
                        capture_output=True,
                        text=True,
                    )
                    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                    if proc.returncode != 0 and "ConfigError" in proc.stderr:  # e.g. FedSM with one site
                        print(f"{size}² {method} K={k}: not run: {proc.stderr.strip().splitlines()[-1]}", flush=True)
                        break
                    if proc.returncode != 0 or not line:
                        raise SystemExit(f"run {spec} failed:\n{proc.stderr[-3000:]}")
                    res[mode] = json.loads(line[0][7:])
                    records.append({**spec, **res[mode]})
                if len(res) < 2:
                    continue
                speedup = res["off"]["s_per_round"] / res["on"]["s_per_round"]
                ask_speedup = res["off"]["ask_s_per_round"] / res["on"]["ask_s_per_round"]
                cpu_speedup = res["off"]["cpu_s_per_round"] / res["on"]["cpu_s_per_round"]
                print(
                    f"{size}² {method} K={k}: sequential {res['off']['s_per_round']:.3f} s/round, vectorized {res['on']['s_per_round']:.3f} "
                    f"({speedup:.2f}×; the sites' asks alone {ask_speedup:.2f}×; CPU time {cpu_speedup:.2f}×; "
                    f"{'vectorized' if res['on']['vectorized'] else 'fell back'}"
                    f"{', CUDA graph' if res['on'].get('graphed') else ''})",
                    flush=True,
                )
                rows.append(
                    [
                        f"{size}²",
                        method,
                        str(k),
                        f"{res['off']['s_per_round']:.3f} ({res['off']['min_s_per_round']:.3f})",
                        f"{res['on']['s_per_round']:.3f} ({res['on']['min_s_per_round']:.3f})",
                        f"{speedup:.2f}×",
                        f"{ask_speedup:.2f}×",
                        f"{cpu_speedup:.2f}×",
                        f"{res['off']['peak_gib']:.2f}",
                        f"{res['on']['peak_gib']:.2f}",
                    ]
                )
    machine = f"{describe(device)}, {platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} threads"
    mem = "peak GPU GiB (allocated)" if device.type == "cuda" else "peak RSS GiB"
    md = [
        f"U-Net {args.channels or 'default (16…256)'}, batch {args.batch_size}, "
        + (f"{args.local_epochs:g} local epochs" if args.local_epochs else f"{args.local_steps} local steps")
        + f", {args.cases} cases/site, "
        f"{args.rounds} rounds, group {args.group or 'all'}"
        + (f", CUDA graphs {args.cuda_graphs}" if device.type == "cuda" else "")
        + f"; {machine}",
        "",
    ]
    md += md_table(
        [
            "size",
            "method",
            "sites K",
            "sequential s/round (fastest)",
            "vectorized s/round (fastest)",
            "speed-up (medians)",
            "speed-up of the sites' asks",
            "speed-up in CPU time",
            f"sequential {mem}",
            f"vectorized {mem}",
        ],
        rows,
    )
    emit(md, args.md, out, {"args": vars(args), "machine": machine, "runs": records})


if __name__ == "__main__":
    main()
