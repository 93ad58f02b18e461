"""``fedseg compare``: several methods over seeds, one table; --tune chooses settings on validation."""

from __future__ import annotations

import argparse
from pathlib import Path

from fedseg.apps.studies.compare import compare, split_method_entries
from fedseg.commands.options import (
    device_argument,
    jobs_arguments,
    launch_arguments,
    study_options,
    track_argument,
    track_uri_argument,
)


def cmd_compare(a: argparse.Namespace) -> int:
    overrides = a.set + ([f"device={a.device}"] if a.device else [])
    _, table = compare(a.config, split_method_entries(a.methods), a.out, study_options(a, overrides), tune=a.tune)
    print("\n" + table)
    print(f"table: {Path(a.out).resolve() / 'comparison.md'}")
    if a.tune:
        print(f"tuning record: {Path(a.out).resolve() / 'tuning.json'}; report: fedseg report {a.out}")
    return 0


def add_compare_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``compare`` verb to the command line's sub-parsers."""
    c = sub.add_parser("compare", help="run several methods over seeds and print one table (mean ± sd)")
    c.add_argument("config", help="run config TOML or federation spec")
    c.add_argument(
        "--methods",
        required=True,
        help="comma-separated, e.g. local,centralized,fedavg; a variant with settings of its own section: fedsm:personalization=ft",
    )
    c.add_argument("--seeds", default="0", help="comma-separated seeds (default: 0)")
    c.add_argument("--rounds", type=int)
    c.add_argument("--out", required=True)
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    c.add_argument(
        "--tune",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="tune a setting per method on validation, e.g. train.lr=3e-4,1e-3,3e-3 (repeatable: a grid; "
        "fedsm:lam=0.3,0.5 for one method's); each method's row is its setting with the best mean validation "
        "score over the seeds, reported on test",
    )
    jobs_arguments(c)
    launch_arguments(c)
    track_argument(c)
    track_uri_argument(c)
    device_argument(c)
    c.set_defaults(func=cmd_compare)
