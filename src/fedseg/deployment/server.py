"""The server half of a deployment, independent of the network library.

``prepare_run`` writes what a deployed run needs into its output folder
(``config.toml``, the resolved run config, and ``deploy.json``: run id, site
order, the federation's data layout — never a data path).  ``serve`` runs
fedseg's unchanged :class:`~fedseg.execution.engine.Engine` in the server's main over a
:class:`~fedseg.deployment.transport.RemoteTransport`, checkpoints after every round
(server state, best models, history; sites checkpoint their own state on the
same call) and writes ``results.json`` / ``results.md`` like a simulation.
"""

from __future__ import annotations

import dataclasses
import json
import time
import tomllib
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedseg.algorithms import get_algorithm, known_sections
from fedseg.data.spec import VOLUME_MODES, load_federation
from fedseg.data.volumes.load import plan_path, with_spec_intensity
from fedseg.data.volumes.plan import load_plan
from fedseg.deployment.params import deploy_params
from fedseg.deployment.site import data_header, is_plain_name
from fedseg.deployment.transport import Call, DeployError, RemoteTransport
from fedseg.deployment.volumes import plan_and_shape
from fedseg.execution.engine import Engine
from fedseg.execution.results import write_results
from fedseg.foundation.arrays import Arrays, is_float, nonfinite
from fedseg.foundation.config import RunConfig, apply_overrides, dump_toml, load_run_config
from fedseg.foundation.errors import ConfigError
from fedseg.seams.checkpoint import PROGRESS, save_json
from fedseg.site.workload import workload_for

__all__ = [
    "CONTROL_RESTART",
    "CONTROL_STOPPED",
    "REFUSED",
    "check_aggregate",
    "load_deploy_config",
    "prepare_run",
    "read_deploy_json",
    "read_dropouts",
    "serve",
]

CONTROL_RESTART = Path("control") / "restart"
"""A file the server polls: the supervisor asks the job to end after the current round (a site rejoins)."""

CONTROL_STOPPED = Path("control") / "stopped"
"""Written by the server when its run stopped on that request (``{"round": r}``): the job has nothing left to
do, and the supervisor ends it when FLARE does not (a job with a dead site's part stays open)."""

REFUSED = "refused.json"
"""Written by the server when too few sites accepted the run (``{site: why}`` of the sites that refused it
by their policy): the supervisor then stops instead of re-submitting a job the same sites would refuse."""


def check_aggregate(state: Arrays, max_abs: float) -> None:
    """Refuse to commit a server state holding a NaN/infinity or a value beyond ``deploy.max_abs_value``."""
    bad = nonfinite(state)
    if bad:
        raise DeployError(
            f"the aggregate holds non-finite values in {bad[:5]}; it is not checkpointed "
            "(the previous round's checkpoint stays valid for --resume)"
        )
    for k, v in state.items():
        if is_float(v) and v.numel() and float(v.abs().max()) > max_abs:
            raise DeployError(
                f"the aggregate's '{k}' reaches {float(v.abs().max()):.3g}, beyond deploy.max_abs_value = {max_abs:g}; "
                "it is not checkpointed (the previous round's checkpoint stays valid for --resume)"
            )


def read_deploy_json(out: Path) -> dict[str, Any]:
    """``OUT/deploy.json`` (the run id, sites, data layout), checked: one error naming the file if it is unreadable."""
    path = Path(out) / "deploy.json"
    if not path.is_file():
        raise ConfigError(f"{out} has no deploy.json: it is not a deployed run folder; check the path")
    try:
        desc = json.loads(path.read_text())
    except ValueError as e:
        raise ConfigError(
            f"{path} is damaged ({e}); it holds the run id the sites' checkpoints are filed under: restore it "
            "from a backup (or rewrite it from a site's WORKDIR/<run_id>), or start a new run"
        ) from None
    if not isinstance(desc, dict) or not is_plain_name(desc.get("run_id")) or not isinstance(desc.get("sites"), list):
        raise ConfigError(f"{path} lacks a plain run_id or the site list; restore it from a backup or start a new run")
    return desc


