"""Several runs at once: method comparisons over seeds, the demo, re-evaluation of a finished run."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fedseg.algorithms import REGISTRY, known_sections
from fedseg.apps.report import ReportOptions, build_report
from fedseg.apps.report.tuning import tuning_markdown
from fedseg.apps.studies.grid import parse_grid
from fedseg.apps.studies.grid import tune as run_grid
from fedseg.apps.studies.jobs import StudyOptions
from fedseg.apps.tracking import tracker_for
from fedseg.data.synth import synthesize
from fedseg.evaluation.summary import row_from_cases
from fedseg.evaluation.tables import table3
from fedseg.execution.federation import load_federation_data
from fedseg.foundation.config import load_run_config
from fedseg.foundation.errors import ConfigError
from fedseg.seams.checkpoint import load_best
from fedseg.simulation.runner import build_engine
from fedseg.site.workload import workload_for

__all__ = [
    "DEMO_LR",
    "DEMO_METHODS",
    "DEMO_OVERRIDES",
    "compare",
    "demo",
    "evaluate_run",
    "parse_method_entry",
    "split_method_entries",
]

DEMO_METHODS = ("local", "centralized", "fedavg", "fedsm")
"""The demo's methods; FedSM runs with its defaults (one γ per personalized model chosen on validation, selector
trained by gradient averaging on flipped batches)."""

DEMO_LR = "1e-2"
"""The demo's ``train.lr`` for every method: the best of the tuning grid 1e-3, 3e-3, 1e-2 for FedAvg and FedSM at
a short budget (docs/results/lr-tuning.md); the default ``train.lr`` stays 1e-3 (the papers')."""

DEMO_OVERRIDES = (
    f"train.lr={DEMO_LR}",
    "train.batch_size=4",
    "eval.every=2",
    "checkpoint_every=10",
    "model.channels=[8,16,32,64,128]",
    "model.num_res_units=1",
)
"""The demo's settings over the defaults: the learning rate :data:`DEMO_LR`, a U-Net of the default's depth at half its width with one residual unit,
batch 4, validation every 2 rounds (``benchmarks/demo_traffic.py`` measures the demo's traffic with them)."""


def split_method_entries(text: str) -> list[str]:
    """Split ``"local,fedsm:personalization=ft,lam=0.5,fedavg"`` into method entries.

    Comma-separated; a ``key=value`` token without ``:`` continues the previous entry.
    """
    entries: list[str] = []
    for token in (t.strip() for t in text.split(",")):
        if not token:
            continue
        if "=" in token and ":" not in token and entries:
            entries[-1] += "," + token
        else:
            entries.append(token)
    return entries


def parse_method_entry(entry: str) -> tuple[str, list[str], str]:
    """``"fedsm:personalization=ft,lam=0.5"`` → (method, overrides in the method's section, label).

    A dotted key is any setting (``fedavg:train.lr=1e-3`` → ``train.lr=1e-3``).

    A plain name (``"fedavg"``) has no overrides and is its own label.  The section is
    the method's config section (``fedsm-extra`` uses ``[fedsm]``).
    """
    method, _, settings = entry.partition(":")
    method = method.strip()
    cls = REGISTRY.get(method)
    if cls is None:
        raise ConfigError(f"unknown method {method!r} in {entry!r}; known methods: {', '.join(sorted(REGISTRY))}")
    pairs = [p.strip() for p in settings.split(",") if p.strip()]
    bad = [p for p in pairs if "=" not in p]
    if bad:
        raise ConfigError(f"{entry!r}: settings must be key=value (e.g. fedsm:personalization=ft), got {bad}")
    overrides = [p if "." in p.partition("=")[0] else f"{cls.section}.{p}" for p in pairs]
    label = f"{method} ({', '.join(pairs)})" if pairs else method
    return method, overrides, label


def compare(
    config: str | Path,
    methods: Sequence[str],
    out: str | Path,
    options: StudyOptions | None = None,
    tune: Sequence[str] = (),
) -> tuple[list[dict[str, Any]], str]:
    """Run every method with every seed into ``out/<entry>/seed<k>`` and tabulate them.

    An entry is a method name, optionally with settings of its own section
    (``fedsm:personalization=ft``) or any dotted setting (``fedavg:train.lr=1e-3``), so variants of one
    method get their own rows (e.g. the FedSM paper's Table 6).  Runs whose ``results.json`` already exists
    are read instead of re-run and a checkpointed run is resumed, so an interrupted comparison continues where
    it stopped.

    ``tune``: grid axes (``"train.lr=3e-4,1e-3,3e-3"``; ``"fedsm:lam=0.3,0.5"`` for one method's entries;
    several make a grid): every point of every entry is trained over the seeds into
    ``out/<entry>/<point>/seed<k>``, judged on validation by the score its runs select their best round by,
    and the point with the highest mean over the seeds is the entry's row (its test Dice, mean ± sd over the
    seeds); test numbers never enter the choice (:mod:`fedseg.apps.studies.grid`).  The table is followed by
    each point's validation score and the choice, also in ``out/tuning.json``.

    ``options`` (:class:`~fedseg.apps.studies.jobs.StudyOptions`, default: its defaults): the seeds, rounds and overrides of every run;
    ``jobs`` > 1 runs the independent runs in that many processes with one torch thread each, ``devices`` one
    process per device (neither: one per CUDA device where there are several, else one after another);
    ``launch`` one Ray task or Slurm array task per run (:mod:`fedseg.apps.studies.launchers`).
    ``track`` (``"mlflow"``, or the config's ``[tracking]`` section): every run an
    MLflow run, nested under one parent run that holds the table, the tuning record and the HTML report
    (``out/report.html``, without the model sections; :mod:`fedseg.apps.tracking`).  Writes ``out/comparison.md`` (Table 3 layout, mean ± sd over seeds) and
    ``out/comparison.json``; returns the reported runs' results and the table.
    """
    out = Path(out)
    options = options or StudyOptions()
    seeds, progress, log = options.seeds, options.progress, options.log
    parsed = [parse_method_entry(m) for m in methods]
    axes = [parse_grid(t) for t in tune]
    missing = sorted({m for m, _, _ in axes if m is not None} - {p[0] for p in parsed})
    if missing:
        raise ConfigError(f"--tune names {missing}, which --methods does not run; add them or drop that --tune")
    tracker = tracker_for(options.track, out, config, options.overrides, options.track_uri)
    parent = (
        tracker.parent(
            out,
            "compare",
            {"config": str(config), "methods": list(methods), "seeds": list(seeds), "tune": list(tune)},
        )
        if tracker is not None
        else None
    )
    record = run_grid(
        config,
        [(entry, method, own, label) for entry, (method, own, label) in zip(methods, parsed)],
        axes,
        out,
        options,
        tracker=tracker,
        parent_id=parent,
    )
    runs = []
    keys = ("method", "label", "seed", "per_site_dice", "client_avg_dice", "global_dice", "wall_time_s")
    summary = []
    for m, (_, own, label) in zip(record["methods"], parsed):
        chosen = m["points"][m["chosen"]]
        scores = {p["text"]: sum(p["validation"]) / len(p["validation"]) for p in m["points"]}
        for f in chosen["folders"]:
            res = json.loads((out / f / "results.json").read_text())
            if own:
                res["label"] = label + (f" [{chosen['text']}]" if chosen["text"] else "")
            runs.append(res)
            row = {k: res[k] for k in keys if k in res}
            if axes:
                row["tuning"] = {"chosen": chosen["point"], "validation_by_setting": scores}
            summary.append(row)
    table = table3(runs)
    if axes:
        table += "\nTuning on validation:\n\n" + tuning_markdown(record)
    (out / "comparison.md").write_text(table)
    (out / "comparison.json").write_text(json.dumps(summary, indent=1))
    if tracker is not None and parent is not None:
        report = build_report([out], out / "report.html", ReportOptions(models=False), progress=progress, log=log)
        names = ("comparison.md", "comparison.json", "tuning.json")
        tracker.log_files(parent, [*(out / n for n in names), report])
        for m in record["methods"]:
            chosen = m["points"][m["chosen"]]
            test = [json.loads((out / f / "results.json").read_text())["client_avg_dice"] for f in chosen["folders"]]
            tracker.log_metrics(parent, {f"{m['entry']}/client_avg_dice": sum(test) / len(test)})
        tracker.end(parent)
    return runs, table


def demo(
    out: str | Path = "runs/demo",
    rounds: int = 40,
    scale: float = 0.15,
    size: int = 64,
    seed: int = 0,
    progress: bool = True,
    log: Callable[[str], None] = print,
    overrides: Sequence[str] = (),
) -> tuple[str, Path]:
    """Synthesize a small fundus-like federation (6 sites), compare local, centralized, FedAvg and FedSM
    (default settings), and write the HTML report of the runs: tables, curves, FedSM's routing on test (which
    model each site's test cases went to, stored in its ``results.json``) and the predictions on test (the
    per-case summary of every site and the first cases' masks; the loss surface and t-SNE are left to
    ``fedseg report``).

    Every method trains at the demo's learning rate :data:`DEMO_LR` (each method's best on the short
    tuning grid of docs/results/lr-tuning.md) instead of the default ``train.lr`` (1e-3, the papers'):
    40 rounds are a short budget.  FedAvg runs with its defaults (sample weights, the step-normalized average:
    docs/results/defaults.md).  ``overrides`` (``key=value``, after the demo's own) change any setting of every
    run: ``["train.lr=1e-3"]`` is the papers' learning rate, ``["fedavg.normalize=none"]`` the papers' FedAvg.

    Sized to run in minutes on 2 CPU cores (its time: docs/results/demo.md): a U-Net of the default's depth at
    half its width with one residual unit (the cost of a CPU step is its number of small operations more
    than the image size), validation every 2 rounds.

    Returns the Table 3-layout table (also written to ``out/comparison.md``) and the report's path
    (``out/report.html``).
    """
    out = Path(out)
    log(f"synthesizing a 6-site fundus-like federation ({size}x{size}, scale {scale}) in {out / 'data'}")
    spec = synthesize("fundus", out / "data", seed=seed, scale=scale, size=size, progress=progress)
    settings = [*DEMO_OVERRIDES, *overrides]
    _runs, table = compare(
        spec,
        DEMO_METHODS,
        out,
        StudyOptions(seeds=(seed,), rounds=rounds, overrides=tuple(settings), progress=progress, log=log),
    )
    # tables, curves, FedSM's routing on test (stored by the run) and the test predictions (a few cases per site
    # through each reported model); the loss surface and t-SNE take minutes on a CPU — `fedseg report runs/demo`
    report = build_report(
        [out / m / f"seed{seed}" for m in DEMO_METHODS],
        out / "report.html",
        options=ReportOptions(loss_surface=False, tsne=False),
        progress=progress,
        log=log,
        title="fedseg demo: local, centralized, FedAvg and FedSM on a synthetic fundus federation",
    )
    return table, report


def evaluate_run(
    run_dir: str | Path, federation: str | Path | None = None, split: str = "testing", progress: bool = True
) -> dict[str, Any]:
    """Score a finished run's best models on a federation's split (its own federation by default).

    Returns ``{"rows": [...], "table": markdown}``; rows follow ``results.json``'s ``rows``.
    """
    run_dir = Path(run_dir)
    fix = "evaluate needs the checkpoints of a finished fedseg run: restore them from a backup or run it again"
    best = load_best(run_dir / "checkpoints", fix=fix)
    cfg = load_run_config(run_dir / "config.toml", known_sections=known_sections())
    fed, data = load_federation_data(federation or cfg.federation, progress=progress)
    engine = build_engine(cfg, workload_for(fed, cfg), data, progress=False)
    sites = list(engine.transport.sites)
    rows = []
    for name, b in best.items():
        per_case = engine.evaluate([b.candidate], split, lambda c: engine.transport.sites)[name]
        rows.append({"name": name, **row_from_cases(per_case, sites, list(fed.labels))})
    runs = [{"method": r["name"], "seed": cfg.seed, "sites": sites, "rows": [], **r} for r in rows]
    return {"rows": rows, "table": table3(runs)}
