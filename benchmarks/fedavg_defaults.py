"""FedAvg on the demo's federation: the papers' FedAvg, the variants that explain why it falls below local training
on the small sites whose style differs, and FedAvg's defaults (sample weights, the step-normalized average), with
local training beside them, over seeds.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fedavg_defaults.py --seeds 0,1,2 --md runs/bench-fedavg/table.md

Every run is the demo's (``fedseg demo``: the fundus preset at scale 0.15 and 64², 6 sites, the demo's U-Net and
settings, learning rate 1e-2, 40 rounds) on the federation that ``fedseg demo --seed S`` synthesizes, with one
change per variant.  Runs are kept in ``OUT/fundus<seed>/<variant>/<method>/seed<seed>`` and reused when the
same command runs again (``--table`` only reads the finished runs).  A variant runs on the seeds of ``--seeds``
when its name is in ``--variants`` (default: all); the table shows what has finished.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from _report import emit, md_table

from fedseg.apps.studies.compare import DEMO_OVERRIDES, compare
from fedseg.apps.studies.jobs import StudyOptions
from fedseg.data.synth import synthesize

PAPERS = ["fedavg.weighting=samples", "fedavg.normalize=none"]
STEPS6 = ["train.local_steps=6", "train.local_epochs=none"]

#: variant folder → (method, settings after the demo's, what it is)
VARIANTS: dict[str, tuple[str, list[str], str]] = {
    "local": ("local", [], "local training (each site's own model on its own site)"),
    "base": ("fedavg", PAPERS, "the papers' FedAvg: p_k = n_k / n, plain average (the demo before)"),
    "reset": ("fedavg", [*PAPERS, "train.reset_optimizer=true"], "papers' FedAvg, fresh Adam state every round"),
    "lr3e-3": ("fedavg", [*PAPERS, "train.lr=3e-3"], "papers' FedAvg at lr 3e-3"),
    "steps6": ("fedavg", [*PAPERS, *STEPS6], "papers' FedAvg, 6 local steps at every site"),
    "evensteps6": (
        "fedavg",
        ["fedavg.weighting=even", "fedavg.normalize=none", *STEPS6],
        "even weights, 6 steps at every site",
    ),
    "evensteps": (
        "fedavg",
        ["fedavg.weighting=even", "fedavg.normalize=steps"],
        "p_k = 1/K, step-normalized average (FedNova with even weights)",
    ),
    ".": ("fedavg", [], "FedAvg's defaults: p_k = n_k / n, step-normalized average (FedNova)"),
}


def run_dir(out: Path, seed: int, variant: str) -> Path:
    root = out / f"fundus{seed}"
    return root if variant in (".", "local") else root / variant  # the demo's layout: OUT/<method>/seed<k>


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/bench-fedavg")
    p.add_argument("--md")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--table", action="store_true", help="only tabulate the finished runs")
    a = p.parse_args()
    torch.set_num_threads(1)
    out = Path(a.out)
    seeds = [int(s) for s in a.seeds.split(",")]
    t0 = time.perf_counter()
    if not a.table:
        for seed in seeds:
            data = out / f"fundus{seed}" / "data"
            spec = data / "federation.toml"
            if not spec.exists():
                spec = synthesize("fundus", data, seed=seed, scale=0.15, size=64, progress=False)
            for v in a.variants.split(","):
                method, settings, _ = VARIANTS[v]
                compare(
                    spec,
                    [method],
                    run_dir(out, seed, v),
                    StudyOptions(
                        seeds=(seed,),
                        rounds=a.rounds,
                        overrides=(*DEMO_OVERRIDES, "device=cpu", *settings),
                        progress=False,
                        log=lambda m: None,
                    ),
                )
    rows, summary = [], {}
    for v, (method, settings, what) in VARIANTS.items():
        for seed in seeds:
            f = run_dir(out, seed, v) / method / f"seed{seed}" / "results.json"
            if not f.exists():
                continue
            r = json.loads(f.read_text())
            sites = r["per_site_dice"]
            rows.append(
                [
                    what,
                    " ".join(settings) or "(defaults)",
                    str(seed),
                    *(f"{sites[s]:.4f}" for s in sorted(sites)),
                    f"**{r['client_avg_dice']:.4f}**",
                    f"{r.get('wall_time_s', 0):.0f}",
                ]
            )
            summary[f"{v}/seed{seed}"] = {"per_site": sites, "client_avg_dice": r["client_avg_dice"]}
    header = ["Run", "Settings after the demo's", "Seed", *(f"site{k}" for k in range(1, 7)), "Client Avg Dice", "s"]
    md = [
        f"**Command:** `OMP_NUM_THREADS=1 python benchmarks/fedavg_defaults.py --seeds {a.seeds} --rounds {a.rounds}`",
        "",
        f"**Machine:** {platform.machine()} CPU, torch {torch.__version__}, 1 torch thread, one run at a time "
        f"({time.perf_counter() - t0:.0f} s this call; the last column is each run's own time).",
        "",
        *md_table(header, rows),
        "",
    ]
    emit(md, a.md, out, summary)


if __name__ == "__main__":
    main()
