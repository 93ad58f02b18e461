"""The round loop: rounds, evaluation schedule, best-model tracking, checkpoints, history.

The engine knows no algorithm's maths.  Each round it calls the algorithm's
server half, then (on schedule) asks the sites to validate the algorithm's
candidates and keeps the best round of each (the papers record the best result
during training).  After the last round every best candidate is tested on every
site.  All of it goes through the transport, so simulation and deployment share
this code.

Checkpoint layout (``OUT/checkpoints/``), safetensors + JSON, no pickle:

* ``server.safetensors`` — the algorithm's server state;
* ``best.safetensors`` + ``best.json`` — best arrays and scores per candidate;
* ``sites/<site>.safetensors`` + ``.json`` — each site's models, optimizer moments,
  algorithm state (written by the transport; deployed sites write their own);
* ``progress.json`` — the last completed round and the history, written last, so
  a crash mid-checkpoint leaves the previous checkpoint valid.

Every tensor is a host (CPU) tensor on disk, so a run checkpointed on a GPU resumes on
the CPU and back.  :class:`CheckpointWriter` takes a synchronous snapshot to host memory
and writes the files in a background thread while the next round trains.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from fedseg.algorithms.base import Algorithm, Candidate, ServerContext
from fedseg.core.arrays import Arrays, clone, layout_of, prefixed, strip_prefix
from fedseg.core.config import RunConfig
from fedseg.core.device import configure_determinism, describe, resolve_device, to_device
from fedseg.core.errors import ConfigError
from fedseg.core.messages import Task
from fedseg.core.seeding import derive_seed
from fedseg.core.site import load_checked
from fedseg.core.workload import Workload
from fedseg.evaluation.summary import summarize
from fedseg.transport.base import Transport

__all__ = ["Best", "CheckpointWriter", "Engine"]


@dataclass
class Best:
    """Best validation result of one candidate so far."""

    score: float
    round: int
    candidate: Candidate


def _save_arrays(arrays: Arrays, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in arrays.items()}, str(tmp))
    os.replace(tmp, path)


def _save_json(data: Any, path: Path) -> None:
    """Write JSON atomically: a temp file, fsync, rename (a crash leaves the old file or the new one, never half)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        fh.write(json.dumps(data, indent=1))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


@dataclass(frozen=True)
class JsonDoc:
    """A JSON file of a staged checkpoint (a snapshot: nothing the round loop changes later)."""

    data: Any


def commit_checkpoint(d: Path) -> None:
    """Move a staged checkpoint into place if its commit record ``progress.json.next`` exists (idempotent:
    safe to repeat after a crash half-way); otherwise drop staged leftovers of an unfinished save."""
    record = d / "progress.json.next"
    if record.is_file():
        for name in json.loads(record.read_text()).get("staged", []):
            if (d / (name + ".next")).is_file():
                os.replace(d / (name + ".next"), d / name)
        if (d / "sites.next").is_dir():
            (d / "sites").mkdir(exist_ok=True)
            for f in (d / "sites.next").iterdir():
                os.replace(f, d / "sites" / f.name)
            (d / "sites.next").rmdir()
        os.replace(record, d / "progress.json")
        return
    for f in d.glob("*.next"):
        if f.is_dir():
            shutil.rmtree(f)
        else:
            f.unlink()


class CheckpointWriter:
    """Writes staged checkpoint files, then commits them (:func:`commit_checkpoint`), in order.

    :meth:`submit` takes ``{relative path: host arrays | JsonDoc}`` whose last entry is the
    commit record ``progress.json.next``; the files are written one after another and the
    checkpoint is committed.  With ``background`` this happens in one worker thread, so a
    round trains while the previous checkpoint is written; :meth:`wait` blocks until it is
    committed and re-raises a failed write.  The engine waits before it stages the next
    checkpoint and before the run returns, so at most one checkpoint is in flight and the
    commit protocol (staged ``.next`` files, then the record) is unchanged.
    """

    def __init__(self, background: bool = True):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedseg-checkpoint") if background else None
        self._pending: Future | None = None
        self._buffers: dict[str, torch.Tensor] = {}
        self.write_s = 0.0
        """Seconds spent writing (in the worker thread when in the background)."""

    def host_copy(self, group: str, arrays: Arrays) -> Arrays:
        """Copies of ``arrays`` in host buffers reused from one checkpoint to the next (pinned
        when the source is on a GPU, so the copies run without blocking until one final
        synchronization; see :meth:`copies_done`).  Reusing them saves allocating and
        page-faulting a checkpoint's worth of memory each time; they are free again once
        :meth:`wait` has returned, which every caller does before copying."""
        out: Arrays = {}
        for k, v in arrays.items():
            name = f"{group}/{k}"
            buf = self._buffers.get(name)
            if buf is None or buf.shape != v.shape or buf.dtype != v.dtype:
                buf = torch.empty(v.shape, dtype=v.dtype, pin_memory=v.is_cuda)
                self._buffers[name] = buf
            buf.copy_(v.detach(), non_blocking=v.is_cuda)
            out[k] = buf
        return out

    @staticmethod
    def copies_done() -> None:
        """Wait for non-blocking device-to-host copies of :meth:`host_copy` (no-op without CUDA)."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def submit(self, folder: Path, files: dict[str, Arrays | JsonDoc]) -> None:
        self.wait()
        if self._pool is None:
            self._write(folder, files)
        else:
            self._pending = self._pool.submit(self._write, folder, files)

    def _write(self, folder: Path, files: dict[str, Arrays | JsonDoc]) -> None:
        t0 = time.perf_counter()
        for rel, content in files.items():
            path = folder / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, JsonDoc):
                _save_json(content.data, path)
            else:
                _save_arrays(content, path)
        commit_checkpoint(folder)
        self.write_s += time.perf_counter() - t0

    def wait(self) -> None:
        """Block until the checkpoint in flight is committed (re-raises its error)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()


