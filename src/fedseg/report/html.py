"""One self-contained HTML report of one or more finished runs (``fedseg report OUT [OUT2 …] --html report.html``).

The file needs no Python and no network to read: styles are inline and every figure
is a base64 PNG inside an ``<img src="data:image/png;base64,…">``.  Sections appear
only for what the runs contain:

=====================  ==============================================================
section id             shown when
=====================  ==============================================================
``runs``, ``config``   always: which runs, their settings (and the full config.toml)
``table3``             always: Dice per site, Client Avg Dice, Global Dice (FedSM Table 3 layout)
``table2``             an ``autofedavg`` run and a ``fedavg`` run are both given (Auto-FedAvg
                       Table 2 layout, Wilcoxon p-values; needs ``fedseg.evaluation.stats``)
``routing``            a run has FedSM routing results (``results["fedsm"]``)
``table5``             FedSM unseen-site runs (``fedseg fedsm unseen``): FedSM Table 5
``curves``             always: best-so-far validation Dice per site and method (FedSM Fig. 2)
``alpha``              a run's history has ``alpha`` (Auto-FedAvg Fig. 3a)
``loss-surface``       the runs' checkpoints and data can be loaded (FedSM Fig. 4)
``tsne``               a run has a FedSM model selector (FedSM Fig. 3)
``predictions``        the runs' checkpoints and data can be loaded
=====================  ==============================================================

The model sections rebuild the best models from ``checkpoints/best.safetensors`` and
the data from the run's federation spec (:mod:`fedseg.report.runs`); when that is not
possible (moved data, no checkpoints) the section says why instead of failing.
"""

from __future__ import annotations

import base64
import datetime
import html
import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedseg.errors import ConfigError
from fedseg.report import figures
from fedseg.report.runs import DataCache, Run, RunModels, load_runs, method_settings, primary_of, run_label, sites_of

