"""DynUNet from the plan (nnU-Net's network, deep supervision) against the MONAI U-Net volume runs trained
before (16 features doubling per level on the plan's strides, 2 residual units), on the synthetic
``ct-lesion`` federation at equal training time.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/volume_networks.py --budget 90

Each network's time per training step (forward, backward, Adam step on one batch of patches) is measured on
this machine first; each then trains FedAvg for ``--rounds`` rounds with as many local steps per round as
fill ``--budget`` seconds of training over the sites, and its test cases are scored in their own grids
(Dice, HD95 in mm).  Writes ``OUT/summary.json`` and a Markdown table.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch
from _report import emit, md_table
from volumes import planned_federation

from fedseg.algorithms import known_sections
from fedseg.data.volumes.load import plan_for_run
from fedseg.foundation.config import load_run_config
from fedseg.simulation.runner import run
from fedseg.site.workload import workload_for


def networks(plan) -> dict[str, list[str]]:
    """The run overrides of each network."""
    levels = len(plan.channels)
    unet_channels = [16 * 2**i for i in range(levels)]
    return {
        "DynUNet (plan)": [],
        f"U-Net {unet_channels[0]}→{unet_channels[-1]}": [
            "model.name=unet",
            f"model.channels={unet_channels}",
            f"model.strides={[list(s) for s in plan.strides]}",
        ],
    }


def step_seconds(spec: Path, plan, overrides: list[str], batch: int, repeats: int = 3) -> float:
    """Seconds of one training step of the network on one batch of patches (after one warm-up step)."""
    cfg = load_run_config(spec, overrides, known_sections())
    cfg = plan_for_run(cfg, plan, log=lambda m: None)
    from fedseg.data.spec import load_federation

    wl = workload_for(load_federation(spec), cfg)
    model = wl.build_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(batch, 1, *cfg.model.roi_size)
    y = (torch.rand(batch, 2, *cfg.model.roi_size) > 0.9).float()
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        opt.zero_grad()
        wl.loss(model(x), y).backward()
        opt.step()
        if i:
            times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--scale", type=float, default=0.3)
    ap.add_argument("--patch-voxels", type=int, default=24 * 24 * 16)
    ap.add_argument("--budget", type=float, default=90.0, help="training seconds per network, all sites")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-volume-networks")
    ap.add_argument("--md", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(a.out)
    spec, fed, plan = planned_federation(out, a.seed, a.scale, a.size, a.patch_voxels)
    common = [f"train.batch_size={a.batch}", "train.local_epochs=none", f"rounds={a.rounds}", "eval.every=1000"]
    rows, summary = [], {"args": vars(a), "plan": plan.to_json(), "networks": {}}
    for name, over in networks(plan).items():
        sec = step_seconds(spec, plan, [*common, "train.local_steps=1", *over], a.batch)
        steps = max(1, int(a.budget / sec / (a.rounds * len(fed.sites))))
        t0 = time.perf_counter()
        res = run(
            spec,
            out=out / name.split()[0].lower(),
            overrides=[*common, f"train.local_steps={steps}", *over],
            method="fedavg",
            progress=False,
            log=lambda m: None,
        )
        wall = time.perf_counter() - t0
        assert res is not None
        keep = ("per_site_dice", "client_avg_dice", "per_site_channel_dice", "client_avg_hd95", "per_site_hd95")
        summary["networks"][name] = {
            "step_s": sec,
            "steps_per_round": steps,
            "wall_s": wall,
            **{k: res.get(k) for k in keep},
        }
        lesion = [v.get("lesion", float("nan")) for v in res["per_site_channel_dice"].values()]
        rows.append(
            [
                name,
                f"{sec:.3f}",
                str(steps),
                f"{wall:.0f}",
                f"{res['client_avg_dice']:.3f}",
                f"{sum(lesion) / len(lesion):.3f}",
                f"{res.get('client_avg_hd95', float('nan')):.1f}",
            ]
        )
    machine = f"{platform.processor() or platform.machine()}, torch threads 1"
    md = [
        f"FedAvg on ct-lesion (size {a.size}, scale {a.scale}), {a.rounds} rounds, about {a.budget:.0f} s of "
        f"training per network over the sites ({machine}):",
        "",
        *md_table(
            ["network", "s / step", "steps / round", "run wall (s)", "test Dice", "lesion Dice", "HD95 (mm)"], rows
        ),
    ]
    emit(md, a.md, out, summary)


if __name__ == "__main__":
    main()