class Engine:
    """Runs an algorithm over a transport.

    Parameters
    ----------
    cfg
        The run configuration.
    algorithm
        The method (server and site halves).
    transport
        Carries tasks to the sites.
    workload
        Builds the initial model on the server (seeded).
    out
        Output folder for checkpoints (None: keep nothing on disk).
    progress
        Show a progress bar over rounds.
    log
        Where messages go.
    on_round
        Called with each history entry after its round (e.g. TensorBoard logging).
    """

    def __init__(
        self,
        cfg: RunConfig,
        algorithm: Algorithm,
        transport: Transport,
        workload: Workload,
        out: str | Path | None = None,
        progress: bool = True,
        log: Callable[[str], None] = print,
        on_round: Callable[[dict[str, Any]], None] | None = None,
    ):
        self.cfg = cfg
        self.on_round = on_round
        self.algorithm = algorithm
        self.transport = transport
        self.workload = workload
        self.out = Path(out) if out is not None else None
        self.progress = progress
        self.log = log
        self.device = resolve_device(cfg.device)
        configure_determinism(self.device, cfg.deterministic)
        self.ctx = ServerContext(
            transport=transport,
            sites=tuple(transport.sites),
            cfg=cfg,
            init_arrays=self.init_arrays,
            log=log,
            device=self.device,
            workload=workload,
        )
        self.history: list[dict[str, Any]] = []
        self.best: dict[str, Best] = {}
        self.state: Arrays = {}
        self.round = 0
        self._saved_best: dict[str, Any] | None = None
        self.check_state: Callable[[Arrays], None] | None = None  # raises to refuse committing a state (deployment)
        self.writer = CheckpointWriter(background=cfg.checkpoint_background)
        self.checkpoint_s = 0.0
        """Seconds the round loop spent on checkpoints (snapshot + staging; the write itself when not in the background)."""

    # ----------------------------------------------------------------- setup
    def init_arrays(self, role: str = "global", factory: Callable[[], torch.nn.Module] | None = None) -> Arrays:
        """Initial weights of a role's model from the seeded RNG (same seed → same weights)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(self.cfg.seed, "init", role))
            model = (factory or self.workload.build_model)()
        dtype = {"float32": torch.float32, "float64": torch.float64}[self.cfg.train.dtype]
        return {
            k: (v.to(dtype) if v.is_floating_point() else v).detach().to(self.device, copy=True)
            for k, v in model.state_dict().items()
        }

    @property
    def ckpt_dir(self) -> Path | None:
        return None if self.out is None else self.out / "checkpoints"

    # ------------------------------------------------------------ evaluation
    def evaluate(
        self, candidates: list[Candidate], split: str, sites_of: Callable[[Candidate], tuple[str, ...]]
    ) -> dict[str, dict[str, list[list[float]]]]:
        """Ask sites to score candidates on a split; returns ``{candidate: {site: per-case (N, C)}}``."""
        tasks: dict[str, Task] = {}
        for s in self.ctx.sites:
            cs = [c for c in candidates if s in sites_of(c)]
            if not cs:
                continue
            arrays: Arrays = {}
            for c in cs:
                arrays.update(prefixed(c.name, c.arrays))
            spec = [{"name": c.name, "predictor": c.predictor, "config": c.config} for c in cs]
            tasks[s] = Task("evaluate", arrays, {"split": split, "candidates": spec})
        replies = self.transport.ask(tasks)
        out: dict[str, dict[str, list[list[float]]]] = {c.name: {} for c in candidates}
        for s, rep in replies.items():
            for name, cases in rep.metrics["per_case"].items():
                out[name][s] = cases
        return out

    def _validate(self, rnd: int) -> dict[str, Any]:
        cands = self.algorithm.candidates(self.state, self.ctx)
        scores = self.evaluate(cands, "validation", lambda c: c.val_sites or self.ctx.sites)
        record: dict[str, Any] = {"val_dice": {}, "val_score": {}}
        for c in cands:
            per_site = scores[c.name]
            case_means = [sum(case) / len(case) for cases in per_site.values() for case in cases]
            if not case_means:
                continue
            if self.cfg.eval.best_criterion == "sites":  # mean of the per-site means (the papers' client average)
                site_means = [sum(sum(c) / len(c) for c in cases) / len(cases) for cases in per_site.values() if cases]
                score = sum(site_means) / len(site_means)
            else:  # "cases": mean over the pooled validation cases
                score = sum(case_means) / len(case_means)
            record["val_dice"][c.name] = {
                s: (sum(sum(x) / len(x) for x in cases) / len(cases) if cases else None)
                for s, cases in per_site.items()
            }
            record["val_score"][c.name] = score
            prev = self.best.get(c.name)
            if prev is None or score > prev.score:
                self.best[c.name] = Best(
                    score,
                    rnd,
                    Candidate(c.name, clone(c.arrays), c.predictor, c.val_sites, c.home_site, dict(c.config)),
                )
        return record

    def test(self) -> dict[str, dict[str, list[list[float]]]]:
        """Score every best candidate on every site's test split."""
        cands = [b.candidate for b in self.best.values()]
        return self.evaluate(cands, "testing", lambda c: self.ctx.sites)

    # ------------------------------------------------------------ checkpoint
    def save_checkpoint(self) -> None:
        """Write the round's checkpoint as one unit: every file goes to ``<name>.next`` (sites to
        ``sites.next/``), then ``progress.json.next`` is written as the commit record and the files
        are moved into place (:func:`commit_checkpoint`).  A crash at any point leaves either the
        previous round's checkpoint or a commit record to finish — never a server state of one round
        with the progress (or site state) of another.

        Everything is first copied to host memory here (server state, best models, every site's
        state, the JSON records), then :attr:`writer` writes it — in a background thread unless
        ``checkpoint_background = false`` — so training may change the live tensors at once."""
        d = self.ckpt_dir
        if d is None:
            return
        if self.check_state is not None:  # deployment: a poisoned state is never committed (it raises)
            self.check_state(self.state)
        t0 = time.perf_counter()
        self.writer.wait()  # the previous checkpoint is committed before this one is staged
        d.mkdir(parents=True, exist_ok=True)
        staged = ["server.safetensors"]
        files: dict[str, Arrays | JsonDoc] = {"server.safetensors.next": self.writer.host_copy("server", self.state)}
        best_meta = {}
        for name, b in self.best.items():
            c = b.candidate
            best_meta[name] = {
                "score": b.score,
                "round": b.round,
                "predictor": c.predictor,
                "val_sites": c.val_sites,
                "home_site": c.home_site,
                "config": c.config,
            }
        best_arrays: Arrays = {}
        for name, b in self.best.items():
            best_arrays.update(prefixed(name, b.candidate.arrays))
        layout = {"server.safetensors": layout_of(self.state), "best.safetensors": layout_of(best_arrays)}
        if best_meta != self._saved_best or not (d / "best.safetensors").is_file():
            best_arrays = self.writer.host_copy("best", best_arrays)
            files["best.safetensors.next"] = best_arrays
            files["best.json.next"] = JsonDoc(copy.deepcopy(best_meta))
            staged += ["best.safetensors", "best.json"]
            self._saved_best = best_meta
        snapshot = getattr(self.transport, "snapshot_sites", None)
        if snapshot is None:  # sites that persist themselves (deployment): asked now, synchronously
            self.transport.save_sites(d / "sites.next")
        else:
            for name, (arrays, meta) in snapshot().items():
                files[f"sites.next/{name}.safetensors"] = self.writer.host_copy(f"sites/{name}", arrays)
                files[f"sites.next/{name}.json"] = JsonDoc(copy.deepcopy(meta))
        progress = {"round": self.round, "history": self.history, "staged": staged, "layout": layout}
        files["progress.json.next"] = JsonDoc(copy.deepcopy(progress))
        self.writer.copies_done()
        self.writer.submit(d, files)
        self.checkpoint_s += time.perf_counter() - t0

    def load_checkpoint(self) -> None:
        d = self.ckpt_dir
        if d is not None:
            commit_checkpoint(d)  # finish a checkpoint interrupted after its commit record
        if d is None or not (d / "progress.json").is_file():
            raise ConfigError(f"no checkpoint to resume in {self.out}; start the run without --resume")
        progress = json.loads((d / "progress.json").read_text())
        self.round = int(progress["round"])
        self.history = progress["history"]
        layout = progress.get("layout") or {}
        self.state = to_device(load_checked(d / "server.safetensors", layout.get("server.safetensors")), self.device)
        best_arrays = to_device(load_checked(d / "best.safetensors", layout.get("best.safetensors")), self.device)
        for name, m in json.loads((d / "best.json").read_text()).items():
            vs = tuple(m["val_sites"]) if m["val_sites"] is not None else None
            cand = Candidate(name, strip_prefix(name, best_arrays), m["predictor"], vs, m["home_site"], m["config"])
            self.best[name] = Best(m["score"], m["round"], cand)
        self.transport.restore_sites(d / "sites")

    # ------------------------------------------------------------------ loop
    def run(
        self, resume: bool = False, stop_after: int | None = None, stop_requested: Callable[[], bool] | None = None
    ) -> dict[str, Any] | None:
        """Run all rounds, then test; returns the results (see ``docs/results-format.md``).

        ``stop_after`` ends the run after that round, checkpointed, as an
        interruption would (for tests of ``resume``); it then returns None.
        ``stop_requested`` is asked after every round; when it answers True the run
        ends the same way after that round (a deployment's supervisor uses it to
        restart a job so that a reconnected site can rejoin).
        """
        cfg = self.cfg
        t_start = time.perf_counter()
        self.log(f"{self.algorithm.name}: device {describe(self.device)}, precision {cfg.train.precision}")
        if resume:
            self.load_checkpoint()
            self.log(f"resuming {self.algorithm.name} after round {self.round} of {cfg.rounds}")
        else:
            self.state = self.algorithm.init_state(self.ctx)
            self.round = 0
        self.transport.traffic.take()
        bar = tqdm(
            total=cfg.rounds,
            initial=self.round,
            desc=self.algorithm.name,
            unit="round",
            disable=not self.progress,
            dynamic_ncols=True,
        )
        try:
            while self.round < cfg.rounds:
                rnd = self.round + 1
                t0 = time.perf_counter()
                self.state, metrics = self.algorithm.server_round(self.ctx, self.state, rnd)
                entry: dict[str, Any] = {"round": rnd, **metrics, "bytes": self.transport.traffic.take()}
                if cfg.is_eval_round(rnd):
                    entry.update(self._validate(rnd))
                    entry["eval_bytes"] = self.transport.traffic.take()
                entry["time_s"] = time.perf_counter() - t0
                self.history.append(entry)
                self.round = rnd
                if self.on_round is not None:
                    self.on_round(entry)
                stop = rnd < cfg.rounds and (
                    (stop_after is not None and rnd >= stop_after) or (stop_requested is not None and stop_requested())
                )
                if rnd % cfg.checkpoint_every == 0 or rnd == cfg.rounds or stop:
                    self.save_checkpoint()
                bar.update(1)
                bar.set_postfix(self._postfix(entry), refresh=False)
                if stop:
                    return None
        finally:
            bar.close()
            self.writer.wait()  # every checkpoint is committed before the run returns
        final = self.algorithm.final_candidates(
            self.state,
            {n: b.candidate for n, b in self.best.items()},
            {n: b.round for n, b in self.best.items()},
            self.ctx,
        )
        if final:
            # e.g. FedSM's composite assembled from its best parts: test (and keep) that one
            for name, cand in final.items():
                self.best[name] = Best(self.best[name].score, self.best[name].round, cand)
            self.save_checkpoint()
            self.writer.wait()
        per_case = self.test()
        results = summarize(
            method=self.algorithm.name,
            sites=list(self.ctx.sites),
            cfg=cfg,
            per_case=per_case,
            best=self.best,
            primary=self.algorithm.primary,
            metric_names=list(self.workload.metric_names),
            history=self.history,
        )
        results["wall_time_s"] = time.perf_counter() - t_start
        results["device"] = describe(self.device)
        results["precision"] = cfg.train.precision
        return results

    @staticmethod
    def _postfix(entry: dict[str, Any]) -> dict[str, str]:
        out = {}
        losses = [v for v in (entry.get("train_loss") or {}).values() if v is not None]
        if losses:
            out["loss"] = f"{sum(losses) / len(losses):.3f}"
        scores = entry.get("val_score") or {}
        if scores:
            out["val"] = f"{max(scores.values()):.3f}"
        return out
