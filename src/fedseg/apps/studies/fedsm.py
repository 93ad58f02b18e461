"""FedSM experiments: runs with a routing report, the unseen-site study (Table 5) and the λ/γ sweep (Table 7).

* :func:`run_fedsm` runs fedsm / fedsm-extra / fedsm-ensemble in simulation and adds
  ``results["fedsm"]``: the selector's routing accuracy and selection frequencies on
  every site's **test** split, and the test Dice of the composite for every γ of the
  grid — computed at the sites by the ``"route"`` task, only sums and counts return.
* :func:`unseen` leaves each site out in turn, trains on the others and tests the
  composite on the held-out site (FedSM Table 5: GM/PM selection frequency at γ = 0,
  Dice, best γ and its Dice).
* :func:`sweep` runs one FedSM per λ (Table 7: Client Avg and Global Dice per λ) and
  reports the test Dice per γ.
* Both studies' runs are independent: ``jobs``/``devices`` run them in spawned processes, one per device
  (:func:`fedseg.apps.studies.jobs.placement`; by default one per CUDA device where there are several), and
  ``launch`` as Ray tasks or Slurm array tasks (:mod:`fedseg.apps.studies.launchers`), each the same numbers as
  one after another.  A run's folder keeps its settings (``point.json``): a finished run of the same settings is
  reused and an interrupted one resumed from its checkpoint when the study is run again.
* Either study over several seeds, and the table over them: :mod:`fedseg.apps.studies.fedsm_seeds`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fedseg.algorithms import get_algorithm, known_sections
from fedseg.algorithms.fedsm import FedSM, route_task
from fedseg.algorithms.fedsm.selection import PER_MODEL
from fedseg.apps.studies.jobs import POINT_FILE, check_point, placement, resolved_settings
from fedseg.apps.studies.launchers import LaunchOptions, RunSpec, launch_all, launcher_for
from fedseg.data.spec import load_federation
from fedseg.evaluation.tables import table5
from fedseg.execution.engine import Engine
from fedseg.execution.federation import load_federation_data
from fedseg.execution.results import write_results
from fedseg.foundation.config import RunConfig, load_run_config
from fedseg.foundation.errors import ConfigError
from fedseg.seams.checkpoint import PROGRESS, save_json
from fedseg.seams.transport import Transport
from fedseg.simulation.runner import build_engine
from fedseg.site.runtime import SiteData
from fedseg.site.workload import Workload, workload_for

__all__ = [
    "gamma_text",
    "load_spec",
    "routing_report",
    "run_fedsm",
    "sweep",
    "table7",
    "unseen",
    "with_fedsm",
]


def with_fedsm(cfg: RunConfig, **settings: Any) -> RunConfig:
    """``cfg`` with ``[fedsm]`` settings replaced."""
    return dataclasses.replace(cfg, params={**cfg.params, "fedsm": {**cfg.params.get("fedsm", {}), **settings}})


def load_spec(
    config: str | Path | RunConfig, overrides: Sequence[str] = (), progress: bool = False, **fields: Any
) -> tuple[RunConfig, Workload, dict[str, SiteData]]:
    """Config, segmentation workload and in-memory site data of a run config / federation spec (as ``fedseg run``)."""
    cfg = (
        config
        if isinstance(config, RunConfig)
        else load_run_config(config, list(overrides), known_sections(), **fields)
    )
    fed, data = load_federation_data(cfg.federation, progress=progress)
    return cfg, workload_for(fed, cfg), data


def routing_report(
    engine: Engine,
    transport: Transport,
    sites: Sequence[str],
    gammas: Sequence[float] | None = None,
    split: str = "testing",
) -> dict[str, Any]:
    """Routing statistics of the best ``"fedsm"`` candidate on ``sites`` (federation sites and/or held-out ones).

    Returns ``{"gamma", "gamma_per_model" (None unless ``fedsm.gamma = "auto-per-model"``), "mode", "models",
    "per_site": {site: {n, routing_acc, selection
    (frequency per model at the run's γ: its per-model thresholds where it has them), dice (likewise), dice_by_gamma,
    selection_by_gamma, dice_per_model}}, "dice_by_gamma": sample-weighted over the
    federation's sites}``.
    """
    algo = engine.algorithm
    if not isinstance(algo, FedSM) or "fedsm" not in engine.best:
        raise ConfigError("routing_report needs a finished fedsm / fedsm-extra / fedsm-ensemble run")
    cand = engine.best["fedsm"].candidate
    mode = cand.config["mode"]
    grid = sorted({*(gammas if gammas is not None else algo.params.gamma_grid), float(cand.config["gamma"])})
    replies = route_task(transport, cand, list(sites), split, grid if mode == "gate" else [None])
    models = ["global", *[f"personal/{s}" for s in cand.config["sites"]]]
    per_site: dict[str, Any] = {}
    per_model = mode == "gate" and cand.config.get("gamma_per_model") is not None
    for s, m in replies.items():
        n = m["n"]
        sels = [x for x in m["selections"] if x["gamma"] != PER_MODEL]  # the grid's
        if per_model:  # the composite routes with its per-model thresholds: the last selection
            at = m["selections"][-1]
        elif mode == "gate":
            at = next((x for x in sels if x["gamma"] == float(cand.config["gamma"])), sels[0])
        else:
            at = sels[0]
        per_site[s] = {
            "n": n,
            "routing_acc": m["routing_acc"],
            "selection": {name: (c / n if n else None) for name, c in zip(models, at["counts"])},
            "dice": at["dice_sum"] / n if n else None,
            "dice_by_gamma": {str(x["gamma"]): (x["dice_sum"] / n if n else None) for x in sels}
            if mode == "gate"
            else {},
            "selection_by_gamma": {
                str(x["gamma"]): {name: (c / n if n else None) for name, c in zip(models, x["counts"])} for x in sels
            }
            if mode == "gate"
            else {},
            "dice_per_model": {name: (d / n if n else None) for name, d in zip(models, m["dice_sum_per_model"])},
        }
    fed = [s for s in replies if s in cand.config["sites"]]
    total = sum(replies[s]["n"] for s in fed)
    by_gamma = {}
    if mode == "gate" and total:
        for i, g in enumerate(grid):
            by_gamma[str(g)] = sum(replies[s]["selections"][i]["dice_sum"] for s in fed) / total
    return {
        "gamma": cand.config["gamma"],
        "gamma_per_model": cand.config.get("gamma_per_model"),
        "mode": mode,
        "models": models,
        "best_round": engine.best["fedsm"].round,
        "per_site": per_site,
        "dice_by_gamma": by_gamma,
    }


def run_fedsm(
    cfg: RunConfig,
    workload: Workload,
    site_data: Mapping[str, SiteData],
    out: str | Path | None = None,
    heldout: str | None = None,
    gammas: Sequence[float] | None = None,
    progress: bool = False,
    log: Callable[[str], None] = print,
    resume: bool = False,
) -> dict[str, Any]:
    """Run a FedSM variant in simulation and add ``results["fedsm"]`` (:func:`routing_report` on test).

    Parameters
    ----------
    heldout
        A site left out of training (Table 5): it is addressable for testing only and
        gets ``results["fedsm"]["per_site"][heldout]``.
    resume
        Continue the run from its checkpoint in ``out`` (the engine's resume).
    """
    algorithm = get_algorithm(cfg)
    if not isinstance(algorithm, FedSM):
        raise ConfigError(f"run_fedsm runs fedsm, fedsm-extra or fedsm-ensemble, not {cfg.method!r}")
    if heldout is not None and heldout not in site_data:
        raise ConfigError(f"held-out site {heldout!r} is not in the federation; sites: {list(site_data)}")
    train = {s: d for s, d in site_data.items() if s != heldout}
    engine = build_engine(
        cfg,
        workload,
        train,
        out=out,
        progress=progress,
        log=log,
        algorithm=algorithm,
        heldout={heldout: site_data[heldout]} if heldout is not None else None,
    )
    results = engine.run(resume=resume)
    assert results is not None
    report_sites = [*train, *([heldout] if heldout is not None else [])]
    results["fedsm"] = routing_report(engine, engine.transport, report_sites, gammas)
    if heldout is not None:
        results["fedsm"]["heldout"] = heldout
    if out is not None:
        write_results(results, out)
        with open(Path(out) / "results.md", "a") as f:
            f.write("\n" + routing_markdown(results) + "\n")
        engine.finish()  # drop what only --resume reads (checkpoint_keep)
    return results


def routing_markdown(results: Mapping[str, Any]) -> str:
    """Per-site routing accuracy and selection frequencies of a :func:`run_fedsm` result."""
    rep = results["fedsm"]
    models = rep["models"]
    short = ["GM"] + [f"PM {m.split('/', 1)[1]}" for m in models[1:]]
    per = rep.get("gamma_per_model")
    at = f"γ per model {', '.join(f'{float(g):g}' for g in per)}" if per else f"γ={rep['gamma']}"
    head = ["Site", "routing acc", *short, f"Dice ({at})" if rep["mode"] == "gate" else "Dice"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s, r in rep["per_site"].items():
        acc = "–" if r["routing_acc"] is None else f"{r['routing_acc']:.2f}"
        cells = [s, acc, *[f"{r['selection'][m]:.2f}" for m in models], f"{r['dice']:.4f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return (
        f"Selector routing on test ({results['method']}, best round {rep['best_round']}):\n\n" + "\n".join(lines) + "\n"
    )


# ------------------------------------------------------------- independent runs
def _fedsm_point(
    cfg: RunConfig,
    out: str,
    heldout: str | None,
    gammas: Sequence[float] | None,
    device: str | None = None,
    workload: Workload | None = None,
    data: Mapping[str, SiteData] | None = None,
    progress: bool = False,
    log: Callable[[str], None] = print,
) -> str:
    """One run of a study into ``out`` (:func:`run_fedsm`; in a process of its own it loads the federation
    itself); returns ``out``, whose ``results.json`` is read back.  A finished run of the same settings
    (``point.json``) is reused, an interrupted one resumed from its checkpoint, a folder of other settings refused."""
    if device is not None:
        cfg = dataclasses.replace(cfg, device=device)
    folder = Path(out)
    want = resolved_settings(cfg)
    check_point(folder, want)
    done = folder / "results.json"
    if done.is_file() and "fedsm" in json.loads(done.read_text()):
        log(f"{folder.name}: already done ({done})")
        return out
    ckpt = folder / "checkpoints"
    resume = (folder / "config.toml").is_file() and (
        (ckpt / PROGRESS).is_file() or (ckpt / f"{PROGRESS}.next").is_file()
    )
    if resume:
        log(f"{folder.name}: resuming {folder}")
    else:
        folder.mkdir(parents=True, exist_ok=True)
        save_json(want, folder / POINT_FILE)
    if data is None or workload is None:
        fed, data = load_federation_data(cfg.federation)
        workload = workload_for(fed, cfg)
    run_fedsm(cfg, workload, data, out=out, heldout=heldout, gammas=gammas, progress=progress, log=log, resume=resume)
    return out


def _run_points(
    points: Sequence[tuple[RunConfig, Path, str | None]],
    workload: Workload | None,
    data: Mapping[str, SiteData] | None,
    gammas: Sequence[float] | None,
    jobs: int | None,
    devices: Sequence[str] | None,
    overrides: Sequence[str],
    progress: bool,
    log: Callable[[str], None],
    launch: LaunchOptions | None = None,
    root: Path | None = None,
) -> list[dict[str, Any]]:
    """Run a study's runs ``(config, folder, held-out site)`` one after another or, as
    :func:`~fedseg.apps.studies.jobs.placement` says for ``jobs``/``devices``, in spawned processes (one torch
    thread each; one per device), or as ``launch`` says (Ray tasks, Slurm array tasks); returns each run's
    ``results.json`` as written, the same either way.  ``workload``/``data``: the federation as loaded here, for
    runs in this process (None: each run loads it)."""
    launch = launch or LaunchOptions()
    launch.check_placement(jobs, devices)
    if launch.remote:
        n, devs = 1, None
    else:
        if jobs is None and devices is None and points and points[0][0].device == "cpu":
            jobs = 1  # set to the CPU: no CUDA devices by default
        n, devs = placement(jobs, devices, overrides)
    specs = []
    for cfg, out, held in points:
        if (Path(out) / "results.json").is_file():  # finished: checked and read here, never dispatched
            _fedsm_point(cfg, str(out), held, gammas, None, workload, data, progress, log)
            continue
        local = {"workload": workload, "data": data, "progress": progress, "log": log}
        name = Path(out).name if root is None else Path(out).relative_to(root).as_posix()
        specs.append(
            RunSpec(name, _fedsm_point, (cfg, str(out), held, gammas), folder=str(out), local_kwargs=local, placed=True)
        )
    launch_all(launcher_for(launch, n, devs, root or Path("."), log), specs, log)
    return [json.loads((Path(out) / "results.json").read_text()) for _, out, _ in points]


def _study_setup(
    config: str | Path | RunConfig,
    overrides: Sequence[str],
    progress: bool,
    launch: LaunchOptions | None,
    fields: Mapping[str, Any],
) -> tuple[RunConfig, Workload | None, dict[str, SiteData] | None, list[str]]:
    """A study's config, and its federation loaded here — or, for runs dispatched to Ray or Slurm, only its site
    names (each run loads the federation where it runs)."""
    if launch is not None and launch.remote:
        cfg = (
            config
            if isinstance(config, RunConfig)
            else load_run_config(config, list(overrides), known_sections(), **fields)
        )
        return cfg, None, None, [s.name for s in load_federation(cfg.federation).sites]
    cfg, workload, data = load_spec(config, overrides, progress=progress, **fields)
    return cfg, workload, data, list(data)


# ------------------------------------------------------------------- Table 5
def unseen(
    config: str | Path | RunConfig,
    out: str | Path,
    overrides: Sequence[str] = (),
    sites: Sequence[str] | None = None,
    gammas: Sequence[float] | None = None,
    progress: bool = False,
    log: Callable[[str], None] = print,
    jobs: int | None = None,
    devices: Sequence[str] | None = None,
    device: str | None = None,
    launch: LaunchOptions | None = None,
    **fields: Any,
) -> tuple[list[dict[str, Any]], str]:
    """FedSM Table 5: for each held-out site k, train on the others, test the composite on k.

    ``jobs``/``devices``: the held-out sites' runs in processes (:func:`_run_points`); ``launch``: as Ray or
    Slurm tasks; ``device``: every run's.

    Returns the rows and the Markdown table (also ``out/unseen.md`` and ``out/unseen.json``).
    Each row: ``site``, ``selection_at_0`` ({model: frequency} at γ = 0), ``dice_at_0``,
    ``best_gamma``, ``best_dice``, ``dice_by_gamma``, and what the run chose on the training sites'
    validation (:func:`_chosen`: ``gamma``, ``gamma_per_model``, ``dice_at_chosen``).
    """
    cfg, workload, data, names = _study_setup(config, overrides, progress, launch, fields)
    if cfg.method != "fedsm":
        cfg = dataclasses.replace(cfg, method="fedsm")
    if device is not None:
        cfg = dataclasses.replace(cfg, device=device)
    grid = sorted({0.0, *(gammas if gammas is not None else get_algorithm(cfg).params.gamma_grid)})
    out = Path(out)
    rows = []
    held = list(sites or names)
    unknown = [k for k in held if k not in names]
    if unknown:
        raise ConfigError(f"held-out site(s) {unknown} are not in the federation; sites: {names}")
    points = [(cfg, out / f"unseen-{k}", k) for k in held]
    done = _run_points(points, workload, data, grid, jobs, devices, overrides, progress, log, launch, out)
    for k, res in zip(held, done):
        r = res["fedsm"]["per_site"][k]
        dbg = {float(g): d for g, d in r["dice_by_gamma"].items()}
        best_g = max(sorted(dbg), key=lambda g: dbg[g])
        rows.append(
            {
                "site": k,
                "selection_at_0": r["selection_by_gamma"][str(0.0)],
                "dice_at_0": dbg[0.0],
                "best_gamma": best_g,
                "best_dice": dbg[best_g],
                "dice_by_gamma": dbg,
                **_chosen(res, k),
                "wall_time_s": res.get("wall_time_s"),
            }
        )
        log(f"unseen {k}: Dice at γ=0 {dbg[0.0]:.4f}, best γ {best_g} → {dbg[best_g]:.4f}")
    table = table5(rows, names)
    out.mkdir(parents=True, exist_ok=True)
    (out / "unseen.md").write_text(table)
    (out / "unseen.json").write_text(json.dumps(rows, indent=1))
    return rows, table


def _chosen(results: Mapping[str, Any], site: str | None = None) -> dict[str, Any]:
    """What a FedSM run chose on its validation (``gamma``; ``gamma_per_model`` under
    ``fedsm.gamma = "auto-per-model"``, else None) and, for a held-out ``site`` (default: the one site
    of ``results["fedsm"]["per_site"]`` that is not in the federation), its test Dice with that choice
    (``dice_at_chosen``)."""
    rep = results["fedsm"]
    out = {"gamma": rep.get("gamma"), "gamma_per_model": rep.get("gamma_per_model")}
    held = [s for s in rep.get("per_site", {}) if s not in results.get("sites", [])]
    site = site or (held[0] if len(held) == 1 else None)
    if site is not None:
        out["dice_at_chosen"] = rep["per_site"][site]["dice"]
    return out


def gamma_text(row: Mapping[str, Any]) -> str:
    """The γ a run used: its per-model thresholds ``(0, 1, 0.95, …)`` or its one γ; – if unknown."""
    per = row.get("gamma_per_model")
    if per:
        return "(" + ", ".join(f"{float(g):g}" for g in per) + ")"
    return "–" if row.get("gamma") is None else f"{row['gamma']:g}"


# ------------------------------------------------------------------- Table 7
def sweep(
    config: str | Path | RunConfig,
    out: str | Path,
    lams: Sequence[float],
    overrides: Sequence[str] = (),
    gammas: Sequence[float] | None = None,
    progress: bool = False,
    log: Callable[[str], None] = print,
    jobs: int | None = None,
    devices: Sequence[str] | None = None,
    device: str | None = None,
    launch: LaunchOptions | None = None,
    **fields: Any,
) -> tuple[list[dict[str, Any]], str]:
    """FedSM Table 7: one FedSM run per λ (Client Avg and Global Dice), plus test Dice per γ.

    ``jobs``/``devices``: the λs' runs in processes (:func:`_run_points`); ``launch``: as Ray or Slurm tasks;
    ``device``: every run's.

    Every λ in [0, 1] runs (the paper's Table 7 includes λ = 0.1 < 1/K = 1/6; below 1/K a
    warning says that a site's own model then weighs less than each other site's); a λ
    outside [0, 1] is reported as rejected rather than run.
    """
    cfg, workload, data, _ = _study_setup(config, overrides, progress, launch, fields)
    if cfg.method != "fedsm":
        cfg = dataclasses.replace(cfg, method="fedsm")
    if device is not None:
        cfg = dataclasses.replace(cfg, device=device)
    out = Path(out)
    rows = []
    ok = [lam for lam in lams if 0.0 <= lam <= 1.0]
    points = [(with_fedsm(cfg, lam=float(lam)), out / f"lam{lam:g}", None) for lam in ok]
    done = _run_points(points, workload, data, gammas, jobs, devices, overrides, progress, log, launch, out)
    results = dict(zip(ok, done))
    for lam in lams:
        if lam not in results:
            rows.append({"lam": lam, "rejected": f"λ = {lam} is outside [0, 1]"})
            log(f"λ = {lam}: skipped, outside [0, 1]")
            continue
        res = results[lam]
        rows.append(
            {
                "lam": lam,
                "client_avg_dice": res["client_avg_dice"],
                "global_dice": res["global_dice"],
                "gamma": res["fedsm"]["gamma"],
                "gamma_per_model": res["fedsm"].get("gamma_per_model"),
                "dice_by_gamma": res["fedsm"]["dice_by_gamma"],
                "wall_time_s": res.get("wall_time_s"),
            }
        )
        log(f"λ = {lam}: client avg Dice {res['client_avg_dice']:.4f}, global {res['global_dice']:.4f}")
    table = table7(rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.md").write_text(table)
    (out / "sweep.json").write_text(json.dumps(rows, indent=1))
    return rows, table


def table7(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown in FedSM Table 7's layout (columns λ; rows Client Avg, Global), then test Dice per γ per λ."""
    head = ["λ", *[f"{r['lam']:g}" for r in rows]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, key in (("Client Avg", "client_avg_dice"), ("Global", "global_dice")):
        lines.append(
            "| " + " | ".join([label, *["rejected" if "rejected" in r else f"{r[key]:.4f}" for r in rows]]) + " |"
        )
    text = "\n".join(lines) + "\n"
    ran = [r for r in rows if "rejected" not in r and r.get("dice_by_gamma")]
    if ran:
        gs = sorted({g for r in ran for g in r["dice_by_gamma"]}, key=float)
        lines = ["| γ \\ λ | " + " | ".join(f"{r['lam']:g}" for r in ran) + " |", "|" + "---|" * (len(ran) + 1)]
        for g in gs:
            lines.append(
                f"| {float(g):g} | " + " | ".join(f"{r['dice_by_gamma'].get(g, float('nan')):.4f}" for r in ran) + " |"
            )
        text += (
            "\nTest Dice (pooled over all sites' test cases) of the FedSM composite per threshold γ:\n\n"
            + "\n".join(lines)
            + "\n"
        )
    notes = [r["rejected"] for r in rows if "rejected" in r]
    if notes:
        text += "\nRejected: " + "; ".join(notes) + " (SoftPull's range, FedSM Eq. 11).\n"
    return text
