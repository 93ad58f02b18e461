"""``fedseg deploy``: provision, roster, site, server, run and rehearse on NVIDIA FLARE."""

from __future__ import annotations

import argparse
from pathlib import Path

from fedseg.algorithms import REGISTRY
from fedseg.apps.tracking import tracker_for
from fedseg.commands.options import (
    split_csv,
    track_argument,
)
from fedseg.deployment import run as dep
from fedseg.deployment.site import read_site_config


def cmd_deploy(a: argparse.Namespace) -> int:
    if a.deploy_verb == "provision":
        kits = dep.provision(split_csv(a.sites), a.server, a.out)
        for name, path in kits.items():
            print(f"{name}: {path}")
        print(
            "give each site its own kit folder (it holds that site's private key); keep 'admin' with the run submitter"
        )
        return 0
    if a.deploy_verb == "site":
        cfg = dep.configure_site(a.kit, a.datalist, a.workdir, a.name, device=a.device, policy=a.policy)
        print(f"site policy: {read_site_config(cfg).policy} (edit it to change what this site accepts)")
        print(f"wrote {cfg}; starting the site (it connects out to the server; Ctrl-C stops it)")
        return dep.foreground(dep.start_site(a.kit, log=Path(a.workdir) / "fedseg-site.log"))
    if a.deploy_verb == "roster":
        for line in dep.show_roster(a.kit):
            print(line)
        print(
            "compare these lines with every other site's over another channel (phone, signed mail): they must be equal"
        )
        return 0
    if a.deploy_verb == "server":
        print("starting the server (sites connect to it; Ctrl-C stops it)")
        return dep.foreground(dep.start_server(a.kit))
    out = (a.resume or a.out) if a.deploy_verb == "run" else a.out
    tracker = tracker_for(a.track, out, a.config or Path(out) / "config.toml", a.set)
    if a.deploy_verb == "run":
        res = dep.deploy_run(
            a.config,
            a.kits,
            out,
            overrides=a.set,
            resume=a.resume is not None,
            progress=True,
            method=a.method,
            rounds=a.rounds,
            seed=a.seed,
        )
    else:
        res = dep.rehearse(
            a.config, a.sites, out, overrides=a.set, progress=True, method=a.method, rounds=a.rounds, seed=a.seed
        )
    if res is None:
        print(
            f"the run did not finish; see {Path(out).resolve()} and resume with: fedseg deploy run --kits KITS --resume {out}"
        )
        return 1
    print(Path(out, "results.md").read_text())
    print(f"results: {Path(out).resolve() / 'results.json'}")
    if tracker is not None:  # the server's results, checkpoints and config, logged where the run was submitted
        print(f"MLflow run {tracker.log_run(out)} in {tracker.uri}")
    return 0


def add_deploy_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``deploy`` verb to the command line's sub-parsers."""
    dp = sub.add_parser(
        "deploy", help="run across real sites on NVIDIA FLARE (mutual TLS), or rehearse it on this machine"
    )
    dsub = dp.add_subparsers(dest="deploy_verb", required=True, metavar="STEP")
    x = dsub.add_parser("provision", help="root CA + server, site and admin startup kits (mutual TLS)")
    x.add_argument("--sites", required=True, help="comma-separated site names, as in the federation spec")
    x.add_argument("--server", required=True, help="HOST:PORT the sites connect to (admin port = PORT+1)")
    x.add_argument("--out", required=True, help="folder for the kits")
    x = dsub.add_parser("site", help="configure this site's data (kept local) and start it")
    x.add_argument("--kit", required=True)
    x.add_argument("--datalist", required=True, help="this site's datalist JSON (never sent to the server)")
    x.add_argument("--workdir", required=True, help="where the site keeps its checkpoints")
    x.add_argument("--name", help="site name in the federation (default: the kit's)")
    x.add_argument(
        "--device",
        default="auto",
        metavar="DEVICE",
        help="where this site trains: auto (CUDA when available, else cpu), cpu, cuda or cuda:N; each site picks its own",
    )
    x.add_argument(
        "--policy",
        metavar="FILE",
        help="this site's privacy policy (JSON; docs/deploy.md 'Site policy'): the floors it enforces whatever the "
        "server's job says (default: KIT/local/fedseg_policy.json, written with the defaults when absent)",
    )
    x = dsub.add_parser(
        "roster", help="print the federation's sites and certificate fingerprints a kit holds, to compare out of band"
    )
    x.add_argument("kit", help="a site kit (KIT/local/fedseg_roster.json) or the folder `provision --out` wrote")
    x = dsub.add_parser("server", help="start the server from its kit")
    x.add_argument("--kit", required=True)
    for verb, text in (
        ("run", "submit a run to the deployment and wait for results.json"),
        ("rehearse", "one machine: server + site processes, real mutual TLS, 127.0.0.1"),
    ):
        x = dsub.add_parser(verb, help=text)
        x.add_argument(
            "config", nargs="?" if verb == "run" else None, help="run config TOML (may hold a [deploy] section)"
        )
        x.add_argument("--out", default="runs/deploy")
        x.add_argument("--method", choices=sorted(REGISTRY))
        x.add_argument("--rounds", type=int)
        x.add_argument("--seed", type=int)
        x.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
        track_argument(x)
        if verb == "run":
            x.add_argument(
                "--kits", required=True, help="folder written by `fedseg deploy provision` (uses kits/admin)"
            )
            x.add_argument(
                "--resume", metavar="OUT", help="continue the deployed run in OUT after a server crash, as a new job"
            )
        else:
            x.add_argument(
                "--sites",
                type=int,
                default=3,
                help="use the first N sites of the federation (a site's default policy joins runs of at least 3)",
            )
    for x in dsub.choices.values():
        x.set_defaults(func=cmd_deploy)
