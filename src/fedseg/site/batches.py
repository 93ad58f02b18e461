"""A site's data: its splits, where their tensors live, and the batches a round trains on.

Random draws (batch order, crops) come from generators seeded by (run seed, site index, round, stream name):
see :mod:`fedseg.foundation.seeding` — and a deployed site's own salt where it salts (:class:`Streams`);
under differential privacy from the site's DP randomness instead.  Which cases make a batch is a
:class:`Sampler`'s choice: seeded permutations (:class:`SeededOrder`), or under ``privacy.dp = "sample"`` Poisson
samples from the site's DP randomness (:class:`fedseg.site.dpsgd.PoissonSampler`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
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
from fedseg.site.workload import CaseTransform

__all__ = [
    "CaseExtents",
    "ImagePairs",
    "Placed",
    "RoundBatches",
    "Sampler",
    "SeededOrder",
    "SiteData",
    "Splits",
    "Streams",
    "batch_at",
    "batch_of",
    "case_extents",
    "dataset_len",
    "steps_per_round",
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


class Splits:
    """A site's splits as its loops read them: each split placed once (:meth:`placed`) and a batch tensor moved
    to the run's device (:meth:`on_device`).

    On a CUDA run, in-memory tensors are moved to the device once (``train.data = "device"``, or ``"auto"`` when
    they fit in half the free GPU memory) or kept on the host and copied per batch from pinned memory
    (``"stream"``).  On the CPU "device" wraps the same tensors (nothing is copied)."""

    def __init__(self, data: SiteData, device: torch.device, dtype: torch.dtype, mode: str = "auto"):
        self.data, self.device, self.dtype, self.mode = data, device, dtype, mode
        self._placed: dict[str, Dataset | None] = {}

    def placed(self, split: str) -> Dataset | None:
        """A split as the training loop reads it (placed on first use)."""
        ds = self.data.split(split)
        if ds is None:
            return ds
        key = split_name(split)
        if key not in self._placed:
            pair = tensor_pair(ds)
            if pair is None or len(pair) != 2:
                self._placed[key] = ds  # a generic dataset: each batch is copied to the device as it is used
            else:
                mode = self.mode
                if mode == "auto":
                    nbytes = sum(t.numel() * t.element_size() for t in pair)
                    mode = "device" if fits_on_device(nbytes, self.device) else "stream"
                # "stream": the host tensors; each batch is pinned and copied without blocking
                self._placed[key] = Placed(pair[0].to(self.device), pair[1].to(self.device)) if mode == "device" else ds
        return self._placed[key]

    def on_device(self, t: torch.Tensor, cast: bool) -> torch.Tensor:
        """A batch tensor on the run's device (through pinned memory, non-blocking, when it comes from the host),
        in the run's dtype with ``cast``."""
        if t.device.type == "cpu" and self.device.type == "cuda":
            t = t.pin_memory().to(self.device, non_blocking=True)
        elif t.device != self.device:
            t = t.to(self.device)
        return t.to(self.dtype) if cast else t

    def steps_per_round(self, train: TrainConfig, split: str = "train") -> int:
        """Local optimizer steps in one round on ``split`` (:func:`steps_per_round`)."""
        return steps_per_round(train, dataset_len(self.data.split(split)))


class StreamKeys(Protocol):
    """A site's differential-privacy randomness, as its training streams use it
    (:class:`fedseg.privacy.randomness.Randomness`)."""

    def key(self, *position: Any) -> bytes: ...


class Streams:
    """The generators of a site's training streams (batch order of a pass, augmentation, FedSM's selector flips).

    Under differential privacy (``random`` given: the site's DP randomness) each is keyed by that randomness
    (:mod:`fedseg.privacy.randomness`: fresh OS bytes, or the seeded test mode's hash), never by the public run
    seed alone: the server cannot predict which augmentation a case got.  Otherwise it is seeded by (run seed,
    site index, round, purpose) and, at a deployed site that salts (:attr:`salt`), its salt: two runs never
    draw the same batches, so (sum of run A − sum of run B) is not one site's update."""

    def __init__(self, seed: int, index: int, random: StreamKeys | None = None):
        self.seed, self.index, self.random = seed, index, random
        self.salt: int | None = None

    def generator(self, rnd: int, *purpose: int | str) -> torch.Generator:
        """The generator of one stream in round ``rnd``."""
        if self.random is not None:
            key = self.random.key("stream", int(rnd), *purpose)
            g = torch.Generator()
            g.manual_seed(int.from_bytes(key[:8], "big") & ((1 << 63) - 1))
            return g
        extra = () if self.salt is None else (int(self.salt),)
        return generator(self.seed, self.index, rnd, *purpose, *extra)


