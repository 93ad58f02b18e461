"""``fedseg prepare``: the papers' public datasets, as downloaded, turned into a federation."""

from __future__ import annotations

import argparse

from fedseg.apps.prepare import FEDERATIONS, list_text, prepare
from fedseg.commands.options import (
    split_csv,
)
from fedseg.foundation.errors import ConfigError


def cmd_prepare(a: argparse.Namespace) -> int:
    if a.list:
        print(list_text())
        return 0
    if not (a.name and a.raw and a.out):
        raise ConfigError(
            "give a federation, --raw and --out (e.g. fedseg prepare fedsm-fundus --raw DIR --out DIR), or --list"
        )
    summary = prepare(
        a.name, a.raw, a.out, force=a.force, strict=a.strict, seed=a.seed, sites=split_csv(a.sites) if a.sites else None
    )
    print("\n" + summary.table())
    print(f"\nwrote {summary.spec}; check it with: fedseg validate {summary.spec}")
    return 0


def add_prepare_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``prepare`` verb to the command line's sub-parsers."""
    pr = sub.add_parser(
        "prepare",
        help="turn the papers' public datasets, as downloaded, into a federation (spec, datalists, PNG files)",
        description="Build a paper's federation from the archives unpacked under --raw in their expected layouts "
        "(docs/datasets.md; fedseg prepare --list says what each needs). Splits by patient; a second run skips "
        "the cases already converted; --raw is only read.",
    )
    pr.add_argument("name", nargs="?", choices=sorted(FEDERATIONS), help="the federation to build")
    pr.add_argument("--list", action="store_true", help="what each federation needs, where to get it, its licence")
    pr.add_argument("--raw", help="folder holding the downloaded datasets (only read)")
    pr.add_argument("--out", help="output folder: federation.toml, <site>/datalist.json, images, labels")
    pr.add_argument("--force", action="store_true", help="convert every case again")
    pr.add_argument("--strict", action="store_true", help="stop at the first bad case instead of skipping it")
    pr.add_argument("--seed", type=int, default=0, help="seed of the patient splits (default 0)")
    pr.add_argument("--sites", help="comma-separated sites to prepare (default: all)")
    pr.set_defaults(func=cmd_prepare)
