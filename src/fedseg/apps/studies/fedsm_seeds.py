"""FedSM's studies over several seeds: :func:`over_seeds` runs the λ/γ sweep or the unseen-site study
(:mod:`fedseg.apps.studies.fedsm`) once per seed (``out/seed<N>``, in processes where ``jobs``/``devices``
ask for them; with ``launch`` on Ray or Slurm, every run of every seed a task of its own) and :func:`tabulate` puts the seeds' studies into one table (mean ± sd over seeds), from
their ``sweep.json`` or ``unseen.json`` alone."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fedseg.apps.studies.fedsm import gamma_text, sweep, unseen
from fedseg.apps.studies.jobs import map_in_processes, placement
from fedseg.apps.studies.launchers import LaunchOptions
from fedseg.evaluation.tables import mean_sd
from fedseg.foundation.config import RunConfig
from fedseg.foundation.errors import ConfigError

__all__ = ["STUDY_FILES", "over_seeds", "table5_over_seeds", "table7_over_seeds", "tabulate"]


STUDY_FILES = {"sweep": "sweep", "unseen": "unseen"}
"""The two studies and the stem of the files each writes in its output folder (``<stem>.json`` / ``.md``)."""


def over_seeds(
    study: str,
    config: str | Path | RunConfig,
    out: str | Path,
    seeds: Sequence[int],
    log: Callable[[str], None] = print,
    jobs: int | None = None,
    devices: Sequence[str] | None = None,
    launch: LaunchOptions | None = None,
    **kwargs: Any,
) -> tuple[dict[int, list[dict[str, Any]]], str]:
    """Run ``study`` (``"sweep"`` or ``"unseen"``, with :func:`sweep`'s / :func:`unseen`'s arguments)
    once per seed into ``out/seed<N>`` (``jobs`` > 1 or ``devices``: the seeds in that many processes, one torch
    thread each, one per device, the same numbers; one seed: its study's runs in them), then write their table
    over seeds (:func:`tabulate`) to ``out/<study>.md``.  ``launch`` on Ray or Slurm: the seeds' studies are
    planned here side by side and each of their runs is a task of its own (the tables once every run is in).
    Returns the rows by seed and that table."""
    if study not in STUDY_FILES:
        raise ConfigError(f"unknown FedSM study {study!r}; use 'sweep' or 'unseen'")
    if not seeds:
        raise ConfigError("over_seeds needs at least one seed, e.g. --seeds 0,1,2")
    fn = sweep if study == "sweep" else unseen
    if launch is not None:
        launch.check_placement(jobs, devices)
    out = Path(out)
    if isinstance(config, RunConfig) and jobs is None and devices is None and config.device == "cpu":
        jobs = 1
    n, devs = placement(jobs, devices, kwargs.get("overrides", ())) if not (launch and launch.remote) else (1, None)
    calls: list[tuple[tuple, dict[str, Any]]]
    if launch is not None and launch.remote:
        kwargs.update(launch=launch, log=log)
        with ThreadPoolExecutor(len(seeds)) as pool:  # each seed's study submits its runs; the cluster runs them
            done = list(pool.map(lambda seed: fn(config, out / f"seed{seed}", seed=seed, **kwargs), seeds))
    elif n > 1 and len(seeds) > 1:
        kwargs.update(progress=False, jobs=1)
        calls = [((config, out / f"seed{seed}"), {"seed": seed, **kwargs}) for seed in seeds]
        done = map_in_processes(fn, calls, n, log, devices=devs)
    else:
        calls = [((config, out / f"seed{seed}"), {"seed": seed, **kwargs}) for seed in seeds]
        done = [fn(*a, **{**k, "log": log, "jobs": jobs, "devices": devices}) for a, k in calls]
    rows = {seed: r for seed, (r, _) in zip(seeds, done)}
    _, table = tabulate([out / f"seed{s}" for s in seeds], out / f"{STUDY_FILES[study]}.md")
    return rows, table


def tabulate(folders: Sequence[str | Path], md: str | Path | None = None) -> tuple[str, str]:
    """One table over the seeds of a study from its per-seed output folders (each with the
    ``sweep.json`` or ``unseen.json`` that :func:`sweep` / :func:`unseen` wrote; all folders the
    same study). Returns ``(study, markdown)`` and writes the Markdown to ``md`` if given."""
    if not folders:
        raise ConfigError("tabulate needs at least one study folder")
    kinds, rows = set(), []
    for f in folders:
        found = [k for k, stem in STUDY_FILES.items() if (Path(f) / f"{stem}.json").is_file()]
        if len(found) != 1:
            raise ConfigError(
                f"{f}: expected the output folder of one FedSM study (a sweep.json or an unseen.json written by "
                "'fedseg fedsm sweep' or 'fedseg fedsm unseen'), found "
                + (" and ".join(f"{k}.json" for k in found) if found else "neither")
            )
        kinds.add(found[0])
        rows.append(json.loads((Path(f) / f"{STUDY_FILES[found[0]]}.json").read_text()))
    if len(kinds) > 1:
        raise ConfigError(f"the folders hold different studies ({sorted(kinds)}); tabulate one study at a time")
    study = kinds.pop()
    table = table7_over_seeds(rows) if study == "sweep" else table5_over_seeds(rows)
    if md is not None:
        Path(md).parent.mkdir(parents=True, exist_ok=True)
        Path(md).write_text(table)
    return study, table


def table7_over_seeds(runs: Sequence[Sequence[Mapping[str, Any]]]) -> str:
    """Table 7 over seeds: per λ, Client Avg and Global Dice as mean ± sd over the runs (one list of
    :func:`sweep` rows per seed), the γ each seed's run used, then the test Dice per γ (mean over seeds)."""
    lams: list[float] = []
    for rows in runs:
        for r in rows:
            if "rejected" not in r and r["lam"] not in lams:
                lams.append(r["lam"])
    by = [{r["lam"]: r for r in rows if "rejected" not in r} for rows in runs]
    cols = [[b[lam] for b in by if lam in b] for lam in lams]
    head = ["λ", *[f"{lam:g}" for lam in lams]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, key in (("Client Avg", "client_avg_dice"), ("Global", "global_dice")):
        lines.append("| " + " | ".join([label, *[mean_sd([r[key] for r in col]) for col in cols]]) + " |")
    lines.append("| γ used (per seed) | " + " | ".join(", ".join(gamma_text(r) for r in col) for col in cols) + " |")
    text = "\n".join(lines) + "\n"
    gs = sorted({g for col in cols for r in col for g in r.get("dice_by_gamma", {})}, key=float)
    if gs:
        lines = ["| γ \\ λ | " + " | ".join(f"{lam:g}" for lam in lams) + " |", "|" + "---|" * (len(lams) + 1)]
        for g in gs:
            cells = [mean_sd([r["dice_by_gamma"].get(g) for r in col]) for col in cols]
            lines.append(f"| {float(g):g} | " + " | ".join(cells) + " |")
        text += (
            "\nTest Dice (pooled over all sites' test cases) of the FedSM composite per threshold γ:\n\n"
            + "\n".join(lines)
            + "\n"
        )
    return text + f"\nmean ± sd over {len(runs)} seed(s).\n"


def table5_over_seeds(runs: Sequence[Sequence[Mapping[str, Any]]]) -> str:
    """Table 5 over seeds: per unseen site, the selection frequency of the global model and of each
    personalized model at γ = 0 (mean over seeds), the Dice at γ = 0 and the best γ's Dice (mean ± sd)
    and the best γ of each seed (one list of :func:`unseen` rows per seed)."""
    sites: list[str] = []
    for rows in runs:
        for r in rows:
            for name in [r["site"], *(m.split("/", 1)[1] for m in r["selection_at_0"] if m.startswith("personal/"))]:
                if name not in sites:
                    sites.append(name)
    heldout = [s for s in sites if any(r["site"] == s for rows in runs for r in rows)]
    chosen = any("dice_at_chosen" in r for rows in runs for r in rows)
    head = ["Unseen site", "γ", "GM", *[f"PM {s}" for s in sites], "Dice", "Best γ (per seed)", "Best γ's Dice"]
    if chosen:
        head += ["γ chosen on validation (per seed)", "Its Dice"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in heldout:
        rs = [r for rows in runs for r in rows if r["site"] == k]
        freq = {
            m: sum(r["selection_at_0"].get(m, 0.0) for r in rs) / len(rs)
            for m in ["global", *(f"personal/{s}" for s in sites)]
        }
        cells = [k, "0", f"{freq['global']:.2f}"]
        cells += ["N/A" if s == k else f"{freq[f'personal/{s}']:.2f}" for s in sites]
        cells += [
            mean_sd([r["dice_at_0"] for r in rs]),
            ", ".join(f"{r['best_gamma']:g}" for r in rs),
            mean_sd([r["best_dice"] for r in rs]),
        ]
        if chosen:
            cells += ["; ".join(gamma_text(r) for r in rs), mean_sd([r.get("dice_at_chosen") for r in rs])]
        lines.append("| " + " | ".join(cells) + " |")
    return (
        "\n".join(lines)
        + f"\n\nGM = global model, PM = personalized model; frequencies of the selector's choice on the unseen site's test cases at γ = 0 (mean over seeds); Dice mean ± sd over {len(runs)} seed(s); best γ over the grid on the unseen site's test set (as the paper reports it)"
        + (
            "; γ chosen on validation: the thresholds the run chose on its training sites' validation (per personalized model under `fedsm.gamma = \"auto-per-model\"`), and the unseen site's test Dice with them"
            if chosen
            else ""
        )
        + ".\n"
    )
