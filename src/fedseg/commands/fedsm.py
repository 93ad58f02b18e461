"""``fedseg fedsm``: FedSM's studies: unseen (Table 5), sweep (Table 7), table."""

from __future__ import annotations

import argparse
from pathlib import Path

from fedseg.apps.studies.fedsm import sweep, unseen
from fedseg.apps.studies.fedsm_seeds import over_seeds, tabulate
from fedseg.commands.options import (
    jobs_arguments,
    launch_arguments,
    launch_options,
    split_csv,
)
from fedseg.foundation.errors import ConfigError


def cmd_fedsm(a: argparse.Namespace) -> int:
    if a.fedsm_verb == "table":
        _, table = tabulate(a.folders, a.md)
        print("\n" + table)
        if a.md:
            print(f"table: {Path(a.md).resolve()}")
        return 0
    gammas = [float(g) for g in split_csv(a.gamma)] if a.gamma else None
    fields = {k: v for k, v in (("rounds", a.rounds), ("seed", a.seed)) if v is not None}
    if a.fedsm_verb == "unseen":
        kwargs: dict = {"sites": split_csv(a.sites) if a.sites else None}
        name = "unseen.md"
    else:
        kwargs = {"lams": [float(x) for x in split_csv(a.lam)]}
        name = "sweep.md"
    kwargs.update(overrides=a.set, gammas=gammas, progress=True)
    devices = tuple(split_csv(a.devices)) if a.devices else None
    if a.seeds:
        if a.seed is not None:
            raise ConfigError("give --seed (one run) or --seeds (one run per seed), not both")
        fields.pop("seed", None)
        seeds = [int(s) for s in split_csv(a.seeds)]
        launch = launch_options(a)
        _, table = over_seeds(
            a.fedsm_verb, a.config, a.out, seeds, jobs=a.jobs, devices=devices, launch=launch, **kwargs, **fields
        )
    else:
        study = unseen if a.fedsm_verb == "unseen" else sweep
        _, table = study(a.config, a.out, jobs=a.jobs, devices=devices, launch=launch_options(a), **kwargs, **fields)
    print("\n" + table)
    print(f"table: {Path(a.out).resolve() / name}")
    return 0


def add_fedsm_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``fedsm`` verb to the command line's sub-parsers."""
    f = sub.add_parser("fedsm", help="FedSM studies: unseen-site selection (Table 5), lambda/gamma sweep (Table 7)")
    fsub = f.add_subparsers(dest="fedsm_verb", required=True, metavar="STUDY")
    for study, text in (
        ("unseen", "leave each site out, train FedSM on the rest, test the composite on it (Table 5)"),
        ("sweep", "one FedSM run per lambda; Client Avg / Global Dice and test Dice per gamma (Table 7)"),
    ):
        x = fsub.add_parser(study, help=text)
        x.add_argument("config", help="run config TOML or federation spec")
        x.add_argument("--out", required=True)
        x.add_argument("--rounds", type=int)
        x.add_argument("--seed", type=int)
        x.add_argument(
            "--seeds", help="comma-separated seeds: one study per seed in OUT/seed<N>, then one table (mean ± sd)"
        )
        x.add_argument("--gamma", help="comma-separated gamma grid (default: fedsm.gamma_grid)")
        jobs_arguments(x)
        launch_arguments(x)
        x.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
        if study == "unseen":
            x.add_argument("--sites", help="comma-separated sites to hold out (default: each site)")
        else:
            x.add_argument("--lam", required=True, help="comma-separated lambdas, e.g. 0.1,0.3,0.5,0.7,0.9")
        x.set_defaults(func=cmd_fedsm)
    x = fsub.add_parser(
        "table", help="one table (mean ± sd over seeds) from the output folders of one study run with several seeds"
    )
    x.add_argument("folders", nargs="+", help="output folders of 'fedseg fedsm sweep' or 'unseen', one per seed")
    x.add_argument("--md", help="also write the table here")
    x.set_defaults(func=cmd_fedsm)