class Sampler(Protocol):
    """Which cases make each batch of a round: ``(on the dataset's device, on the CPU)`` index tensors of batches
    ``0..steps-1`` of round ``rnd`` (``place`` moves CPU indices to the dataset's device)."""

    def __call__(
        self,
        rnd: int,
        stream: str,
        split: str,
        steps: int,
        n: int,
        batch_size: int,
        place: Callable[[torch.Tensor], torch.Tensor],
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...


class SeededOrder:
    """Successive seeded permutations cut into batches (a :class:`Sampler`): each pass over the data is a
    permutation drawn from the stream of (round, stream name, pass) (:class:`Streams`); the last batch of a
    pass may be smaller."""

    def __init__(self, streams: Streams):
        self.streams = streams

    def __call__(
        self,
        rnd: int,
        stream: str,
        split: str,
        steps: int,
        n: int,
        batch_size: int,
        place: Callable[[torch.Tensor], torch.Tensor],
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        done, epoch = 0, 0
        while done < steps:
            order = torch.randperm(n, generator=self.streams.generator(rnd, stream, epoch))  # on the CPU everywhere
            perm = place(order)  # one copy per pass
            for start in range(0, n, batch_size):
                if done >= steps:
                    break
                yield perm[start : start + batch_size], order[start : start + batch_size]
                done += 1
            epoch += 1


@dataclass(frozen=True)
class RoundBatches:
    """The training batches of one round of one site (a :class:`fedseg.site.calls.Batches`): ``steps`` batches
    of ``batch_size`` cases of ``split``, the cases chosen by ``sampler`` (:class:`SeededOrder`, or the site's
    Poisson sampler under ``privacy.dp = "sample"``: :class:`fedseg.site.dpsgd.PoissonSampler`) and each batch
    through the workload's transform, drawn lazily; each iteration starts the round's streams afresh.  An empty
    sample is a batch of zero rows.  Volumes kept in the site's cache
    (:class:`fedseg.data.volumes.lazy.CachedVolumes`) go to a patch transform as a
    :class:`~fedseg.data.volumes.lazy.CaseBatch`, which reads only the patches."""

    site: str
    splits: Splits
    streams: Streams
    sampler: Sampler
    transform: Any
    rnd: int
    stream: str
    steps: int
    batch_size: int
    split: str = "train"

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return training_batches(self)


def training_batches(b: RoundBatches) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The batches of :class:`RoundBatches` ``b``."""
    splits = b.splits
    ds = splits.placed(b.split)
    n = dataset_len(ds)
    if ds is None or n == 0:
        raise PayloadError(f"site {b.site}: the {b.split} split is empty; add cases to its datalist")
    tf = b.transform
    g_tf = b.streams.generator(b.rnd, b.stream, "transform") if tf is not None else None
    cases_aware = isinstance(tf, CaseTransform)
    lazy = isinstance(ds, CachedVolumes) and cases_aware
    # padded volumes: each case's own shape, so that patches stay within it (the workload's patch crop)
    extents = case_extents(splits.data.split(b.split)) if cases_aware and not lazy else None
    on_dataset = isinstance(ds, Placed)

    def place(idx: torch.Tensor) -> torch.Tensor:
        return idx.to(splits.device) if on_dataset else idx

    for placed, order in b.sampler(b.rnd, b.stream, b.split, b.steps, n, b.batch_size, place):
        if order.numel() == 0:  # a batch of no case: one case's shapes, cut to zero rows
            take = torch.zeros(1, dtype=torch.int64)
            x, y = batch_at(splits, ds, place(take), take, tf, g_tf, lazy, extents)
            yield x[:0], y[:0]
        else:
            yield batch_at(splits, ds, placed, order, tf, g_tf, lazy, extents)


def batch_at(
    splits: Splits, ds: Dataset, idx: torch.Tensor, order: torch.Tensor, tf: Any, g_tf: Any, lazy: bool, extents: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Training cases ``idx`` (on the dataset's device; ``order``: the same on the CPU) as a batch on the
    run's device, through the workload's transform."""
    if lazy and isinstance(ds, CachedVolumes):  # volumes in the site's cache: the transform reads only its patches
        cases = ds.batch(idx)
        cases.place = splits.on_device
        return tf(cases, cases, g_tf)
    x, y = batch_of(ds, idx)
    x = splits.on_device(x, cast=True)
    y = splits.on_device(y, cast=y.is_floating_point())
    if extents is not None:
        return tf(x, y, g_tf, [extents[i] for i in order.tolist()])
    if tf is not None:
        return tf(x, y, g_tf)
    return x, y
