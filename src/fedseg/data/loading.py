"""Loading one site's split into memory as tensors.

``load_split(fed, site, split)`` reads every case of the split listed in the
site's datalist, checks it (:func:`fedseg.data.readers.check_case`),
normalizes intensities, resizes, maps label values to channels and stacks the
cases into a :class:`SegmentationDataset`. Nothing is cached on disk.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from fedseg.data import labelmap
from fedseg.data.datalist import load_datalist
from fedseg.data.readers import check_case
from fedseg.data.spec import FederationSpec, SiteSpec
from fedseg.foundation.errors import ConfigError, DataError
from fedseg.foundation.messages import SPLITS as SPLIT_NAMES


class SegmentationDataset(torch.utils.data.Dataset):
    """In-memory segmentation cases.

    Attributes
    ----------
    images : torch.Tensor
        float32 (N, C, *spatial), values in [0, 1].
    labels : torch.Tensor
        float32 (N, L, *spatial), values in {0, 1}; channel order of
        ``FederationSpec.labels``.
    case_ids : list of str
        One id per case: the image path relative to the datalist folder, with
        ``#z`` appended for slice ``z`` in "slices" mode.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, case_ids: list[str]):
        if (
            images.shape[0] != labels.shape[0]
            or images.shape[0] != len(case_ids)
            or images.shape[2:] != labels.shape[2:]
        ):
            raise ValueError(
                f"inconsistent dataset: images {tuple(images.shape)}, labels "
                f"{tuple(labels.shape)}, {len(case_ids)} case ids"
            )
        self.images, self.labels, self.case_ids = images, labels, list(case_ids)

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(image (C, *spatial), label (L, *spatial))`` of case ``i``."""
        return self.images[i], self.labels[i]


def normalize(image: np.ndarray) -> np.ndarray:
    """Scale intensities to [0, 1] as float32.

    uint8 images are divided by 255; any other dtype is min-max scaled over the
    whole array (all channels together, so colour balance is kept). A constant
    array becomes zeros.
    """
    if image.dtype == np.uint8:
        return image.astype(np.float32) / 255.0
    image = image.astype(np.float32)
    lo, hi = float(image.min()), float(image.max())
    return (image - lo) / (hi - lo) if hi > lo else np.zeros_like(image)


def resize_pair(image: np.ndarray, label: np.ndarray, size: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Resize image (C, *spatial) and integer label (*spatial) to ``size``.

    Images use "area" when shrinking every axis, else (bi/tri)linear; labels
    use nearest so values stay in the label set.
    """
    if tuple(image.shape[1:]) == tuple(size):
        return image, label
    shrink = all(t <= s for t, s in zip(size, image.shape[1:]))
    mode = "area" if shrink else ("bilinear" if len(size) == 2 else "trilinear")
    from monai.transforms import Resize  # deferred: importing MONAI costs seconds

    img = Resize(size, mode=mode, anti_aliasing=False)(torch.from_numpy(image))
    lab = Resize(size, mode="nearest")(torch.from_numpy(label[None].astype(np.float32)))
    return np.asarray(img, dtype=np.float32), np.rint(np.asarray(lab[0])).astype(np.int64)


def label_channels(label: np.ndarray, labels: dict[str, tuple[int, ...]]) -> np.ndarray:
    """Map an integer label map (*spatial) to float32 channels (L, *spatial).

    Channel ``c`` is ``isin(label, values_c)`` (:func:`fedseg.data.labelmap.channels`, the rule a predicted
    label map is scored by), so nested classes (cup inside disc: disc = [1, 2], cup = [2]) give nested channels.
    """
    return labelmap.channels(label, labels).astype(np.float32)


def _pieces(fed: FederationSpec, image: np.ndarray, label: np.ndarray, case_id: str):
    """Yield (case_id, image, label) units the model sees: whole cases or slices."""
    if fed.mode != "slices":
        yield case_id, image, label
        return
    for z in range(label.shape[-1]):
        lab = label[..., z]
        if fed.foreground_only and not lab.any():
            continue
        yield f"{case_id}#{z}", image[..., z], lab


def load_split(fed: FederationSpec, site: SiteSpec | str, split: str, *, progress: bool = False) -> SegmentationDataset:
    """Load one split of one site into memory.

    Parameters
    ----------
    fed : FederationSpec
        The federation (mode, channels, label mapping, image size).
    site : SiteSpec or str
        The site or its name.
    split : str
        "training", "validation" or "testing" (or "train", "val", "test").
    progress : bool
        Show a tqdm bar over the files.

    Returns
    -------
    SegmentationDataset
        images (N, C, *spatial) float32 in [0, 1]; labels (N, L, *spatial)
        float32 in {0, 1}. ``*spatial`` is (H, W) for "2d"/"slices", (D, H, W)
        for "3d" (as stored in the file).

    Raises
    ------
    DataError
        If a file is missing or unreadable, has the wrong channel count, NaN,
        label values not declared, image/label size mismatch, or cases of
        different sizes without ``image_size``.
    ConfigError
        Unknown site or split name.
    """
    site = fed.site(site) if isinstance(site, str) else site
    canonical = SPLIT_NAMES.get(split) if isinstance(split, str) else None
    if canonical is None:
        raise ConfigError(f"{site.name}: unknown split {split!r} -> use one of {sorted(SPLIT_NAMES)}")
    split = canonical
    entries = load_datalist(site.datalist, site=site.name)[split]
    root = site.datalist.parent
    images: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    ids: list[str] = []
    for entry in tqdm(entries, desc=f"{site.name} {split}", disable=not progress, leave=False):
        case, issues = check_case(fed, entry["image"], entry["label"])
        if case is None:
            raise DataError(
                "; ".join(f"{site.name}: {i.file}: {i.message} -> {i.fix}" for i in issues if i.fatal)
                + " (fedseg.data.validate_federation lists every problem)"
            )
        image = normalize(case.image)
        try:
            cid = Path(entry["image"]).relative_to(root).as_posix()
        except ValueError:
            cid = str(entry["image"])
        for pid, img, lab in _pieces(fed, image, case.label, cid):
            if fed.image_size is not None:
                img, lab = resize_pair(img, lab, fed.image_size)
            if images and img.shape != images[0].shape:
                raise DataError(
                    f"{site.name}: {entry['image']}: size {img.shape[1:]} differs from "
                    f"{images[0].shape[1:]} of {ids[0]} -> set data.image_size in "
                    f"{fed.path} to resize all cases to one size"
                )
            images.append(img)
            labels.append(label_channels(lab, fed.labels))
            ids.append(pid)
    if not images:
        raise DataError(
            f"{site.name}: {site.datalist}: split {split!r} has no cases"
            + (" with foreground" if fed.foreground_only else "")
            + " -> add cases to the datalist"
        )
    return SegmentationDataset(torch.from_numpy(np.stack(images)), torch.from_numpy(np.stack(labels)), ids)
