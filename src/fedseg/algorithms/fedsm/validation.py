"""FedSM's validation in one pass over a site's cases: the composite's routing (Alg. 2) at every γ of the grid,
the global model and the site's own personalized model scored from one read of each case batch and one forward
of each model on it.

A ``"route"`` task with ``per_model = false`` (:func:`fedseg.algorithms.fedsm.selection.route_stats`) runs
:func:`one_pass`: per batch the selector's softmax, the global model on every case, the site's own personalized
model on every case (when the task asks for the ``candidates`` or the selector routes there), and each other
personalized model on the cases whose top class it is (γ-gated routing sends a case to the global model or to
its top class's model, never to another; FedSM-extra's argmax to its top class; the ensemble mixes every model's
output, so every model runs on every case).  The routed Dice of every γ is then read off the stored per-case
scores — no model runs twice on a case.  With ``candidates = true`` the reply also carries ``candidate_sums``:
the sums over the cases of the global model's and the site's own personalized model's mean score, which the
server takes as those candidates' validation scores (:class:`fedseg.seams.algorithm.Candidate` ``scored``)
instead of asking the site to evaluate them again.  Only sums and counts leave the site, as for any route.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fedseg.algorithms.fedsm.selection import (
    PER_MODEL,
    SelectorFactory,
    composite_predict,
    load_composite,
    oracle_accuracy,
    selector_probs,
)
from fedseg.algorithms.softpull import ensemble_mix, route, routing_accuracy
from fedseg.foundation.messages import Reply, Task
from fedseg.site import scoring
from fedseg.site.runtime import Site

__all__ = ["SharedForwards", "one_pass", "route_stats"]


def route_stats(site: Site, task: Task, factory: SelectorFactory) -> Reply:
    """Site half of a ``route`` task: aggregate routing statistics of a composite on one split (only
    sums and counts leave the site).

    Config: ``split``, ``sites``, ``num_classes``, ``mode``, ``gammas``, ``per_model`` (default true;
    false — what choosing γ and validating during a run need — scores each case with the models its routing can
    use in one pass over the cases, :func:`one_pass`, and reports ``dice_sum_per_model`` as null),
    ``candidates`` (with ``per_model = false``: ``candidate_sums`` too), ``scores`` (false: the selector alone
    runs, counts only).  Metrics:
    ``n`` cases, ``routing_acc`` (Eq. 2 selector: fraction routed to the site's own
    model, None for a site outside the federation; K + 1-class selector: fraction
    whose argmax is Eq. 1's oracle label, None with ``candidates``),
    ``dice_sum_per_model`` (K + 1 sums of per-case Dice: global, personal…), ``n_by_top`` (γ-gated: K counts,
    the cases whose top class is each personalized model; null otherwise), and
    ``selections``: one entry per γ (gate) or one entry (argmax / mix) with
    ``gamma``, ``dice_sum`` and ``counts`` (cases routed to each of the K + 1 models); gate entries also
    ``dice_sum_by_top`` (K sums: the routed Dice of the cases whose top class is each personalized model,
    what :func:`pick_gamma_per_model` chooses on), and when the config has ``gamma_per_model`` one more
    entry last, ``gamma = "per-model"``, routed with those thresholds; with ``candidates``,
    ``candidate_sums``: ``{"global": Σ, "personal": Σ or null}`` over the cases of each case's mean score.
    """
    cfg = task.config
    split, sites, mode = cfg["split"], list(cfg["sites"]), cfg.get("mode", "gate")
    sel, models = load_composite(site, task.arrays, cfg, factory, "fedsm-eval/")
    gates: list[tuple[Any, Any]] = []
    if mode == "gate":
        gates = [(float(g), float(g)) for g in cfg.get("gammas", [0.9])]
        if cfg.get("gamma_per_model") is not None:
            gates.append((PER_MODEL, [float(g) for g in cfg["gamma_per_model"]]))
    if cfg.get("scores", True) and not cfg.get("per_model", True):
        return one_pass(site, cfg, sel, models, gates)
    probs = selector_probs(site, sel, split)
    n = probs.shape[0]
    top = probs.argmax(dim=1)
    if not cfg.get("scores", True):
        return _routing_only(site, cfg, probs, sites, len(models))
    per_model = (
        torch.stack([site.score(functools.partial(site.workload.predict, m), split).mean(dim=1) for m in models], dim=1)
        if n
        else torch.zeros(0, len(models), dtype=torch.float64)
    )
    n_by_top = torch.bincount(top, minlength=probs.shape[1]).tolist() if mode == "gate" else None
    if probs.shape[1] == len(sites):  # Eq. 2 selector: is the site itself picked?
        acc = routing_accuracy(probs, sites.index(site.name), 0) if site.name in sites else None
    else:  # K + 1 classes (fedsm-extra, ensemble): agreement with Eq. 1's oracle labels
        acc = oracle_accuracy(site, sel, models, split) if n else None
    selections = []
    for label, gamma in gates:
        idx = route(probs, gamma)
        dice = per_model.gather(1, idx.unsqueeze(1)).squeeze(1)
        by_top = torch.zeros(probs.shape[1], dtype=torch.float64).index_add_(0, top, dice.double())
        selections.append(
            {
                "gamma": label,
                "dice_sum": float(dice.sum()),
                "counts": torch.bincount(idx, minlength=len(models)).tolist(),
                "dice_sum_by_top": by_top.tolist(),
            }
        )
    if mode != "gate":
        if mode == "mix":
            dice = site.score(composite_predict(site, sel, models, "mix", 0.0), split).mean(dim=1)
        else:
            dice = per_model.gather(1, top.unsqueeze(1)).squeeze(1)
        selections.append(
            {
                "gamma": None,
                "dice_sum": float(dice.sum()),
                "counts": torch.bincount(top, minlength=len(models)).tolist(),
            }
        )
    return Reply(
        metrics={
            "n": n,
            "routing_acc": acc,
            "dice_sum_per_model": per_model.sum(dim=0).tolist(),
            "n_by_top": n_by_top,
            "selections": selections,
        },
        num_samples=n,
    )


def _routing_only(site: Site, cfg: Mapping[str, Any], probs: torch.Tensor, sites: list[str], models: int) -> Reply:
    """A ``route`` reply with ``scores = false``: where the selector sends each case and nothing else (the selector
    runs, no segmentation model): ``n``, ``routing_acc`` (Eq. 2 selector; null for a K + 1-class selector, whose
    agreement with Eq. 1's labels needs every model), ``dice_sum_per_model`` and ``n_by_top`` null, one selection
    per γ (plus the per-model one) or one for argmax / mix, each ``gamma`` and ``counts`` with ``dice_sum`` null."""
    n = probs.shape[0]
    acc = None
    if probs.shape[1] == len(sites) and site.name in sites:
        acc = routing_accuracy(probs, sites.index(site.name), 0)
    gates: list[tuple[Any, Any]] = [(None, None)]
    if cfg.get("mode", "gate") == "gate":
        gates = [(float(g), float(g)) for g in cfg.get("gammas", [])]
        if cfg.get("gamma_per_model") is not None:
            gates.append((PER_MODEL, [float(g) for g in cfg["gamma_per_model"]]))
    selections = [
        {
            "gamma": label,
            "dice_sum": None,
            "counts": torch.bincount(
                probs.argmax(dim=1) if gamma is None else route(probs, gamma), minlength=models
            ).tolist(),
        }
        for label, gamma in gates
    ]
    metrics = {"n": n, "routing_acc": acc, "dice_sum_per_model": None, "n_by_top": None, "selections": selections}
    return Reply(metrics=metrics, num_samples=n)


def _case_sum(scores: torch.Tensor) -> float:
    """Σ over cases of each case's mean score, summed as the engine sums the per-case scores of an evaluation
    (in dataset order, each case's mean over its metric columns first)."""
    return sum(sum(c) / len(c) for c in scores.tolist())


class SharedForwards:
    """The forwards of one case batch shared by the predictors of :func:`one_pass`: the selector's softmax and each
    model's output on the whole batch computed once, the first time a predictor asks for them on that batch (the
    batch tensor itself is the key: :func:`fedseg.site.scoring.score_each` hands every predictor the same one)."""

    def __init__(self, site: Site, sel: nn.Module, models: Sequence[nn.Module]):
        self.site, self.sel, self.models = site, sel, list(models)
        self.probs: list[torch.Tensor] = []  # (B, C) float64 per batch, in dataset order
        self._x: torch.Tensor | None = None
        self._out: dict[int, torch.Tensor] = {}
        self._weights: torch.Tensor | None = None

    def _on(self, x: torch.Tensor) -> None:
        if self._x is x:
            return
        self._x, self._out = x, {}
        with torch.autocast(x.device.type, enabled=False):  # the selector's softmax as selector_probs takes it
            logits = self.sel(x)
        self._weights = torch.softmax(logits, dim=1)
        self.probs.append(torch.softmax(logits.double(), dim=1))

    def top(self, x: torch.Tensor) -> torch.Tensor:
        """The batch's top class per case."""
        self._on(x)
        return self.probs[-1].argmax(dim=1)

    def full(self, j: int, x: torch.Tensor) -> torch.Tensor:
        """Model ``j``'s output on the whole batch (computed once per batch)."""
        self._on(x)
        if j not in self._out:
            self._out[j] = self.site.workload.predict(self.models[j], x)
        return self._out[j]

    def routed(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Each case ``x[i]`` segmented by model ``idx[i]``: a model whose whole-batch output is at hand gives its
        rows, any other runs on its cases only."""
        out: torch.Tensor | None = None
        for j in idx.unique().tolist():
            mask = idx == j
            o = self._out[j][mask] if j in self._out else self.site.workload.predict(self.models[j], x[mask])
            if out is None:
                out = o.new_zeros((x.shape[0], *o.shape[1:]))
            out[mask] = o
        assert out is not None
        return out

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        """The ensemble's softmax-weighted mix of every model's output (Section 3.1.1)."""
        outs = [self.full(j, x) for j in range(len(self.models))]
        assert self._weights is not None
        return ensemble_mix(self._weights, outs)


def one_pass(
    site: Site, cfg: Mapping[str, Any], sel: nn.Module, models: Sequence[nn.Module], gates: list[tuple[Any, Any]]
) -> Reply:
    """The reply of a ``"route"`` task with ``per_model = false`` (:func:`.selection.route_stats` documents its
    metrics), every score from one pass over the split; ``gates`` are the γ-gated selections to report
    (label, threshold(s)).  ``candidates`` in ``cfg``: ``candidate_sums`` too (this module's docstring)."""
    split, sites, mode = cfg["split"], list(cfg["sites"]), cfg.get("mode", "gate")
    own = sites.index(site.name) + 1 if site.name in sites else None
    want = bool(cfg.get("candidates", False))
    fw = SharedForwards(site, sel, models)

    def to_global(x: torch.Tensor) -> torch.Tensor:
        return fw.full(0, x)

    def own_model(x: torch.Tensor) -> torch.Tensor:
        assert own is not None
        return fw.full(own, x)

    def chosen(x: torch.Tensor) -> torch.Tensor:  # gate: the top class's model; argmax: the top class
        top = fw.top(x)
        return fw.routed(x, top + 1 if mode == "gate" else top)

    predicts = [to_global] if mode == "gate" or want else []
    if want and own is not None:
        predicts.append(own_model)
    predicts.append(fw.mix if mode == "mix" else chosen)
    raw = [s for s, _ in scoring.score_each(site, predicts, split)]
    names = ["global"] * (mode == "gate" or want) + ["personal"] * (want and own is not None)
    by_case = dict(zip(names, raw))
    last = raw[-1].mean(dim=1)
    probs = torch.cat(fw.probs).cpu() if fw.probs else torch.zeros(0, len(sites), dtype=torch.float64)
    n = int(last.shape[0])
    top = probs.argmax(dim=1)
    acc = None
    if probs.shape[1] == len(sites):  # Eq. 2 selector: is the site itself picked?
        acc = routing_accuracy(probs, own - 1, 0) if own is not None else None
    elif n and not want:  # K + 1 classes: agreement with Eq. 1's oracle labels (the final assembly compares by it)
        acc = oracle_accuracy(site, sel, models, split)
    selections = []
    if mode == "gate":
        g = by_case["global"].mean(dim=1)
        for label, gamma in gates:
            idx = route(probs, gamma)
            dice = torch.where(idx == 0, g, last)
            by_top = torch.zeros(probs.shape[1], dtype=torch.float64).index_add_(0, top, dice.double())
            selections.append(
                {
                    "gamma": label,
                    "dice_sum": float(dice.sum()),
                    "counts": torch.bincount(idx, minlength=len(models)).tolist(),
                    "dice_sum_by_top": by_top.tolist(),
                }
            )
    else:
        selections.append(
            {
                "gamma": None,
                "dice_sum": float(last.sum()),
                "counts": torch.bincount(top, minlength=len(models)).tolist(),
            }
        )
    metrics: dict[str, Any] = {
        "n": n,
        "routing_acc": acc,
        "dice_sum_per_model": None,
        "n_by_top": torch.bincount(top, minlength=probs.shape[1]).tolist() if mode == "gate" else None,
        "selections": selections,
    }
    if want:
        personal = by_case.get("personal")
        metrics["candidate_sums"] = {
            "global": _case_sum(by_case["global"]),
            "personal": None if personal is None else _case_sum(personal),
        }
    return Reply(metrics=metrics, num_samples=n)
