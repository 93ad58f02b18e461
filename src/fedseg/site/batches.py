"""A site's data: its splits, where their tensors live, and the batches a round trains on.

Random draws (batch order, crops) come from generators seeded by (run seed, site index, round, stream name):
see :mod:`fedseg.foundation.seeding` — and a deployed site's own salt where it salts (:func:`stream_generator`);
under differential privacy from the site's DP randomness instead.  Under ``privacy.dp = "sample"`` the batches are Poisson samples from the
site's DP randomness (:mod:`fedseg.site.dp`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch.utils.data import Dataset, TensorDataset

from fedseg.data.volumes.lazy import CachedVolumes
from fedseg.foundation.config import TrainConfig
from fedseg.foundation.device import fits_on_device
from fedseg.foundation.errors import PayloadError
from fedseg.foundation.messages import split_name
from fedseg.foundation.seeding import generator
from fedseg.site.dp import draw_batches
from fedseg.site.workload import CaseTransform

__all__ = [
    "CaseExtents",
    "ImagePairs",
    "Placed",
    "SiteData",
    "batch_at",
    "batch_of",
    "case_extents",
    "dataset_len",
    "on_device",
    "placed_split",
    "steps_per_round",
    "stream_generator",
    "tensor_pair",
    "training_batches",
]


@runtime_checkable
class ImagePairs(Protocol):
    """A dataset whose cases are rows of two tensors: ``images`` and ``labels`` (a volume split, a split moved
    to the device)."""

    images: torch.Tensor
    labels: torch.Tensor


@runtime_checkable
class CaseExtents(Protocol):
    """A dataset of padded volumes that records each case's own extent (:mod:`fedseg.site.extent`)."""

    extents: Any


