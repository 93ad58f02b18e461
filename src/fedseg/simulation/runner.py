"""Library entry points: run a method in simulation, on a federation spec or on any task.

``run(cfg, out)`` loads the federation named by the config (validating every file
first), builds the segmentation workload and runs the method; ``simulate(...)``
does the same for a user-supplied workload and in-memory site datasets.  Both build the
run through :func:`build_engine`, the one place where sites, the in-process transport and
the engine are put together (the FedSM studies and ``fedseg evaluate`` use it too).  What a deployed run
shares with a simulation — loading a federation, a volume run's plan, the results files — lives below both,
in :mod:`fedseg.execution.federation` and :mod:`fedseg.execution.results`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import ConcatDataset, TensorDataset

from fedseg.algorithms import get_algorithm, known_sections
from fedseg.algorithms.centralized import POOLED
from fedseg.data.spec import load_federation
from fedseg.data.volumes.lazy import CachedVolumes
from fedseg.execution.engine import Engine
from fedseg.execution.federation import load_federation_data, plan_volume_run, write_layout
from fedseg.execution.inprocess import InProcessTransport
from fedseg.execution.results import write_results
from fedseg.execution.vectorize import AUTO_MIN_SITES, VectorizedExecutor, resolve_vectorize
from fedseg.foundation.config import RunConfig, dump_toml, load_run_config
from fedseg.foundation.device import describe, resolve_device
from fedseg.foundation.errors import ConfigError
from fedseg.seams.algorithm import Algorithm
from fedseg.seams.checkpoint import check_resumable
from fedseg.site.runtime import Site, SiteData
from fedseg.site.workload import Workload, workload_for

__all__ = ["build_engine", "build_transport", "run", "simulate", "vectorized_schedule"]


def _pooled(site_data: Mapping[str, SiteData]) -> SiteData:
    trains: list[Any] = [d.train for d in site_data.values()]  # in-memory, cached or other datasets
    if all(isinstance(t, CachedVolumes) for t in trains):
        return SiteData(train=CachedVolumes.concat(trains))
    pooled: Any
    if all(hasattr(t, "images") for t in trains):
        pooled = TensorDataset(torch.cat([t.images for t in trains]), torch.cat([t.labels for t in trains]))
    else:
        pooled = ConcatDataset(trains)
    if all(getattr(t, "extents", None) is not None for t in trains):
        pooled.extents = [e for t in trains for e in t.extents]  # volumes: each case's own shape
    return SiteData(train=pooled)


def vectorized_schedule(steps: list[int]) -> list[tuple[int, int]]:
    """The stacks a vectorized round of sites taking ``steps`` local steps passes through, as (sites stacked,
    stacked steps): all of them until the first finishes, then the sites still training (the executor
    regroups as sites finish, :func:`fedseg.execution.vectorize.fit.train_group`).  The stacked steps add up
    to max(steps) and the rows they compute to sum(steps), the arithmetic of training the sites in turn."""
    out: list[tuple[int, int]] = []
    done = 0
    for i, s in enumerate(sorted(steps)):
        if s > done:
            out.append((len(steps) - i, s - done))
            done = s
    return out


def _say_vectorized(steps: list[int], device: torch.device, log: Callable[[str], None]) -> None:
    """The start-up lines of a vectorized run: how the stack shrinks when the sites take different numbers of
    steps (epoch mode, sites of different sizes), and on the CPU when a vectorized round is slower."""
    plan = vectorized_schedule(steps)
    if len(plan) > 1:
        stacks = ", ".join(f"{k} for {n}" for k, n in plan)
        log(
            f"simulation.vectorize: the sites take {min(steps)} to {max(steps)} local steps a round; the stack drops "
            f"each site as it finishes (sites stacked for steps: {stacks}): {max(steps)} stacked steps computing "
            f"{sum(steps)} site-steps, the arithmetic of training them one after another"
        )
    if device.type == "cpu":
        log(
            "simulation.vectorize: on the CPU vectorizing gains where a step costs little arithmetic (small models "
            "and images: up to 2x at 32² with channels 8…64); where the arithmetic dominates (the default U-Net at 64²) "
            "a stacked step costs about what the sites' steps cost one after another, and packing every site's "
            "weights and Adam moments into the stack and back each round makes short rounds slower (6 sites at "
            "64²: about 1.0x with 100 steps a round, 0.85-0.9x with 10); simulation.vectorize = off trains the "
            "sites one after another"
        )


def build_transport(
    cfg: RunConfig,
    workload: Workload,
    site_data: Mapping[str, SiteData],
    algorithm: Algorithm | None = None,
    log: Callable[[str], None] = print,
    heldout: Mapping[str, SiteData] | None = None,
) -> InProcessTransport:
    """In-process transport over one :class:`Site` per entry of ``site_data`` (plus the pooled site if needed),
    vectorized when ``simulation.vectorize`` resolves to on (:mod:`fedseg.execution.vectorize`).

    ``heldout``: sites addressable by name for evaluation but not part of the federation (FedSM's
    unseen-site study); their indices follow the federation's (and the pooled site's)."""
    algorithm = algorithm or get_algorithm(cfg)
    sites = [Site(name, i, data, workload, cfg, algorithm) for i, (name, data) in enumerate(site_data.items())]
    extra = []
    if algorithm.needs_pooled_site:
        extra.append(Site(POOLED, len(sites), _pooled(site_data), workload, cfg, algorithm))
    for name, data in (heldout or {}).items():
        extra.append(Site(name, len(sites) + len(extra), data, workload, cfg, algorithm))
    vectorized = None
    device = resolve_device(cfg.device)
    if cfg.privacy.dp == "sample" and resolve_vectorize(cfg.simulation.vectorize, device, len(sites)):
        log("privacy.dp = sample: the sites train one after another (DP-SGD's per-sample gradients are per site)")
    elif resolve_vectorize(cfg.simulation.vectorize, device, len(sites)):
        vectorized = VectorizedExecutor(
            cfg.simulation.vectorize_group, log, cuda_graphs=cfg.simulation.cuda_graphs == "on"
        )
        log(
            f"simulation.vectorize = {cfg.simulation.vectorize}: the sites' local steps run as one vectorized computation (equal to sequential to rounding)"
        )
        _say_vectorized([s.steps_per_round() for s in sites], device, log)
    elif cfg.simulation.vectorize == "auto" and resolve_vectorize("auto", device):
        log(
            f"simulation.vectorize = auto: {len(sites)} sites train one after another (vectorizing fewer than "
            f"{AUTO_MIN_SITES} sites gained nothing on a GPU); --set simulation.vectorize=on to vectorize them"
        )
    return InProcessTransport(sites, extra, vectorized)


def build_engine(
    cfg: RunConfig,
    workload: Workload,
    site_data: Mapping[str, SiteData],
    out: str | Path | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    algorithm: Algorithm | None = None,
    heldout: Mapping[str, SiteData] | None = None,
) -> Engine:
    """The one way a simulation is put together: the method with its settings resolved (defaults filled
    in), one :class:`Site` per entry of ``site_data`` over an in-process transport (:func:`build_transport`;
    ``heldout`` sites are addressable but not trained), the engine, and ``out/config.toml`` (the settings
    as used, the device in its first line).  ``engine.transport`` is the transport."""
    if not site_data:
        raise ConfigError("no sites given; a federation needs at least one site")
    algorithm = algorithm or get_algorithm(cfg)
    cfg = algorithm.cfg = algorithm.resolved_config()  # write down the settings as used (defaults filled in)
    transport = build_transport(cfg, workload, site_data, algorithm, log=log, heldout=heldout)
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        used = f"# ran on device {describe(resolve_device(cfg.device))}, precision {cfg.train.precision}\n"
        (Path(out) / "config.toml").write_text(used + dump_toml(cfg.to_dict()))
    return Engine(cfg, algorithm, transport, workload, out=out, progress=progress, log=log, on_round=on_round)


def simulate(
    cfg: RunConfig,
    workload: Workload,
    site_data: Mapping[str, SiteData],
    out: str | Path | None = None,
    progress: bool = True,
    resume: bool = False,
    stop_after: int | None = None,
    log: Callable[[str], None] = print,
    on_round: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any] | None:
    """Run ``cfg.method`` with every site in this process.

    Parameters
    ----------
    cfg
        Run configuration (``cfg.federation`` is only recorded).
    workload
        Model factory, loss, metric (any task; see :mod:`fedseg.site.workload`).
    site_data
        ``{site name: SiteData}`` in federation order.
    out
        Output folder: checkpoints, ``results.json``, ``results.md``, ``config.toml``.
    resume
        Continue from the checkpoint in ``out``.
    stop_after
        Stop (checkpointed) after this round, as an interruption would.
    on_round
        Called with each round's history entry (see :class:`fedseg.execution.engine.Engine`).
    """
    engine = build_engine(cfg, workload, site_data, out=out, progress=progress, log=log, on_round=on_round)
    transport = engine.transport
    if out is not None and cfg.privacy.dp != "off" and isinstance(transport, InProcessTransport):
        for name in transport.sites:  # each site's privacy ledger, outside its checkpoints
            transport.site(name).dp.ledger.attach(Path(out) / "privacy" / f"{name}.jsonl", fresh=not resume)
    results = engine.run(resume=resume, stop_after=stop_after)
    if results is not None and out is not None:
        write_results(results, out)
        engine.finish()  # the results are on disk: drop what only --resume reads (checkpoint_keep)
    return results


def _check_slice_evaluation(cfg: RunConfig, algorithm: Algorithm) -> None:
    """Refuse, before any data is read, a method with its own predictors (FedSM's selector routing) on a
    ``patches2d`` federation, whose evaluation volumes only the workload's model predicts (slice by slice)."""
    if not Path(cfg.federation).is_file() or load_federation(cfg.federation).mode != "patches2d":
        return
    own = sorted(set(algorithm.predictors()) - {"model"})
    if own:
        raise ConfigError(
            f"method {cfg.method!r} evaluates through its own predictors {own}, which see each case as stored; "
            'data.mode = "patches2d" evaluates volumes slice by slice through the model alone -> run a method '
            'whose candidates are models (e.g. fedavg, fga) or set data.mode = "3d"'
        )


def run(
    cfg: RunConfig | str | Path,
    out: str | Path | None = None,
    overrides: list[str] | None = None,
    progress: bool = True,
    resume: bool = False,
    stop_after: int | None = None,
    log: Callable[[str], None] = print,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    **fields: Any,
) -> dict[str, Any] | None:
    """Run a method on a federation spec in simulation (what ``fedseg run`` does).

    ``cfg`` is a :class:`RunConfig` or a path to a run config / federation spec;
    ``overrides`` and ``fields`` (method, rounds, seed) apply to a path.
    """
    if resume:
        if out is None:
            raise ConfigError("resume needs the output folder of the interrupted run")
        saved = Path(out) / "config.toml"
        if not saved.is_file():
            raise ConfigError(f"{out} has no config.toml: it is not a fedseg run folder; check the path")
        check_resumable(Path(out) / "checkpoints")  # a pruned finished run: said before any data is read
        cfg = load_run_config(saved, overrides, known_sections(), **fields)
    elif not isinstance(cfg, RunConfig):
        cfg = load_run_config(cfg, overrides, known_sections(), **fields)
    algorithm = get_algorithm(cfg)  # validate the method and its settings before loading data
    resolve_device(cfg.device)  # --device cuda without CUDA stops here, before any data is read
    _check_slice_evaluation(cfg, algorithm)
    fed, data = load_federation_data(
        cfg.federation,
        progress=progress,
        log=log,
        volume_cache=cfg.volume_cache,
        volume_reads=cfg.volume_reads,
        device=cfg.device,
        batch=cfg.train.batch_size,
    )
    plan = None
    if fed.volumes:
        cfg, plan = plan_volume_run(cfg, fed, data, log=log)
    if out is not None:
        write_layout(out, fed, plan)
    results = simulate(
        cfg,
        workload_for(fed, cfg),
        data,
        out=out,
        progress=progress,
        resume=resume,
        stop_after=stop_after,
        log=log,
        on_round=on_round,
    )
    if plan is not None and results is not None:
        results["plan"] = plan.to_json()
        if out is not None:
            write_results(results, out)
    return results
