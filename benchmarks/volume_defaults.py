"""The default volume network for a CPU, chosen at equal training time on the synthetic ``ct-lesion`` federation.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/volume_defaults.py --budget 90

Candidates, each trained with FedAvg for about ``--budget`` seconds of training over the sites (its time per
training step measured first on this machine, one torch thread; its local steps per round set to fill the
budget over ``--rounds`` rounds, or with ``--steps N`` its rounds of N local steps), then its test cases scored in their own grids (Dice, HD95 in mm):

* **DynUNet, 8 GiB GPU plan** — what ``model.name = "auto"`` built on any device before plans knew their device
  (nnU-Net's plan for an 8 GiB GPU);
* **U-Net, CPU plan** and **DynUNet, CPU plan** — the plan ``fedseg plan`` makes for this CPU
  (:mod:`fedseg.data.volumes.budget`: the largest rung of the CPU ladder whose U-Net step is estimated within
  the target), built as MONAI's U-Net (2 residual units; what ``model.name = "auto"`` builds) or as DynUNet
  on its channels and strides;
* **DynUNet, CPU plan sized for DynUNet** — the same ladder with DynUNet's step as the cost (a slimmer
  DynUNet);
* **hand-set U-Net** — MONAI's U-Net 16 → 64, two stride-2 levels, a patch of 20 × 24 × 16: the network the
  volume results were measured with (docs/results/volumes.md).

Writes ``OUT/summary.json`` and a Markdown table.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch
from _report import emit, md_table
from volume_networks import step_seconds
from volumes import planned_federation

from fedseg.data.volumes.budget import device_budget
from fedseg.data.volumes.load import plan_federation, plan_path
from fedseg.data.volumes.plan import save_plan
from fedseg.simulation.runner import run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=48)
    ap.add_argument("--scale", type=float, default=0.5)
    ap.add_argument("--budget", type=float, default=90.0, help="training seconds per network, all sites")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="fixed local steps per round, the rounds set to fill the budget (default: --rounds fixed, the local "
        "steps set to fill it)",
    )
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default=None, help="comma-separated candidate numbers (1-5) to run")
    ap.add_argument("--out", default="bench-volume-defaults")
    ap.add_argument("--md", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(a.out)
    spec, fed, gpu_plan = planned_federation(out, a.seed, a.scale, a.size, 10**9)
    budget = device_budget("cpu", batch=a.batch)
    cpu_plan = plan_federation(fed, weighting="voxel", budget=budget, log=lambda m: None)
    slim_plan = plan_federation(fed, weighting="voxel", budget=budget, network="dynunet", log=lambda m: None)
    hand = [
        "model.name=unet",
        "model.channels=[16,32,64]",
        "model.strides=[[2,2,2],[2,2,2]]",
        "model.roi_size=[20,24,16]",
    ]
    candidates = {
        "DynUNet, 8 GiB GPU plan": (gpu_plan, ["model.name=dynunet"]),
        "DynUNet, CPU plan": (cpu_plan, ["model.name=dynunet"]),
        "DynUNet, CPU plan sized for DynUNet": (slim_plan, ["model.name=dynunet"]),
        "U-Net, CPU plan (the default)": (cpu_plan, ["model.name=unet"]),
        "hand-set U-Net 16→64": (cpu_plan, hand),
    }
    keep = None if a.only is None else {int(i) for i in a.only.split(",")}
    common = [
        f"train.batch_size={a.batch}",
        "train.local_epochs=none",
        f"train.lr={a.lr}",
        "eval.every=1000",
        "volume_cache=off",
    ]
    rows, summary = [], {"args": vars(a), "cpu_budget": cpu_plan.budget, "plans": {}, "networks": {}}
    for i, (name, (plan, over)) in enumerate(candidates.items(), 1):
        if keep is not None and i not in keep:
            continue
        save_plan(plan, plan_path(fed))
        summary["plans"][name] = plan.to_json()
        sec = step_seconds(spec, plan, [*common, "train.local_steps=1", *over], a.batch)
        if a.steps is None:
            rounds, steps = a.rounds, max(1, int(a.budget / sec / (a.rounds * len(fed.sites))))
        else:
            rounds, steps = max(1, int(a.budget / sec / (a.steps * len(fed.sites)))), a.steps
        t0 = time.perf_counter()
        res = run(
            spec,
            out=out / f"net{i}",
            overrides=[*common, f"rounds={rounds}", f"train.local_steps={steps}", *over],
            method="fedavg",
            progress=False,
            log=lambda m: None,
        )
        wall = time.perf_counter() - t0
        assert res is not None
        roi = res["config"]["model"]["roi_size"]
        channels = res["config"]["model"]["channels"]
        summary["networks"][name] = {
            "step_s": sec,
            "steps_per_round": steps,
            "rounds": rounds,
            "wall_s": wall,
            "roi_size": roi,
            "channels": channels,
            **{k: res.get(k) for k in ("per_site_dice", "client_avg_dice", "client_avg_hd95")},
        }
        rows.append(
            [
                name,
                "×".join(map(str, roi)),
                f"{channels[0]}→{channels[-1]}, {len(channels)} levels",
                f"{sec:.3f}",
                f"{rounds} × {steps}",
                f"{wall:.0f}",
                f"{res['client_avg_dice']:.3f}",
                f"{res.get('client_avg_hd95', float('nan')):.1f}",
            ]
        )
        print(rows[-1], flush=True)
    machine = f"{platform.processor() or platform.machine()}, torch threads 1"
    md = [
        f"FedAvg on ct-lesion (size {a.size}, scale {a.scale}, seed {a.seed}), "
        + (f"{a.rounds} rounds" if a.steps is None else f"{a.steps} local steps a round")
        + f", batch {a.batch}, Adam lr {a.lr}, "
        f"about {a.budget:.0f} s of training per network over the sites ({machine}; CPU plan budget "
        f"{cpu_plan.budget}):",
        "",
        *md_table(
            ["network", "patch", "features", "s / step", "rounds × steps", "run wall (s)", "test Dice", "HD95 (mm)"],
            rows,
        ),
    ]
    emit(md, a.md, out, summary)


if __name__ == "__main__":
    main()
