"""The site half of a deployment, independent of the network library.

A :class:`SiteRuntime` lives for the whole run in the site's job process.  Its data
paths come from the site's own config file (``fedseg deploy site`` writes it into
the site's kit): the server never learns them.  The server sends, once, the run
description (resolved run config, data layout, site order); the runtime then
builds a :class:`fedseg.site.runtime.Site` (models and optimizer moments stay in memory
between tasks) and answers operations:

``setup``       JSON run description -> JSON summary (site name, training cases)
``task``        encoded :class:`Task` -> encoded :class:`Reply` (``site.handle``)
``checkpoint``  JSON ``{"round": r}`` -> writes ``WORKDIR/<run_id>/round-<r>/`` (safetensors)
``restore``     JSON ``{"round": r}`` -> loads the newest checkpoint at or before round r
``ping``        -> JSON ``{"site": name}``
``fingerprint``, ``histogram``, ``volumes``
                a volume run's planning before setup (:mod:`fedseg.deployment.volumes`)

Everything is bytes in, bytes out (see :mod:`fedseg.deployment.wire`).

The site's own policy (:mod:`fedseg.deployment.policy`, a file the site config names) decides which runs
and tasks it takes part in: a run below its floors is refused at setup, a task kind it does not allow is
refused, and evaluation replies carry aggregates only where it says so.  Some settings are the site's, not
the run's: a site with a kit always signs its secure-aggregation keys and checks its peers against its
roster (a run whose sites are not all in it is refused), and draws its DP noise and batches from its
operating system unless its policy is ``reproducible``; what it enforced is logged at setup and sent with
its ``privacy`` report (``"enforced"``).  Every reply that leaves the site
is recorded in its release log (``WORKDIR/releases.jsonl``: sha256 of the reply bytes, operation, task
kind, round, step, exchange, time), which no checkpoint or restore touches.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedseg.algorithms import get_algorithm, known_sections
from fedseg.data.loading import load_split
from fedseg.data.spec import LAYOUT_NAME, data_header
from fedseg.deployment.guard import SALT_NAME, Guard, site_salt
from fedseg.deployment.policy import SitePolicy, aggregate_scores, enforced, read_policy, site_held
from fedseg.deployment.volumes import VOLUME_OPS, load_volume_site_data, local_spec, site_operation
from fedseg.deployment.wire import check_arrays, decode_task, encode_reply, parse_json_object
from fedseg.foundation.config import load_run_config
from fedseg.foundation.errors import ConfigError, PayloadError
from fedseg.privacy.identity import Identity, load_identity
from fedseg.seams.checkpoint import restore_site, save_site
from fedseg.site.runtime import Site, SiteData, dataset_len
from fedseg.site.secure import RECORD_NAME, Record
from fedseg.site.workload import Workload, workload_for

__all__ = [
    "RELEASE_LOG",
    "SALT_NAME",
    "SITE_CONFIG_NAME",
    "SiteConfig",
    "SiteRuntime",
    "data_header",
    "is_plain_name",
    "read_site_config",
    "write_site_config",
]

SITE_CONFIG_NAME = "fedseg_site.json"
"""File name of a site's config inside its kit's ``local/`` folder."""

RELEASE_LOG = "releases.jsonl"
"""A site's release log in its working folder: one JSON line per reply it sent (append-only)."""

log = logging.getLogger("fedseg.deployment.site")
_KEEP = 2


@dataclass(frozen=True)
class SiteConfig:
    """What only the site knows: its name in the federation, its datalist, its working folder, its device."""

    name: str
    datalist: str
    workdir: str
    device: str = "auto"
    """Where this site trains ('auto', 'cpu', 'cuda', 'cuda:N'); replaces the run config's device at this site."""
    policy: str = ""
    """The site's policy file (:mod:`fedseg.deployment.policy`); '' names none (a deployed site then keeps
    the policy's defaults)."""


def write_site_config(path: str | Path, cfg: SiteConfig) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"name": cfg.name, "datalist": str(cfg.datalist), "workdir": str(cfg.workdir), "device": cfg.device}
    if cfg.policy:
        body["policy"] = str(cfg.policy)
    path.write_text(json.dumps(body, indent=1))
    return path


