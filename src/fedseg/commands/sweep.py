"""``fedseg sweep``: one method over a grid of any settings."""

from __future__ import annotations

import argparse
from pathlib import Path

from fedseg.algorithms import REGISTRY
from fedseg.apps.studies.grid import sweep as grid_sweep
from fedseg.commands.options import (
    device_argument,
    jobs_arguments,
    launch_arguments,
    study_options,
    track_argument,
    track_uri_argument,
)


def cmd_sweep(a: argparse.Namespace) -> int:
    overrides = a.set + ([f"device={a.device}"] if a.device else [])
    _, table = grid_sweep(a.config, a.method, a.grid, a.out, study_options(a, overrides))
    print("\n" + table)
    print(f"table: {Path(a.out).resolve() / 'sweep.md'}, figure: {Path(a.out).resolve() / 'sweep.png'}")
    return 0


def add_sweep_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``sweep`` verb to the command line's sub-parsers."""
    sw = sub.add_parser(
        "sweep",
        help="one method over a grid of any settings: one run per point (resumable), a table and a plot of "
        "validation Dice over the grid",
    )
    sw.add_argument("config", help="run config TOML or federation spec")
    sw.add_argument("--method", required=True, choices=sorted(REGISTRY))
    sw.add_argument(
        "--grid",
        action="append",
        required=True,
        metavar="KEY=V1,V2",
        help="a setting and its values, e.g. train.lr=3e-4,1e-3 (repeatable: the product of all)",
    )
    sw.add_argument("--seeds", default="0", help="comma-separated seeds (default: 0)")
    sw.add_argument("--rounds", type=int)
    sw.add_argument("--out", required=True, help="output folder: one subfolder per grid point, seed<k> below it")
    sw.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    jobs_arguments(sw)
    launch_arguments(sw)
    track_argument(sw)
    track_uri_argument(sw)
    device_argument(sw)
    sw.set_defaults(func=cmd_sweep)
