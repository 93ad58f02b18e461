"""A finished run's predictor, outside any federation: the run's settings, its data layout and plan, the
best model ``evaluate`` uses for the method (or the one ``--site`` / ``--model`` name), loaded into one
:class:`fedseg.site.runtime.Site` with no data and turned into a predictor by
:func:`fedseg.site.predict.predictor`, the function evaluation runs.

The data layout comes from the run folder itself (``data.json``, written when the run starts), so that a run
copied to another machine predicts without its training federation; ``--spec`` overrides it, and a run
without one falls back on the spec its ``config.toml`` names."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from torch.utils.data import TensorDataset

from fedseg.algorithms import get_algorithm, known_sections
from fedseg.algorithms.fedsm.selection import load_composite, route, thresholds
from fedseg.data.spec import LAYOUT_NAME, data_header, load_federation
from fedseg.data.volumes.plan import Plan
from fedseg.foundation.config import RunConfig, load_run_config
from fedseg.foundation.errors import ConfigError
from fedseg.seams.algorithm import Candidate
from fedseg.seams.checkpoint import load_best, restore_site
from fedseg.site import predict as prediction
from fedseg.site.runtime import Site, SiteData
from fedseg.site.workload import workload_for

__all__ = ["MODEL_CHOICES", "Loaded", "choose_candidate", "find_run", "load_predictor", "load_site_predictor"]

MODEL_CHOICES = ("global", "personal", "ensemble")
"""``--model``: the method's global model, a site's own (personalized or local) model, or its composite /
ensemble (FedSM's selector-routed models)."""


@dataclasses.dataclass
class Loaded:
    """What ``fedseg predict`` and ``fedseg export`` need of a run."""

    cfg: RunConfig
    layout: dict[str, Any]
    """``spatial_dims``, ``in_channels``, ``labels`` ({name: values}), ``mode``, ``image_size``."""
    plan: Plan | None
    site: Site
    candidate: Candidate
    predict: prediction.Predict
    routing: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
    """FedSM's composite: ``x → (chosen model index per image, selector probabilities)``; 0 is the global
    model, ``j`` the j-th site's personalized model (:attr:`route_names`)."""
    route_names: list[str] = dataclasses.field(default_factory=list)
    intensity_site: str | None = None
    """Whose intensity scheme a volume is normalized by (the plan may hold one per site): ``--site``, the
    model's own site, or the deployed site; None: each channel's scheme for the federation."""
    run_dir: Path | None = None
    """The run folder (or a deployed site's work folder) the model came from."""
    round: int | None = None
    """The round of the model: its best round (a deployed site: its newest checkpoint's)."""
    layout_source: str = ""
    """Where the data layout was read: the run's ``data.json``, a spec (``--spec``, or the one the run's
    ``config.toml`` names), or a deployed server's ``deploy.json``."""
    asked: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The choices given (``site``, ``model``, ``device``, ``precision``), recorded with the masks."""

    @property
    def volumes(self) -> bool:
        return self.plan is not None

    @property
    def threshold(self) -> float:
        return float(self.cfg.eval.threshold)


def choose_candidate(best: dict[str, Any], primary: str | None, site: str | None, model: str | None) -> str:
    """The best-model entry ``fedseg predict`` uses: ``--model`` and ``--site`` as given, else the method's
    primary candidate (what its row reports), else ``--site``'s own model; one error naming the choices."""
    names = sorted(best)
    own = [n for n in names if best[n].candidate.home_site is not None]
    sites = sorted({best[n].candidate.home_site for n in own})
    composite = [n for n in names if best[n].candidate.predictor != "model"]
    if model is not None and model not in MODEL_CHOICES:
        raise ConfigError(f"--model {model!r} is not known; use one of {', '.join(MODEL_CHOICES)}")
    if site is not None and own and site not in sites:
        raise ConfigError(f"--site {site!r}: this run's sites with models of their own are {sites}; use one of them")
    if model == "global" or (model is None and site is None and primary is None and "global" in best):
        if "global" not in best:
            raise ConfigError(
                f"this run has no global model (its best models: {names}); use --model personal --site NAME"
            )
        return "global"
    if model == "ensemble":
        if not composite:
            raise ConfigError(f"this run has no composite or ensemble (its best models: {names}); use --model global")
        return composite[0]
    if model == "personal" or (model is None and primary is None) or (model is None and site is not None and own):
        if not own:
            raise ConfigError(f"this run has no per-site models (its best models: {names}); leave out --model")
        if site is None:
            raise ConfigError(
                f"this run's models belong to its sites; choose one with --site (one of {sites})"
                + ("" if "global" not in best else " or use --model global")
            )
        return next(n for n in own if best[n].candidate.home_site == site)
    if primary is not None and primary in best:
        return primary
    return names[0]


def find_run(path: str | Path, log: Callable[[str], None] = print) -> Path:
    """The run folder ``path`` names: itself when it holds a run (``config.toml``; a deployed site's work
    folder: ``data.json`` and ``round-*``), else the one run one or two levels below it (logged), else one
    error listing the runs found there and saying to name one."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: no such folder -> give the output folder of a finished fedseg run")
    if not path.is_dir():
        raise ConfigError(f"{path} is a file, not a run folder -> give the output folder of a finished fedseg run")
    if (path / "config.toml").is_file():
        return path
    found = sorted(
        {p.parent for pattern in ("*/config.toml", "*/*/config.toml") for p in path.glob(pattern)},
        key=lambda p: p.as_posix(),
    )
    runs = [p for p in found if (p / "checkpoints").is_dir() or (p / LAYOUT_NAME).is_file()] or found
    if len(runs) == 1:
        log(f"predict: using the run in {runs[0]}")
        return runs[0]
    if not runs:
        raise ConfigError(
            f"{path} holds no fedseg run (no config.toml in it or in its sub-folders) -> give the output folder "
            "of a finished fedseg run (fedseg run ... --out FOLDER)"
        )
    shown = ", ".join(str(r) for r in runs[:8]) + (f" and {len(runs) - 8} more" if len(runs) > 8 else "")
    raise ConfigError(f"{path} holds {len(runs)} runs ({shown}) -> name the one to use")


def _header_layout(header: dict[str, Any]) -> dict[str, Any]:
    return {k: header.get(k) for k in ("spatial_dims", "in_channels", "labels", "mode", "image_size")}


def _layout(cfg: RunConfig, run_dir: Path, spec: str | Path | None) -> tuple[dict[str, Any], dict | None, str]:
    """``(layout, plan as JSON or None, where it was read)``: ``--spec``, else the run's ``data.json``, else a
    deployed server's ``deploy.json``, else the spec the run's config names."""
    stored = run_dir / LAYOUT_NAME
    header: dict[str, Any] = {}
    if stored.is_file():
        try:
            header = json.loads(stored.read_text())
        except ValueError as e:
            if spec is None:
                raise ConfigError(f"{stored} is damaged ({e}) -> give the run's federation spec with --spec") from None
    if spec is not None:  # the spec's layout; a volume run's plan stays the one it was trained with
        return _header_layout(data_header(load_federation(spec))), header.get("plan"), str(spec)
    if header:
        return _header_layout(header), header.get("plan"), str(stored)
    deployed = run_dir / "deploy.json"
    if deployed.is_file():
        desc = json.loads(deployed.read_text())
        if isinstance(desc.get("data"), dict):
            return _header_layout(desc["data"]), desc.get("plan"), str(deployed)
    federation = Path(str(cfg.federation))
    if not federation.is_file():
        raise ConfigError(
            f"{run_dir} has no {LAYOUT_NAME} (the data layout a run writes when it starts) and its config.toml "
            f"names the federation {federation}, which is not there -> give the federation spec the run was "
            "trained on with --spec PATH"
        )
    return _header_layout(data_header(load_federation(federation))), None, str(federation)


def load_predictor(
    run_dir: str | Path,
    site: str | None = None,
    model: str | None = None,
    device: str | None = None,
    precision: str | None = None,
    spec: str | Path | None = None,
    log: Callable[[str], None] = print,
) -> Loaded:
    """The predictor of the finished run in ``run_dir`` (see the module docstring; a folder holding exactly
    one run is taken for it, :func:`find_run`).

    ``device`` / ``precision`` override the run's (``"cpu"``, ``"cuda"``; ``"fp32"``, ``"bf16"``); ``spec``
    the data layout the run folder keeps."""
    run_dir = find_run(run_dir, log)
    asked = {"site": site, "model": model, "device": device, "precision": precision}
    if (run_dir / LAYOUT_NAME).is_file() and not (run_dir / "checkpoints").is_dir() and any(run_dir.glob("round-*")):
        return load_site_predictor(run_dir, model=model, device=device, precision=precision)
    fix = (
        "predict needs the best models of a finished fedseg run (checkpoints/best.safetensors + best.json): "
        "give the run's folder, or finish the run (fedseg run --resume RUN)"
    )
    best = load_best(run_dir / "checkpoints", fix=fix)
    cfg = load_run_config(run_dir / "config.toml", known_sections=known_sections())
    cfg = _override(cfg, device, precision)
    results = json.loads((run_dir / "results.json").read_text()) if (run_dir / "results.json").is_file() else {}
    layout, stored_plan, source = _layout(cfg, run_dir, spec)
    plan_json = stored_plan or results.get("plan")
    plan_file = str(run_dir / LAYOUT_NAME) if spec is not None else source
    where = plan_file if stored_plan else f"{run_dir}/results.json"
    plan = Plan.from_json(plan_json, where=where) if plan_json else None
    if plan is None and layout["mode"] in ("3d", "patches2d"):
        raise ConfigError(
            f"{run_dir} records no plan (data.json, results.json); a volume run's predictor needs it -> run it again"
        )
    name = choose_candidate(best, results.get("primary"), site, model)
    cand = best[name].candidate
    algorithm = get_algorithm(cfg)
    cfg = algorithm.cfg = algorithm.resolved_config()
    spec_sites = list(results.get("sites") or cand.config.get("sites") or [site or "site"])
    here = site or cand.home_site or spec_sites[0]
    index = spec_sites.index(here) if here in spec_sites else 0
    empty = TensorDataset(torch.zeros(0), torch.zeros(0))
    runtime = Site(here, index, SiteData(empty), workload_for(layout, cfg), cfg, cast(Any, algorithm))
    predict = prediction.predictor(runtime, cand.name, cand.predictor, cand.arrays, cand.config)
    routing, route_names = None, []
    if cand.predictor == "fedsm":
        routing, route_names = _fedsm_routing(runtime, cand, algorithm)
    return Loaded(
        cfg,
        layout,
        plan,
        runtime,
        cand,
        predict,
        routing,
        route_names,
        site or cand.home_site,
        run_dir=run_dir,
        round=int(best[name].round),
        layout_source=source,
        asked=asked,
    )


def _fedsm_routing(site: Site, cand: Candidate, algorithm: Any):
    """FedSM's routing of each image (Alg. 2), with the composite's own selector and thresholds."""
    config = cand.config
    sel, _ = load_composite(site, cand.arrays, config, algorithm.selector_factory, "fedsm-eval/")
    mode = config.get("mode", "gate")
    gamma = thresholds(config)
    names = ["global", *[f"personal/{s}" for s in config["sites"]]]

    @torch.no_grad()
    def routing(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with site.autocast():
            probs = torch.softmax(sel(x), dim=1).float()
        if mode == "gate":
            return route(probs, gamma), probs
        return probs.argmax(dim=1), probs

    return routing, names


def _override(cfg: RunConfig, device: str | None, precision: str | None) -> RunConfig:
    if device is not None:
        cfg = dataclasses.replace(cfg, device=device)
    if precision is not None:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=cast(Any, precision)))
    return cfg


def load_site_predictor(
    folder: str | Path, model: str | None = None, device: str | None = None, precision: str | None = None
) -> Loaded:
    """The predictor of a deployed site from its work folder ``WORKDIR/<run_id>`` alone (no server, no other
    site): the run's config and data layout the site keeps there, its newest complete checkpoint
    (``round-<r>/<site>.safetensors``), and of its models the personalized one (``--model personal``, the
    default where the method has one) or its copy of the global model (``--model global``)."""
    folder = Path(folder)
    rounds = sorted(
        (int(d.name.split("-", 1)[1]), d)
        for d in folder.glob("round-*")
        if d.name.split("-", 1)[1].isdigit() and (d / "DONE").is_file()
    )
    states = sorted(rounds[-1][1].glob("*.json")) if rounds else []
    if not states:
        raise ConfigError(
            f"{folder} holds no complete site checkpoint (round-<r>/<site>.safetensors with DONE); give the work "
            "folder of a deployed site's run (WORKDIR/<run_id>) after at least one checkpointed round"
        )
    meta = json.loads(states[0].read_text())
    name = str(meta["site"])
    cfg = load_run_config(folder / "config.toml", known_sections=known_sections() | {"deploy"})
    cfg = _override(cfg, device, precision)
    header = json.loads((folder / LAYOUT_NAME).read_text())
    layout = _header_layout(header)
    plan = Plan.from_json(header["plan"], where=f"{folder}/{LAYOUT_NAME}") if header.get("plan") else None
    algorithm = get_algorithm(cfg)
    cfg = algorithm.cfg = algorithm.resolved_config()
    empty = TensorDataset(torch.zeros(0), torch.zeros(0))
    runtime = Site(name, 0, SiteData(empty), workload_for(layout, cfg), cfg, cast(Any, algorithm))
    restore_site(runtime, rounds[-1][1])
    roles: list[str] = [r for r in ("personal", "local", "global") if r in runtime.models]
    choices: dict[str | None, list[str]] = {"personal": ["personal", "local"], "global": ["global"], None: roles}
    want = choices.get(model)
    if want is None:
        raise ConfigError(
            f"--model {model!r} at a deployed site: its work folder holds the models {roles}; use --model personal "
            "or global (a composite needs every site's models: predict with the server's run folder)"
        )
    role = next((r for r in want if r in roles), None)
    if role is None:
        raise ConfigError(f"site {name}: no {model} model in {rounds[-1][1]} (it holds {roles}); use one of those")
    arrays = {k: v for k, v in runtime.models[role].state_dict().items()}
    cand = Candidate(role, arrays, home_site=name)
    predict = prediction.predictor(runtime, role, "model", arrays, {"bn_role": role})
    return Loaded(
        cfg,
        layout,
        plan,
        runtime,
        cand,
        predict,
        intensity_site=name,
        run_dir=folder,
        round=rounds[-1][0],
        layout_source=str(folder / LAYOUT_NAME),
        asked={"site": None, "model": model, "device": device, "precision": precision},
    )
