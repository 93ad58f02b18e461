"""``fedseg plan``: volumes: fingerprint every site and write the federation's plan."""

from __future__ import annotations

import argparse
import json

from fedseg.data.spec import load_federation
from fedseg.data.validate import raise_if_invalid
from fedseg.data.volumes.load import plan_federation, plan_path
from fedseg.data.volumes.plan import save_plan
from fedseg.foundation.errors import FedsegError


def cmd_plan(a: argparse.Namespace) -> int:
    raise_if_invalid(a.spec)
    fed = load_federation(a.spec)
    if not fed.volumes:
        raise FedsegError(
            f'{a.spec}: data.mode = "{fed.mode}"; a plan is made for volumes (mode = "3d" or "patches2d")'
        )
    plan = plan_federation(fed, gpu_memory=a.gpu_memory, patch_voxels=a.patch_voxels, weighting=a.weighting)
    path = plan_path(fed)
    save_plan(plan, path)
    print(json.dumps(plan.to_json(), indent=2))
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
        default=8.0,
        help="GPU memory (GiB) the patch, network and batch are sized for, as nnU-Net plans (default 8, its reference)",
    )
    pl.add_argument(
        "--weighting",
        choices=("case", "voxel"),
        default="case",
        help="how the CT percentiles, mean and sd weigh the foreground: every case equally (nnU-Net) or every voxel",
    )
    pl.set_defaults(func=cmd_plan)
