"""The server half of a deployment, independent of the network library.

``prepare_run`` writes what a deployed run needs into its output folder
(``config.toml``, the resolved run config, and ``deploy.json``: run id, site
order, the federation's data layout — never a data path).  ``serve`` runs
fedseg's unchanged :class:`~fedseg.engine.Engine` in the server's main over a
:class:`~fedseg.deploy.transport.RemoteTransport`, checkpoints after every round
(server state, best models, history; sites checkpoint their own state on the
same call) and writes ``results.json`` / ``results.md`` like a simulation.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedseg.config import RunConfig, dump_toml, load_run_config
from fedseg.errors import ConfigError

from fedseg.deploy.params import deploy_params
from fedseg.deploy.site import data_header
from fedseg.deploy.supervise import CONTROL_RESTART
from fedseg.deploy.transport import Call, RemoteTransport

__all__ = ["load_deploy_config", "prepare_run", "serve"]


def load_deploy_config(path: str | Path, overrides: list[str] | None = None, **fields: Any) -> RunConfig:
    """A run config that may carry a ``[deploy]`` section."""
    from fedseg.algorithms import known_sections

    cfg = load_run_config(path, overrides, known_sections(), **fields)
    deploy_params(cfg)
    return cfg


def prepare_run(cfg: RunConfig, out: str | Path, sites: list[str] | None = None, resume: bool = False) -> dict[str, Any]:
    """Write ``OUT/config.toml`` and ``OUT/deploy.json``; returns the deploy description.

    ``sites`` restricts the run to these sites of the federation spec (in spec
    order); by default all of them.  With ``resume`` the existing description is
    kept (same run id, so sites find their checkpoints) and marked for resuming.
    """
    from fedseg.algorithms import get_algorithm
    from fedseg.data.spec import load_federation

    out = Path(out)
    desc_path = out / "deploy.json"
    if resume:
        if not desc_path.is_file():
            raise ConfigError(f"{out} has no deploy.json: it is not a deployed run folder; check the path")
        desc = json.loads(desc_path.read_text())
        if not (out / "checkpoints" / "progress.json").is_file():
            raise ConfigError(f"{out} has no checkpoint yet (no round completed); start the run again without --resume")
        desc["resume"] = True
        desc_path.write_text(json.dumps(desc, indent=1))
        return desc
    get_algorithm(cfg)
    if get_algorithm(cfg).needs_pooled_site:
        raise ConfigError(f"method {cfg.method!r} pools all sites' data and cannot be deployed; it exists in simulation only")
    fed = load_federation(cfg.federation)
    names = list(fed.site_names)
    if sites is not None:
        unknown = [s for s in sites if s not in names]
        if unknown:
            raise ConfigError(f"sites {unknown} are not in the federation {cfg.federation} (it has {names})")
        names = [s for s in names if s in sites]
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.toml").write_text(dump_toml(cfg.to_dict()))
    desc = {"run_id": f"{cfg.method}-{uuid.uuid4().hex[:12]}", "sites": names, "data": data_header(fed), "resume": False}
    desc_path.write_text(json.dumps(desc, indent=1))
    return desc


def serve(out: str | Path, call: Call, log: Callable[[str], None] = print) -> dict[str, Any] | None:
    """Run the engine of the prepared run in ``out`` over ``call``; returns the results.

    Writes ``results.json`` / ``results.md`` (plus a ``deploy`` record: dropouts,
    bytes on the wire, timing) when the run finishes.
    """
    from fedseg.algorithms import get_algorithm
    from fedseg.engine import Engine
    from fedseg.runner import write_results
    from fedseg.workload import segmentation_workload

    t0 = time.perf_counter()
    out = Path(out)
    desc = json.loads((out / "deploy.json").read_text())
    cfg = load_deploy_config(out / "config.toml")
    params = deploy_params(cfg)
    algorithm = get_algorithm(cfg)
    h = desc["data"]
    workload = segmentation_workload(int(h["spatial_dims"]), int(h["in_channels"]), list(h["labels"]), cfg.model, cfg.train, cfg.eval.threshold, empty_dice=cfg.eval.empty_dice)
    resume = bool(desc.get("resume"))
    record = out / "dropouts.jsonl"
    if not resume:
        record.unlink(missing_ok=True)
    transport = RemoteTransport(desc["sites"], call, params, log=log, record=record)
    setup = transport.setup({"run_id": desc["run_id"], "sites": desc["sites"], "data": h, "config_toml": (out / "config.toml").read_text()})
    log(f"[deploy] sites set up: {json.dumps(setup)}")
    t_setup = time.perf_counter() - t0
    engine = Engine(cfg, algorithm, transport, workload, out=out, progress=False, log=log)
    transport.round_source = lambda: engine.round
    restart = out / CONTROL_RESTART
    results = engine.run(resume=resume, stop_after=desc.get("stop_after"), stop_requested=restart.is_file)
    if results is None and restart.is_file():
        log(f"[deploy] stopped after round {engine.round} on the supervisor's request ({restart.read_text()})")
    if results is None:
        return None
    results["deploy"] = {
        "transport": desc.get("transport", "remote"),
        "run_id": desc["run_id"],
        "resumed": resume,
        "setup_s": t_setup,
        "dropouts": [json.loads(line) for line in record.read_text().splitlines()] if record.is_file() else [],
        "wire_bytes": transport.wire_bytes,
    }
    write_results(results, out)
    return results
