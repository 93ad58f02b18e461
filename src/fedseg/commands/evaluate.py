"""``fedseg evaluate``: test a finished run's best models, optionally on another federation."""

from __future__ import annotations

import argparse

from fedseg.apps.studies.compare import evaluate_run


def cmd_evaluate(a: argparse.Namespace) -> int:
    res = evaluate_run(a.run, federation=a.spec, split=a.split)
    print(res["table"])
    return 0


def add_evaluate_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``evaluate`` verb to the command line's sub-parsers."""
    e = sub.add_parser("evaluate", help="test a finished run's best models (optionally on another federation)")
    e.add_argument("run", help="output folder of a finished run")
    e.add_argument("--spec", help="federation spec to test on (default: the run's own)")
    e.add_argument("--split", default="testing", choices=["validation", "testing"])
    e.set_defaults(func=cmd_evaluate)
