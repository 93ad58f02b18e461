"""Grids of runs: any setting swept, each point trained and judged on validation, runs resumable and parallel.

* :func:`parse_grid` reads ``train.lr=3e-4,1e-3`` (optionally ``fedsm:lam=0.1,0.5``, one method's) and
  :func:`grid_points` makes the cartesian product of several such specs.
* Every run goes through :mod:`fedseg.apps.studies.jobs`: reused when its folder holds a finished run of the
  same settings, resumed (the engine's resume) when it holds a checkpoint of them, else run; one after another
  or in spawned processes with the same results.
* :func:`validation_score` is the score a run selects its best round by (its method's row: the primary
  candidate's best validation score, or the mean over the sites of each site's own model's), and
  :func:`choose` picks the grid point with the highest mean of it over the seeds; neither reads a test number.
* :func:`tune` runs a grid per method entry over seeds and returns the tuning record (``tuning.json``) that
  ``fedseg compare --tune`` and ``fedseg sweep`` write, and :func:`tuning_markdown` / :func:`grid_figure`
  its table and figure.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedseg.algorithms import REGISTRY
from fedseg.apps.report.tuning import TUNING_FILE, grid_figure, tuning_markdown
from fedseg.apps.studies.jobs import Job, StudyOptions, point_text, requested_config, run_jobs, run_point
from fedseg.apps.tracking import MlflowTracker, tracker_for
from fedseg.evaluation.tables import mean_sd
from fedseg.foundation.config import RunConfig
from fedseg.foundation.errors import ConfigError
from fedseg.seams.checkpoint import save_json

__all__ = [
    "Job",
    "StudyOptions",
    "choose",
    "grid_figure",
    "grid_points",
    "parse_grid",
    "point_text",
    "requested_config",
    "run_jobs",
    "run_point",
    "split_values",
    "sweep",
    "tune",
    "tuning_markdown",
    "validation_score",
]


def split_values(text: str) -> list[str]:
    """``"3e-4,1e-3"`` → ``["3e-4", "1e-3"]``; commas inside brackets belong to a value
    (``"[4,8],[8,16]"`` → ``["[4,8]", "[8,16]"]``)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    out.append(cur.strip())
    return [v for v in out if v]


def parse_grid(spec: str) -> tuple[str | None, str, list[str]]:
    """One axis of a grid: ``"train.lr=3e-4,1e-3"`` → ``(None, "train.lr", ["3e-4", "1e-3"])``.

    ``"fedsm:lam=0.1,0.5"`` is one method's axis: a key without a dot is a setting of that method's section
    (``fedsm.lam``), as in ``compare --methods fedsm:lam=0.5``.
    """
    method = None
    head, eq, values = spec.partition("=")
    if ":" in head:
        method, _, head = head.partition(":")
        method = method.strip()
        if method not in REGISTRY:
            raise ConfigError(
                f"--tune/--grid {spec!r}: unknown method {method!r}; known methods: {', '.join(sorted(REGISTRY))}"
            )
    key = head.strip()
    vals = split_values(values)
    if not eq or not key or not vals:
        raise ConfigError(
            f"--tune/--grid {spec!r}: expected KEY=V1,V2,… (e.g. train.lr=3e-4,1e-3,3e-3, or fedsm:lam=0.3,0.5 "
            "for one method's setting)"
        )
    if method is not None and "." not in key:
        key = f"{REGISTRY[method].section}.{key}"
    if key == "seed":
        raise ConfigError(f"--tune/--grid {spec!r}: seeds are not a setting to tune; give them with --seeds")
    if len(set(vals)) != len(vals):
        raise ConfigError(f"--tune/--grid {spec!r}: a value is given twice; give each value once")
    return method, key, vals


def grid_points(axes: Sequence[tuple[str, Sequence[str]]]) -> list[dict[str, str]]:
    """The cartesian product of ``(key, values)`` axes, first axis slowest: ``[{key: value, …}, …]``;
    no axes → one empty point (the run as given)."""
    keys = [k for k, _ in axes]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"the grid names a setting twice ({keys}); give each setting in one --tune/--grid")
    return [dict(zip(keys, combo)) for combo in itertools.product(*(v for _, v in axes))]


