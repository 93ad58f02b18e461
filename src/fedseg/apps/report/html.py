"""One self-contained HTML report of one or more finished runs (``fedseg report OUT [OUT2 …] --html report.html``).

The file needs no Python and no network to read: styles are inline and every figure
is a base64 PNG inside an ``<img src="data:image/png;base64,…">`` (the only links are
relative ones to the runs' ``config.toml`` files).  Runs are keyed by method **and**
variant settings (``FedSM (gamma=auto)``, :func:`fedseg.apps.report.runs.variant_labels`);
seeds of one variant are aggregated, variants never.  Sections, in page order
(:data:`SECTIONS`), appear only for what the runs contain:

=====================  ==============================================================
section id             shown when
=====================  ==============================================================
``headline``           always: Client Avg / Global Dice per method with uncertainty,
                       Δ to FedAvg and centralized, best round, test cases per site
``table3``             always: Dice per site (FedSM Table 3 layout; ε of DP runs); for
                       volumes, HD95 (mm) per site below it
``tuning``             a folder of ``fedseg compare --tune`` or ``fedseg sweep``: the
                       validation score of every grid point and the choice (its chosen
                       runs are the report's runs)
``privacy``            a run with ``privacy.dp``: ε per site, δ, accountant, σ, steps
``distributions``      per-case Dice stored: box + dot plots per site, Wilcoxon vs FedAvg
``table2``             an ``autofedavg`` and a ``fedavg`` run (Auto-FedAvg Table 2 layout)
``fedsm``              a FedSM-family run: selector curves, γ, composite vs its models,
                       routing on test, generated findings
``table5``             FedSM unseen-site runs (``fedseg fedsm unseen``): FedSM Table 5
``curves``             always: validation Dice as measured (best round marked),
                       training loss, cumulative traffic
``alpha``              a run's history has ``alpha`` (Auto-FedAvg Fig. 3a)
``loss-surface``       the runs' checkpoints and data can be loaded (FedSM Fig. 4)
``tsne``               a run has a FedSM model selector (FedSM Fig. 3)
``predictions``        the runs' checkpoints and data can be loaded
``runs``, ``config``   always, last: the runs, their settings, links to config.toml
=====================  ==============================================================

Module layout: :mod:`~fedseg.apps.report.markup` builds HTML, :mod:`~fedseg.apps.report.numbers`
computes from results, :mod:`~fedseg.apps.report.sections` are the sections over results
alone, :mod:`~fedseg.apps.report.model_sections` the ones that run the trained models
(rebuilt from ``checkpoints/best.safetensors`` and the run's federation spec; when that
is not possible the section says why instead of failing).
"""

from __future__ import annotations

import datetime
import html
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from fedseg.apps.report import model_sections, sections
from fedseg.apps.report.fedsm_section import fedsm_section
from fedseg.apps.report.markup import Doc, figure, markdown_html, note
from fedseg.apps.report.numbers import is_fedsm
from fedseg.apps.report.privacy_section import privacy_section
from fedseg.apps.report.runs import DataCache, Run, RunModels, load_runs, variants_of
from fedseg.apps.report.tuning import tuned_paths, tuning_section
from fedseg.foundation.errors import ConfigError

__all__ = ["SECTIONS", "ReportOptions", "build_report", "markdown_html"]

#: Section ids and titles in page order: the results first, the bookkeeping last.
SECTIONS = (
    ("headline", "Headline"),
    ("table3", "Dice (and HD95) per site"),
    ("tuning", "Tuning on validation"),
    ("privacy", "Differential privacy"),
    ("distributions", "Per-case Dice and paired comparisons"),
    ("table2", "Auto-FedAvg comparison (Table 2 layout, Wilcoxon tests)"),
    ("fedsm", "FedSM: model selection"),
    ("table5", "Unseen sites (Table 5 layout)"),
    ("curves", "Training curves"),
    ("alpha", "Auto-FedAvg aggregation weights"),
    ("loss-surface", "Loss surface"),
    ("tsne", "Model selector features (t-SNE)"),
    ("predictions", "Predictions on test"),
    ("runs", "Runs"),
    ("config", "Configuration"),
)


