"""What is being learned: a model factory, a loss, a metric — independent of any algorithm.

The engine and every algorithm see only a :class:`Workload`, so any task runs on
fedseg: :func:`segmentation_workload` builds the paper's U-Net + Dice setting, and a
user may pass their own ``nn.Module`` factory, loss and metric (e.g. a classifier,
see ``docs/python-api.md``).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, cast

import torch
from torch import nn

from fedseg.data import labelmap
from fedseg.data.augment import patch_augmenter
from fedseg.data.spec import VOLUME_MODES
from fedseg.data.volumes.lazy import CaseBatch
from fedseg.foundation.config import ModelConfig, RunConfig, TrainConfig
from fedseg.site.extent import pad_far_end

__all__ = [
    "CaseTransform",
    "DataLayout",
    "Workload",
    "accuracy_metric",
    "dice_metric",
    "hd95_metric",
    "make_loss",
    "predicted_channels",
    "segmentation_workload",
    "workload_for",
]

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Metric = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
SpacedMetric = Callable[[torch.Tensor, torch.Tensor, "Sequence[float] | None"], torch.Tensor]


@dataclass
class Workload:
    """A learning task.

    Attributes
    ----------
    build_model
        Returns a freshly initialized ``nn.Module`` (called under a seeded RNG).
    loss
        ``loss(output, target) -> scalar`` (mean-reduced over the batch).
    metric
        ``metric(output, target) -> (B, C)`` per-case scores in [0, 1], higher is better
        (Dice per label channel, or accuracy with C = 1).
    metric_names
        One name per metric column (e.g. ``("disc", "cup")``).
    infer
        ``infer(model, x) -> output`` at evaluation (default ``model(x)``; 3D uses
        sliding-window inference).
    train_transform
        Optional ``(x, y, generator) -> (x, y)`` applied to each training batch (random
        patch crops for 3D); every draw comes from the given seeded generator.
    spatial_dims, in_channels
        Input layout, for builders of auxiliary models.
    build_selector
        ``build_selector(num_classes, width, hidden) -> nn.Module``: a classifier of this task's
        inputs into ``num_classes`` classes (FedSM's model selector); the default is the papers'
        VGG-11-style :class:`fedseg.models.Selector` for ``spatial_dims``/``in_channels``.  Methods
        get auxiliary networks from the workload, so no algorithm imports a network library.
    test_metrics
        ``{name: metric(output, target, spacing) -> (B, C)}``: further per-case, per-channel numbers
        reported beside ``metric`` on the test split only (never used to pick a best round), with the
        voxel spacing of the grid being scored (the scan's own grid for volumes; None: unit spacing).
        The segmentation workload's is ``{"hd95": hd95_metric()}`` for volumes (``eval.hd95``).
    labels
        The spec's labels (channel name → label values) whose delivered label map the metrics score
        (:func:`predicted_channels`); None: a workload without a label map.
    """

    build_model: Callable[[], nn.Module]
    loss: Loss
    metric: Metric
    metric_names: Sequence[str] = ("score",)
    infer: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None
    train_transform: (
        Callable[[torch.Tensor, torch.Tensor, torch.Generator], tuple[torch.Tensor, torch.Tensor]] | None
    ) = None
    spatial_dims: int = 2
    in_channels: int = 1
    build_selector: Callable[[int, float, int], nn.Module] | None = None
    test_metrics: Mapping[str, SpacedMetric] = field(default_factory=dict)
    labels: Mapping[str, Sequence[int]] | None = None

    def selector(self, num_classes: int, width: float = 0.25, hidden: int = 128) -> nn.Module:
        """A freshly initialized selector network (``build_selector``, or the papers' VGG-11 layout)."""
        if self.build_selector is not None:
            return self.build_selector(num_classes, width, hidden)
        from fedseg.models import Selector  # MONAI-free, but models/ imports MONAI's U-Net

        return Selector(self.spatial_dims, self.in_channels, num_classes, width=width, hidden=hidden)

    def predict(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Model output for evaluation, through ``infer`` when set."""
        return self.infer(model, x) if self.infer is not None else model(x)


def predicted_channels(
    logits: torch.Tensor, threshold: float, labels: Mapping[str, Sequence[int]] | None
) -> torch.Tensor:
    """The label channels a metric scores (boolean, ``(B, L, *spatial)``): with the spec's ``labels``, those of
    the delivered label map (:func:`fedseg.data.labelmap.delivered`: nested regions resolved, the map
    ``fedseg predict`` writes); without, each channel's ``sigmoid(logits) > threshold`` on its own."""
    if labels is None:
        return torch.sigmoid(logits.float()) > threshold
    return labelmap.delivered(logits, labels, threshold, dim=1)


def dice_metric(
    threshold: float = 0.5, empty_dice: float = 1.0, labels: Mapping[str, Sequence[int]] | None = None
) -> Metric:
    """Per-case, per-channel Dice of the predicted channels (:func:`predicted_channels`: with ``labels``, the
    channels of the delivered label map) against binary masks (MONAI DiceMetric).

    An empty prediction on an empty mask scores ``empty_dice`` (``eval.empty_dice``, default
    1 as MONAI's ``ignore_empty=False``); a non-empty prediction on an empty mask scores 0.
    """
    from monai.metrics import DiceMetric

    metric = DiceMetric(include_background=True, reduction="none", ignore_empty=False)

    def compute(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        pred = predicted_channels(logits, threshold, labels).float()
        out = cast(torch.Tensor, metric(pred, target.float()))  # a tensor for tensor inputs
        metric.reset()
        if empty_dice != 1.0:
            dims = tuple(range(2, pred.dim()))
            both = (pred.sum(dim=dims) == 0) & (target.float().sum(dim=dims) == 0)
            out = torch.where(both.to(out.device), torch.full_like(out, empty_dice), out)
        return out

    return compute


def hd95_metric(threshold: float = 0.5, labels: Mapping[str, Sequence[int]] | None = None) -> SpacedMetric:
    """Per-case, per-channel 95th-percentile Hausdorff distance of the predicted channels
    (:func:`predicted_channels`) to binary masks, in the units of ``spacing`` (mm for volumes), with MONAI's ``compute_hausdorff_distance``
    (symmetric, euclidean, ``percentile=95``: the 95th percentile of the distances from each surface
    voxel of one mask to the nearest surface voxel of the other, both directions pooled).

    Undefined cases get fixed values, as the BraTS evaluation does (MONAI itself returns NaN or inf):
    prediction and mask both empty → 0 (nothing there, nothing predicted); exactly one of them empty →
    the diagonal of the grid's field of view, ``sqrt(sum((shape_a * spacing_a)^2))``, the largest
    distance the grid can hold.  So every case has a finite distance and a missed or hallucinated
    structure costs the most.

    ``metric(logits (B, C, *spatial), target (B, C, *spatial), spacing)``: ``spacing`` is one voxel size per
    spatial axis, shared by the batch (None: 1 per axis, distances in voxels).  ``field_of_view``: the
    shape of the whole grid when the arrays are a region of it holding every voxel either mask sets (the
    diagonal is the whole grid's; distances within the region are the grid's).
    """

    def compute(
        logits: torch.Tensor,
        target: torch.Tensor,
        spacing: Sequence[float] | None = None,
        field_of_view: Sequence[int] | None = None,
    ) -> torch.Tensor:
        from monai.metrics import compute_hausdorff_distance

        pred = predicted_channels(logits, threshold, labels).cpu()
        gt = target.cpu() > 0.5
        dims = pred.dim() - 2
        sp = [1.0] * dims if spacing is None else [float(v) for v in spacing]
        if len(sp) != dims:
            raise ValueError(f"spacing {list(sp)} must have one entry per spatial axis ({dims})")
        grid = pred.shape[2:] if field_of_view is None else field_of_view
        worst = math.sqrt(sum((n * v) ** 2 for n, v in zip(grid, sp)))
        out = torch.zeros(pred.shape[:2], dtype=torch.float64)
        for b in range(pred.shape[0]):
            for c in range(pred.shape[1]):
                p_any, g_any = bool(pred[b, c].any()), bool(gt[b, c].any())
                if p_any and g_any:
                    with warnings.catch_warnings():  # MONAI's own internal call of a deprecated argument
                        warnings.filterwarnings("ignore", message=".*always_return_as_numpy", category=FutureWarning)
                        hd = compute_hausdorff_distance(
                            pred[b, c][None, None],
                            gt[b, c][None, None],
                            include_background=True,
                            percentile=95,
                            spacing=sp,
                        )
                    out[b, c] = float(hd[0, 0])
                elif p_any or g_any:
                    out[b, c] = worst
        return out

    compute.takes_field_of_view = True  # type: ignore[attr-defined]  # Site.score_cases passes scored regions' grids
    return compute


def accuracy_metric(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-case classification accuracy (B, 1) from class logits (B, K) and integer targets (B,)."""
    return (logits.argmax(dim=1) == target).float().unsqueeze(1)


def make_loss(name: str) -> Loss:
    """Segmentation loss on logits with one sigmoid per channel (MONAI losses; FedSM uses Dice).  ``"auto"``
    is Dice here; :func:`workload_for` makes it Dice + cross-entropy for volumes (``train.loss``)."""
    from monai.losses import DiceCELoss, DiceLoss

    if name in ("dice", "auto"):
        return DiceLoss(sigmoid=True)
    if name == "dicece":
        return DiceCELoss(sigmoid=True)
    if name == "bce":
        return nn.BCEWithLogitsLoss()
    raise ValueError(f"unknown loss {name!r}")


class CaseTransform:
    """A training transform that reads each case's own extent and, for volumes kept in a site's cache, a
    :class:`fedseg.data.volumes.lazy.CaseBatch` instead of stacked tensors (:class:`fedseg.site.batches.RoundBatches`
    hands it those): ``fn(x, y, g, extents) -> (x, y)``, every draw from ``g``.  A plain callable
    ``(x, y, g) -> (x, y)`` gets the stacked batch only."""

    def __init__(self, fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]):
        self.fn = fn

    def __call__(
        self, x: Any, y: Any, g: torch.Generator, extents: Sequence[Sequence[int]] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fn(x, y, g, extents)


def _random_crop(roi: Sequence[int], foreground_share: float = 0.0, pooled: bool = False):
    """Batch transform cutting one patch of size ``roi`` per case (same place for image and label).

    With probability ``foreground_share`` a patch is centred (as far as the case allows) on a foreground
    voxel drawn class first, as nnU-Net draws it: a label channel uniformly among those present in the case,
    then one of its voxels uniformly (so a small lesion beside a large organ centres as many patches as the
    organ; with one channel present no class is drawn); otherwise, and in a case without foreground, its
    corner is drawn uniformly.  ``pooled`` (axial slices of volumes, ``patches2d``): the voxel is drawn
    from every case of the batch and the patch cut from its slice, as a volume's patch is centred on any of
    its foreground voxels.  A case smaller than the patch is padded first.  Every draw comes from ``g``.

    ``extents`` (volumes padded to one shape; a :class:`fedseg.data.volumes.lazy.CaseBatch` knows its own):
    each case's own spatial shape before padding; a patch then stays within the case where the case is at
    least as large as the patch (its corner is drawn, and a centred patch shifted, within the case), so no
    patch is spent on the padding that only makes the federation's volumes one shape.

    ``x`` may be a :class:`fedseg.data.volumes.lazy.CaseBatch` (then ``y`` is the same batch): the patches
    are placed by the same draws and only they are read from the site's cache."""

    def place(
        n: int, spatial: Sequence[int], count, at, g: torch.Generator, extents: Sequence[Sequence[int]] | None
    ) -> list[tuple[int, list[int]]]:
        """``(case, corner)`` of each of ``n`` patches; ``count(i)``: voxels of each label channel of case ``i``,
        ``at(i, c, k)``: the ``k``-th voxel of channel ``c``."""
        cuts = []
        for i in range(n):
            src, starts = i, None
            bound = spatial if extents is None else [min(max(e, r), s) for e, r, s in zip(extents[i], roi, spatial)]
            if foreground_share > 0 and float(torch.rand((), generator=g)) < foreground_share:
                counts = count(i)
                present = [c for c, m in enumerate(counts) if m]
                if present:
                    c = (
                        present[int(torch.randint(0, len(present), (1,), generator=g))]
                        if len(present) > 1
                        else present[0]
                    )
                    centre = at(i, c, int(torch.randint(0, counts[c], (1,), generator=g)))
                    if pooled:
                        src, centre = centre[0], centre[1:]
                    starts = [min(max(0, c - r // 2), max(0, s - r)) for c, s, r in zip(centre, bound, roi)]
            if starts is None:
                starts = [int(torch.randint(0, max(1, s - r + 1), (1,), generator=g)) for s, r in zip(bound, roi)]
            cuts.append((src, starts))
        return cuts

    def crop(x, y, g: torch.Generator, extents: Sequence[Sequence[int]] | None = None):
        if isinstance(x, CaseBatch):
            spatial = [max(s, r) for s, r in zip(x.spatial, roi)]  # a case smaller than the patch: padded
            return x.regions(place(len(x), spatial, x.foreground_count, x.foreground_at, g, x.extents), roi)
        # a case smaller than the patch: padded at the far end (image: its lowest value)
        x, y = pad_far_end(x, y, [max(s, r) for s, r in zip(x.shape[2:], roi)])
        if pooled and foreground_share > 0:
            batch_fg = [torch.nonzero(y[:, c] > 0) for c in range(y.shape[1])]
            count, at = (lambda i: [len(f) for f in batch_fg]), (lambda i, c, k: batch_fg[c][k].tolist())
        else:
            fgs: dict[int, list[torch.Tensor]] = {}

            def fg(i: int) -> list[torch.Tensor]:
                if i not in fgs:
                    fgs[i] = [torch.nonzero(y[i, c] > 0) for c in range(y.shape[1])]
                return fgs[i]

            count, at = (lambda i: [len(f) for f in fg(i)]), (lambda i, c, k: fg(i)[c][k].tolist())
        xs, ys = [], []
        for src, starts in place(x.shape[0], x.shape[2:], count, at, g, None if pooled else extents):
            sl = tuple(slice(a, a + r) for a, r in zip(starts, roi))
            xs.append(x[(src, slice(None), *sl)])
            ys.append(y[(src, slice(None), *sl)])
        return torch.stack(xs), torch.stack(ys)

    return CaseTransform(crop)


def _augmented(crop, spatial_dims: int, roi: Sequence[int] | None = None):
    """``crop`` (or the batch as drawn, when None) followed by :func:`fedseg.data.augment.patch_augmenter`,
    seeded per batch from ``g`` (the site's (run seed, site, round) generator); 90° in-plane rotations
    when the patch ``roi`` is square in its first two axes."""
    augment = patch_augmenter(spatial_dims, square_plane=roi is not None and roi[0] == roi[1])

    def transform(x, y, g: torch.Generator, extents: Sequence[Sequence[int]] | None = None):
        if crop is not None:
            x, y = crop(x, y, g, extents)
        return augment(x, y, int(torch.randint(0, 2**31 - 1, (), generator=g)))

    return CaseTransform(transform) if isinstance(crop, CaseTransform) else transform


def _slicewise(infer2d: Callable[[nn.Module, torch.Tensor], torch.Tensor]):
    """Inference of a 2D model on a batch of volumes ``(B, C, X, Y, Z)``: every axial slice (last axis)
    predicted by ``infer2d`` and the logits stacked back into ``(B, L, X, Y, Z)``; a 2D batch goes to
    ``infer2d`` as it is."""

    def infer(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 5:
            return infer2d(m, x)
        b, c, sx, sy, sz = x.shape
        out = infer2d(m, x.permute(0, 4, 1, 2, 3).reshape(b * sz, c, sx, sy))
        return out.reshape(b, sz, out.shape[1], sx, sy).permute(0, 2, 3, 4, 1)

    return infer


def segmentation_workload(
    spatial_dims: int,
    in_channels: int,
    label_names: Sequence[str] | Mapping[str, Sequence[int]],
    model: ModelConfig | None = None,
    train: TrainConfig | None = None,
    threshold: float = 0.5,
    sw_batch_size: int = 4,
    empty_dice: float = 1.0,
    sw_overlap: float = 0.5,
    sw_weighting: str = "gaussian",
    hd95: bool = False,
    augment: bool = False,
    slices: bool = False,
) -> Workload:
    """The papers' setting: a U-Net (``model.name``: MONAI's or FGA's reduced one), Dice loss with sigmoid,
    per-channel Dice of the delivered label map.

    ``label_names``: the spec's labels (channel name → label values, ``[data.labels]``), or the channel names
    alone (values 1, 2, … in order: disjoint labels).  Every metric scores the channels of the label map
    :func:`fedseg.data.labelmap.label_map` makes of the logits — the map ``fedseg predict`` writes.

    With ``model.roi_size`` set (volumes), training cuts patches of that size (a share
    ``train.foreground_share`` centred on foreground) and evaluation uses MONAI's sliding-window
    inference with ``sw_overlap`` and ``sw_weighting`` ("gaussian" or "constant").  ``hd95`` adds the
    95th-percentile Hausdorff distance (:func:`hd95_metric`) to the test metrics.  ``augment``: every
    training patch (or image) is augmented (:mod:`fedseg.data.augment`).  ``slices`` (``patches2d``): a
    2D model trained on patches of axial slices (the foreground voxel of a centred patch drawn from the
    whole batch) and evaluated on volumes slice by slice.
    """
    from monai.inferers import sliding_window_inference

    from fedseg.models import build_model as network
    from fedseg.models import deep_supervision_loss

    model = model or ModelConfig()
    train = train or TrainConfig()
    labels = (
        {str(k): tuple(int(v) for v in vs) for k, vs in label_names.items()}
        if isinstance(label_names, Mapping)
        else {str(n): (i + 1,) for i, n in enumerate(label_names)}
    )
    out_channels = len(labels)
    roi = model.roi_size
    infer: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None
    transform = None
    if roi is not None:
        if len(roi) != spatial_dims:
            raise ValueError(f"model.roi_size {roi} must have {spatial_dims} entries")
        windows = max(sw_batch_size, 32) if slices else sw_batch_size  # a volume's slices, many at a time

        def windowed(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
            out = sliding_window_inference(
                x,
                roi_size=tuple(roi),
                sw_batch_size=windows,
                predictor=m,
                overlap=sw_overlap,
                mode=sw_weighting,
            )
            return cast(torch.Tensor, out)  # a tensor for a predictor that returns one

        infer = windowed
        transform = _random_crop(roi, train.foreground_share, pooled=slices)
    if slices:
        infer = _slicewise(infer or (lambda m, x: m(x)))
    if augment:
        transform = _augmented(transform, spatial_dims, roi)
    return Workload(
        build_model=lambda: network(spatial_dims, in_channels, out_channels, model),
        loss=deep_supervision_loss(make_loss(train.loss)),  # DynUNet's deep-supervised training output
        metric=dice_metric(threshold, empty_dice, labels),
        metric_names=tuple(labels),
        infer=infer,
        train_transform=transform,
        spatial_dims=spatial_dims,
        in_channels=in_channels,
        test_metrics={"hd95": hd95_metric(threshold, labels)} if hd95 else {},
        labels=labels,
    )


class DataLayout(Protocol):
    """What a workload needs to know of a federation's data (a :class:`fedseg.data.spec.FederationSpec` has it)."""

    # read-only (a frozen spec's fields are)
    @property
    def spatial_dims(self) -> int: ...
    @property
    def in_channels(self) -> int: ...
    @property
    def labels(self) -> Mapping[str, Any]: ...


def workload_for(layout: DataLayout | Mapping[str, Any], cfg: RunConfig) -> Workload:
    """The segmentation workload of a run: its federation's data layout and the run's model, loss,
    threshold, ``eval.empty_dice``, ``eval.hd95`` ("auto": on for volumes), ``train.augment`` ("auto": on
    for volumes) and ``train.loss`` ("auto": Dice + cross-entropy for volumes, Dice otherwise) — what ``fedseg run``, ``evaluate``, the FedSM studies, the report
    and both halves of a deployment build.

    ``layout`` is a federation spec or its data header (a mapping with ``spatial_dims``,
    ``in_channels``, ``labels`` and ``mode``: what a deployed server receives, :func:`fedseg.data.spec.data_header`).
    """
    if isinstance(layout, Mapping):
        spatial_dims, in_channels, labels = layout["spatial_dims"], layout["in_channels"], layout["labels"]
        mode = layout.get("mode")
    else:
        spatial_dims, in_channels, labels = layout.spatial_dims, layout.in_channels, layout.labels
        mode = getattr(layout, "mode", None)
    volumes = mode in VOLUME_MODES
    augment = cfg.train.augment == "on" or (cfg.train.augment == "auto" and volumes)
    loss = cast(Literal["dice", "dicece", "bce"], cfg.train.loss_for(volumes))  # one of train.loss's values
    train = dataclasses.replace(cfg.train, loss=loss)
    return segmentation_workload(
        int(spatial_dims),
        int(in_channels),
        dict(labels),
        cfg.model,
        train,
        cfg.eval.threshold,
        empty_dice=cfg.eval.empty_dice,
        sw_overlap=cfg.eval.sw_overlap,
        sw_weighting=cfg.eval.sw_weighting,
        hd95=cfg.eval.hd95 == "on" or (cfg.eval.hd95 == "auto" and volumes),
        augment=augment,
        slices=mode == "patches2d",
    )
