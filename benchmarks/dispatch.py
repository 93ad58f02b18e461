"""Operators dispatched per round: every ATen call of a tiny vectorized run, counted by a TorchDispatchMode.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/dispatch.py --method fedsm --rounds 3

Writes the synthetic ``fundus`` federation (scale 0.05, 32²) and runs ``--method`` (vectorized, 2 local steps,
the tiny U-Net of benchmarks/digest.py) on the CPU with one thread, counting, per round, the operators that reach
the dispatcher in every thread of the process (the mode is entered in each thread started during the run).
Round 2 is the one to compare (round 1 includes building the sites, the last entry is the final evaluation).  Prints the counts per round and the
ten most frequent operators of round 1.
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class Count(TorchDispatchMode):
    """Counts every operator dispatched while it is active."""

    def __init__(self, per_round: list[collections.Counter[str]]) -> None:
        super().__init__()
        self.per_round = per_round  # counts go to the last entry: the round under way

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.per_round[-1][str(func)] += 1
        return func(*args, **(kwargs or {}))


def count_run(method: str, rounds: int, extra: list[str]) -> list[collections.Counter[str]]:
    from digest import SMALL

    from fedseg.data.synth import synthesize
    from fedseg.simulation.runner import run

    per_round: list[collections.Counter[str]] = [collections.Counter()]
    real_run = threading.Thread.run

    def counted_run(self: threading.Thread) -> None:
        with Count(per_round):
            real_run(self)

    with tempfile.TemporaryDirectory() as tmp:
        spec = synthesize("fundus", Path(tmp) / "fundus", seed=0, scale=0.05, size=32, progress=False)
        overrides = [*SMALL, f"rounds={rounds}", f"method={method}", "train.local_steps=2", "simulation.vectorize=on"]
        threading.Thread.run = counted_run  # type: ignore[method-assign]
        try:
            with Count(per_round):
                run(
                    spec,
                    out=None,
                    overrides=[*overrides, *extra],
                    progress=False,
                    log=lambda m: None,
                    on_round=lambda e: per_round.append(collections.Counter()),
                )
        finally:
            threading.Thread.run = real_run  # type: ignore[method-assign]
    return [c for c in per_round if c]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", default="fedsm")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], help="more overrides, e.g. fedsm.selector_training=fedavg")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rounds = count_run(args.method, args.rounds, args.set)
    for r, c in enumerate(rounds, 1):
        print(f"round {r}: {sum(c.values())} operators")
    for op, n in rounds[0].most_common(10):
        print(f"  {n:7d}  {op}")


if __name__ == "__main__":
    main()
