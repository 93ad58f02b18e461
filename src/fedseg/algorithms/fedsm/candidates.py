"""FedSM's candidates on the server: the composite (global + personalized models + selector, routed by the
``"fedsm"`` predictor), its validation with the global and personalized models in one ``"route"`` task per site
(:mod:`.validation`), the choice of γ on those sums, the composite assembled from the best parts after the last
round, and the test report of its routing.  :class:`FedSMCandidates` is the part of :class:`.method.FedSM` that
the engine's evaluation hooks call (``candidates``, ``final_candidates``, ``test_report``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fedseg.algorithms.fedsm import secure as sm_secure
from fedseg.algorithms.fedsm.selection import mean_routing, pick_gamma, pick_gamma_per_model, route_task
from fedseg.foundation.arrays import Arrays, clone, prefixed, strip_prefix
from fedseg.seams.algorithm import Algorithm, Candidate, ServerContext

__all__ = ["FedSMCandidates"]


class FedSMCandidates(Algorithm):
    """FedSM's candidates, their one-pass validation, γ, the final assembly and the test report."""

    params: Any  # FedSMParams, resolved (fedsm.profile fills in what is unset)
    labels = "site"  # Eq. 2
    mode = "gate"  # Alg. 2

    def num_classes(self, k: int) -> int:
        """Selector outputs: K sites (Eq. 2), or K + 1 with the global model as class 0 (Eq. 1 / ensemble)."""
        return k if self.labels == "site" else k + 1

    def pick_gamma(self, replies: dict[str, dict[str, Any]]) -> float:
        """γ of ``fedsm.gamma_grid`` with the best validation Dice in the sites' routing ``replies``, by the
        run's best-round criterion (``eval.best_criterion``: pooled cases or the mean of per-site means)."""
        return pick_gamma(replies, self.params.gamma_grid, self.cfg.eval.best_criterion)[0]

    def set_gamma(self, cand: Candidate, replies: dict[str, dict[str, Any]]) -> None:
        """Put the γ chosen on validation ``replies`` into the composite's config: ``gamma`` (one γ, also
        reported under ``"auto-per-model"``) and, for ``"auto-per-model"``, ``gamma_per_model`` (one
        threshold per personalized model, :func:`pick_gamma_per_model`), which routing then uses."""
        cand.config["gamma"] = self.pick_gamma(replies)
        if self.params.gamma == "auto-per-model":
            cand.config["gamma_per_model"] = pick_gamma_per_model(
                replies, self.params.gamma_grid, self.cfg.eval.best_criterion, self.params.gamma_margin
            )[0]

    @property
    def gamma_auto(self) -> bool:
        """γ is chosen on validation (``fedsm.gamma = "auto"`` or ``"auto-per-model"``, γ-gated routing)."""
        return isinstance(self.params.gamma, str) and self.mode == "gate"

    def _gamma(self) -> float:
        return 0.9 if isinstance(self.params.gamma, str) else float(self.params.gamma)

    @property
    def secure(self) -> bool:
        """``privacy.secure_aggregation``: the server learns sums only (:mod:`.secure`)."""
        return self.cfg.privacy.secure_aggregation

    def composite(self, state: Arrays, ctx: ServerContext, gamma: float | None = None) -> Candidate:
        """The "fedsm" candidate: global + selector + personalized models, routed by the ``"fedsm"`` predictor."""
        sites = list(ctx.sites)
        arrays = {k: v for k, v in state.items() if k.startswith(("global/", "selector/", "personal/"))}
        config = {
            "sites": sites,
            "num_classes": self.num_classes(len(sites)),
            "mode": self.mode,
            "gamma": self._gamma() if gamma is None else gamma,
        }
        return Candidate("fedsm", arrays, predictor="fedsm", config=config)

    def candidates(self, state: Arrays, ctx: ServerContext) -> list[Candidate]:
        """The composite (once there is a selector) and the global and personalized models.  FedSM-extra
        and the ensemble offer their models in the selector phase too: they are the last model round's,
        frozen, and that round is validated only if ``eval.every`` divides it — without this the
        assembled composite could hold older models than those its selector was trained against (with
        ``eval.every = 20`` and 213 model rounds: round 200's models under a selector trained against
        round 213's).  Re-validating unchanged weights gives the same score, and a tie keeps the
        earlier round."""
        if self.secure:  # the personalized models are at their sites: no composite until they are released
            return [Candidate("global", strip_prefix("global", state)), *sm_secure.held_candidates(ctx.sites)]
        have_selector = any(k.startswith("selector/") for k in state)
        if have_selector:
            return self._validated_candidates(state, ctx)
        return [Candidate("global", strip_prefix("global", state)), *self._personal_candidates(state, ctx)]

    @staticmethod
    def _personal_candidates(state: Arrays, ctx: ServerContext) -> list[Candidate]:
        return [
            Candidate(
                f"personal/{s}",
                strip_prefix(f"personal/{s}", state),
                val_sites=(s,),
                home_site=s,
                config={"bn_role": "personal"},
            )
            for s in ctx.sites
        ]

    def _validated_candidates(self, state: Arrays, ctx: ServerContext) -> list[Candidate]:
        """:meth:`candidates` with a selector, validated in one ``"route"`` task per site: each site reads its cases
        once, runs each model once on them (:func:`.validation.one_pass`) and sends the composite's Dice sums at
        every γ of the grid (γ-gated; one selection for argmax and the mix) and the sums of the global model and of
        its own personalized model.  γ is chosen on those sums (``gamma = "auto"``, ``"auto-per-model"``); each
        candidate carries its validation sums (``scored``), so the engine asks the sites nothing more."""
        cand = self.composite(state, ctx)
        sites = list(ctx.sites)
        grid: Sequence[float] = []
        if self.mode == "gate":
            grid = self.params.gamma_grid if self.gamma_auto else [cand.config["gamma"]]
        replies = route_task(ctx.transport, cand, sites, "validation", grid, per_model=False, candidates=True)
        if self.gamma_auto and any(r["n"] for r in replies.values()):
            self.set_gamma(cand, replies)
        cand.scored = {s: (r["n"], self._composite_sum(r, cand.config, grid)) for s, r in replies.items()}
        glob = Candidate("global", strip_prefix("global", state))
        glob.scored = {s: (r["n"], r["candidate_sums"]["global"]) for s, r in replies.items()}
        personal = self._personal_candidates(state, ctx)
        for c, s in zip(personal, ctx.sites):
            r = replies.get(s)
            c.scored = {} if r is None else {s: (r["n"], r["candidate_sums"]["personal"])}
        return [cand, glob, *personal]

    def _composite_sum(self, reply: dict[str, Any], config: dict[str, Any], grid: Sequence[float]) -> float:
        """The composite's Dice sum over a site's cases at its thresholds, from a one-pass route ``reply``: the
        selection of its γ, or per personalized model j the Dice of the cases of top class j at γ_j (a case's
        route depends only on its top class's threshold, :func:`pick_gamma_per_model`)."""
        if not reply["n"]:
            return 0.0
        sels = reply["selections"]
        if self.mode != "gate":
            return float(sels[0]["dice_sum"])
        per = config.get("gamma_per_model")
        if per is None:
            return float(sels[list(grid).index(config["gamma"])]["dice_sum"])
        return sum(sels[list(grid).index(g)]["dice_sum_by_top"][j] for j, g in enumerate(per))

    def final_candidates(
        self, state: Arrays, best: dict[str, Candidate], best_rounds: dict[str, int], ctx: ServerContext
    ) -> dict[str, Candidate]:
        """The composite to test, assembled from the best parts as the reference code keeps them.

        Global model: the best-validation ``global`` candidate; personalized models: each
        site's best-validation ``personal/<site>`` (for fedsm-extra / ensemble the best of the model
        phase, its last round included: :meth:`candidates`); selector: the
        final one or the best earlier one (``best_selector/…``, kept by the server), whichever
        has the higher mean validation routing accuracy over the sites (Eq. 2; Eq. 1's oracle
        labels for K + 1 classes) — for the ensemble, whose output is the mix, the higher
        validation Dice of the assembled mix (:meth:`selector_score`).  With ``gamma = "auto"`` γ
        is picked again on validation for the assembled composite.  ``config["assembled"]``
        records the rounds of the parts.
        """
        if self.secure:
            return self._final_secure(state, best, best_rounds, ctx)
        return self._assemble(state, best, best_rounds, ctx)

    def _assemble(
        self, state: Arrays, best: dict[str, Candidate], best_rounds: dict[str, int], ctx: ServerContext
    ) -> dict[str, Candidate]:
        """:meth:`final_candidates`' composite from ``best``'s parts."""
        comp = best.get("fedsm")
        if comp is None:
            return {}
        sites = list(ctx.sites)
        arrays: Arrays = {}
        rounds: dict[str, Any] = {}
        for name in ["global", *(f"personal/{s}" for s in sites)]:
            part = best.get(name)
            arrays.update(prefixed(name, part.arrays if part is not None else strip_prefix(name, comp.arrays)))
        gate_auto = self.gamma_auto
        grid = self.params.gamma_grid
        options: list[tuple[str, Arrays, float | None]] = [("final", strip_prefix("selector", state), None)]
        if "best_selector_score" in state:
            options.append(("best", strip_prefix("best_selector", state), float(state["best_selector_score"])))
        chosen = None
        for label, sel, known in options:
            cand = self.composite({**arrays, **prefixed("selector", sel)}, ctx)
            ask = known is None or gate_auto or self.selector_criterion == "dice"
            replies = route_task(ctx.transport, cand, sites, "validation", grid, per_model=False) if ask else None
            score = self.selector_score(replies, known)
            if chosen is None or (score is not None and (chosen[1] is None or score > chosen[1])):
                chosen = (cand, score, replies, label)
        assert chosen is not None
        cand, score, replies, label = chosen
        if gate_auto and replies is not None and sum(r["n"] for r in replies.values()):
            self.set_gamma(cand, replies)
        rounds["selector"] = int(state["best_selector_round"]) if label == "best" else self.cfg.rounds
        rounds[f"selector_val_{self.selector_criterion}"] = score
        for name in ["global", *(f"personal/{s}" for s in sites)]:
            rounds[name] = best_rounds.get(name, best_rounds["fedsm"])
        cand.config["assembled"] = rounds
        cand.arrays = clone(cand.arrays)  # its own tensors (the best candidates keep theirs)
        return {"fedsm": cand}

    def _final_secure(
        self, state: Arrays, best: dict[str, Candidate], best_rounds: dict[str, int], ctx: ServerContext
    ) -> dict[str, Candidate]:
        """Under secure aggregation: the composite of :meth:`final_candidates` from the best personalized
        models the sites release now (a site that does not: the best global model in its place, logged),
        with its validation score (``config["val_score"]``), and those models as the personalized
        candidates to test."""
        glob = best["global"].arrays if "global" in best else strip_prefix("global", state)
        released = sm_secure.release_round(ctx)
        personal: dict[str, Candidate] = {}
        for s in ctx.sites:
            if s not in released:
                ctx.log(f"{self.name}: site {s} did not release its personalized model; the global model stands in")
            personal[f"personal/{s}"] = Candidate(
                f"personal/{s}",
                released.get(s, clone(glob)),
                val_sites=(s,),
                home_site=s,
                config={"bn_role": "personal"},
            )
        arrays = {**prefixed("global", glob), **{k: v for k, v in state.items() if k.startswith("selector/")}}
        for name, cand in personal.items():
            arrays.update(prefixed(name, cand.arrays))
        out = self._assemble(
            state,
            {**best, **personal, "fedsm": self.composite(arrays, ctx)},
            {"fedsm": self.cfg.rounds, **best_rounds},
            ctx,
        )
        cand = out["fedsm"]
        replies = route_task(
            ctx.transport, cand, list(ctx.sites), "validation", [cand.config["gamma"]], per_model=False
        )
        if sum(r["n"] for r in replies.values()):
            cand.config["val_score"] = pick_gamma(replies, [cand.config["gamma"]], self.cfg.eval.best_criterion)[1]
        return {**out, **personal}

    def test_report(
        self, best: dict[str, Candidate], best_rounds: dict[str, int], ctx: ServerContext
    ) -> dict[str, Any]:
        """``results["fedsm"]``: where the composite's selector sent each site's test cases — per site the share
        routed to the global and to each personalized model, at the composite's own γ (or per-model thresholds;
        the argmax / the top choice without γ), and its routing accuracy (the share sent to the site's own model;
        null for a K + 1-class selector).  Only the selector runs at the sites (``route`` with ``scores =
        false``): counts come back, no image and no score; a site whose reply is missing or rejected is left out.  ``fedseg fedsm`` replaces it by the full report with
        each model's Dice (:func:`fedseg.apps.studies.fedsm.routing_report`)."""
        cand = best.get("fedsm")
        if cand is None or cand.predictor != "fedsm":
            return {}
        mode = cand.config.get("mode", "gate")
        per_model = cand.config.get("gamma_per_model") is not None
        gammas = [cand.config["gamma"]] if mode == "gate" and not per_model else []
        # optional: a site whose reply is rejected is left out of the report; the finished run is not stopped
        replies = route_task(ctx.transport, cand, list(ctx.sites), "testing", gammas, scores=False, optional=True)
        models = ["global", *[f"personal/{s}" for s in cand.config["sites"]]]
        per_site = {}
        for s, m in replies.items():
            n, counts = m["n"], m["selections"][-1]["counts"]
            per_site[s] = {
                "n": n,
                "routing_acc": m["routing_acc"],
                "selection": {name: (c / n if n else None) for name, c in zip(models, counts)},
                "counts": dict(zip(models, counts)),
            }
        report = {
            "split": "testing",
            "gamma": cand.config.get("gamma"),
            "gamma_per_model": cand.config.get("gamma_per_model"),
            "mode": mode,
            "models": models,
            "best_round": best_rounds.get("fedsm"),
            "per_site": per_site,
            "scored": False,
        }
        return {"fedsm": report}

    selector_criterion = "routing_acc"
    """How :meth:`final_candidates` compares the final and the best earlier selector (:meth:`selector_score`)."""

    def selector_score(self, replies: dict[str, dict[str, Any]] | None, known: float | None) -> float | None:
        """A selector's validation score in the assembled composite, by :attr:`selector_criterion`:
        ``"routing_acc"``, the mean routing accuracy over the sites (``known``: as measured when it was
        kept; else from the ``"route"`` ``replies``); ``"dice"``, the validation Dice of the composite with
        one selection (argmax or mix routing) by ``eval.best_criterion``, None without validation cases."""
        if self.selector_criterion == "dice":
            if not replies or not sum(r["n"] for r in replies.values()):
                return None
            return pick_gamma(replies, [0.0], self.cfg.eval.best_criterion)[1]
        if known is not None:
            return known
        return mean_routing({s: r["routing_acc"] for s, r in (replies or {}).items()})
