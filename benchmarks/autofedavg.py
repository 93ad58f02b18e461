"""Auto-FedAvg vs FedAvg on a synthetic federation: Table 2 layout, α trajectory (Fig. 3a), effect of t0 (Fig. 4).

Runs Local, FedAvg, FedAvg-even, FedProx (when registered) and the four Auto-FedAvg
variants (softmax/Dirichlet × network/layer) over several seeds, then Auto-FedAvg-N-Dirichlet
with t0 ∈ {1, 5, 10}.  The baselines run unchanged; for the Table 2 columns "local avg" /
"local gen" they also track the global model selected on each site's validation set (an
evaluation-only addition: training is bitwise the same).

    .venv/bin/python benchmarks/autofedavg.py --sites site6,site1,site5 --scale 0.1 --size 32 --rounds 20

Writes ``OUT/table2.md`` (the Markdown fragment), ``OUT/<label>/seed<k>/results.json`` and the
plots (``--plots``).  Runs already present in OUT are read instead of re-run.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from fedseg.algorithms import REGISTRY, known_sections
from fedseg.algorithms.autofedavg import site_selected_candidates
from fedseg.data.synth import synthesize
from fedseg.evaluation.plots import plot_alpha_trajectory, plot_interval_effect
from fedseg.evaluation.stats import table2
from fedseg.execution.federation import load_federation_data
from fedseg.execution.results import write_results
from fedseg.foundation.config import load_run_config
from fedseg.simulation.runner import simulate
from fedseg.site.workload import segmentation_workload

VARIANTS = {
    "Auto-FedAvg-L-Softmax": ["autofedavg.param=softmax", "autofedavg.granularity=layer"],
    "Auto-FedAvg-L-Dirichlet": ["autofedavg.param=dirichlet", "autofedavg.granularity=layer"],
    "Auto-FedAvg-N-Softmax": ["autofedavg.param=softmax", "autofedavg.granularity=network"],
    "Auto-FedAvg-N-Dirichlet": ["autofedavg.param=dirichlet", "autofedavg.granularity=network"],
}


def with_site_selection(cls):
    """The same method, also validating the global model on each single site (Table 2's best local models)."""

    class WithSiteSelection(cls):
        def candidates(self, state, ctx):
            out = super().candidates(state, ctx)
            return out + site_selected_candidates(out[0].arrays, ctx.sites)

    WithSiteSelection.__name__ = cls.__name__
    return WithSiteSelection


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="fundus", choices=["fundus", "prostate"])
    ap.add_argument(
        "--sites", default="site6,site1,site5", help="comma-separated subset of the preset's sites ('' = all six)"
    )
    ap.add_argument("--scale", type=float, default=0.1)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--interval", type=int, default=5, help="t0 of the Table 2 runs")
    ap.add_argument(
        "--intervals", type=int, nargs="*", default=[1, 5, 10], help="t0 values of the Fig. 4 sweep (N-Dirichlet)"
    )
    ap.add_argument("--channels", default="[8,16,32,64]")
    ap.add_argument(
        "--set", dest="overrides", action="append", default=[], help="extra config overrides, e.g. autofedavg.lr=0.05"
    )
    ap.add_argument("--out", default="runs/bench_autofedavg")
    ap.add_argument("--plots", default="docs/results", help="folder for the PNGs")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    out = Path(args.out)
    for name in ("fedavg", "fedavg-even", "fedprox"):
        if name in REGISTRY:
            REGISTRY[name] = with_site_selection(REGISTRY[name])

    spec = synthesize(args.preset, out / "data", seed=0, scale=args.scale, size=args.size)
    fed, data = load_federation_data(spec)
    if args.sites:
        data = {s: data[s] for s in args.sites.split(",")}
    base = [
        f"model.channels={args.channels}",
        f"model.strides=[{','.join(['2'] * (args.channels.count(',')))}]",
        "model.num_res_units=1",
        "train.batch_size=8",
        "checkpoint_every=1000",
        *args.overrides,
    ]
    plan: list[tuple[str, str, list[str]]] = [
        ("Local only", "local", []),
        ("FedAvg", "fedavg", []),
        ("FedAvg - even", "fedavg-even", []),
    ]
    if "fedprox" in REGISTRY:
        plan.append(("FedProx", "fedprox", []))
    plan += [(label, "autofedavg", [*ov, f"autofedavg.interval={args.interval}"]) for label, ov in VARIANTS.items()]
    sweep = [
        (f"N-Dirichlet t0={t}", "autofedavg", [*VARIANTS["Auto-FedAvg-N-Dirichlet"], f"autofedavg.interval={t}"])
        for t in args.intervals
        if t != args.interval
    ]

    runs: dict[str, list[dict]] = {}
    for label, method, ov in plan + sweep:
        for seed in args.seeds:
            folder = out / label.replace(" ", "_").replace("=", "") / f"seed{seed}"
            done = folder / "results.json"
            if done.is_file():
                res = json.loads(done.read_text())
            else:
                cfg = load_run_config(spec, base + ov, known_sections(), method=method, seed=seed, rounds=args.rounds)
                wl = segmentation_workload(
                    fed.spatial_dims, fed.in_channels, fed.labels, cfg.model, cfg.train, cfg.eval.threshold
                )
                t0 = time.perf_counter()
                res = simulate(cfg, wl, data, out=None, progress=False, log=lambda s: None)
                res["label"] = label
                write_results(res, folder)
                print(
                    f"{label:28s} seed {seed}: global test avg {res['client_avg_dice']:.4f}  ({time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )
            runs.setdefault(label, []).append(res)

    table = table2([r for label, _, _ in plan for r in runs[label]])
    t0_scores = {args.interval: [r["client_avg_dice"] for r in runs["Auto-FedAvg-N-Dirichlet"]]}
    for t in args.intervals:
        if t != args.interval:
            t0_scores[t] = [r["client_avg_dice"] for r in runs[f"N-Dirichlet t0={t}"]]
    fedavg_bytes = None
    lines = [
        "\n### Effect of the learning interval t0 (Auto-FedAvg-N-Dirichlet)\n",
        "| t0 | global test avg (%) | extra bytes / FedAvg bytes (measured) | (K−1)/(2 t0) |",
        "|---|---|---|---|",
    ]
    k = len(data)

    def total_bytes(res):
        return sum(b["sent"] + b["received"] for e in res["history"] for b in e["bytes"].values())

    fedavg_bytes = total_bytes(runs["FedAvg"][0])
    for t in sorted(t0_scores):
        label = "Auto-FedAvg-N-Dirichlet" if t == args.interval else f"N-Dirichlet t0={t}"
        r0 = runs[label][0]
        extra = total_bytes(r0) - fedavg_bytes
        models = sum(e["extra_bytes"]["models"] for e in r0["history"] if e.get("alpha_learned"))
        vals = [100 * v for v in t0_scores[t]]
        sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
        lines.append(
            f"| {t} | {statistics.mean(vals):.2f} ± {sd:.2f} | {extra / fedavg_bytes:.4f} (models only {models / fedavg_bytes:.4f}) | {(k - 1) / (2 * t):.4f} |"
        )
    t_table = "\n".join(lines) + "\n"

    plots = Path(args.plots)
    alpha_png = plot_alpha_trajectory(
        {label: runs[label][0] for label in VARIANTS},
        plots / "autofedavg_alpha.png",
        title=f"α per round, seed {args.seeds[0]}",
    )
    t0_png = plot_interval_effect(t0_scores, plots / "autofedavg_t0.png", title="Auto-FedAvg-N-Dirichlet")
    traj = runs["Auto-FedAvg-N-Dirichlet"][0]["history"]
    alpha_lines = [
        f"\n### α trajectory, Auto-FedAvg-N-Dirichlet, seed {args.seeds[0]} (learned rounds marked *)\n",
        "| round | " + " | ".join(data) + " |",
        "|---|" + "---|" * len(data),
    ]
    for e in traj:
        alpha_lines.append(
            f"| {e['round']}{'*' if e.get('alpha_learned') else ''} | "
            + " | ".join(f"{e['alpha'][s]:.4f}" for s in data)
            + " |"
        )
    wall = time.perf_counter() - t_start
    n = {s: len(d.train) for s, d in data.items()}
    header = (
        f"Preset {args.preset}, sites {list(data)} (train sizes {n}), scale {args.scale}, {args.size} px, "
        f"U-Net channels {args.channels}, {args.rounds} rounds, seeds {args.seeds}, Table 2 runs with t0 = {args.interval}, "
        f"overrides {base}. Machine: {platform.machine()} {torch.get_num_threads()} thread(s). Wall {wall:.0f} s.\n\n"
    )
    md = header + table + t_table + "\n".join(alpha_lines) + f"\n\nPlots: {alpha_png}, {t0_png}\n"
    (out / "table2.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
