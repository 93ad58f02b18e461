"""Tuning study behind the training defaults: local training, centralized training, FedAvg and FedSM on the
synthetic fundus and prostate presets at two data sizes each, every method's learning rate (and any further
axis, e.g. FedAvg's weighting) chosen on validation over seeds with ``fedseg compare --tune``.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/tuning.py --md runs/bench-tuning/tuning.md

For every federation (``--federations preset:scale,…``, synthesized once with seed 0) each method entry trains
every grid point with every seed; the table lists, per federation, method and point, the validation score the
runs select their best round by and the test Client Avg Dice (mean ± sd over the seeds), and marks the point
that validation chooses (the highest mean validation score; test numbers never enter the choice).  Local work
is the defaults' (one epoch a round over each site's cases, so sites of different sizes take different numbers
of steps) unless ``--steps``.  Sized for a shared 2-core CPU with one torch thread: a small U-Net at 32², few
rounds; the FedSM paper tunes at 256² over 150 rounds and reports 3 seeds.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from _report import emit, md_table

from fedseg.apps.studies.compare import compare, split_method_entries
from fedseg.apps.studies.jobs import StudyOptions
from fedseg.data.synth import synthesize


def _ms(xs: list[float]) -> str:
    if not xs:
        return "–"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.fmean(xs):.4f} ± {sd:.4f}"


def study_rows(out: Path, label: str, n_train: int) -> list[list[str]]:
    """Rows of one federation's study from its ``tuning.json`` and the runs' ``results.json``."""
    record = json.loads((out / "tuning.json").read_text())
    rows = []
    for m in record["methods"]:
        for i, p in enumerate(m["points"]):
            test = [json.loads((out / f / "results.json").read_text())["client_avg_dice"] for f in p["folders"]]
            rows.append(
                [
                    label,
                    str(n_train),
                    m["entry"],
                    p["text"] or "(defaults)",
                    _ms([float(v) for v in p["validation"]]),
                    _ms(test),
                    "✓" if i == m["chosen"] else "",
                ]
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/bench-tuning")
    p.add_argument("--md")
    p.add_argument(
        "--federations",
        default="fundus:0.1,fundus:0.2,prostate:0.04,prostate:0.08",
        help="preset:scale of every federation studied (scale: fraction of the paper's case counts)",
    )
    p.add_argument(
        "--methods",
        default="local,centralized,fedavg,fedsm",
        help="method entries as compare --methods (fedavg:weighting=samples,normalize=none: the papers' FedAvg)",
    )
    p.add_argument("--lrs", default="1e-3,3e-3,1e-2")
    p.add_argument(
        "--tune",
        action="append",
        default=[],
        help="a further grid axis, as compare --tune (e.g. fedavg:weighting=samples,even)",
    )
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--steps", type=int, default=0, help="local steps per round (0: one epoch a round, the default)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--channels", default="8,16,32")
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--jobs", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(1)
    out = Path(a.out)
    channels = [int(c) for c in a.channels.split(",")]
    local = ["train.local_steps=" + str(a.steps), "train.local_epochs=none"] if a.steps else []
    overrides = [
        *local,
        f"train.batch_size={a.batch}",
        f"model.channels={channels}",
        f"model.strides={[2] * (len(channels) - 1)}",
        "model.num_res_units=1",
        f"eval.every={a.eval_every}",
        f"checkpoint_every={a.rounds}",
        "device=cpu",
    ]
    seeds = tuple(int(s) for s in a.seeds.split(","))
    rows: list[list[str]] = []
    walls = {}
    t0 = time.perf_counter()
    for fed in a.federations.split(","):
        preset, _, scale = fed.partition(":")
        where = out / f"{preset}-{scale}"
        spec = synthesize(preset, where / "data", seed=0, scale=float(scale), size=a.size, progress=False)
        t1 = time.perf_counter()
        compare(
            spec,
            split_method_entries(a.methods),
            where / "tuned",
            StudyOptions(
                seeds=seeds,
                rounds=a.rounds,
                overrides=tuple(overrides),
                jobs=a.jobs,
                progress=False,
                log=lambda m: None,
            ),
            tune=[f"train.lr={a.lrs}", *a.tune],
        )
        walls[fed] = time.perf_counter() - t1
        n_train = _train_cases(Path(spec))
        rows += study_rows(where / "tuned", f"{preset} (scale {scale})", n_train)
    wall = time.perf_counter() - t0
    tune_args = "".join(f" --tune {t}" for t in a.tune)
    md = [
        f"**Command:** `OMP_NUM_THREADS=1 python benchmarks/tuning.py --federations {a.federations} "
        f"--methods '{a.methods}' --lrs {a.lrs}{tune_args} --seeds {a.seeds} --rounds {a.rounds} --steps {a.steps} "
        f"--batch {a.batch} --size {a.size} --channels {a.channels} --eval-every {a.eval_every} --jobs {a.jobs}`",
        "",
        f"**Machine:** {platform.machine()} CPU, torch {torch.__version__}, 1 torch thread per run, {a.jobs} "
        f"process(es); {wall:.0f} s in all (" + ", ".join(f"{k} {v:.0f} s" for k, v in walls.items()) + ").",
        "",
        *md_table(
            [
                "Federation",
                "Training cases",
                "Method",
                "Setting",
                "Validation score",
                "Test Client Avg Dice",
                "Chosen on validation",
            ],
            rows,
        ),
        "",
    ]
    emit(md, a.md, out, {"wall_s": wall, "walls": walls, "rows": rows})


def _train_cases(spec: Path) -> int:
    """Training cases of a synthesized federation (the sites' data lists)."""
    return sum(len(json.loads(d.read_text())["training"]) for d in spec.parent.glob("*/datalist.json"))


if __name__ == "__main__":
    main()
