"""3D workload on one device: Auto-FedAvg on the ``ct-lesion`` preset at the paper's patch.

The synthetic ``ct-lesion`` federation (3 sites, :mod:`fedseg.data.synth3d`) at ``--size`` voxels
in-plane is planned as ``fedseg plan`` plans it, then resampled to ``--spacing`` (Auto-FedAvg's
(0.8, 0.8, 5) mm by default) with the patch ``--roi`` (256×256×32) and the U-Net the plan derives
for that patch and spacing.  Auto-FedAvg runs ``--rounds`` rounds of ``--steps`` local steps at
batch ``--batch-size`` (4), in each ``--precisions``.  Per precision it records:

* ``s/round`` and ``s/step``: mean wall time of the rounds after the first (the first pays cuDNN's
  plans and the allocator), validation excluded (it runs after the last round only);
* peak device memory (``torch.cuda.max_memory_allocated``);
* sliding-window inference: seconds per test volume of the trained model (gaussian windows with the
  run's overlap, ``sw_batch_size`` 4), and the volumes' shape.

    .venv/bin/python benchmarks/gpu3d.py --device cuda                                     # the paper's patch
    .venv/bin/python benchmarks/gpu3d.py --device cpu --size 64 --roi 32,32,8 --steps 2 --rounds 2 --precisions fp32   # CPU smoke size
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _report import emit, md_table

from fedseg.algorithms import known_sections
from fedseg.data.spec import load_federation
from fedseg.data.synth3d import synthesize_ct
from fedseg.data.volumes.load import ensure_plan, plan_for_run, plan_path
from fedseg.data.volumes.plan import features, save_plan, topology
from fedseg.execution.federation import load_federation_data
from fedseg.foundation.config import load_run_config
from fedseg.foundation.device import describe, resolve_device
from fedseg.simulation.runner import run
from fedseg.site.workload import workload_for


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--size", type=int, default=384, help="in-plane voxels of the synthetic scans")
    ap.add_argument("--scale", type=float, default=0.1, help="fraction of the preset's case counts (>= 2 per split)")
    ap.add_argument("--spacing", default="0.8,0.8,5", help="target spacing in mm (RAS), written into the plan")
    ap.add_argument("--roi", default="256,256,32", help="training patch and sliding window (RAS voxels)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10, help="local steps per site and round")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--method", default="autofedavg")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--out", default=None)
    ap.add_argument("--md", default=None, help="also write the Markdown table here")
    args = ap.parse_args()
    device = resolve_device(args.device)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="fedseg-gpu3d-"))
    roi = [int(v) for v in args.roi.split(",")]
    spacing = [float(v) for v in args.spacing.split(",")]

    t0 = time.perf_counter()
    spec = synthesize_ct(out / "data", seed=0, scale=args.scale, size=args.size)
    t_synth = time.perf_counter() - t0
    fed = load_federation(spec)
    plan = ensure_plan(fed, log=lambda m: None)
    strides, kernels, roi = topology(roi, spacing)
    channels = features(len(kernels))
    plan = dataclasses.replace(
        plan,
        target_spacing=spacing,
        patch_size=roi,
        channels=channels,
        strides=strides,
        kernels=kernels,
    )
    plan.check()
    save_plan(plan, plan_path(fed))
    t0 = time.perf_counter()
    fed, data = load_federation_data(spec)
    t_load = time.perf_counter() - t0
    shape = list(next(iter(data.values())).test.images.shape[2:])
    print(f"data: synthesized in {t_synth:.0f} s, planned and loaded in {t_load:.0f} s; volumes {shape}", flush=True)

    rows, records = [], []
    for precision in args.precisions.split(","):
        cfg = load_run_config(
            spec,
            [
                f"model.roi_size={roi}",
                f"train.batch_size={args.batch_size}",
                f"train.local_steps={args.steps}",
                f"train.precision={precision}",
                f"eval.every={args.rounds}",
            ],
            known_sections(),
            method=args.method,
            rounds=args.rounds,
            seed=0,
        )
        cfg = dataclasses.replace(cfg, device=args.device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        results = run(cfg, out=out / f"run-{precision}", progress=False, log=lambda m: None)
        wall = time.perf_counter() - t0
        times = [e["time_s"] for e in results["history"]]
        steady = times[1:-1] or times[-1:]
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None

        # sliding-window inference of the trained global model over every test volume

        used = plan_for_run(cfg, plan, log=lambda m: None)
        workload = workload_for(fed, used)
        model = workload.build_model().to(device).eval()
        per_volume = []
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            for d in data.values():
                for i in range(d.test.images.shape[0]):
                    x = d.test.images[i : i + 1].to(device)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    t1 = time.perf_counter()
                    workload.infer(model, x)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    per_volume.append(time.perf_counter() - t1)
        sw = statistics.median(per_volume[1:] or per_volume)
        dice = results["client_average"] if "client_average" in results else None
        r = {
            "precision": precision,
            "s_per_round": statistics.mean(steady),
            "s_per_step": statistics.mean(steady) / (args.steps * len(data)),
            "peak_gib": peak,
            "sw_s_per_volume": sw,
            "volume_shape": shape,
            "wall_s": wall,
            "client_average": dice,
        }
        records.append(r)
        print(
            f"{args.method} {precision}: {r['s_per_round']:.2f} s/round ({r['s_per_step'] * 1e3:.0f} ms/step), "
            f"sliding windows {sw:.2f} s/volume, peak {'–' if peak is None else f'{peak:.1f} GiB'}",
            flush=True,
        )
        rows.append(
            [
                args.method,
                precision,
                f"{r['s_per_round']:.2f}",
                f"{r['s_per_step'] * 1e3:.0f}",
                "–" if peak is None else f"{peak:.1f}",
                f"{sw:.2f}",
            ]
        )
    machine = f"{describe(device)}, {platform.processor() or platform.machine()}, torch {torch.__version__}"
    md = [
        f"ct-lesion at size {args.size}, scale {args.scale} ({len(data)} sites), spacing {spacing} mm, volumes {shape}, "
        f"patch {roi}, U-Net {channels} strides {strides}, batch {args.batch_size}, {args.steps} local steps per site; {machine}",
        "",
    ]
    md += md_table(
        ["method", "precision", "s/round", "ms/step", "peak GiB", "sliding windows s/volume"],
        rows,
    )
    emit(md, args.md, out, {"args": vars(args), "machine": machine, "runs": records})


if __name__ == "__main__":
    main()
