"""``fedseg report``: one self-contained HTML report of finished runs."""

from __future__ import annotations

import argparse

from fedseg.apps.report import ReportOptions, build_report


def cmd_report(a: argparse.Namespace) -> int:
    opts = ReportOptions(
        models=not a.no_models,
        loss_site=a.loss_site,
        directions=a.directions,
        steps=a.steps,
        radius=a.radius,
        normalize=a.normalize,
        loss_cases=a.loss_cases,
        cases=a.cases,
        tsne_cases=a.tsne_cases,
        seed=a.seed,
    )
    path = build_report(a.runs, a.html, opts, title=a.title)
    print(f"report: {path.resolve()} ({path.stat().st_size / 1e6:.1f} MB, self-contained: open it in any browser)")
    return 0


def add_report_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``report`` verb to the command line's sub-parsers."""
    rp = sub.add_parser(
        "report",
        help="one self-contained HTML report (tables, training curves, loss surface, t-SNE, predictions) of finished runs",
    )
    rp.add_argument(
        "runs", nargs="+", metavar="OUT", help="run output folders (or folders holding runs, e.g. a compare output)"
    )
    rp.add_argument("--html", default="report.html", help="HTML file to write (default: report.html)")
    rp.add_argument("--title", help="report title (default: the methods)")
    rp.add_argument(
        "--no-models",
        action="store_true",
        help="tables and history figures only: skip loss surface, t-SNE and predictions",
    )
    rp.add_argument(
        "--loss-site",
        help="site whose training data the loss surface uses (default: the one with the fewest training cases)",
    )
    rp.add_argument(
        "--directions", type=int, default=10, help="random directions of the loss surface (FedSM Fig. 4: 10)"
    )
    rp.add_argument("--steps", type=int, default=21, help="points along each direction (odd; default 21)")
    rp.add_argument(
        "--radius",
        type=float,
        help="loss-surface range ±R (default: mean parameter norm for unit directions, 1 for filter)",
    )
    rp.add_argument(
        "--normalize",
        choices=["unit", "filter"],
        default="unit",
        help="unit directions in parameter space (the paper) or filter-normalized (Li et al.)",
    )
    rp.add_argument(
        "--loss-cases", type=int, default=32, help="at most this many training cases for the loss surface (default 32)"
    )
    rp.add_argument("--cases", type=int, default=2, help="sample predictions per site (default 2)")
    rp.add_argument("--tsne-cases", type=int, default=40, help="test images per site in the t-SNE map (default 40)")
    rp.add_argument("--seed", type=int, default=0, help="seed of the loss-surface directions and t-SNE")
    rp.set_defaults(func=cmd_report)
