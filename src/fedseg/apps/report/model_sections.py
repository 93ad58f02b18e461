"""Report sections that run the trained models: loss surface (FedSM Fig. 4), selector t-SNE (Fig. 3),
sample predictions, and FedSM's routing on the test split when the results do not hold it.

Each run's best models are rebuilt from its checkpoints (:class:`fedseg.apps.report.runs.RunModels`);
one run per variant (its first seed) is shown.  When a run's models cannot be loaded,
the section says why instead of failing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from fedseg.algorithms.fedsm.selection import thresholds
from fedseg.algorithms.softpull import route
from fedseg.apps.report import figures
from fedseg.apps.report.loss_surface import loss_surface, trainable_arrays
from fedseg.apps.report.markup import figure, note, para, table
from fedseg.apps.report.numbers import is_fedsm, method_cases, model_short
from fedseg.apps.report.runs import DataCache, Run, RunModels
from fedseg.apps.report.tsne import selector_features, tsne_embed
from fedseg.foundation.errors import ConfigError
from fedseg.foundation.messages import Task
from fedseg.site.batches import batch_of, dataset_len
from fedseg.site.workload import predicted_channels

__all__ = [
    "loss_surface_section",
    "open_models",
    "predictions_section",
    "routed_models",
    "routing_on_test",
    "tsne_section",
]


def open_models(runs: Sequence[Run], cache: DataCache) -> tuple[list[RunModels], list[str]]:
    """One RunModels per variant (its first seed), and notes for runs that could not be opened."""
    seen: set[str] = set()
    out, notes = [], []
    for r in runs:
        if r.variant in seen:
            continue
        seen.add(r.variant)
        try:
            out.append(RunModels.open(r, cache))
        except (ConfigError, OSError, KeyError, ValueError) as e:
            notes.append(f"{r.label}: models not loaded ({e})")
    return out, notes


def loss_surface_section(models: Sequence[RunModels], opts: Any, progress: bool, colors_for: Mapping[str, Any]) -> str:
    if not models:
        return note("no run's models could be loaded")
    data = models[0].data
    site = opts.loss_site
    if site is None:
        candidates = [s for s in data if all(s in m.run.results["sites"] for m in models)] or list(data)
        site = min(candidates, key=lambda s: len(data[s].train))
    if site not in data:
        return note(f"loss-surface site {site!r} is not in the federation; sites: {list(data)}")
    chosen: dict[str, tuple[RunModels, str, torch.nn.Module]] = {}
    notes = []
    for m in models:
        got = m.loss_model(site) if site in m.data else None
        if got is None:
            notes.append(f"{m.run.variant}: no plain model for site {site}")
            continue
        chosen[m.run.variant] = (m, got[0], got[1])
    if not chosen:
        return "".join(note(n) for n in notes) or note("no models")
    radius = opts.radius
    if radius is None:
        if opts.normalize == "unit":
            norms = [
                float(torch.cat([v.reshape(-1).double() for v in trainable_arrays(mod).values()]).norm())
                for _, _, mod in chosen.values()
            ]
            radius = float(np.mean(norms))
        else:
            radius = 1.0
    surfaces = {}
    palette = dict(colors_for)
    colors = {}
    for label, (m, name, mod) in chosen.items():
        colors[f"{label} ({name})"] = palette[label]
        surfaces[f"{label} ({name})"] = loss_surface(
            mod,
            m.workload.loss,
            m.data[site].train,
            directions=opts.directions,
            radius=radius,
            steps=opts.steps,
            seed=opts.seed,
            normalize=opts.normalize,
            max_cases=opts.loss_cases,
            batch_size=m.cfg.eval.batch_size,
            forward=m.workload.predict,
            progress=progress,
            desc=f"loss surface {label}",
        )
    n_cases = min(len(data[site].train), opts.loss_cases or len(data[site].train))
    what = "distance along a random unit direction" if opts.normalize == "unit" else "α (filter-normalized direction)"
    loss_name = models[0].cfg.train.loss_for(volumes=False)  # a volume run records the loss its plan chose
    png = figures.loss_surface_figure(surfaces, what, f"train loss ({loss_name})", colors)
    caption = (
        f"1D loss surface (FedSM Fig. 4): training loss on {site}'s first {n_cases} training cases along "
        f"{opts.directions} random {'unit' if opts.normalize == 'unit' else 'filter-normalized'} directions (seed {opts.seed}, "
        f"the same directions for every method), α ∈ [−{radius:.3g}, {radius:.3g}]; the dot is the trained model. "
        "Sharpness = mean over directions of (max loss on the grid − loss at the model); the table lists both per model."
    )
    rows = [[label, f"{s.center:.4f}", f"{s.sharpness:.4f}"] for label, s in surfaces.items()]
    return (
        figure("fig-loss-surface", png, caption)
        + table(["Model", f"train loss at the model ({site})", "sharpness"], rows)
        + "".join(note(n) for n in notes)
    )


def tsne_section(models: Sequence[RunModels], opts: Any) -> str | None:
    with_sel = [(m, m.selector()) for m in models]
    selectors = [(m, s) for m, s in with_sel if s is not None]
    if not selectors:
        return None
    parts = []
    for m, sel in selectors:
        feats, sites = selector_features(sel, {s: d.test for s, d in m.data.items()}, max_per_site=opts.tsne_cases)
        try:
            pts = tsne_embed(feats, seed=opts.seed)
        except ImportError as e:
            return note(str(e))
        except ValueError as e:
            parts.append(note(f"{m.run.variant}: {e}"))
            continue
        png = figures.tsne_figure(pts, sites, m.run.variant)
        held = f" ({m.run.heldout} was not in training)" if m.run.heldout else ""
        caption = (
            f"t-SNE of the FedSM model selector's pooled features (FedSM Fig. 3), {m.run.variant}: "
            f"up to {opts.tsne_cases} test images per site{held}, coloured by site (perplexity min(30, (N − 1)/3), seed {opts.seed})."
        )
        parts.append(figure(f"fig-tsne-{len(parts)}", png, caption))
    return '<div class="figrow">' + "\n".join(parts) + "</div>"


def _slice(arr: np.ndarray, spatial_dims: int, index: int | None) -> np.ndarray:
    return arr if spatial_dims == 2 or index is None else arr[:, index]


@torch.no_grad()
def predictions_section(models: Sequence[RunModels], opts: Any, progress: bool) -> str:
    data = models[0].data
    wl0 = models[0].workload
    same = [m for m in models if m.data is data]  # runs on the first run's federation (one figure, one set of cases)
    notes = [
        f"{m.run.variant}: trained on another federation ({m.cfg.federation}); not shown"
        for m in models
        if m.data is not data
    ]
    models = same
    labels = [m.run.variant for m in models]
    rows = []
    predictors: dict[tuple[str, str], Any] = {}
    for m in tqdm(models, desc="sample predictions", unit="run", disable=not progress, leave=False):
        for s in data:
            try:
                got = m.predictor(s)
            except Exception as e:  # a site this run cannot predict for
                notes.append(f"{m.run.variant}: no prediction on {s} ({e})")
                got = None
            predictors[(m.run.variant, s)] = got
    for s, d in data.items():
        n = min(opts.cases, dataset_len(d.test))
        if n == 0:
            continue
        x, y = batch_of(d.test, torch.arange(n))
        outs = {}
        for m in models:
            got = predictors[(m.run.variant, s)]
            if got is not None:
                logits = got[1](x.to(m.site(s).dtype))
                dice = m.workload.metric(logits, y).double().mean(dim=1)
                routed = routed_models(m, x.to(m.site(s).dtype)) or [""] * n
                outs[m.run.variant] = (
                    predicted_channels(logits, m.cfg.eval.threshold, m.workload.labels).numpy(),
                    dice.numpy(),
                    routed,
                )
        for i in range(n):
            lab = y[i].numpy()
            idx = None
            if wl0.spatial_dims == 3:
                idx = int(lab.reshape(lab.shape[0], lab.shape[1], -1).sum(axis=(0, 2)).argmax())
            rows.append(
                {
                    "site": s,
                    "case": i,
                    "image": _slice(x[i].numpy(), wl0.spatial_dims, idx),
                    "label": _slice(lab, wl0.spatial_dims, idx),
                    "preds": {
                        k: (_slice(v[0][i], wl0.spatial_dims, idx), float(v[1][i]), v[2][i]) for k, v in outs.items()
                    },
                }
            )
    if not rows:
        return note("no test cases to show")
    png = figures.predictions_figure(rows, labels, list(wl0.metric_names))
    caption = (
        f"Sample predictions: the first {opts.cases} test case(s) of every site. First column: the image with the "
        "ground truth filled; then each method's reported model: its prediction filled over the image, the ground "
        "truth as a line, the case's Dice, and for FedSM the model the selector sent the image to (→ GM / → PM site)."
    )
    summary = cases_summary([m.run for m in models])
    return figure("fig-predictions", png, caption) + summary + "".join(note(n) for n in notes)


def cases_summary(runs: Sequence[Run]) -> str:
    """Every site's test predictions of each run, from the per-case Dice its ``results.json`` stores (no model
    runs): the cases, the mean and the worst case (its index in the site's test split and its Dice), and for a
    FedSM run the model its selector sent most of the site's test cases to (``results["fedsm"]``)."""
    sites = list(dict.fromkeys(s for r in runs for s in r.results["sites"]))
    rows = []
    for s in sites:
        row = [s]
        for r in runs:
            cases = method_cases(r.results).get(s) or []
            if not cases:
                row.append("–")
                continue
            worst = min(range(len(cases)), key=lambda i: cases[i])
            cell = f"{len(cases)} cases, mean {sum(cases) / len(cases):.3f}, worst #{worst} {cases[worst]:.3f}"
            sel = ((r.results.get("fedsm") or {}).get("per_site", {}).get(s) or {}).get("selection") or {}
            if sel and any(v for v in sel.values()):
                top = max(sel, key=lambda m: sel[m] or 0.0)
                cell += f"; {100 * (sel[top] or 0.0):.0f} % → {model_short(top)}"
            row.append(cell)
        rows.append(row)
    intro = para(
        "Test predictions per site, from the per-case Dice each run stored (case numbers are positions in the "
        "site's test split); for FedSM the model its selector sent most of the site's test cases to."
    )
    return intro + table(["Site", *[r.variant for r in runs]], rows)


@torch.no_grad()
def routing_on_test(m: RunModels, gamma: float | None = None) -> dict[str, Any] | None:
    """Routing report of a FedSM run's best composite on every site's test split, computed from its checkpoint.

    Runs the algorithm's own ``"route"`` site handler (the code the deployed sites
    run) with the composite's arrays and the γ it was saved with, so the numbers are
    those of the composite the results report.  Same shape as
    :func:`fedseg.apps.studies.fedsm.routing_report`: ``{"gamma", "mode", "models",
    "per_site": {site: {"n", "routing_acc", "selection" {model: share}, "dice",
    "dice_per_model" {model: Dice}}}}``.  None if the run has no composite.
    ``gamma`` overrides the saved γ (γ-gated composites only).
    """
    meta = m.meta.get("fedsm")
    if meta is None or not is_fedsm(m.run.method):
        return None
    config = dict(meta.get("config") or {})
    mode = config.get("mode", "gate")
    if gamma is not None:  # an override replaces per-model thresholds too
        config.pop("gamma_per_model", None)
    per_model = config.get("gamma_per_model") is not None
    gamma = config.get("gamma") if gamma is None else gamma
    models = ["global", *[f"personal/{s}" for s in config.get("sites", [])]]
    handler = m.algorithm.site_handlers()["route"]
    arrays = m.arrays("fedsm")
    per_site: dict[str, Any] = {}
    for s in m.data:
        task_cfg = {
            **config,
            "split": "testing",
            "gammas": [float(gamma)] if mode == "gate" and gamma is not None and not per_model else [],
        }
        got = handler(m.site(s), Task("route", arrays, task_cfg)).metrics  # one selection: γ's or per-model
        n = got["n"]
        sel = got["selections"][0]
        per_site[s] = {
            "n": n,
            "routing_acc": got["routing_acc"],
            "selection": {name: (c / n if n else None) for name, c in zip(models, sel["counts"])},
            "dice": sel["dice_sum"] / n if n else None,
            "dice_per_model": {name: (d / n if n else None) for name, d in zip(models, got["dice_sum_per_model"])},
        }
    return {
        "gamma": gamma,
        "gamma_per_model": config.get("gamma_per_model"),
        "mode": mode,
        "models": models,
        "per_site": per_site,
        "computed_by_report": True,
    }


@torch.no_grad()
def routed_models(m: RunModels, x: torch.Tensor, gamma: float | None = None) -> list[str] | None:
    """Name of the model FedSM's selector sends each image of ``x`` to (``GM``, ``PM site3``), or None if not FedSM.

    The same rule as the composite's predictor: γ-gated routing (Alg. 2), the argmax
    for FedSM-extra; for the ensemble (which mixes all models) the selector's top choice.
    """
    meta = m.meta.get("fedsm")
    sel = m.selector() if meta is not None else None
    if meta is None or sel is None:
        return None
    config = meta.get("config") or {}
    names = ["global", *[f"personal/{s}" for s in config.get("sites", [])]]
    probs = torch.softmax(sel(x.to(next(sel.parameters()).dtype)).double(), dim=1)
    mode = config.get("mode", "gate")
    idx = route(probs, thresholds(config, gamma)) if mode == "gate" else probs.argmax(dim=1)
    prefix = "mix, top: " if mode == "mix" else "→ "
    return [prefix + model_short(names[int(i)]) if int(i) < len(names) else f"model {int(i)}" for i in idx]