def point_folder(point: Mapping[str, str]) -> str:
    """A folder name for a grid point: ``train.lr=1e-3`` (``_`` between settings, odd characters replaced)."""
    text = "_".join(f"{k}={v}" for k, v in point.items())
    return "".join(c if c.isalnum() or c in "._=-" else "-" for c in text) or "default"


def _section_of(key: str) -> str | None:
    """The method section a dotted key belongs to (``fedsm.lam`` → ``fedsm``), None for any other setting."""
    head = key.partition(".")[0]
    return head if "." in key and head in {c.section for c in REGISTRY.values() if c.section} else None


def reads(method: str, key: str) -> bool:
    """Whether a run of ``method`` reads the setting ``key``: every setting outside the methods' sections, and of
    those only its own section's (a method parses nothing but ``[<its section>]``)."""
    section = _section_of(key)
    return section is None or REGISTRY[method].section == section


def check_read(axes: Sequence[tuple[str | None, str, Sequence[str]]], methods: Sequence[str]) -> None:
    """Refuse, before anything runs, a grid axis of a method section that none of ``methods`` it applies to reads
    (``--methods fedavg --tune fedsm.lam=0.3,0.5`` would train FedAvg once per value, the same run each time)."""
    for m, key, _ in axes:
        listed = [x for x in dict.fromkeys(methods) if m is None or x == m]
        if listed and not any(reads(x, key) for x in listed):
            section = _section_of(key)
            readers = sorted(n for n, c in REGISTRY.items() if c.section == section)
            raise ConfigError(
                f"--tune/--grid {key}: no method listed ({', '.join(listed)}) reads [{section}], so every value "
                f"would train the same run; [{section}] is read by {', '.join(readers)} -> add one of them to "
                "--methods or drop that axis"
            )


# ------------------------------------------------------------- choosing on validation
def validation_score(results: Mapping[str, Any]) -> float:
    """The validation score a run selects its best round by, for its method's row (``eval.best_criterion``):
    the primary candidate's best validation score, or — a method whose models belong to the sites
    (``primary = None``: local, personalization) — the mean over the sites of each site's own model's best
    validation score.  Reads ``rows[*].best_val_dice`` only: no test number."""
    rows = results["rows"]
    primary = results.get("primary")
    if primary is not None:
        found = [r["best_val_dice"] for r in rows if r["name"] == primary]
        if not found:
            raise ConfigError(f"results of {results.get('method')!r} have no row of its primary candidate {primary!r}")
        return float(found[0])
    homes = {r["home_site"]: r["best_val_dice"] for r in rows if r.get("home_site") in results["sites"]}
    if not homes:
        raise ConfigError(f"results of {results.get('method')!r} have no site's own model to score")
    return float(sum(homes.values()) / len(homes))


def choose(scores: Sequence[Sequence[float]]) -> int:
    """The index of the grid point with the highest mean validation score over its seeds (``scores[i]``: point
    i's score per seed); a tie goes to the earlier point; a NaN mean never wins over a number."""

    def key(i: int) -> float:
        m = sum(scores[i]) / len(scores[i]) if scores[i] else math.nan
        return -math.inf if math.isnan(m) else m

    if not scores:
        raise ConfigError("nothing to choose from: the grid has no point")
    return max(range(len(scores)), key=lambda i: (key(i), -i))


def _score(results: Mapping[str, Any], needed: bool) -> float:
    """:func:`validation_score`, or NaN where nothing is chosen (one point) and the run has none to give."""
    try:
        return validation_score(results)
    except ConfigError:
        if needed:
            raise
        return math.nan