__all__ = ["build_report", "markdown_html", "ReportOptions"]

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222;line-height:1.45}
h1{font-size:1.6em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:2em}
table{border-collapse:collapse;margin:.8em 0;font-size:.88em}th,td{border:1px solid #ccc;padding:.25em .6em;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}
figure{margin:1em 0}figure img{max-width:100%;border:1px solid #eee}figcaption{font-size:.88em;color:#444;margin-top:.3em}
.note{color:#7a4a00;background:#fff6e5;border-left:3px solid #f0ad4e;padding:.4em .8em}
pre{background:#f7f7f7;padding:.6em;overflow-x:auto;font-size:.82em}nav a{margin-right:1em}
"""


# ------------------------------------------------------------------ Markdown
def _md_cells(line: str) -> list[str]:
    s = line.strip()
    if s.startswith("|"):
        s = s[1:]
    if s.endswith("|"):
        s = s[:-1]
    return [c.strip() for c in s.split("|")]


def markdown_html(md: str) -> str:
    """HTML for the Markdown the tables module writes: pipe tables and plain paragraphs (all text escaped).

    Example: ``"| a | b |\\n|---|---|\\n| 1 | 2 |"`` → one ``<table>`` with header a, b and row 1, 2.
    """
    out: list[str] = []
    lines = md.splitlines()
    i = 0
    para: list[str] = []

    def flush() -> None:
        if para:
            out.append("<p>" + html.escape(" ".join(para)) + "</p>")
            para.clear()

    while i < len(lines):
        line = lines[i]
        if line.strip().startswith("|"):
            flush()
            block = []
            while i < len(lines) and lines[i].strip().startswith("|"):
                block.append(lines[i])
                i += 1
            rows = [_md_cells(b) for b in block]
            head, body = rows[0], rows[1:]
            if body and all(set(c) <= set("-: ") for c in body[0]):
                body = body[1:]
            t = ["<table>", "<thead><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in head) + "</tr></thead>", "<tbody>"]
            t += ["<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in body]
            t.append("</tbody></table>")
            out.append("\n".join(t))
            continue
        if not line.strip():
            flush()
        elif line.startswith("#"):
            flush()
            out.append(f"<h3>{html.escape(line.lstrip('#').strip())}</h3>")
        else:
            para.append(line.strip())
        i += 1
    flush()
    return "\n".join(out)


def _table(head: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    t = ["<table>", "<thead><tr>" + "".join(f"<th>{html.escape(str(h))}</th>" for h in head) + "</tr></thead>", "<tbody>"]
    t += ["<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows]
    t.append("</tbody></table>")
    return "\n".join(t)


def _note(text: str) -> str:
    return f'<p class="note">{html.escape(text)}</p>'


def _figure(fig_id: str, png: bytes, caption: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return (f'<figure id="{html.escape(fig_id)}"><img alt="{html.escape(caption)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


class _Doc:
    def __init__(self, title: str):
        self.title = title
        self.sections: list[tuple[str, str, str]] = []

    def add(self, sec_id: str, title: str, body: str) -> None:
        self.sections.append((sec_id, title, body))

    def render(self, intro: str) -> str:
        nav = " ".join(f'<a href="#{i}">{html.escape(t)}</a>' for i, t, _ in self.sections)
        parts = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
                 f"<title>{html.escape(self.title)}</title>", f"<style>{_CSS}</style>", "</head>", "<body>",
                 f"<h1>{html.escape(self.title)}</h1>", intro, f"<nav>{nav}</nav>"]
        for i, t, body in self.sections:
            parts.append(f'<section id="{html.escape(i)}">\n<h2>{html.escape(t)}</h2>\n{body}\n</section>')
        parts += ["</body>", "</html>"]
        return "\n".join(parts) + "\n"


# ------------------------------------------------------------------ options
class ReportOptions:
    """Settings of the model sections (defaults sized for a CPU; each documented in ``docs/report.md``).

    models
        Build the sections that need the trained models (loss surface, t-SNE, predictions).
    loss_site
        Site whose training data the loss surface uses (default: the site with the
        fewest training cases, where local training overfits most; FedSM uses client 5).
    directions, steps, radius, normalize, loss_cases
        Loss surface: number of random directions (FedSM: 10), α grid points (odd),
        α range (default: mean ‖θ‖ of the compared models for ``unit``, 1 for
        ``filter``), direction type, and at most this many training cases.
    cases
        Sample predictions per site.
    tsne_cases
        Test images per site in the t-SNE map.
    seed
        Seed of the loss-surface directions and of t-SNE.
    """

    def __init__(self, models: bool = True, loss_site: str | None = None, directions: int = 10, steps: int = 21,
                 radius: float | None = None, normalize: str = "unit", loss_cases: int | None = 32, cases: int = 2,
                 tsne_cases: int = 40, seed: int = 0):
        self.models = models
        self.loss_site = loss_site
        self.directions = directions
        self.steps = steps
        self.radius = radius
        self.normalize = normalize
        self.loss_cases = loss_cases
        self.cases = cases
        self.tsne_cases = tsne_cases
        self.seed = seed
        self.validate()

    def validate(self) -> None:
        """Reject settings the model sections cannot use, before any model is loaded."""
        if self.directions < 1:
            raise ConfigError(f"report: --directions = {self.directions}; give at least 1 (FedSM Fig. 4 uses 10)")
        if self.steps < 3 or self.steps % 2 == 0:
            raise ConfigError(f"report: --steps = {self.steps}; give an odd number >= 3 so that the trained model (α = 0) is on the grid")
        if self.radius is not None and not self.radius > 0:
            raise ConfigError(f"report: --radius = {self.radius}; give a positive range")
        if self.normalize not in ("unit", "filter"):
            raise ConfigError(f"report: --normalize = {self.normalize!r}; use 'unit' or 'filter'")
        if self.loss_cases is not None and self.loss_cases < 1:
            raise ConfigError(f"report: --loss-cases = {self.loss_cases}; give at least 1")
        if self.cases < 0 or self.tsne_cases < 1:
            raise ConfigError(f"report: --cases = {self.cases} must be >= 0 and --tsne-cases = {self.tsne_cases} >= 1")


# ------------------------------------------------------------------ sections
def _fmt(v: Any, digits: int = 4) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return "–" if math.isnan(v) else f"{v:.{digits}f}"
    return str(v)


def _runs_section(runs: Sequence[Run]) -> str:
    rows = []
    for r in runs:
        res = r.results
        rows.append([r.label, r.method, _fmt(res.get("seed")), len(res.get("history", [])), ", ".join(res["sites"]),
                     _fmt(res.get("client_avg_dice")), _fmt(res.get("global_dice")),
                     "–" if res.get("wall_time_s") is None else f"{res['wall_time_s']:.0f} s", str(r.path)])
    return _table(["Run", "Method", "Seed", "Rounds", "Sites", "Client Avg Dice", "Global Dice", "Wall time", "Folder"], rows)


def _config_section(runs: Sequence[Run]) -> str:
    rows = []
    details = []
    for r in runs:
        c = r.results.get("config") or {}
        m, t, e = c.get("model") or {}, c.get("train") or {}, c.get("eval") or {}
        work = f"{t.get('local_epochs')} epoch(s)" if t.get("local_epochs") is not None else f"{t.get('local_steps')} steps"
        extra = ", ".join(f"{k}={v}" for k, v in method_settings(r).items())
        rows.append([r.label, Path(str(c.get("federation", "–"))).name, c.get("rounds", "–"),
                     f"U-Net {m.get('channels')} strides {m.get('strides')}", f"{t.get('optimizer')} lr {t.get('lr')}",
                     t.get("batch_size", "–"), work, t.get("loss", "–"), e.get("every", "–"), extra or "–"])
        cfg_file = r.path / "config.toml"
        text = cfg_file.read_text() if cfg_file.is_file() else "(no config.toml)"
        details.append(f"<details><summary>{html.escape(r.label)}: config.toml</summary><pre>{html.escape(text)}</pre></details>")
    head = ["Run", "Federation", "Rounds", "Model", "Optimizer", "Batch", "Local work", "Loss", "Validate every", "Method settings"]
    return _table(head, rows) + "\n" + "\n".join(details)


def _table3_section(runs: Sequence[Run]) -> str:
    from fedseg.evaluation.tables import table3

    docs = []
    for r in runs:
        d = dict(r.results)
        d["label"] = run_label(r.results)
        docs.append(d)
    intro = ("<p>Test Dice of each method's best model (best validation round) on every site's test set; "
             "Client Avg Dice = mean over sites, Global Dice = mean over all test cases pooled. "
             "For local training, one row per site's model tested on every site.</p>")
    return intro + markdown_html(table3(docs, sites_of(runs)))


#: Methods of the Auto-FedAvg paper's Table 2 (rows: local models, FedAvg variants, FedProx, centralized, Auto-FedAvg).
_TABLE2_METHODS = {"local", "fedavg", "fedavg-even", "fedprox", "centralized", "autofedavg"}


def _table2_section(runs: Sequence[Run]) -> str | None:
    methods = {r.method for r in runs}
    if not ({"autofedavg", "fedavg"} <= methods):
        return None
    try:
        from fedseg.evaluation.stats import table2
    except ImportError:
        return _note("Table 2 needs fedseg.evaluation.stats, which this installation lacks.")
    sites = runs[[r.method for r in runs].index("fedavg")].results["sites"]
    chosen = [{**r.results, "label": run_label(r.results)} for r in runs
              if r.method in _TABLE2_METHODS and r.results["sites"] == sites and (r.method == "local" or "global" in (r.results.get("per_case_dice") or {}))]
    try:
        md = table2(chosen, baseline="FedAvg")
    except Exception as e:  # a run without the paired per-case scores
        return _note(f"Table 2 could not be built: {e}")
    intro = ("<p>Auto-FedAvg Table 2 layout (Dice in %): the global model on each site and its mean (global test avg); "
             "local avg / local gen = mean of the best local models on their own / on the other sites. "
             "† marks a significant gain over FedAvg (two-sided Wilcoxon signed-rank test of per-case Dice, p &lt; 0.05).</p>")
    return intro + markdown_html(md)


def _routing_section(runs: Sequence[Run]) -> str | None:
    with_routing = [r for r in runs if isinstance(r.results.get("fedsm"), dict)]
    if not with_routing:
        return None
    from fedseg.fedsm_experiments import routing_markdown

    parts = ["<p>How often the FedSM model selector sends each site's test images to the global model (GM) or to "
             "a site's personalized model (PM); routing acc = share routed to the site's own model.</p>"]
    for r in with_routing:
        parts.append(f"<h3>{html.escape(r.label)}</h3>")
        try:
            parts.append(markdown_html(routing_markdown(r.results)))
        except Exception as e:
            parts.append(_note(f"routing table unavailable: {e}"))
    return "\n".join(parts)


def _table5_section(runs: Sequence[Run]) -> str | None:
    held = [r for r in runs if r.heldout]
    if not held:
        return None
    from fedseg.fedsm_experiments import table5

    rows, notes = [], []
    for r in held:
        k = r.heldout
        per = r.results["fedsm"]["per_site"].get(k) or {}
        dbg = {float(g): d for g, d in (per.get("dice_by_gamma") or {}).items() if d is not None}
        sel0 = (per.get("selection_by_gamma") or {}).get(str(0.0))
        if not dbg or sel0 is None or 0.0 not in dbg:
            notes.append(f"{r.label}: no selection frequencies at γ = 0 (run it with 0 in fedsm.gamma_grid, as `fedseg fedsm unseen` does)")
            continue
        best_g = max(sorted(dbg), key=lambda g: dbg[g])
        rows.append({"site": k, "selection_at_0": sel0, "dice_at_0": dbg[0.0], "best_gamma": best_g, "best_dice": dbg[best_g]})
    sites = sites_of(runs)
    sites += [r.heldout for r in held if r.heldout not in sites]
    body = "<p>FedSM Table 5 layout: the federation trains without site k; the selector routes the unseen site's test images.</p>"
    if rows:
        body += markdown_html(table5(rows, sites))
    body += "".join(_note(n) for n in notes)
    return body


def _curves_section(runs: Sequence[Run]) -> tuple[str, bytes | None]:
    sites = sites_of(runs)
    curves: dict[str, dict[str, tuple[list[int], list[float]]]] = {}
    upper: dict[str, dict[str, float]] = {}
    for r in runs:
        hist = r.results.get("history") or []
        primary = primary_of(r.method)
        home = {row.get("home_site"): row["name"] for row in r.results.get("rows", []) if row.get("home_site")}
        per_site = {s: figures.site_curve(hist, primary, s, home) for s in sites}
        if not any(v[0] for v in per_site.values()):
            continue
        if r.method == "centralized":
            upper[r.label] = {s: max(v[1]) for s, v in per_site.items() if v[1]}
        else:
            curves[r.label] = per_site
    if not curves and not upper:
        return _note("no validation Dice in the runs' histories (eval.every larger than the rounds?)"), None
    caption = ("Best-so-far validation Dice per site (FedSM Fig. 2): for each method its reported model "
               "(the global model, FedSM's composite, or the site's own model for local/personalized methods); "
               "centralized training is the dashed line (its best validation Dice).")
    return caption, figures.training_curves(curves, sites, upper, figures.color_of([r.label for r in runs]))


def _alpha_section(runs: Sequence[Run]) -> bytes | None:
    hist = {r.label: r.results["history"] for r in runs if any(e.get("alpha") for e in r.results.get("history", []))}
    return figures.alpha_figure(hist) if hist else None


def _open_models(runs: Sequence[Run], cache: DataCache) -> tuple[list[RunModels], list[str]]:
    """One RunModels per distinct method label (first seed), and notes for runs that could not be opened."""
    seen: set[str] = set()
    out, notes = [], []
    for r in runs:
        base = run_label(r.results)
        if base in seen:
            continue
        seen.add(base)
        try:
            out.append(RunModels.open(r, cache))
        except (ConfigError, OSError, KeyError, ValueError) as e:
            notes.append(f"{r.label}: models not loaded ({e})")
    return out, notes


def _loss_surface_section(models: Sequence[RunModels], opts: ReportOptions, progress: bool, colors_for: Sequence[str]) -> str:
    from fedseg.report.loss_surface import loss_surface, trainable_arrays

    if not models:
        return _note("no run's models could be loaded")
    data = models[0].data
    site = opts.loss_site
    if site is None:
        candidates = [s for s in data if all(s in m.run.results["sites"] for m in models)] or list(data)
        site = min(candidates, key=lambda s: len(data[s].train))
    if site not in data:
        return _note(f"loss-surface site {site!r} is not in the federation; sites: {list(data)}")
    chosen: dict[str, tuple[RunModels, str, torch.nn.Module]] = {}
    notes = []
    for m in models:
        got = m.loss_model(site) if site in m.data else None
        if got is None:
            notes.append(f"{m.run.label}: no plain model for site {site}")
            continue
        chosen[m.run.label] = (m, got[0], got[1])
    if not chosen:
        return "".join(_note(n) for n in notes) or _note("no models")
    radius = opts.radius
    if radius is None:
        if opts.normalize == "unit":
            norms = [float(torch.cat([v.reshape(-1).double() for v in trainable_arrays(mod).values()]).norm()) for _, _, mod in chosen.values()]
            radius = float(np.mean(norms))
        else:
            radius = 1.0
    surfaces = {}
    palette = figures.color_of(list(colors_for))
    colors = {}
    for label, (m, name, mod) in chosen.items():
        colors[f"{label} ({name})"] = palette[label]
        surfaces[f"{label} ({name})"] = loss_surface(
            mod, m.workload.loss, m.data[site].train, directions=opts.directions, radius=radius, steps=opts.steps,
            seed=opts.seed, normalize=opts.normalize, max_cases=opts.loss_cases, batch_size=m.cfg.eval.batch_size,
            forward=(lambda model, x, wl=m.workload: wl.predict(model, x)), progress=progress, desc=f"loss surface {label}",
        )
    n_cases = min(len(data[site].train), opts.loss_cases or len(data[site].train))
    what = "distance along a random unit direction" if opts.normalize == "unit" else "α (filter-normalized direction)"
    loss_name = models[0].cfg.train.loss
    png = figures.loss_surface_figure(surfaces, what, f"train loss ({loss_name})", colors)
    caption = (f"1D loss surface (FedSM Fig. 4): training loss on {site}'s first {n_cases} training cases along "
               f"{opts.directions} random {'unit' if opts.normalize == 'unit' else 'filter-normalized'} directions (seed {opts.seed}, "
               f"the same directions for every method), α ∈ [−{radius:.3g}, {radius:.3g}]; the dot is the trained model. "
               "Sharpness = mean over directions of (max loss − loss at the model): sharp minima (local training) "
               "tend to generalize worse, over-flat ones (FedAvg) carry a convergence error.")
    rows = [[label, f"{s.center:.4f}", f"{s.sharpness:.4f}"] for label, s in surfaces.items()]
    return (_figure("fig-loss-surface", png, caption) + _table(["Model", f"train loss at the model ({site})", "sharpness"], rows)
            + "".join(_note(n) for n in notes))


def _tsne_section(models: Sequence[RunModels], opts: ReportOptions) -> str | None:
    from fedseg.report.tsne import selector_features, tsne_embed

    with_sel = [(m, m.selector()) for m in models]
    with_sel = [(m, s) for m, s in with_sel if s is not None]
    if not with_sel:
        return None
    parts = []
    for m, sel in with_sel:
        feats, sites = selector_features(sel, {s: d.test for s, d in m.data.items()}, max_per_site=opts.tsne_cases)
        try:
            pts = tsne_embed(feats, seed=opts.seed)
        except ImportError as e:
            return _note(str(e))
        except ValueError as e:
            parts.append(_note(f"{m.run.label}: {e}"))
            continue
        png = figures.tsne_figure(pts, sites, m.run.label)
        held = f" ({m.run.heldout} was not in training)" if m.run.heldout else ""
        caption = (f"t-SNE of the FedSM model selector's pooled features (FedSM Fig. 3), {m.run.label}: "
                   f"up to {opts.tsne_cases} test images per site{held}, coloured by site. Separated clusters mean the "
                   "selector can tell the sites' data apart, which its routing relies on.")
        parts.append(_figure(f"fig-tsne-{len(parts)}", png, caption))
    return "\n".join(parts)


def _slice(arr: np.ndarray, spatial_dims: int, index: int | None) -> np.ndarray:
    return arr if spatial_dims == 2 or index is None else arr[:, index]


@torch.no_grad()
def _predictions_section(models: Sequence[RunModels], opts: ReportOptions, progress: bool) -> str:
    from tqdm.auto import tqdm

    from fedseg.site import batch_of, dataset_len

    data = models[0].data
    wl0 = models[0].workload
    same = [m for m in models if m.data is data]  # runs on the first run's federation (one figure, one set of cases)
    notes = [f"{m.run.label}: trained on another federation ({m.cfg.federation}); not shown" for m in models if m.data is not data]
    models = same
    labels = [m.run.label for m in models]
    rows = []
    predictors: dict[tuple[str, str], Any] = {}
    for m in tqdm(models, desc="sample predictions", unit="run", disable=not progress, leave=False):
        for s in data:
            try:
                got = m.predictor(s)
            except Exception as e:  # a site this run cannot predict for
                notes.append(f"{m.run.label}: no prediction on {s} ({e})")
                got = None
            predictors[(m.run.label, s)] = got
    for s, d in data.items():
        n = min(opts.cases, dataset_len(d.test))
        if n == 0:
            continue
        x, y = batch_of(d.test, torch.arange(n))
        outs = {}
        for m in models:
            got = predictors[(m.run.label, s)]
            if got is not None:
                logits = got[1](x.to(m.site(s).dtype))
                dice = m.workload.metric(logits, y).double().mean(dim=1)
                outs[m.run.label] = ((torch.sigmoid(logits.float()) > m.cfg.eval.threshold).numpy(), dice.numpy())
        for i in range(n):
            lab = y[i].numpy()
            idx = None
            if wl0.spatial_dims == 3:
                idx = int(lab.reshape(lab.shape[0], lab.shape[1], -1).sum(axis=(0, 2)).argmax())
            rows.append({"site": s, "case": i, "image": _slice(x[i].numpy(), wl0.spatial_dims, idx), "label": _slice(lab, wl0.spatial_dims, idx),
                         "preds": {k: (_slice(v[0][i], wl0.spatial_dims, idx), float(v[1][i])) for k, v in outs.items()}})
    if not rows:
        return _note("no test cases to show")
    png = figures.predictions_figure(rows, labels, list(wl0.metric_names))
    chans = " + ".join(f"{c} = {j + 1}" if j == 0 else c for j, c in enumerate(wl0.metric_names))
    caption = (f"Sample predictions: the first {opts.cases} test case(s) of every site — image, ground truth, then each "
               f"method's prediction (its reported model; masks summed over label channels: {chans}), with the case's Dice.")
    return _figure("fig-predictions", png, caption) + "".join(_note(n) for n in notes)


# ------------------------------------------------------------------ builder
def build_report(
    paths: Iterable[str | Path],
    html_path: str | Path = "report.html",
    options: ReportOptions | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
    title: str | None = None,
) -> Path:
    """Write one self-contained HTML report of the runs under ``paths``; returns its path.

    Parameters
    ----------
    paths
        Run folders (each with ``results.json``), or folders holding runs (a
        ``fedseg compare`` or ``fedseg fedsm unseen`` output).
    html_path
        The HTML file to write.
    options
        Settings of the model sections (:class:`ReportOptions`).
    """
    from tqdm.auto import tqdm

    opts = options or ReportOptions()
    runs = load_runs(paths)
    doc = _Doc(title or "fedseg report: " + ", ".join(dict.fromkeys(run_label(r.results) for r in runs)))
    steps = ["tables", "curves", "alpha"] + (["models", "loss surface", "t-SNE", "predictions"] if opts.models else [])
    bar = tqdm(steps, desc="report", unit="step", disable=not progress, leave=False)
    models: list[RunModels] = []
    model_notes: list[str] = []
    for step in bar:
        bar.set_postfix_str(step)
        if step == "tables":
            doc.add("runs", "Runs", _runs_section(runs))
            doc.add("config", "Configuration", _config_section(runs))
            doc.add("table3", "Results (Table 3 layout)", _table3_section(runs))
            t2 = _table2_section(runs)
            if t2 is not None:
                doc.add("table2", "Auto-FedAvg comparison (Table 2 layout, Wilcoxon tests)", t2)
            rt = _routing_section(runs)
            if rt is not None:
                doc.add("routing", "FedSM model selection on test", rt)
            t5 = _table5_section(runs)
            if t5 is not None:
                doc.add("table5", "Unseen sites (Table 5 layout)", t5)
        elif step == "curves":
            caption, png = _curves_section(runs)
            doc.add("curves", "Training curves", caption if png is None else _figure("fig-curves", png, caption))
        elif step == "alpha":
            png = _alpha_section(runs)
            if png is not None:
                doc.add("alpha", "Auto-FedAvg aggregation weights", _figure(
                    "fig-alpha", png, "Auto-FedAvg's aggregation weight α of each site per round (Auto-FedAvg Fig. 3a); "
                    "grey lines mark rounds in which α was learned. Equal weights would be 1/K each."))
        elif step == "models":
            models, model_notes = _open_models(runs, DataCache(progress=progress))
            for n in model_notes:
                log(n)
        elif not models:
            if step == "loss surface":
                doc.add("loss-surface", "Loss surface", "".join(_note(n) for n in model_notes) or _note("no models to load"))
            continue
        elif step == "loss surface":
            doc.add("loss-surface", "Loss surface", _loss_surface_section(models, opts, progress, [r.label for r in runs]) + "".join(_note(n) for n in model_notes))
        elif step == "t-SNE":
            ts = _tsne_section(models, opts)
            if ts is not None:
                doc.add("tsne", "Model selector features (t-SNE)", ts)
        elif step == "predictions" and opts.cases > 0:
            doc.add("predictions", "Sample predictions", _predictions_section(models, opts, progress))
    bar.close()
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    intro = (f"<p>Generated by <code>fedseg report</code> on {html.escape(stamp)} from {len(runs)} run(s). "
             "Dice is between 0 (no overlap) and 1 (perfect overlap with the reference segmentation).</p>")
    out = Path(html_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(doc.render(intro), encoding="utf-8")
    return out