def read_dropouts(path: Path, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """The dropouts recorded in ``dropouts.jsonl``; a torn or malformed line (a crash mid-append) is skipped with a warning."""
    out: list[dict[str, Any]] = []
    if not path.is_file():
        return out
    for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            entry = None
        if not isinstance(entry, dict):
            log(f"[deploy] warning: {path} line {i} is torn or malformed ({line[:80]!r}); skipped")
            continue
        out.append(entry)
    return out


def _given(path: str | Path | None, overrides: list[str], key: str) -> bool:
    """Whether the run config file or the overrides set the dotted ``key`` (unreadable files: no; the
    config's loader names their error)."""
    raw: dict[str, Any] = {}
    try:
        if path is not None and Path(path).is_file():
            raw = tomllib.loads(Path(path).read_text())
        raw = apply_overrides(raw, overrides)
    except (OSError, ValueError):
        return False
    node: Any = raw
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def load_deploy_config(path: str | Path, overrides: list[str] | None = None, **fields: Any) -> RunConfig:
    """A run config that may carry a ``[deploy]`` section.

    A deployment runs with secure aggregation unless the config or the overrides set
    ``privacy.secure_aggregation`` (then, unless they set it too, with ``deploy.max_update_ratio = 0``, the
    rule that compares single sites' updates the server no longer sees); a method whose server reads each
    site's reply then stops here with the setting that deploys it in the clear."""
    overrides = list(overrides or [])
    default_secure = not _given(path, overrides, "privacy.secure_aggregation")
    if default_secure:
        ratio = [] if _given(path, overrides, "deploy.max_update_ratio") else ["deploy.max_update_ratio=0"]
        overrides = ["privacy.secure_aggregation=true", *ratio, *overrides]
    cfg = load_run_config(path, overrides, known_sections(), **fields)
    if default_secure:
        clear = dataclasses.replace(cfg, privacy=dataclasses.replace(cfg.privacy, secure_aggregation=False))
        try:
            why = get_algorithm(clear).secure_aggregation_unsupported()
        except ConfigError:
            why = None  # any other error of the config: raised below as usual
        if why:
            raise ConfigError(
                f"a deployment runs with privacy.secure_aggregation = true unless the run config says otherwise, and "
                f"{cfg.method} cannot: {why}; to deploy it with each site's reply in the clear, set "
                "--set privacy.secure_aggregation=false (and every site's policy must then say "
                '"secure_aggregation": false, or that site refuses the run)'
            )
    try:
        deploy_params(cfg)
    except ConfigError as e:
        if default_secure and "secure_aggregation" in str(e):
            raise ConfigError(
                f"{e} (a deployment turns privacy.secure_aggregation on unless the run config sets it: "
                "--set privacy.secure_aggregation=false deploys in the clear)"
            ) from None
        raise
    return cfg


def prepare_run(
    cfg: RunConfig, out: str | Path, sites: list[str] | None = None, resume: bool = False
) -> dict[str, Any]:
    """Write ``OUT/config.toml`` and ``OUT/deploy.json``; returns the deploy description.

    ``sites`` restricts the run to these sites of the federation spec (in spec
    order); by default all of them.  With ``resume`` the existing description is
    kept (same run id, so sites find their checkpoints) and marked for resuming.
    """
    out = Path(out)
    desc_path = out / "deploy.json"
    if resume:
        desc = read_deploy_json(out)
        if not (out / "checkpoints" / PROGRESS).is_file():
            raise ConfigError(f"{out} has no checkpoint yet (no round completed); start the run again without --resume")
        desc["resume"] = True
        save_json(desc, desc_path)
        return desc
    algorithm = get_algorithm(cfg)
    if algorithm.needs_pooled_site:
        raise ConfigError(
            f"method {cfg.method!r} pools all sites' data and cannot be deployed; it exists in simulation only"
        )
    fed = load_federation(cfg.federation)
    names = list(fed.site_names)
    if sites is not None:
        unknown = [s for s in sites if s not in names]
        if unknown:
            raise ConfigError(f"sites {unknown} are not in the federation {cfg.federation} (it has {names})")
        names = [s for s in names if s in sites]
    out.mkdir(parents=True, exist_ok=True)
    # the settings as used, defaults filled in (as a simulation writes them), so the server and
    # every site read one fully resolved description of the method
    (out / "config.toml").write_text(dump_toml(algorithm.resolved_config().to_dict()))
    desc = {
        "run_id": f"{cfg.method}-{uuid.uuid4().hex[:12]}",
        "sites": names,
        "data": data_header(fed),
        "resume": False,
    }
    if fed.volumes and plan_path(fed).is_file():  # the federation's plan (edited or not) wins, as in simulation
        path = plan_path(fed)
        desc["plan"] = with_spec_intensity(load_plan(path), fed, str(path), log=print).to_json()
    save_json(desc, desc_path)
    return desc


def serve(out: str | Path, call: Call, log: Callable[[str], None] = print) -> dict[str, Any] | None:
    """Run the engine of the prepared run in ``out`` over ``call``; returns the results.

    Writes ``results.json`` / ``results.md`` (plus a ``deploy`` record: dropouts,
    bytes on the wire, timing) when the run finishes.
    """
    t0 = time.perf_counter()
    out = Path(out)
    desc = read_deploy_json(out)
    cfg = load_deploy_config(out / "config.toml")
    params = deploy_params(cfg)
    h = desc["data"]
    resume = bool(desc.get("resume"))
    record = out / "dropouts.jsonl"
    if not resume:
        record.unlink(missing_ok=True)
    transport = RemoteTransport(desc["sites"], call, params, log=log, record=record, train=cfg.train)
    plan = None
    if h["mode"] in VOLUME_MODES:  # the federated plan and one volume shape, before the sites set up
        cfg, h, plan = plan_and_shape(out, desc, cfg, transport, params.setup_timeout_s, log)
    algorithm = get_algorithm(cfg)
    workload = workload_for(h, cfg)
    transport.num_metrics = len(workload.metric_names)
    transport.reply_check = algorithm.check_reply
    transport.train = cfg.train
    (out / REFUSED).unlink(missing_ok=True)
    try:
        setup = transport.setup(
            {
                "run_id": desc["run_id"],
                "sites": desc["sites"],
                "data": h,
                "config_toml": (out / "config.toml").read_text(),
            }
        )
    except DeployError:
        if transport.refusals:  # the sites' own policies: a new job would be refused the same way
            save_json(transport.refusals, out / REFUSED)
        raise
    log(f"[deploy] sites set up: {json.dumps(setup)}")
    if getattr(algorithm.params, "selector_training", None) == "fga" and not cfg.privacy.secure_aggregation:
        log(
            "[deploy] warning: fedsm.selector_training = 'fga' without privacy.secure_aggregation: every site's "
            "selector gradient of every step reaches the server in the clear"
        )
    t_setup = time.perf_counter() - t0
    engine = Engine(cfg, algorithm, transport, workload, out=out, progress=False, log=log)
    engine.check_state = lambda state: check_aggregate(state, params.max_abs_value)
    transport.round_source = lambda: engine.round
    restart = out / CONTROL_RESTART
    results = engine.run(resume=resume, stop_after=desc.get("stop_after"), stop_requested=restart.is_file)
    if results is None and restart.is_file():
        log(f"[deploy] stopped after round {engine.round} on the supervisor's request ({restart.read_text()})")
        save_json({"round": engine.round}, out / CONTROL_STOPPED)
    if results is None:
        return None
    results["deploy"] = {
        "transport": desc.get("transport", "remote"),
        "run_id": desc["run_id"],
        "resumed": resume,
        "setup_s": t_setup,
        "declared_samples": transport.declared,
        "dropouts": read_dropouts(record, log),
        "wire_bytes": transport.wire_bytes,
        "refused": transport.refusals,
        "aggregate_evaluation": sorted(transport.aggregated),
    }
    if plan is not None:
        results["plan"] = plan.to_json()
    write_results(results, out)
    return results
