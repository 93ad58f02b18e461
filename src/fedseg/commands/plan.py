"""``fedseg plan``: volumes: fingerprint every site and write the federation's plan."""

from __future__ import annotations

import argparse
import json

from fedseg.data.spec import load_federation
from fedseg.data.validate import raise_if_invalid
from fedseg.data.volumes.budget import CPU_STEP_SECONDS, device_budget
from fedseg.data.volumes.load import plan_federation, plan_path
from fedseg.data.volumes.plan import describe_budget, save_plan
from fedseg.foundation.config import TrainConfig
from fedseg.foundation.errors import FedsegError


def cmd_plan(a: argparse.Namespace) -> int:
    raise_if_invalid(a.spec)
    fed = load_federation(a.spec)
    if not fed.volumes:
        raise FedsegError(
            f'{a.spec}: data.mode = "{fed.mode}"; a plan is made for volumes (mode = "3d" or "patches2d")'
        )
    budget = device_budget(a.device, gpu_memory=a.gpu_memory, batch=a.batch_size, step_seconds=a.step_seconds)
    plan = plan_federation(fed, patch_voxels=a.patch_voxels, weighting=a.weighting, budget=budget)
    path = plan_path(fed)
    save_plan(plan, path)
    print(json.dumps(plan.to_json(), indent=2))
    print(describe_budget(plan))
    print(f"wrote {path} (edit any field to override it; runs on this federation read it)")
    return 0


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``plan`` verb to the command line's sub-parsers."""
    pl = sub.add_parser(
        "plan", help="volumes: fingerprint every site (aggregate numbers only) and write the federation's plan"
    )
    pl.add_argument("spec")
    pl.add_argument(
        "--patch-voxels", type=int, default=None, help="most voxels in one training patch beside the memory budget"
    )
    pl.add_argument(
        "--gpu-memory",
        type=float,
        default=None,
        metavar="GIB",
        help="plan for a GPU of this memory (GiB) as nnU-Net plans (8: its reference plan); default: the device "
        "at hand (a CUDA GPU's memory, or on a CPU the time of a training step, measured)",
    )
    pl.add_argument(
        "--device",
        default="auto",
        help="the device the plan is for without --gpu-memory: auto (a CUDA GPU if there is one), cpu, cuda, cuda:N",
    )
    pl.add_argument(
        "--step-seconds",
        type=float,
        default=CPU_STEP_SECONDS,
        help=f"on a CPU: the target seconds of one training step (default {CPU_STEP_SECONDS})",
    )
    pl.add_argument(
        "--batch-size",
        type=int,
        default=TrainConfig.batch_size,
        help="on a CPU: the patches of one training step the target is for (default: train.batch_size's default)",
    )
    pl.add_argument(
        "--weighting",
        choices=("case", "voxel"),
        default="case",
        help="how the CT percentiles, mean and sd weigh the foreground: every case equally (nnU-Net) or every voxel",
    )
    pl.set_defaults(func=cmd_plan)
