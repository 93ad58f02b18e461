"""Experiment reports and observability: one self-contained HTML report of finished runs
(tables and the papers' figures), the loss surface and t-SNE analyses, TensorBoard scalars.

See ``docs/report.md``.  Matplotlib draws every figure on the Agg canvas; scikit-learn
(t-SNE) and tensorboard are optional (``pip install 'fedseg[report]'``).
"""

from fedseg.apps.report.html import ReportOptions, build_report, markdown_html
from fedseg.apps.report.loss_surface import LossSurface, loss_surface, random_directions
from fedseg.apps.report.tensorboard import TensorBoardLogger, round_scalars
from fedseg.apps.report.tsne import selector_features, tsne_embed

__all__ = [
    "LossSurface",
    "ReportOptions",
    "TensorBoardLogger",
    "build_report",
    "loss_surface",
    "markdown_html",
    "random_directions",
    "round_scalars",
    "selector_features",
    "tsne_embed",
]
