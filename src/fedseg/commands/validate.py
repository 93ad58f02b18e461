"""``fedseg validate``: check a federation spec and every file it names."""

from __future__ import annotations

import argparse

from fedseg.data.validate import validate_federation


def cmd_validate(a: argparse.Namespace) -> int:
    problems = validate_federation(a.spec)
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} problem(s) in {a.spec}; a run refuses to start until they are fixed")
        return 1
    print(f"{a.spec}: OK")
    return 0


def add_validate_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``validate`` verb to the command line's sub-parsers."""
    v = sub.add_parser("validate", help="check a federation spec and every file it names")
    v.add_argument("spec")
    v.set_defaults(func=cmd_validate)
