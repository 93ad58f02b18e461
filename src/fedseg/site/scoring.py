"""A site's scoring: its evaluation batches, the per-case scores of a predictor, the ``"evaluate"`` task."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from fedseg.data.volumes.lazy import CachedVolumes
from fedseg.foundation.arrays import strip_prefix
from fedseg.foundation.config import RunConfig
from fedseg.foundation.messages import Reply, Task
from fedseg.site import extent
from fedseg.site import predict as prediction
from fedseg.site.batches import SiteData, Splits, batch_of, case_extents, dataset_len
from fedseg.site.workload import Workload

__all__ = ["OriginalGrids", "ScoringSite", "eval_groups", "evaluate", "score_cases", "score_each"]


class ScoringSite(prediction.PredictingSite, Protocol):
    """What scoring reads of a :class:`~fedseg.site.runtime.Site` (which imports this module): its splits, its
    settings and its workload, and what prediction reads."""

    cfg: RunConfig
    workload: Workload
    splits: Splits

    @property
    def data(self) -> SiteData: ...


@runtime_checkable
class OriginalGrids(Protocol):
    """A volume split that keeps each scan's original grid: ``originals`` (each with its ``spacing``) and
    ``original_grid(i, prediction, threshold)`` → (prediction, label) resampled back to scan ``i``'s own grid."""

    originals: Any

    def original_grid(
        self, i: int, prediction: torch.Tensor, threshold: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def eval_groups(site: ScoringSite, split: str, cast_labels: bool = False) -> Iterator[extent.EvalGroup]:
    """:meth:`Site.eval_batches <fedseg.site.runtime.Site.eval_batches>` with each batch's first case index and
    extent (None: as stored)."""
    ds = site.splits.placed(split)
    extents = case_extents(site.data.split(split))
    take: Callable[[Any, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = batch_of
    if isinstance(ds, CachedVolumes) and extents is not None:  # read each case's extent only

        def read_extent(d: Any, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return d.read(idx, d.extents[int(idx[0])])  # a group's cases share one extent

        take = read_extent

    groups = extent.eval_groups(ds, extents, site.cfg.eval.batch_size, take, site.cfg.model.roi_size)
    for first, ext, x, y in groups:
        yield (
            first,
            ext,
            site.splits.on_device(x, cast=True),
            site.splits.on_device(y, cast=cast_labels and y.is_floating_point()),
        )


@torch.no_grad()
def score_cases(
    site: ScoringSite, predict: Callable[[torch.Tensor], torch.Tensor], split: str, test_metrics: bool = False
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-case metric (N, C) of ``predict`` on a split, in dataset order, and with ``test_metrics`` the
    workload's test metrics (``{name: (N, C)}``, e.g. HD95 in mm) computed on the same predictions.

    Volumes are scored in each scan's own grid (the prediction resampled back first), with that grid's
    voxel spacing; other data with unit spacing.  A volume is predicted over its own extent
    (:meth:`eval_batches`) and the prediction, cut back to that extent, resampled from there."""
    return score_each(site, [predict], split, test_metrics)[0]


@torch.no_grad()
def score_each(
    site: ScoringSite,
    predicts: Sequence[Callable[[torch.Tensor], torch.Tensor]],
    split: str,
    test_metrics: bool = False,
) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """:func:`score_cases` of several predictors in one pass over the split: each batch read once and given to
    every predictor in turn (which may share work on it: the same batch tensor reaches each), the scores of each
    as :func:`score_cases` gives them."""
    names = list(site.workload.test_metrics) if test_metrics else []
    out: list[list[torch.Tensor]] = [[] for _ in predicts]
    extra: list[dict[str, list[torch.Tensor]]] = [{k: [] for k in names} for _ in predicts]
    ds = site.data.split(split)
    restore = ds.original_grid if isinstance(ds, OriginalGrids) and ds.originals is not None else None
    for first, ext, x, y0 in eval_groups(site, split):
        for i, predict in enumerate(predicts):
            pred, y = prediction.logits(site, predict, x), y0
            if restore is None:
                if ext is not None:  # a volume split kept in the plan's grid: scored over the extents
                    pred, y = extent.crop_to_extent(pred, ext), extent.crop_to_extent(y, ext)
                out[i].append(site.workload.metric(pred, y).double())
                for k in names:
                    extra[i][k].append(site.workload.test_metrics[k](pred, y, None).double())
            else:
                for j in range(pred.shape[0]):
                    pj = pred[j] if ext is None else extent.crop_to_extent(pred[j], ext)
                    # scored in the region of the scan's grid that either mask can reach (on the device)
                    p, t = restore(first + j, pj.float(), threshold=site.cfg.eval.threshold)
                    out[i].append(site.workload.metric(p[None], t[None]).double())
                    for k in names:
                        grid = ds.originals[first + j]
                        m = site.workload.test_metrics[k]
                        fov = {"field_of_view": grid.shape} if getattr(m, "takes_field_of_view", False) else {}
                        extra[i][k].append(m(p[None], t[None], grid.spacing, **fov).double())
    width = len(site.workload.metric_names)
    result = []
    for scores, more in zip(out, extra):
        scores = [o.cpu() for o in scores]  # one transfer per split, after every batch is queued
        result.append(
            (
                torch.cat(scores) if scores else torch.zeros(0, width, dtype=torch.float64),
                {
                    k: torch.cat([v.cpu() for v in vs]) if vs else torch.zeros(0, width, dtype=torch.float64)
                    for k, vs in more.items()
                },
            )
        )
    return result


def evaluate(site: ScoringSite, task: Task) -> Reply:
    """The built-in ``"evaluate"`` task: every candidate's per-case scores on a split (and, on the test split, the
    workload's test metrics), each predicted by its predictor (``algorithm.predictors()``)."""
    split = task.config["split"]
    results = {}
    extras: dict[str, dict[str, list[list[float]]]] = {}
    for cand in task.config["candidates"]:
        kind = cand.get("predictor", "model")
        predict = prediction.predictor(
            site, cand["name"], kind, strip_prefix(cand["name"], task.arrays), cand.get("config", {})
        )
        scores, extra = score_cases(site, predict, split, test_metrics=split == "testing")
        results[cand["name"]] = scores.tolist()
        for k, v in extra.items():
            extras.setdefault(k, {})[cand["name"]] = v.tolist()
    metrics: dict[str, Any] = {"per_case": results}
    if extras:  # e.g. {"hd95": {candidate: per-case (N, C)}}: the test split's further metrics
        metrics["test_metrics"] = extras
    return Reply(metrics=metrics, num_samples=dataset_len(site.data.split(split)))