def tune(
    config: str | Path,
    entries: Sequence[tuple[str, str, list[str], str]],
    axes: Sequence[tuple[str | None, str, list[str]]],
    out: str | Path,
    options: StudyOptions | None = None,
    flat: bool = False,
    tracker: MlflowTracker | None = None,
    parent_id: str | None = None,
) -> dict[str, Any]:
    """Train every grid point of every method entry over ``seeds``, judge each on validation
    (:func:`validation_score`) and choose per entry the point with the highest mean over the seeds (:func:`choose`).

    ``entries``: ``(entry text, method, the entry's own overrides, label)``; ``axes``: :func:`parse_grid`'s
    (an axis with a method applies to that method's entries only); ``options``: the seeds, rounds, overrides and
    placement of every run (:class:`~fedseg.apps.studies.jobs.StudyOptions`; its ``track`` is the caller's).  Runs go to
    ``out/<entry>/<point>/seed<k>`` (``flat``: ``out/<point>/seed<k>``, one entry).  Returns the tuning
    record (also ``out/tuning.json``): per entry its points with their validation scores per seed, the chosen
    point, and the folders of the chosen point's runs (whose test numbers are the comparison's).
    ``tracker``: every run is logged as an MLflow run under ``parent_id`` as it goes (per round, from the process
    that runs it), then with its grid point, validation score and whether it was chosen.
    """
    out = Path(out)
    options = options or StudyOptions()
    seeds, rounds, overrides = options.seeds, options.rounds, options.overrides
    if not seeds:
        raise ConfigError("give at least one seed, e.g. --seeds 0,1,2")
    check_read(axes, [method for _, method, _, _ in entries])
    plan: list[tuple[str, str, str, list[dict[str, str]]]] = []
    all_jobs: list[Job] = []
    for entry, method, own, label in entries:
        mine = [(k, v) for m, k, v in axes if (m is None or m == method) and reads(method, k)]
        points = grid_points(mine)
        base = out if flat else out / entry.replace(":", "-").replace(",", "-").replace(" ", "")
        plan.append((entry, method, label, points))
        for p in points:
            for s in seeds:
                folder = (base / point_folder(p) if p else base) / f"seed{s}"
                all_jobs.append(
                    Job(
                        str(config),
                        str(folder),
                        (*overrides, *own, *(f"{k}={v}" for k, v in p.items())),
                        method,
                        int(s),
                        rounds,
                        tuple(p.items()),
                    )
                )
    results = run_jobs(
        all_jobs,
        options.jobs,
        options.devices,
        progress=options.progress,
        log=options.log,
        launch=options.launch,
        track=tracker.target(parent_id) if tracker is not None else None,
        root=out,
    )
    record: dict[str, Any] = {
        "selection": (
            "per method, the grid point with the highest mean over the seeds of the best validation score its runs "
            "select their best round by (eval.best_criterion); test numbers are read only for the chosen point"
        ),
        "seeds": list(seeds),
        "methods": [],
    }
    i = 0
    for entry, method, label, points in plan:
        rows: list[dict[str, Any]] = []
        for p in points:
            runs = [(all_jobs[i + k], results[i + k]) for k in range(len(seeds))]
            i += len(seeds)
            rows.append(
                {
                    "point": p,
                    "text": point_text(p),
                    "validation": [_score(r, needed=len(points) > 1) for _, r in runs],
                    "folders": [Path(j.folder).relative_to(out).as_posix() for j, _ in runs],
                }
            )
        c = choose([r["validation"] for r in rows])
        if label == method:  # a plain method entry: its display name (FedAvg, FedAvg - even)
            label = str(results[i - 1]["label"]).split(" [")[0]
        record["methods"].append(
            {"entry": entry, "method": method, "label": label, "points": rows, "chosen": c, "keys": list(points[0])}
        )
    if tracker is not None:
        for m in record["methods"]:
            for k, p in enumerate(m["points"]):
                for f, v in zip(p["folders"], p["validation"]):
                    tracker.log_run(
                        out / f,
                        parent_id,
                        params={"fedseg.grid_point": p["text"]} if p["point"] else None,
                        metrics={"validation_score": v, "chosen": float(k == m["chosen"])},
                    )
    if any(p for *_, points in plan for p in points):  # a grid: the record of the choice
        out.mkdir(parents=True, exist_ok=True)
        save_json(record, out / TUNING_FILE)
    return record


