"""What a FedSM round costs against a FedAvg round on the demo's federation: time, operators, bytes, in one run.

The federation `fedseg demo` builds (synthetic fundus, 6 sites, 64², scale 0.15) and its settings
(``fedseg.apps.studies.compare.DEMO_OVERRIDES``: the half-width U-Net 8…128 with one residual unit, batch 4,
validation every 2 rounds), FedAvg and FedSM each with its defaults, on the CPU with one thread.  Per method:

* **time**: the median wall time of rounds 2–N of a ``--rounds`` run (round 1 builds the models and optimizers;
  every second round validates, as in the demo), from the engine's ``time_s`` per round; with ``--repeat R`` the
  median over R runs of each, FedAvg's and FedSM's in turn (a machine shared with other work loads both alike);
* **operators** per round by role and phase (the ATen operators torch dispatches, views apart: what stands for
  GPU kernel launches, ``benchmarks/_operators.py``), from a second run of 3 rounds, each validating, counted over
  rounds 2–3;
* **bytes** per site and round, sent + received, counted by the transport (``results.json``'s ``bytes`` and
  ``eval_bytes``, as ``benchmarks/demo_traffic.py`` counts them): a training round after the first, and a
  validation.

Then the ratios FedSM / FedAvg.  ``--small`` runs a smaller federation (32², scale 0.05, 4 rounds) to check the
script in well under a minute.

    .venv/bin/python benchmarks/fedsm_cost.py --rounds 8 --md runs/fedsm-cost.md   # a few minutes on a 2-core CPU
    .venv/bin/python benchmarks/fedsm_cost.py --small
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _operators import OperatorCounter, total
from _operators import table as operator_table
from _report import emit, md_table

from fedseg.algorithms import known_sections
from fedseg.apps.studies.compare import DEMO_OVERRIDES
from fedseg.data.synth import synthesize
from fedseg.foundation.config import load_run_config
from fedseg.simulation.runner import build_engine, load_federation_data
from fedseg.site.workload import workload_for

METHODS = ("fedavg", "fedsm")


def per_site(entry: dict, key: str) -> float | None:
    """Mean over the sites of the bytes sent + received under ``key`` of one history entry (None when absent)."""
    b = entry.get(key)
    if not b:
        return None
    return sum(v["sent"] + v["received"] for v in b.values()) / len(b)


def one_run(spec: Path, fed, data, method: str, rounds: int, out: Path, extra: list[str], counter=None) -> list[dict]:
    """Run ``method`` for ``rounds`` rounds with the demo's settings; the engine's history."""
    overrides = [*DEMO_OVERRIDES, "device=cpu", f"checkpoint_every={rounds}", *extra]
    cfg = load_run_config(spec, overrides, known_sections(), method=method, rounds=rounds)
    engine = build_engine(cfg, workload_for(fed, cfg), data, out=out, progress=False, log=lambda m: None)
    if counter is not None:
        with counter.attach(engine):
            engine.run()
    else:
        engine.run()
    return engine.history


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8, help="rounds of the timed runs (the median is of rounds 2–N)")
    ap.add_argument("--repeat", type=int, default=1, help="timed runs per method, the methods in turn")
    ap.add_argument("--small", action="store_true", help="32², scale 0.05, 4 rounds: a check of the script")
    ap.add_argument("--vectorize", default="off", help="simulation.vectorize of every run (the demo's CPU: off)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--md", default=None, help="write the Markdown fragment here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    size, scale = (32, 0.05) if args.small else (64, 0.15)
    rounds = min(args.rounds, 4) if args.small else args.rounds
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="fedseg-fedsm-cost-"))
    t0 = time.perf_counter()
    spec = synthesize("fundus", out / "data", seed=0, scale=scale, size=size, progress=False)
    fed, data = load_federation_data(spec, progress=False)
    extra = [f"simulation.vectorize={args.vectorize}"]
    hists: dict[str, list[list[dict]]] = {m: [] for m in METHODS}
    for r in range(args.repeat):  # the methods in turn, so that a load on the machine weighs on both alike
        for method in METHODS:
            hists[method].append(one_run(spec, fed, data, method, rounds, out / f"{method}-{r}", extra))
    res: dict[str, dict] = {}
    for method in METHODS:
        hist = hists[method][-1]
        times = [e["time_s"] for h in hists[method] for e in h[1:]]
        train = [b for e in hist[1:] if (b := per_site(e, "bytes")) is not None]
        evals = [b for e in hist if (b := per_site(e, "eval_bytes")) is not None]
        counter = OperatorCounter()
        one_run(spec, fed, data, method, 3, out / f"{method}-ops", [*extra, "eval.every=1"], counter)
        ops = counter.per_round()
        res[method] = {
            "median_round_s": statistics.median(times),
            "round_s": [[e["time_s"] for e in h] for h in hists[method]],
            "train_bytes_per_site": train[-1] if train else None,
            "eval_bytes_per_site": max(evals) if evals else None,
            "operators": ops,
            "operators_per_round": total(ops),
            "operators_by_phase": {p: sum(by[p] for by in ops.values()) for p in ("training", "validation")},
        }
    fa, fs = res["fedavg"], res["fedsm"]

    def ratio(key: str) -> float | None:
        a, b = fa[key], fs[key]
        return b / a if a and b is not None else None

    ratios = {k: ratio(k) for k in ("median_round_s", "operators_per_round", "train_bytes_per_site")}
    rows = []
    for label, key, fmt in (
        (f"median round, rounds 2–{rounds} of {args.repeat} run(s) (s)", "median_round_s", "{:.3f}"),
        ("operators per round (3-round run, each validating)", "operators_per_round", "{:,.0f}"),
        ("bytes per site, training round after the first", "train_bytes_per_site", "{:,.0f}"),
        ("bytes per site, validation", "eval_bytes_per_site", "{:,.0f}"),
    ):
        r = ratio(key)
        rows.append([label, fmt.format(fa[key]), fmt.format(fs[key]), "–" if r is None else f"{r:.2f}×"])
    for phase in ("training", "validation"):
        a, b = fa["operators_by_phase"][phase], fs["operators_by_phase"][phase]
        rows.append([f"operators per round, {phase}", f"{a:,.0f}", f"{b:,.0f}", f"{b / a:.2f}×" if a else "–"])
    md = [
        f"Command: `.venv/bin/python benchmarks/fedsm_cost.py {' '.join(sys.argv[1:])}`\n",
        f"Machine: {platform.machine()} CPU, torch {torch.__version__}, 1 torch thread; wall "
        f"{time.perf_counter() - t0:.0f} s.  Federation: synthetic fundus, 6 sites, {size}², scale {scale}; the demo's "
        f"settings, simulation.vectorize={args.vectorize}.\n",
        *md_table(["measure", "FedAvg", "FedSM", "FedSM / FedAvg"], rows),
        "",
    ]
    for method in METHODS:
        md += [
            f"Operators per round by role and phase, {method} (rounds 2–3):",
            "",
            *operator_table(res[method]["operators"]),
            "",
        ]
    emit(md, args.md, out, {"args": vars(args), "size": size, "scale": scale, "ratios": ratios, **res})


if __name__ == "__main__":
    main()