# ------------------------------------------------------------------ options
class ReportOptions:
    """Settings of the model sections (defaults sized for a CPU; each documented in ``docs/report.md``).

    models
        Build the sections that need the trained models (loss surface, t-SNE, predictions).
    loss_surface, tsne
        With ``models``: build the loss surface / the t-SNE map (minutes on a CPU; the demo leaves them out and
        keeps the sample predictions).
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
        Seed of the loss-surface directions, of t-SNE and of the headline's bootstrap intervals.
    """

    def __init__(
        self,
        models: bool = True,
        loss_site: str | None = None,
        directions: int = 10,
        steps: int = 21,
        radius: float | None = None,
        normalize: str = "unit",
        loss_cases: int | None = 32,
        cases: int = 2,
        tsne_cases: int = 40,
        seed: int = 0,
        loss_surface: bool = True,
        tsne: bool = True,
    ):
        self.models = models
        self.loss_surface = loss_surface
        self.tsne = tsne
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
            raise ConfigError(
                f"report: --steps = {self.steps}; give an odd number >= 3 so that the trained model (α = 0) is on the grid"
            )
        if self.radius is not None and not self.radius > 0:
            raise ConfigError(f"report: --radius = {self.radius}; give a positive range")
        if self.normalize not in ("unit", "filter"):
            raise ConfigError(f"report: --normalize = {self.normalize!r}; use 'unit' or 'filter'")
        if self.loss_cases is not None and self.loss_cases < 1:
            raise ConfigError(f"report: --loss-cases = {self.loss_cases}; give at least 1")
        if self.cases < 0 or self.tsne_cases < 1:
            raise ConfigError(f"report: --cases = {self.cases} must be >= 0 and --tsne-cases = {self.tsne_cases} >= 1")


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
    opts = options or ReportOptions()
    paths, tunings = tuned_paths(paths)  # a tuned comparison or sweep: its chosen runs, and the record of the choice
    runs = load_runs(paths)
    out = Path(html_path)
    base = out.parent
    doc = Doc(title or "fedseg report: " + ", ".join(dict.fromkeys(r.variant for r in runs)))
    model_steps = ["models"] + ["loss surface"] * opts.loss_surface + ["t-SNE"] * opts.tsne + ["predictions"]
    steps = ["tables", "curves"] + (model_steps if opts.models else []) + ["FedSM"]
    bar = tqdm(steps, desc="report", unit="step", disable=not progress, leave=False)
    colors = sections.colors_of(runs)
    cache = DataCache(progress=progress)
    got: dict[str, str | None] = {}
    models: list[RunModels] = []
    model_notes: list[str] = []
    for step in bar:
        bar.set_postfix_str(step)
        if step == "tables":
            got["headline"] = sections.headline_section(runs, seed=opts.seed)
            got["table3"] = sections.table3_section(runs)
            got["tuning"] = tuning_section(tunings)
            got["privacy"] = privacy_section(runs)
            dist, png = sections.distributions_section(runs)
            got["distributions"] = (
                figure(
                    "fig-distributions",
                    png,
                    (
                        "Per-case test Dice of each method's reported model, one panel per site (seeds pooled): the box spans the "
                        "quartiles with the median as a black line, whiskers reach 1.5 × IQR, each dot is one test case. "
                        "All panels share one y-range."
                    ),
                )
                if png is not None
                else ""
            ) + dist
            got["table2"] = sections.table2_section(runs)
            got["table5"] = sections.table5_section(runs)
        elif step == "curves":
            got["curves"] = sections.curves_section(runs)
            got["alpha"] = sections.alpha_section(runs)
        elif step == "models":
            models, model_notes = model_sections.open_models(runs, cache)
            for n in model_notes:
                log(n)
        elif step == "FedSM":
            routings, notes = _routings(runs, models, cache if opts.models else None)
            got["fedsm"] = fedsm_section(runs, routings, notes)
        elif not models:
            if step == "loss surface":
                got["loss-surface"] = "".join(note(n) for n in model_notes) or note("no models to load")
        elif step == "loss surface":
            got["loss-surface"] = model_sections.loss_surface_section(models, opts, progress, colors) + "".join(
                note(n) for n in model_notes
            )
        elif step == "t-SNE":
            got["tsne"] = model_sections.tsne_section(models, opts)
        elif step == "predictions" and opts.cases > 0:
            got["predictions"] = model_sections.predictions_section(models, opts, progress)
    bar.close()
    got["runs"] = sections.bookkeeping_runs(runs, base)
    got["config"] = sections.bookkeeping_config(runs, base)
    for sec_id, sec_title in SECTIONS:
        body = got.get(sec_id)
        if body is not None:
            doc.add(sec_id, sec_title, body)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    intro = (
        f"<p>Generated by <code>fedseg report</code> on {html.escape(stamp)} from {len(runs)} run(s) "
        f"of {len(variants_of(runs))} method variant(s). Dice is between 0 (no overlap) and 1 (perfect overlap with "
        "the reference segmentation).</p>"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(doc.render(intro), encoding="utf-8")
    return out


def _routings(
    runs: Sequence[Run], models: Sequence[RunModels], cache: DataCache | None
) -> tuple[dict[str, Any], dict[str, str]]:
    """FedSM routing on test per run: from ``results["fedsm"]`` when recorded, else computed from the run's
    checkpoint (every seed; ``cache`` None = models off)."""
    opened = {m.run.label: m for m in models}
    routings: dict[str, Any] = {}
    notes: dict[str, str] = {}
    for r in runs:
        if not is_fedsm(r.method):
            continue
        if isinstance(r.results.get("fedsm"), dict):
            routings[r.label] = r.results["fedsm"]
            continue
        if cache is None:
            notes[r.label] = (
                "routing on test is not in results.json; the report computes it from the checkpoints (leave out --no-models)"
            )
            continue
        try:
            m = opened.get(r.label) or RunModels.open(r, cache)
            routings[r.label] = model_sections.routing_on_test(m)
        except (ConfigError, OSError, KeyError, ValueError, RuntimeError) as e:
            notes[r.label] = f"routing on test could not be computed from the checkpoints: {e}"
    return routings, notes