def _own_key(method: str, spec: str) -> str:
    """A sweep's axis whose key has no dot and is not a top-level setting is a setting of the method's own
    section: ``lam=0.3,0.5`` for fedsm is ``fedsm:lam=0.3,0.5``."""
    key = spec.partition("=")[0].strip()
    top = {f.name for f in dataclasses.fields(RunConfig)}
    return f"{method}:{spec}" if "." not in key and key not in top and REGISTRY[method].section else spec


def sweep(
    config: str | Path,
    method: str,
    grid: Sequence[str],
    out: str | Path,
    options: StudyOptions | None = None,
) -> tuple[dict[str, Any], str]:
    """``fedseg sweep``: ``method`` over the grid of ``grid`` (``["train.lr=3e-4,1e-3", …]``), one run per point
    and seed in ``out/<point>/seed<k>`` (resumable: :func:`run_point`).

    Writes ``out/tuning.json`` (validation score per point and seed, the best point), ``out/sweep.md`` (per point:
    validation score, test Client Avg and Global Dice, mean ± sd over the seeds; the best on validation marked)
    and ``out/sweep.png`` (validation score over the grid).  ``track`` (``"mlflow"``, or the config's
    ``[tracking]``): every run an MLflow run under one parent run holding these files.  ``options``: the seeds,
    rounds, overrides, placement and tracking of the runs (:class:`~fedseg.apps.studies.jobs.StudyOptions`).
    Returns the record and the table.
    """
    options = options or StudyOptions()
    seeds = options.seeds
    if method not in REGISTRY:
        raise ConfigError(f"unknown method {method!r}; known methods: {', '.join(sorted(REGISTRY))}")
    axes = [parse_grid(g if ":" in g.partition("=")[0] else _own_key(method, g)) for g in grid]
    if not axes:
        raise ConfigError("give at least one --grid KEY=V1,V2")
    other = sorted({m for m, _, _ in axes if m is not None and m != method})
    if other:
        raise ConfigError(f"--grid names {other}, not the swept method {method!r}; use {method}:KEY or a dotted KEY")
    out = Path(out)
    tracker = tracker_for(options.track, out, config, options.overrides, options.track_uri)
    parent = (
        tracker.parent(
            out, "sweep", {"config": str(config), "method": method, "grid": list(grid), "seeds": list(seeds)}
        )
        if tracker is not None
        else None
    )
    record = tune(
        config,
        [(method, method, [], method)],
        axes,
        out,
        options,
        flat=True,
        tracker=tracker,
        parent_id=parent,
    )
    m = record["methods"][0]
    keys = m["keys"]
    lines = [
        "| " + " | ".join([*keys, "Validation score", "Client Avg Dice (test)", "Global Dice (test)", ""]) + " |",
        "|" + "---|" * (len(keys) + 4),
    ]
    for i, p in enumerate(m["points"]):
        res = [json.loads((out / f / "results.json").read_text()) for f in p["folders"]]
        cells = [
            *(p["point"][k] for k in keys),
            mean_sd(p["validation"]),
            mean_sd([r["client_avg_dice"] for r in res]),
            mean_sd([r["global_dice"] for r in res]),
            "best on validation" if i == m["chosen"] else "",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    table = (
        f"{method} over the grid, mean ± sd over {len(seeds)} seed(s); validation score: the best validation score "
        "each run selects its best round by (eval.best_criterion)\n\n" + "\n".join(lines) + "\n"
    )
    (out / "sweep.md").write_text(table)
    (out / "sweep.png").write_bytes(grid_figure(record))
    if tracker is not None and parent is not None:
        tracker.log_files(parent, [out / "sweep.md", out / "sweep.png", out / TUNING_FILE])
        tracker.end(parent)
    return record, table
