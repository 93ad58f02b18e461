"""The round loop: rounds, evaluation schedule, best-model tracking, checkpoints, history.

The engine knows no algorithm's maths.  Each round it calls the algorithm's
server half, then (on schedule) asks the sites to validate the algorithm's
candidates and keeps the best round of each (the papers record the best result
during training).  After the last round every best candidate is tested on every
site.  All of it goes through the transport, so simulation and deployment share
this code.

Checkpoints (``OUT/checkpoints/``: server state, best candidates, every site's state, the
progress record) are written after every ``checkpoint_every`` rounds as one unit and read
back on ``--resume``; their files and the commit protocol are :mod:`fedseg.seams.checkpoint`'s.
The engine takes a synchronous snapshot to host memory and hands it to a
:class:`~fedseg.seams.checkpoint.CheckpointWriter`, which writes it in a background thread
while the next round trains.  Once the caller has written the results, :meth:`Engine.finish` prunes what only
``--resume`` reads (``checkpoint_keep``; :func:`~fedseg.seams.checkpoint.prune_checkpoints`).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from fedseg.evaluation.summary import summarize
from fedseg.foundation.arrays import Arrays, clone, layout_of, prefixed
from fedseg.foundation.config import RunConfig
from fedseg.foundation.device import DTYPES, configure_determinism, describe, resolve_device, to_device
from fedseg.foundation.errors import ConfigError
from fedseg.foundation.messages import Task
from fedseg.foundation.seeding import derive_seed
from fedseg.seams.algorithm import Algorithm, Candidate, ServerContext
from fedseg.seams.checkpoint import (
    BEST_ARRAYS,
    BEST_META,
    PROGRESS,
    SERVER,
    SITES,
    Best,
    CheckpointWriter,
    JsonDoc,
    best_files,
    check_resumable,
    commit_checkpoint,
    load_best,
    load_checked,
    prune_checkpoints,
    read_progress,
)
from fedseg.seams.transport import Transport
from fedseg.site.workload import Workload

__all__ = ["Engine"]


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
        k, least = len(self.ctx.sites), cfg.privacy.secagg_min_sites
        if cfg.privacy.secure_aggregation and not algorithm.needs_pooled_site and k < least:
            raise ConfigError(
                f"privacy.secure_aggregation = true with {k} sites: every site masks only with at least "
                f"privacy.secagg_min_sites = {least} sites and would refuse each exchange; run with at least {least} "
                f"sites or set privacy.secagg_min_sites (≥ 2) at every site, knowing that with 2 sites one site's input "
                "is all that hides the other's"
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
        dtype = DTYPES[self.cfg.train.dtype]
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
        return self.evaluate_all(candidates, split, sites_of)[0]

    def evaluate_all(
        self, candidates: list[Candidate], split: str, sites_of: Callable[[Candidate], tuple[str, ...]]
    ) -> tuple[dict[str, dict[str, list[list[float]]]], dict[str, dict[str, dict[str, list[list[float]]]]]]:
        """:meth:`evaluate`, and the sites' test metrics (``Workload.test_metrics``, test split only) as
        ``{metric: {candidate: {site: per-case (N, C)}}}``."""
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
        extra: dict[str, dict[str, dict[str, list[list[float]]]]] = {}
        for s, rep in replies.items():
            for name, cases in rep.metrics["per_case"].items():
                out[name][s] = cases
            for metric, by_cand in (rep.metrics.get("test_metrics") or {}).items():
                for name, cases in by_cand.items():
                    extra.setdefault(metric, {}).setdefault(name, {})[s] = cases
        return out, extra

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
        return self.test_all()[0]

    def test_all(
        self,
    ) -> tuple[dict[str, dict[str, list[list[float]]]], dict[str, dict[str, dict[str, list[list[float]]]]]]:
        """:meth:`test` and the test metrics beside Dice (:meth:`evaluate_all`)."""
        cands = [b.candidate for b in self.best.values()]
        return self.evaluate_all(cands, "testing", lambda c: self.ctx.sites)

    # --------------------------------------------------------------- privacy
    def privacy_report(self) -> dict[str, dict[str, Any]] | None:
        """Under ``privacy.dp``: each site's ε so far, its ε after one more planned round, σ, q and its
        privatized steps (a ``"privacy"`` task, answered by the site from its privacy ledger); None with dp off."""
        if self.cfg.privacy.dp == "off":
            return None
        replies = self.transport.ask({s: Task("privacy", {}, {}) for s in self.ctx.sites})
        self.transport.traffic.take()  # a few numbers per site, not counted as the round's traffic
        return {s: dict(replies[s].metrics) for s in self.ctx.sites if s in replies}

    def over_budget(self, report: dict[str, dict[str, Any]] | None, rnd: int) -> bool:
        """True when round ``rnd`` would take a site past ``privacy.epsilon`` and ``budget_action = "stop"``
        (logged either way); a budget that not even the first round fits is a :class:`ConfigError`.  Also True
        (whatever ``budget_action``) when it would take a deployed site past its policy's lifetime ceiling over
        all its runs (``epsilon_lifetime_next`` > ``epsilon_ceiling`` in its report): the site would refuse it."""
        target = self.cfg.privacy.epsilon
        if report is None:
            return False
        lifetime = {
            s: r["epsilon_lifetime_next"]
            for s, r in report.items()
            if r.get("epsilon_ceiling") is not None and r.get("epsilon_lifetime_next", 0.0) > r["epsilon_ceiling"]
        }
        if lifetime and rnd > 1:  # round 1: the site refused the run at setup already
            worst = max(lifetime, key=lambda s: lifetime[s])
            self.log(
                f"privacy budget: round {rnd} would take the data of site {worst} to ε = {lifetime[worst]:.3g} over "
                f"all its runs > its policy's max_epsilon = {report[worst]['epsilon_ceiling']:g} (sites over it: "
                f"{sorted(lifetime)}): training stops after round {rnd - 1} (checkpoint saved) and its models are "
                "tested; the site's lifetime budget is its own"
            )
            return True
        if target is None:
            return False
        over = {s: r["epsilon_next"] for s, r in report.items() if r["epsilon_next"] > target}
        if not over:
            return False
        worst = max(over, key=lambda s: over[s])
        said = (
            f"privacy budget: round {rnd} would take site {worst} to ε = {over[worst]:.3g} > privacy.epsilon = "
            f"{target:g} (δ = {self.cfg.privacy.delta:g}; sites over it: {sorted(over)})"
        )
        if self.cfg.privacy.budget_action == "warn":
            self.log(f"{said}; privacy.budget_action = warn: training on")
            return False
        if rnd == 1:
            raise ConfigError(
                f"{said}: not even one round fits; raise privacy.epsilon or privacy.noise_multiplier, or lower "
                "train.local_epochs / train.local_steps"
            )
        self.log(
            f"{said}: training stops after round {rnd - 1} (checkpoint saved) and its models are tested; raise "
            "privacy.epsilon (or privacy.noise_multiplier) to train further, or set privacy.budget_action = warn"
        )
        return True

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
        staged = [SERVER]
        files: dict[str, Arrays | JsonDoc] = {f"{SERVER}.next": self.writer.host_copy("server", self.state)}
        best_arrays, best_meta = best_files(self.best)
        layout = {SERVER: layout_of(self.state), BEST_ARRAYS: layout_of(best_arrays)}
        if best_meta != self._saved_best or not (d / BEST_ARRAYS).is_file():
            files[f"{BEST_ARRAYS}.next"] = self.writer.host_copy("best", best_arrays)
            files[f"{BEST_META}.next"] = JsonDoc(copy.deepcopy(best_meta))
            staged += [BEST_ARRAYS, BEST_META]
            self._saved_best = best_meta
        snapshot = getattr(self.transport, "snapshot_sites", None)
        if snapshot is None:  # sites that persist themselves (deployment): asked now, synchronously
            self.transport.save_sites(d / f"{SITES}.next")
        else:
            for name, (arrays, meta) in snapshot().items():
                files[f"{SITES}.next/{name}.safetensors"] = self.writer.host_copy(f"sites/{name}", arrays)
                files[f"{SITES}.next/{name}.json"] = JsonDoc(copy.deepcopy(meta))
        progress = {"round": self.round, "history": self.history, "staged": staged, "layout": layout}
        files[f"{PROGRESS}.next"] = JsonDoc(copy.deepcopy(progress))
        self.writer.copies_done()
        self.writer.submit(d, files)
        self.checkpoint_s += time.perf_counter() - t0

    def load_checkpoint(self) -> None:
        d = self.ckpt_dir
        if d is not None:
            check_resumable(d)  # a finished run pruned of its resumable state: one message
            commit_checkpoint(d)  # finish a checkpoint interrupted after its commit record
        progress = read_progress(d) if d is not None else None
        if d is None or progress is None:
            raise ConfigError(f"no checkpoint to resume in {self.out}; start the run without --resume")
        self.round = int(progress["round"])
        self.history = progress["history"]
        layout = progress["layout"]
        self.state = to_device(load_checked(d / SERVER, layout[SERVER]), self.device)
        for name, b in load_best(d, layout[BEST_ARRAYS]).items():
            b.candidate.arrays = to_device(b.candidate.arrays, self.device)
            self.best[name] = b
        self.transport.restore_sites(d / SITES)

    def finish(self) -> int:
        """After the run's results are written: remove from ``OUT/checkpoints`` what only ``--resume`` reads, as
        ``checkpoint_keep`` says ('best': every site's state and the last round's server state; 'final': every
        site's state; 'all': nothing); returns the bytes removed.  The best models, ``progress.json`` and the results stay."""
        d = self.ckpt_dir
        if d is None:
            return 0
        self.writer.wait()
        gone = prune_checkpoints(d, self.cfg.checkpoint_keep)
        freed = sum(size for _, size in gone)
        if gone:
            self.log(
                f"checkpoint_keep = {self.cfg.checkpoint_keep}: removed the resumable state of the finished run "
                f"({freed / 1e6:.1f} MB: {', '.join(p.name for p, _ in gone)}); --set checkpoint_keep=all keeps it"
            )
        return freed

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
        report = self.privacy_report()
        stopped_at: int | None = None
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
                if self.over_budget(report, rnd):
                    stopped_at = self.round
                    if self.round % cfg.checkpoint_every != 0:
                        self.save_checkpoint()
                    break
                t0 = time.perf_counter()
                self.state, metrics = self.algorithm.server_round(self.ctx, self.state, rnd)
                entry: dict[str, Any] = {"round": rnd, **metrics, "bytes": self.transport.traffic.take()}
                if cfg.is_eval_round(rnd):
                    entry.update(self._validate(rnd))
                    entry["eval_bytes"] = self.transport.traffic.take()
                report = self.privacy_report()
                if report is not None:
                    entry["epsilon"] = {s: r["epsilon"] for s, r in report.items()}
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
                # a candidate first formed here (FedSM's composite under secure aggregation) brings its own
                # validation score and counts as the last round's
                prev = self.best.get(name)
                score = prev.score if prev is not None else float(cand.config.get("val_score", float("nan")))
                self.best[name] = Best(score, prev.round if prev is not None else self.round, cand)
            self.save_checkpoint()
            self.writer.wait()
        per_case, test_metrics = self.test_all()
        extra = self.algorithm.test_report(
            {n: b.candidate for n, b in self.best.items()}, {n: b.round for n, b in self.best.items()}, self.ctx
        )
        results = summarize(
            method=self.algorithm.name,
            sites=list(self.ctx.sites),
            cfg=cfg,
            per_case=per_case,
            best=self.best,
            primary=self.algorithm.primary,
            metric_names=list(self.workload.metric_names),
            history=self.history,
            label=self.algorithm.label(),
            test_metrics=test_metrics,
        )
        if results["sites_without_results"]:
            self.log(
                f"sites {results['sites_without_results']} have no test result (left out of every test exchange, "
                "or without an own model): the client average is over the other sites"
            )
        results.update({k: v for k, v in extra.items() if k not in results})  # e.g. FedSM's routing on test
        results["wall_time_s"] = time.perf_counter() - t_start
        results["device"] = describe(self.device)
        results["precision"] = cfg.train.precision
        if report is not None:
            results["privacy"] = {
                "dp": cfg.privacy.dp,
                "delta": cfg.privacy.delta,
                "epsilon_budget": cfg.privacy.epsilon,
                "accountant": cfg.privacy.accountant,
                "clip": cfg.privacy.clip,
                "dp_randomness": cfg.privacy.dp_randomness,
                # "seeded": the server knows the seed, regenerates the noise and the batches: no ε holds against it
                "epsilon_against_server": "inf" if cfg.privacy.dp_randomness == "seeded" else "epsilon",
                "sites": {
                    s: {
                        k: r[k]
                        for k in ("epsilon", "noise_multiplier", "sample_rate", "steps", "batches", "epsilon_lifetime")
                        if k in r  # epsilon_lifetime: a deployed site's ε over every run in its ledger
                    }
                    for s, r in report.items()
                },
                "stopped_after_round": stopped_at,
            }
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
