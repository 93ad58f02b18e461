"""One table comparing FedSM runs that differ in how the selector is trained or in its size, from the
``results.json`` that ``benchmarks/fedsm.py`` wrote (nothing is trained here).

    .venv/bin/python benchmarks/fedsm_selectors.py runs/bench16rs/fga runs/bench16rs/fedavg \
        --preset fundus --baseline runs/bench16rs/fga --md runs/bench16rs/selectors.md

Per preset (``--preset``, comma-separated), run folder and seed: the selector training and its settings
(from the run's resolved ``[fedsm]`` config), the selector's width and parameter count, FedSM's
client-average test Dice, FedAvg's (``--baseline``), the mean over sites of the test routing accuracy
(``results["fedsm"]``), the first round whose validation routing accuracy (mean over sites, from the
history) reached 0.9, the last one, and the mean bytes per site and training round; then per preset and
run folder the mean over the seeds (the first round ≥ 0.9 as the seeds' rounds, "never" where one did not).

The selector-size study (fundus and prostate, three seeds, the selector of the default profile at two
widths; docs/results/fedsm-selector.md, "Selector size")::

    ARGS="--presets fundus,prostate --rounds 40 --eval-every 10 --seeds 0,1,2"
    .venv/bin/python benchmarks/fedsm.py $ARGS --methods fedsm,fedavg --selector-width 0.125 --out runs/selw/w0.125
    .venv/bin/python benchmarks/fedsm.py $ARGS --methods fedsm --selector-width 0.03125 --out runs/selw/w0.03125
    .venv/bin/python benchmarks/fedsm_selectors.py runs/selw/w0.125 runs/selw/w0.03125 --preset fundus,prostate \
        --baseline runs/selw/w0.125 --md runs/selw/selectors.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from _report import emit, md_table


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _bytes(res: dict) -> float:
    per = [
        sum(b["sent"] + b["received"] for b in e["bytes"].values()) / len(e["bytes"])
        for e in res["history"]
        if e.get("bytes")
    ]
    return _mean(per)


IN_CHANNELS = {"fundus": 3, "prostate": 1}
"""Image channels of the synthetic presets (2D)."""


def selector_params(res: dict, preset: str) -> int:
    """Parameters of the run's selector (the 2D VGG-11 layout at the run's resolved width and hidden units)."""
    from fedseg.models import Selector

    c = res["config"]["fedsm"]
    sites = len(res["fedsm"]["per_site"])
    sel = Selector(2, IN_CHANNELS.get(preset, 1), sites, width=c["selector_width"], hidden=c["selector_hidden"])
    return sum(p.numel() for p in sel.parameters())


def first_routing(res: dict, level: float = 0.9) -> int | None:
    """The first round after which the mean validation routing accuracy reached ``level`` (None: never)."""
    val = [(e["round"] - 1, _mean(list(e["routing_acc"].values()))) for e in res["history"] if e.get("routing_acc")]
    return next((r for r, a in val if a >= level), None)


def row(res: dict, fedavg: dict | None, preset: str) -> list[str]:
    c = res["config"]["fedsm"]
    training = c["selector_training"]
    if training == "fedrs":
        training += f" (α {c['fedrs_alpha']:g})"
    elif training == "fedaws":
        training += f" (ν {c['fedaws_nu']:g}, η {c['fedaws_lr']:g}, m {c['fedaws_margin']:g})"
    test_routing = _mean([v["routing_acc"] for v in res["fedsm"]["per_site"].values() if v["routing_acc"] is not None])
    val = [(e["round"] - 1, _mean(list(e["routing_acc"].values()))) for e in res["history"] if e.get("routing_acc")]
    first = first_routing(res)
    cells = [
        training,
        str(c["selector_steps"]),
        f"{c['selector_width']:g}",
        f"{selector_params(res, preset) / 1e3:.1f} k",
        str(res["seed"]),
        f"{res['client_avg_dice']:.4f}",
        f"{fedavg['client_avg_dice']:.4f}" if fedavg else "—",
        f"{test_routing:.2f}",
        "never" if first is None else str(first),
        f"{val[-1][1]:.2f} (round {val[-1][0]})" if val else "—",
        f"{_bytes(res) / 1e3:.0f} kB" + (f" = {_bytes(res) / _bytes(fedavg):.2f}×" if fedavg else ""),
    ]
    return cells


def summary(rows: list[tuple[str, str, dict, dict | None]]) -> list[list[str]]:
    """Per preset and run folder, the mean over its seeds: FedSM's Dice (± the seeds' spread, max − min), FedAvg's,
    the test routing, the seeds' first rounds of validation routing ≥ 0.9 and the bytes per site and round."""
    out = []
    groups: dict[tuple[str, str], list[tuple[dict, dict | None]]] = {}
    for preset, folder, res, fedavg in rows:
        groups.setdefault((preset, folder), []).append((res, fedavg))
    for (preset, _folder), runs in groups.items():
        dice = [r["client_avg_dice"] for r, _ in runs]
        base = [f["client_avg_dice"] for _, f in runs if f]
        routing = [
            _mean([v["routing_acc"] for v in r["fedsm"]["per_site"].values() if v["routing_acc"] is not None])
            for r, _ in runs
        ]
        firsts = [first_routing(r) for r, _ in runs]
        c = runs[0][0]["config"]["fedsm"]
        fedavg_bytes = [_bytes(f) for _, f in runs if f]
        b = _mean([_bytes(r) for r, _ in runs])
        out.append(
            [
                preset,
                f"{c['selector_training']}, {c['selector_steps']} steps",
                f"{c['selector_width']:g} ({selector_params(runs[0][0], preset) / 1e3:.1f} k)",
                str(len(runs)),
                f"{_mean(dice):.4f} ± {max(dice) - min(dice):.4f}",
                f"{_mean(base):.4f}" if base else "—",
                f"{_mean(routing):.2f}",
                ", ".join("never" if f is None else str(f) for f in firsts),
                f"{b / 1e3:.0f} kB" + (f" = {b / _mean(fedavg_bytes):.2f}×" if fedavg_bytes else ""),
            ]
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="--out folders of benchmarks/fedsm.py")
    ap.add_argument("--preset", default="fundus", help="preset(s), comma-separated")
    ap.add_argument("--baseline", default=None, help="--out folder holding the FedAvg runs")
    ap.add_argument("--md", default=None)
    args = ap.parse_args()
    rows, found = [], []
    for preset in args.preset.split(","):
        for folder in args.runs:
            for path in sorted((Path(folder) / preset / "fedsm").glob("seed*/results.json")):
                res = json.loads(path.read_text())
                fedavg = None
                if args.baseline:
                    p = Path(args.baseline) / preset / "fedavg" / path.parent.name / "results.json"
                    fedavg = json.loads(p.read_text()) if p.is_file() else None
                rows.append([preset, *row(res, fedavg, preset)])
                found.append((preset, folder, res, fedavg))
    header = [
        "preset",
        "selector training",
        "selector steps / round",
        "selector width",
        "selector params",
        "seed",
        "FedSM client-avg Dice",
        "FedAvg",
        "test routing acc (mean over sites)",
        "first round val routing ≥ 0.9",
        "val routing, last",
        "bytes / site / round",
    ]
    mean_header = [
        "preset",
        "selector training",
        "selector width (params)",
        "seeds",
        "FedSM client-avg Dice (mean ± max − min)",
        "FedAvg",
        "test routing acc",
        "first round val routing ≥ 0.9, per seed",
        "bytes / site / round",
    ]
    md = [
        f"Command: `.venv/bin/python benchmarks/fedsm_selectors.py {' '.join(sys.argv[1:])}`\n",
        *md_table(header, rows),
        "\nMean over the seeds:\n",
        *md_table(mean_header, summary(found)),
    ]
    emit(md, args.md, Path(args.runs[0]), {"args": vars(args)})


if __name__ == "__main__":
    main()
