"""``fedseg demo``: synthesize a small federation, train four methods, print a Dice table, write an HTML report."""

from __future__ import annotations

import argparse
from pathlib import Path

from fedseg.apps.studies.compare import demo


def cmd_demo(a: argparse.Namespace) -> int:
    table, report = demo(out=a.out, rounds=a.rounds, scale=a.scale, size=a.size, seed=a.seed, overrides=a.set)
    print("\n" + table)
    print(f"results, resolved configs and checkpoints: {Path(a.out).resolve()}")
    print(f"HTML report: {Path(report).resolve()}")
    return 0


def add_demo_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``demo`` verb to the command line's sub-parsers."""
    d = sub.add_parser(
        "demo",
        help="synthesize a small federation, train local/centralized/FedAvg/FedSM, print a Dice table, write an HTML report",
    )
    d.add_argument("--out", default="runs/demo", help="output folder (default: runs/demo)")
    d.add_argument("--rounds", type=int, default=40)
    d.add_argument("--scale", type=float, default=0.15, help="fraction of the paper's Table 1 case counts")
    d.add_argument("--size", type=int, default=64, help="image side in pixels")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting of every run, after the demo's own (repeatable); --set train.lr=1e-3: the papers' learning "
        "rate instead of the demo's 1e-2; --set fedavg.weighting=samples --set fedavg.normalize=none: the papers' "
        "FedAvg (p_k = n_k / n, the plain average) instead of its defaults",
    )
    d.set_defaults(func=cmd_demo)
