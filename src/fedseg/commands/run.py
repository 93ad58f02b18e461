"""``fedseg run``: train one method in simulation, with TensorBoard and MLflow hooks per round."""

from __future__ import annotations

import argparse
from pathlib import Path

from fedseg.algorithms import REGISTRY
from fedseg.apps.report.tensorboard import TensorBoardLogger
from fedseg.apps.tracking import LiveRun, tracker_for
from fedseg.commands.options import (
    device_argument,
    track_argument,
)
from fedseg.foundation.errors import FedsegError
from fedseg.simulation.runner import run


def cmd_run(a: argparse.Namespace) -> int:
    if a.resume is None and a.config is None:
        raise FedsegError("give a run config or federation spec, or --resume OUT to continue a run")
    out = a.resume or a.out
    tracker = tracker_for(a.track, out, a.config or Path(out) / "config.toml", a.set)
    logger = None
    if getattr(a, "tensorboard", False):
        logger = TensorBoardLogger(a.tensorboard_dir or Path(out) / "tensorboard")
        print(f"TensorBoard scalars: {logger.logdir.resolve()} (view with: tensorboard --logdir {logger.logdir})")
    live = LiveRun(tracker.target(), out) if tracker is not None else None  # each round as it ends
    hooks = [h for h in (logger, live) if h is not None]

    def on_round(entry: dict) -> None:
        for h in hooks:
            h(entry)

    try:
        res = run(
            a.config,
            out=out,
            overrides=a.set,
            resume=a.resume is not None,
            method=a.method,
            rounds=a.rounds,
            seed=a.seed,
            device=a.device,
            on_round=on_round if hooks else None,
        )
    finally:
        if logger is not None:
            logger.close()
    print(Path(out, "results.md").read_text())
    print(f"results: {Path(out).resolve() / 'results.json'}")
    if logger is not None:
        print(f"tensorboard: tensorboard --logdir {logger.logdir.resolve()}")
    if tracker is not None and res is not None:
        print(f"MLflow run {tracker.log_run(out)} in {tracker.uri}")
    return 0 if res is not None else 1


def add_run_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``run`` verb to the command line's sub-parsers."""
    r = sub.add_parser("run", help="train one method in simulation and test it on every site")
    r.add_argument("config", nargs="?", help="run config TOML or federation spec")
    r.add_argument("--method", choices=sorted(REGISTRY), help="method (default: the config's, else fedavg)")
    r.add_argument("--rounds", type=int)
    r.add_argument("--seed", type=int)
    r.add_argument("--out", default="runs/run", help="output folder (default: runs/run)")
    r.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. train.lr=1e-4 (repeatable)"
    )
    r.add_argument("--resume", metavar="OUT", help="continue the interrupted run in OUT")
    device_argument(r)
    r.add_argument(
        "--tensorboard",
        action="store_true",
        help="write per-round TensorBoard scalars (losses, Dice, bytes, alpha) to OUT/tensorboard",
    )
    r.add_argument("--tensorboard-dir", metavar="DIR", help="with --tensorboard: write the scalars to DIR instead")
    track_argument(r)
    r.set_defaults(func=cmd_run)
