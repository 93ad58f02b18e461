"""The traffic of `make demo`'s FedAvg and FedSM runs: the demo's federation (synthetic fundus, 6 sites, 64², scale
0.15), its settings (``fedseg.apps.studies.compare.DEMO_OVERRIDES``: the half-width U-Net 8…128 with one residual
unit, batch 4, 1 local epoch a round) and FedSM's defaults (selector by gradient averaging: one selector gradient
each way per local step), run through ``fedseg.simulation.run`` for ``--rounds`` rounds.

Bytes are counted by the transport (``results.json["history"][i]["bytes"]``: sent + received by every site in a
training round; validation traffic, ``eval_bytes``, beside it).  They do not depend on the machine or on the weights,
only on the arrays exchanged and the steps a round takes, so a short run gives the demo's per-round figures; the
totals over the demo's 40 rounds are printed from the measured rounds (round 1 carries FedSM's initial selector once,
every later training round the same bytes; validation every 2 rounds).

    .venv/bin/python benchmarks/demo_traffic.py --rounds 4 --md runs/demo-traffic/traffic.md
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch
from _report import emit, md_table

from fedseg.apps.studies.compare import DEMO_OVERRIDES
from fedseg.data.synth import synthesize
from fedseg.simulation.runner import run


def totals(history: list[dict], key: str) -> list[int]:
    """Per round: bytes sent + received by all sites under ``key`` (``bytes`` or ``eval_bytes``; 0 when absent)."""
    return [sum(v["sent"] + v["received"] for v in (e.get(key) or {}).values()) for e in history]


def projected(per_round: list[int], rounds: int) -> int:
    """Total over ``rounds`` from measured rounds: round 1 as measured, every later round as the last measured one
    (training traffic is the same every round after the first)."""
    return per_round[0] + per_round[-1] * (rounds - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/demo-traffic")
    ap.add_argument("--md", default=None, help="write the Markdown fragment here")
    ap.add_argument("--rounds", type=int, default=4, help="rounds measured (the demo runs 40)")
    ap.add_argument("--demo-rounds", type=int, default=40, help="rounds the totals are projected to")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more setting for both runs after the demo's (e.g. fedsm.selector_width=0.125); repeatable",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    out = Path(args.out)
    spec = synthesize("fundus", out / "data", seed=0, scale=0.15, size=64)
    rows, summary = [], {}
    for method in ("fedavg", "fedsm"):
        res = run(
            spec,
            out=out / method,
            overrides=[*DEMO_OVERRIDES, f"checkpoint_every={args.rounds}", "device=cpu", *args.set],
            progress=False,
            log=lambda m: None,
            method=method,
            rounds=args.rounds,
        )
        assert res is not None
        train, evals = totals(res["history"], "bytes"), totals(res["history"], "eval_bytes")
        summary[method] = {"train_bytes": train, "eval_bytes": evals}
    fa, fs = summary["fedavg"]["train_bytes"], summary["fedsm"]["train_bytes"]
    for method in ("fedavg", "fedsm"):
        train, evals = summary[method]["train_bytes"], summary[method]["eval_bytes"]
        total = projected(train, args.demo_rounds)
        summary[method]["projected_train_bytes"] = total
        rows.append(
            [
                method,
                f"{train[0] / 1e6:.1f} MB",
                f"{train[-1] / 1e6:.1f} MB",
                f"{max(evals) / 1e6:.2f} MB",
                f"{sum(train) / 1e6:.1f} MB",
                f"{total / 1e6:.0f} MB",
            ]
        )
    ratio_last = fs[-1] / fa[-1]
    ratio_total = summary["fedsm"]["projected_train_bytes"] / summary["fedavg"]["projected_train_bytes"]
    summary["ratio"] = {"per_round": ratio_last, "projected": ratio_total}
    header = [
        "method",
        "round 1 (all sites)",
        f"round {args.rounds} (all sites)",
        "validation round",
        f"{args.rounds} rounds measured",
        f"{args.demo_rounds} rounds",
    ]
    md = [
        f"Command: `.venv/bin/python benchmarks/demo_traffic.py {' '.join(sys.argv[1:])}`\n",
        f"Machine: {platform.machine()} CPU, {torch.get_num_threads()} torch thread(s), shared 2-core host; "
        f"wall {time.perf_counter() - t0:.0f} s.\n",
        "Training traffic (sent + received, all 6 sites) of the demo's runs; FedSM / FedAvg per training round "
        f"after the first: {ratio_last:.2f}×, over {args.demo_rounds} rounds: {ratio_total:.2f}×.\n",
        *md_table(header, rows),
    ]
    emit(md, args.md, out, {"args": vars(args), **summary})


if __name__ == "__main__":
    main()
