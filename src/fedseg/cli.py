"""``fedseg <verb>``: thin wrappers over library functions (no logic here)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fedseg.errors import FedsegError


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def cmd_demo(a: argparse.Namespace) -> int:
    from fedseg.experiments import demo

    table = demo(out=a.out, rounds=a.rounds, scale=a.scale, size=a.size, seed=a.seed)
    print("\n" + table)
    print(f"results, resolved configs and checkpoints: {Path(a.out).resolve()}")
    return 0


def cmd_synth(a: argparse.Namespace) -> int:
    from fedseg.data.synth import synthesize

    spec = synthesize(a.preset, a.out, seed=a.seed, scale=a.scale, size=a.size, progress=True)
    print(f"wrote {spec}")
    return 0


def cmd_validate(a: argparse.Namespace) -> int:
    from fedseg.data.validate import validate_federation

    problems = validate_federation(a.spec)
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} problem(s) in {a.spec}; a run refuses to start until they are fixed")
        return 1
    print(f"{a.spec}: OK")
    return 0


def cmd_run(a: argparse.Namespace) -> int:
    from fedseg.runner import run

    if a.resume is None and a.config is None:
        raise FedsegError("give a run config or federation spec, or --resume OUT to continue a run")
    out = a.resume or a.out
    res = run(a.config, out=out, overrides=a.set, resume=a.resume is not None, method=a.method, rounds=a.rounds, seed=a.seed)
    print(Path(out, "results.md").read_text())
    print(f"results: {Path(out).resolve() / 'results.json'}")
    return 0 if res is not None else 1


def cmd_evaluate(a: argparse.Namespace) -> int:
    from fedseg.experiments import evaluate_run

    res = evaluate_run(a.run, federation=a.spec, split=a.split)
    print(res["table"])
    return 0


def cmd_compare(a: argparse.Namespace) -> int:
    from fedseg.experiments import compare

    _, table = compare(a.config, _csv(a.methods), a.out, seeds=[int(s) for s in _csv(a.seeds)], rounds=a.rounds, overrides=a.set)
    print("\n" + table)
    print(f"table: {Path(a.out).resolve() / 'comparison.md'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from fedseg.algorithms import REGISTRY

    p = argparse.ArgumentParser(prog="fedseg", description="Cross-silo federated learning of medical image segmentation.")
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")

    d = sub.add_parser("demo", help="synthesize a small federation, train local/centralized/FedAvg, print a Dice table")
    d.add_argument("--out", default="runs/demo", help="output folder (default: runs/demo)")
    d.add_argument("--rounds", type=int, default=40)
    d.add_argument("--scale", type=float, default=0.15, help="fraction of the paper's Table 1 case counts")
    d.add_argument("--size", type=int, default=64, help="image side in pixels")
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=cmd_demo)

    s = sub.add_parser("synth", help="write a synthetic multi-site federation (PNG + datalists + spec)")
    s.add_argument("--preset", choices=["fundus", "prostate"], required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--scale", type=float, default=1.0, help="fraction of the paper's per-site case counts")
    s.add_argument("--size", type=int, default=64)
    s.set_defaults(func=cmd_synth)

    v = sub.add_parser("validate", help="check a federation spec and every file it names")
    v.add_argument("spec")
    v.set_defaults(func=cmd_validate)

    r = sub.add_parser("run", help="train one method in simulation and test it on every site")
    r.add_argument("config", nargs="?", help="run config TOML or federation spec")
    r.add_argument("--method", choices=sorted(REGISTRY), help="method (default: the config's, else fedavg)")
    r.add_argument("--rounds", type=int)
    r.add_argument("--seed", type=int)
    r.add_argument("--out", default="runs/run", help="output folder (default: runs/run)")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. train.lr=1e-4 (repeatable)")
    r.add_argument("--resume", metavar="OUT", help="continue the interrupted run in OUT")
    r.set_defaults(func=cmd_run)

    e = sub.add_parser("evaluate", help="test a finished run's best models (optionally on another federation)")
    e.add_argument("run", help="output folder of a finished run")
    e.add_argument("--spec", help="federation spec to test on (default: the run's own)")
    e.add_argument("--split", default="testing", choices=["validation", "testing"])
    e.set_defaults(func=cmd_evaluate)

    c = sub.add_parser("compare", help="run several methods over seeds and print one table (mean ± sd)")
    c.add_argument("config", help="run config TOML or federation spec")
    c.add_argument("--methods", required=True, help="comma-separated, e.g. local,centralized,fedavg")
    c.add_argument("--seeds", default="0", help="comma-separated seeds (default: 0)")
    c.add_argument("--rounds", type=int)
    c.add_argument("--out", required=True)
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    c.set_defaults(func=cmd_compare)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except FedsegError as e:
        print(f"fedseg {args.verb}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted; continue a run with: fedseg run --resume OUT", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
