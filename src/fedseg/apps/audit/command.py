"""``fedseg audit``: the verb's arguments and its thin wrapper over :func:`.run.audit_federation` (kept with
the audit so that the command line only registers it)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from fedseg.apps.audit.inversion import AttackConfig
from fedseg.apps.audit.messages import METHOD_MESSAGES
from fedseg.apps.audit.observe import PROTECTIONS
from fedseg.apps.audit.run import AuditOptions, audit_federation, audit_table, messages_for

__all__ = ["add_audit_parser", "cmd_audit"]


def _csv(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


CPU_ITERATIONS = 200
"""``--iterations``' default on the CPU: minutes for every message."""
GPU_ITERATIONS = 4_000
"""``--iterations``' default on a GPU: closer to the reference attack's 24,000 (an hour or so for every message)."""


def default_iterations(device: torch.device) -> int:
    """``--iterations``' default on the run's device (``--device``, else the config's ``device``):
    :data:`GPU_ITERATIONS` on CUDA, :data:`CPU_ITERATIONS` otherwise."""
    return GPU_ITERATIONS if device.type == "cuda" else CPU_ITERATIONS


def cmd_audit(a: argparse.Namespace) -> int:
    attack = AttackConfig(
        iterations=a.iterations or CPU_ITERATIONS,
        restarts=a.restarts,
        tv=a.tv,
        layers=_csv(a.layers) or None,
        unroll=not a.no_unroll,
    )
    opts = AuditOptions(
        messages=messages_for(a.method),
        protections=_csv(a.protections),
        sites=a.sites,
        images=a.images,
        clip=a.clip,
        sigma=a.sigma,
        attack=attack,
    )
    doc, rows, json_path, page = audit_federation(
        a.config,
        a.out,
        opts,
        overrides=a.set,
        seed=a.seed,
        device=a.device,
        iterations_for=default_iterations if a.iterations is None else None,
    )
    print("\n" + audit_table(rows, AttackConfig(**doc["attack"])))
    print(f"numbers: {json_path.resolve()}\nreconstructions beside the originals: {page.resolve()}")
    return 0


def add_audit_parser(
    sub: argparse._SubParsersAction, device_argument: Callable[[argparse.ArgumentParser], None]
) -> None:
    """Add the ``audit`` verb to the command line's sub-parsers (``device_argument`` adds ``--device``)."""
    au = sub.add_parser(
        "audit", help="gradient-inversion attack on what each method sends, plain, with secure aggregation and DP"
    )
    au.add_argument("config", help="run config TOML or federation spec (e.g. a synthetic fundus federation)")
    au.add_argument("--method", default="all", choices=[*METHOD_MESSAGES, "all"], help="whose messages (default all)")
    au.add_argument("--out", default="runs/audit", help="output folder for audit.json and audit.html")
    au.add_argument(
        "--iterations",
        type=int,
        help=f"attack iterations per restart (default {GPU_ITERATIONS} on a GPU, {CPU_ITERATIONS} on the CPU; "
        "the reference attack runs 24,000)",
    )
    au.add_argument("--restarts", type=int, default=2, help="attack restarts from seeded noise (default 2)")
    au.add_argument("--images", type=int, default=1, help="images per attacked batch (default 1)")
    au.add_argument("--sites", type=int, default=3, help="sites taking part; secure aggregation sums over them")
    au.add_argument("--protections", default=",".join(PROTECTIONS), help="comma list of " + ", ".join(PROTECTIONS))
    au.add_argument("--clip", type=float, default=1.0, help="DP clipping bound C, privacy.clip (default 1)")
    au.add_argument(
        "--sigma", type=float, default=1.0, help="DP noise multiplier, privacy.noise_multiplier (default 1)"
    )
    au.add_argument("--tv", type=float, default=1e-4, help="weight of the total-variation prior (default 1e-4)")
    au.add_argument(
        "--no-unroll", action="store_true", help="attack a FedAvg update as one gradient instead of unrolling its steps"
    )
    au.add_argument("--layers", default="", help="match only parameters starting with these comma-separated prefixes")
    au.add_argument("--seed", type=int)
    au.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    device_argument(au)
    au.set_defaults(func=cmd_audit)