def read_site_config(path: str | Path) -> SiteConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"site config {path} does not exist; run `fedseg deploy site --kit KIT --datalist ... --workdir ...` on this machine first"
        )
    raw = json.loads(path.read_text())
    missing = [k for k in ("name", "datalist", "workdir") if not raw.get(k)]
    if missing:
        raise ConfigError(f"site config {path} lacks {missing}; rewrite it with `fedseg deploy site`")
    return SiteConfig(
        raw["name"], raw["datalist"], raw["workdir"], str(raw.get("device", "auto")), str(raw.get("policy") or "")
    )


def load_site_data(name: str, datalist: str | Path, header: dict[str, Any], cfg: Any) -> tuple[SiteData, Workload]:
    """Load this site's splits from its own datalist, laid out as the server's header says (volumes: in the
    plan's grid the header carries, padded to its volume shape, through the site's cache)."""
    fed = local_spec(name, datalist, header)
    if fed.volumes:
        if not isinstance(header.get("plan"), dict):
            raise PayloadError(
                f"site {name}: a volume run's setup carries no plan; server and site must run the same fedseg version"
            )
        data = load_volume_site_data(name, datalist, header, cfg.volume_cache, log.info, cfg.volume_reads)
    else:
        data = SiteData(*(load_split(fed, fed.sites[0], split) for split in ("training", "validation", "testing")))
    return data, workload_for(fed, cfg)