def tensor_pair(ds: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (images, labels) tensors of an in-memory dataset (:class:`ImagePairs`, or a two-tensor
    :class:`~torch.utils.data.TensorDataset`); None for any other dataset."""
    if isinstance(ds, ImagePairs):
        return ds.images, ds.labels
    if isinstance(ds, TensorDataset) and len(ds.tensors) == 2:
        return ds.tensors[0], ds.tensors[1]
    return None


def case_extents(ds: Any) -> Any:
    """The dataset's per-case extents (:class:`CaseExtents`), None when it records none."""
    return ds.extents if isinstance(ds, CaseExtents) else None


@dataclass
class SiteData:
    """A site's splits; each item of a dataset is an ``(input, target)`` pair."""

    train: Dataset
    val: Dataset | None = None
    test: Dataset | None = None

    def split(self, name: str) -> Dataset | None:
        """The split named ``name`` (any name of :data:`fedseg.foundation.messages.SPLITS`: ``"val"`` or ``"validation"``)."""
        return {"training": self.train, "validation": self.val, "testing": self.test}[split_name(name)]


def dataset_len(ds: Dataset | None) -> int:
    return 0 if ds is None else len(ds)  # type: ignore[arg-type]


def batch_of(ds: Dataset, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cases ``idx`` of ``ds`` as a batch, without a DataLoader for in-memory datasets."""
    pair = tensor_pair(ds)
    if pair is not None:
        return pair[0][idx], pair[1][idx]
    items = [ds[int(i)] for i in idx]
    return torch.stack([torch.as_tensor(a) for a, _ in items]), torch.stack([torch.as_tensor(b) for _, b in items])


class Placed(Dataset):
    """A site split's tensors, moved once to the run's device."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]


def steps_per_round(train: TrainConfig, n: int) -> int:
    """Local optimizer steps in one round of a site with ``n`` training cases: ``train.local_steps``, or
    ``train.local_epochs`` × batches per epoch (:meth:`Site.steps_per_round`; a deployed server checks
    the claims of lockstep sites against their declared counts with it)."""
    if train.local_steps is not None:
        return train.local_steps
    return max(1, round(float(train.local_epochs or 0.0) * math.ceil(n / train.batch_size)))


def placed_split(site: Any, split: str) -> Dataset | None:
    """A split as the training loop reads it: on a CUDA run, in-memory tensors are moved to the
    device once (``train.data = "device"``, or ``"auto"`` when they fit in half the free GPU
    memory) or kept on the host and copied per batch from pinned memory (``"stream"``).  On the
    CPU "device" wraps the same tensors (nothing is copied)."""
    ds = site.data.split(split)
    if ds is None:
        return ds
    key = split_name(split)
    if key not in site.placed:
        pair = tensor_pair(ds)
        if pair is None or len(pair) != 2:
            site.placed[key] = ds  # a generic dataset: each batch is copied to the device as it is used
        else:
            mode = site.cfg.train.data
            if mode == "auto":
                mode = (
                    "device"
                    if fits_on_device(sum(t.numel() * t.element_size() for t in pair), site.device)
                    else "stream"
                )
            # "stream": the host tensors; each batch is pinned and copied without blocking
            site.placed[key] = Placed(pair[0].to(site.device), pair[1].to(site.device)) if mode == "device" else ds
    return site.placed[key]


def on_device(site: Any, t: torch.Tensor, cast: bool) -> torch.Tensor:
    """A batch tensor on the run's device (through pinned memory, non-blocking, when it comes from the host)."""
    if t.device.type == "cpu" and site.device.type == "cuda":
        t = t.pin_memory().to(site.device, non_blocking=True)
    elif t.device != site.device:
        t = t.to(site.device)
    return t.to(site.dtype) if cast else t


def training_batches(
    site: Any,
    rnd: int,
    stream: str = "train",
    steps: int | None = None,
    split: str = "train",
    batch_size: int | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Training batches of one round: successive seeded permutations cut into batches.

    Each pass over the data is a permutation drawn from the generator of
    (seed, site, round, stream, pass); the last batch of a pass may be smaller.  Under
    ``privacy.dp = "sample"`` each batch is instead a Poisson sample (every case with probability
    q = B / n) from the site's DP randomness, the same for every model trained on the round's
    batches (:meth:`fedseg.site.dp.SiteDP.batch`); an empty sample is a batch of zero rows.  Volumes kept in the
    site's cache (:class:`fedseg.data.volumes.lazy.CachedVolumes`) go to a patch transform as a
    :class:`~fedseg.data.volumes.lazy.CaseBatch`, which reads only the patches.
    """
    ds = placed_split(site, split)
    n = dataset_len(ds)
    if ds is None or n == 0:
        raise PayloadError(f"site {site.name}: the {split} split is empty; add cases to its datalist")
    bs = batch_size or site.cfg.train.batch_size
    steps = site.steps_per_round(split) if steps is None else steps
    tf = site.workload.train_transform
    g_tf = stream_generator(site, rnd, stream, "transform") if tf is not None else None
    cases_aware = isinstance(tf, CaseTransform)
    lazy = isinstance(ds, CachedVolumes) and cases_aware
    # padded volumes: each case's own shape, so that patches stay within it (the workload's patch crop)
    extents = case_extents(site.data.split(split)) if cases_aware and not lazy else None
    if site.cfg.privacy.dp == "sample":  # Poisson batches from the site's DP randomness (fedseg.site.dp)
        for idx in draw_batches(site.dp, rnd, stream, split, steps, n, bs):
            empty = idx.numel() == 0  # a batch of no case: one case's shapes, cut to zero rows
            take = torch.zeros(1, dtype=torch.int64) if empty else idx
            placed = take.to(site.device) if isinstance(ds, Placed) else take
            x, y = batch_at(site, ds, placed, take, tf, g_tf, lazy, extents)
            yield (x[:0], y[:0]) if empty else (x, y)
        return
    done, epoch = 0, 0
    while done < steps:
        order = torch.randperm(n, generator=stream_generator(site, rnd, stream, epoch))  # on the CPU on every device
        perm = order.to(site.device) if isinstance(ds, Placed) else order  # one copy per pass
        for start in range(0, n, bs):
            if done >= steps:
                break
            yield batch_at(site, ds, perm[start : start + bs], order[start : start + bs], tf, g_tf, lazy, extents)
            done += 1
        epoch += 1


def stream_generator(site: Any, rnd: int, *purpose: int | str) -> torch.Generator:
    """The generator of one of a site's training streams (batch order of a pass, augmentation, FedSM's selector
    flips) in round ``rnd``.  Under differential privacy (``privacy.dp`` not off) it is keyed by the site's DP
    randomness (:mod:`fedseg.privacy.randomness`: fresh OS bytes, or the seeded test mode's hash), never by the
    public run seed alone: the server cannot predict which augmentation a case got.  Otherwise it is seeded by
    (run seed, site index, round, purpose) and, at a deployed site that salts (``site.salt``), its salt: two runs
    never draw the same batches, so (sum of run A − sum of run B) is not one site's update."""
    if site.cfg.privacy.dp != "off":
        key = site.dp.random.key("stream", int(rnd), *purpose)
        g = torch.Generator()
        g.manual_seed(int.from_bytes(key[:8], "big") & ((1 << 63) - 1))
        return g
    salt = getattr(site, "salt", None)
    extra = () if salt is None else (int(salt),)
    return generator(site.cfg.seed, site.index, rnd, *purpose, *extra)


def batch_at(
    site: Any, ds: Dataset, idx: torch.Tensor, order: torch.Tensor, tf: Any, g_tf: Any, lazy: bool, extents: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Training cases ``idx`` (on the dataset's device; ``order``: the same on the CPU) as a batch on the
    run's device, through the workload's transform."""
    if lazy and isinstance(ds, CachedVolumes):  # volumes in the site's cache: the transform reads only its patches
        cases = ds.batch(idx)
        cases.place = lambda t, cast: on_device(site, t, cast)
        return tf(cases, cases, g_tf)
    x, y = batch_of(ds, idx)
    x = on_device(site, x, cast=True)
    y = on_device(site, y, cast=y.is_floating_point())
    if extents is not None:
        return tf(x, y, g_tf, [extents[i] for i in order.tolist()])
    if tf is not None:
        return tf(x, y, g_tf)
    return x, y