class SiteRuntime:
    """One site's long-lived runtime.

    Parameters
    ----------
    config
        The site's own config (name, datalist, workdir).
    loader
        ``loader(name, datalist, header, cfg) -> (SiteData, Workload)``; defaults to
        :func:`load_site_data` (tests pass in-memory data).
    identity
        What signs this site's secure-aggregation keys whatever ``privacy.secagg_identity`` the run ships: the
        ``startup/`` folder of its FLARE kit (:func:`fedseg.privacy.identity.load_identity`, read with the kit's
        roster when a run with secure aggregation is set up; no ``client.crt`` there: unsigned), an
        :class:`~fedseg.privacy.identity.Identity`, or None (unsigned).
    policy
        The site's :class:`~fedseg.deployment.policy.SitePolicy`; None: the file ``config.policy`` names, or
        no policy when it names none (tests and benchmarks of the server; a deployed site is always given one).
    """

    def __init__(
        self,
        config: SiteConfig,
        loader: Callable[..., tuple[SiteData, Workload]] | None = None,
        identity: Identity | str | Path | None = None,
        policy: SitePolicy | None = None,
    ):
        self.config = config
        self.loader = loader or load_site_data
        self.identity = identity
        self.policy = policy if policy is not None else (read_policy(config.policy) if config.policy else None)
        self.site: Site | None = None
        self.run_id: str | None = None
        self.refused: str | None = None
        """Why this site refused the run set up last (None: it took part)."""
        self.enforced: dict[str, Any] = {}
        """What this site enforces in the run set up last (:func:`~fedseg.deployment.policy.enforced`): logged,
        and sent with its ε report."""
        self._lock = threading.Lock()
        self._sending: dict[str, Any] = {}
        self.guard = Guard()
        """What the site's policy checks of its evaluations and planning requests in this run (:class:`Guard`)."""

    @property
    def name(self) -> str:
        return self.config.name

    def run_dir(self) -> Path:
        if self.run_id is None:
            raise PayloadError(f"site {self.name}: no run set up yet; the server must send 'setup' first")
        return Path(self.config.workdir) / self.run_id

    # ------------------------------------------------------------- operations
    def call(self, op: str, payload: bytes) -> bytes:
        """Dispatch one operation (thread-safe: one at a time); what it sends back is recorded in the release log."""
        with self._lock:
            self._sending = {"op": op}
            try:
                out = self._dispatch(op, payload)
            except Exception as e:
                self._record(None, f"{type(e).__name__}: {e}")
                raise
            self._record(out)
            return out

    def release_log(self) -> Path:
        """The site's release log (:data:`RELEASE_LOG` in its working folder)."""
        return Path(self.config.workdir) / RELEASE_LOG

    def _record(self, out: bytes | None, error: str | None = None) -> None:
        """Append one line to the release log: what left the site (sha256 and size of the reply bytes, or the
        error text the server receives instead), for which operation, task kind, round, step and exchange."""
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "run_id": self.run_id,
            **self._sending,
            "to": "server",
        }
        if out is not None:
            entry.update(sha256=hashlib.sha256(out).hexdigest(), bytes=len(out))
        else:
            entry["error"] = (error or "")[:500]
        path = self.release_log()
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as fh:  # one line per reply, synced before the reply leaves
            fh.write(json.dumps(entry) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def _dispatch(self, op: str, payload: bytes) -> bytes:
        if op == "task":
            return self._task(payload)
        if op == "setup":
            return _json(self._setup(parse_json_object(payload, f"site {self.name}: setup")))
        if op == "checkpoint":
            return _json(self._checkpoint(self._round(payload, op)))
        if op == "restore":
            return _json(self._restore(self._round(payload, op)))
        if op == "ping":
            return _json({"site": self.name, "ready": self.site is not None})
        if op in VOLUME_OPS:
            body = parse_json_object(payload, f"site {self.name}: {op}")
            why = self.guard.planning_refusal(self.policy, op, body) if self.policy is not None else None
            if why:
                log.warning("site %s refuses a planning request: %s", self.name, why)
                raise PayloadError(f"site {self.name} refuses by its policy: {why}")
            out = site_operation(self.name, self.config.datalist, op, body, log.info, self.config.device)
            self.guard.planned(op, body)
            return _json(out)
        raise PayloadError(
            f"site {self.name}: unknown operation {op!r}; server and site must run the same fedseg version"
        )

    def _round(self, payload: bytes, op: str) -> int:
        """The round of a checkpoint/restore request: an integer in 0..rounds of the run set up."""
        rnd = parse_json_object(payload, f"site {self.name}: {op}").get("round")
        top = self.site.cfg.rounds if self.site is not None else None
        if isinstance(rnd, bool) or not isinstance(rnd, int) or rnd < 0 or (top is not None and rnd > top):
            raise PayloadError(
                f"site {self.name}: {op} of round {rnd!r} refused; a round is an integer in 0..{top if top is not None else 'rounds'}"
            )
        return rnd

    def _setup(self, desc: dict[str, Any]) -> dict[str, Any]:
        sites = list(desc["sites"])
        if self.name not in sites:
            raise ConfigError(
                f"site {self.name}: not among the run's sites {sites}; check the name in {SITE_CONFIG_NAME}"
            )
        run_id = desc.get("run_id")
        if not is_plain_name(run_id):
            raise PayloadError(
                f"site {self.name}: run id {run_id!r} is not a plain name (letters, digits, '_', '.', '-'; "
                "starting with a letter or digit; at most 128 characters)"
            )
        if self.site is not None and self.run_id == run_id:
            return self._summary()
        if self.refused is not None and self.run_id == run_id:
            return {"site": self.name, "refused": self.refused}
        self.site, self.refused = None, None
        self.run_id = run_id
        self.guard = Guard()
        self.run_dir().mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            p = Path(tmp) / "config.toml"
            p.write_text(desc["config_toml"])
            cfg = load_run_config(p, known_sections=known_sections() | {"deploy"})
        cfg = dataclasses.replace(cfg, device=self.config.device)  # each site trains on its own device
        (self.run_dir() / "config.toml").write_text(desc["config_toml"])
        (self.run_dir() / LAYOUT_NAME).write_text(json.dumps(desc["data"]))  # the layout `fedseg predict` needs here
        if self.policy is not None:
            why = self.policy.refusals(cfg, sites)
            if why:
                return self._refuse(why)
            cfg = self._own_privacy(cfg, self.policy)
        cfg = site_held(cfg, self.policy, self.identity is not None, lambda m: log.warning("site %s: %s", self.name, m))
        try:  # a kit without its roster, or another site's: refused with the fix, as a floor is
            identity = self._identity() if cfg.privacy.secure_aggregation else None
        except ConfigError as e:
            return self._refuse([str(e)])
        if identity is not None and identity.roster is not None and identity.roster.outside(sites):
            return self._refuse(
                [
                    f"the run's sites {identity.roster.outside(sites)} are not sites of this site's roster "
                    f"{sorted(identity.roster.sites)} (its kit's local/fedseg_roster.json); if the federation changed, "
                    "provision it again and compare the new rosters out of band"
                ]
            )
        algorithm = get_algorithm(cfg)
        if getattr(algorithm.params, "selector_training", None) == "fga" and not cfg.privacy.secure_aggregation:
            log.warning(
                "site %s: fedsm.selector_training = 'fga' without privacy.secure_aggregation sends this site's "
                "selector gradient of every step to the server in the clear",
                self.name,
            )
        data, workload = self.loader(self.name, self.config.datalist, desc["data"], cfg)
        if self.policy is not None and cfg.privacy.dp != "off":  # the default δ ceiling needs n_k
            why = self.policy.refusals(cfg, sites, num_train=dataset_len(data.train))
            if why:
                return self._refuse(why)
        self.site = Site(self.name, sites.index(self.name), data, workload, cfg, algorithm)
        if cfg.privacy.dp != "off":  # the site's privacy ledger: outside the round checkpoints, never restored
            self.site.dp.ledger.attach(Path(self.config.workdir) / "privacy-ledger.jsonl", run=run_id)
        if self.policy is not None and self.policy.min_noise_multiplier is not None and cfg.privacy.dp != "off":
            why = self.policy.refusals(cfg, sites, sigma=float(self.site.dp.sigma))
            if why:
                self.site = None
                return self._refuse(why)
        if self.policy is not None and self.policy.max_epsilon is not None and cfg.privacy.dp != "off":
            # the policy's ceiling holds over every run of this site's ledger, composed before each release
            dp = self.site.dp
            dp.lifetime_ceiling = self.policy.max_epsilon
            spent, next_round = dp.lifetime_epsilon(), dp.lifetime_epsilon(extra_rounds=1)
            if next_round > self.policy.max_epsilon:
                self.site = None
                return self._refuse(
                    [
                        f"this site's data has spent ε = {spent:.4g} over {len(dp.ledger.other_runs)} other runs "
                        f"(δ = {cfg.privacy.delta:g}) and one more round of this run would take it to "
                        f"{next_round:.4g} > the policy's lifetime ceiling max_epsilon = {self.policy.max_epsilon:g}"
                    ]
                )
        # one record for every run of this site, outside the checkpoints: restore keeps it, a new run id does not
        # reset it (fedseg.site.secure.Record)
        self.site.secagg_record = Record(Path(self.config.workdir) / RECORD_NAME)
        self.site.epoch = str(run_id)
        if self.policy is not None and not self.policy.reproducible:
            self.site.salt = site_salt(Path(self.config.workdir), str(run_id), self.name)
        self.site.identity = identity
        where = self.config.policy or ("its default policy" if self.policy is not None else None)
        self.enforced = enforced(cfg, self.policy, where, identity, self.site.num_train)
        log.info("site %s enforces for run %s: %s", self.name, run_id, json.dumps(self.enforced))
        log.info(
            "site %s set up for run %s (index %d, %d training cases)",
            self.name,
            run_id,
            sites.index(self.name),
            self.site.num_train,
        )
        return self._summary()

    def _refuse(self, why: list[str]) -> dict[str, Any]:
        """Refuse the run being set up (logged here; the reply tells the server why)."""
        where = self.config.policy or "its default policy"
        self.refused = f"site {self.name} refuses run {self.run_id} by its policy ({where}): " + "; ".join(why)
        log.warning("%s", self.refused)
        return {"site": self.name, "refused": self.refused}

    def _own_privacy(self, cfg: Any, policy: SitePolicy) -> Any:
        """The run config as this site runs it: its ``policy``'s secure aggregation and participant minimum
        (``privacy.secagg_min_sites`` where the run has that setting) replace the server's."""
        p = cfg.privacy
        changes: dict[str, Any] = {}
        if policy.secure_aggregation:
            changes["secure_aggregation"] = True
        floor = getattr(p, "secagg_min_sites", None)
        if isinstance(floor, int) and floor < policy.min_sites:
            changes["secagg_min_sites"] = policy.min_sites
        return dataclasses.replace(cfg, privacy=dataclasses.replace(p, **changes)) if changes else cfg

    def _identity(self) -> Identity | None:
        """This site's identity for signed secure-aggregation keys (loaded from its kit once), or None."""
        if isinstance(self.identity, (str, Path)):
            self.identity = load_identity(self.identity, self.name)
        if self.identity is None:
            log.info("site %s: no certificate in its kit; its secure-aggregation keys go unsigned", self.name)
        else:
            log.info("site %s: signs its secure-aggregation keys with its kit's certificate", self.name)
        return self.identity

    def _summary(self) -> dict[str, Any]:
        assert self.site is not None
        d = self.site.data
        return {
            "site": self.name,
            "index": self.site.index,
            "num_train": self.site.num_train,
            "num_validation": dataset_len(d.val),
            "num_testing": dataset_len(d.test),
        }

    def _task(self, payload: bytes) -> bytes:
        if self.refused is not None:
            raise PayloadError(self.refused)
        if self.site is None:
            raise PayloadError(f"site {self.name}: received a task before setup")
        task = decode_task(payload)
        secagg = task.config.get("secagg")
        self._sending.update(
            kind=task.kind,
            round=task.config.get("round"),
            step=task.config.get("step"),
            exchange=task.config.get("exchange") or (secagg.get("exchange") if isinstance(secagg, dict) else None),
            masked=isinstance(secagg, dict),
        )
        check_arrays(task.arrays, f"site {self.name}: task {task.kind!r} from the server")
        why = self.guard.task_refusal(self.policy, task) if self.policy is not None else None
        if why:
            log.warning("site %s refuses a task: %s", self.name, why)
            raise PayloadError(f"site {self.name} refuses by its policy: {why}")
        try:
            reply = self.site.handle(task)
        except PayloadError as e:  # a refusal of the site's own checks (secure aggregation's among them): logged here
            log.warning("site %s refuses a %r task: %s", self.name, task.kind, e)
            raise
        if self.policy is not None:
            self.guard.saw(task, reply)
        if task.kind == "privacy":  # the site's own statement of what it enforced, beside its ε
            reply = dataclasses.replace(reply, metrics={**reply.metrics, "enforced": dict(self.enforced)})
        if task.kind == "evaluate" and self.policy is not None and self.policy.evaluation == "aggregates":
            reply = dataclasses.replace(reply, metrics=aggregate_scores(reply.metrics))
        return encode_reply(reply)

    def _checkpoint(self, rnd: int) -> dict[str, Any]:
        if self.site is None:
            raise PayloadError(f"site {self.name}: checkpoint before setup")
        folder = self.run_dir() / f"round-{rnd:06d}"
        save_site(self.site, folder)
        (folder / "DONE").write_text(str(rnd))
        for old in self._checkpoints()[:-_KEEP]:
            shutil.rmtree(old[1], ignore_errors=True)
        return {"site": self.name, "round": rnd}

    def _checkpoints(self) -> list[tuple[int, Path]]:
        out = []
        for d in self.run_dir().glob("round-*"):
            m = re.fullmatch(r"round-(\d+)", d.name)
            if m and (d / "DONE").is_file():  # anything else in the folder is not ours: ignored
                out.append((int(m.group(1)), d))
        return sorted(out)

    def _restore(self, rnd: int) -> dict[str, Any]:
        if self.site is None:
            raise PayloadError(f"site {self.name}: restore before setup")
        usable = [(r, d) for r, d in self._checkpoints() if r <= rnd]
        if not usable:
            return {"site": self.name, "restored": None}
        r, d = usable[-1]
        restore_site(self.site, d)
        if r != rnd:
            log.warning(
                "site %s: no checkpoint of round %d; resumed from its round %d (it missed rounds)", self.name, rnd, r
            )
        return {"site": self.name, "restored": r}


def is_plain_name(name: Any) -> bool:
    """A run id or folder name that stays inside its parent: letters, digits, ``_.-``, starting with a letter
    or digit (so never ``.``, ``..`` or a path), at most 128 characters."""
    return isinstance(name, str) and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}", name) is not None


def _json(x: Any) -> bytes:
    return json.dumps(x).encode()
