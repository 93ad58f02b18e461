"""Site runtime: one institution's data, models, optimizers and persistent state.

A :class:`Site` answers tasks (``site.handle(task) -> reply``).  It dispatches the
task to the site half of the run's algorithm (``algorithm.site_handlers()``), or to
the built-in ``"evaluate"`` handler and secure aggregation's steps (:mod:`fedseg.site.secure`, which
also masks a reply whose task asks for it).  Everything a site must remember between
rounds — its models, optimizer moments, algorithm state such as control
variates — lives here; :meth:`Site.state_arrays` / :meth:`Site.load_state_arrays` turn it
into flat host arrays + JSON and back, and :mod:`fedseg.seams.checkpoint` writes and reads
them (safetensors + JSON), so a restarted site resumes exactly.  The site does no file I/O.

Random draws (batch order, crops) come from generators seeded by
(run seed, site index, round, stream name): see :mod:`fedseg.foundation.seeding`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.data import Dataset

from fedseg.data.volumes.lazy import CachedVolumes
from fedseg.foundation.arrays import Arrays, check_compatible, strip_prefix
from fedseg.foundation.config import RunConfig, TrainConfig
from fedseg.foundation.device import (
    autocast,
    configure_determinism,
    fits_on_device,
    grad_scaler,
    resolve_device,
    to_device,
)
from fedseg.foundation.errors import ConfigError, PayloadError
from fedseg.foundation.messages import Reply, Task, split_name
from fedseg.foundation.seeding import generator
from fedseg.privacy.identity import Identity
from fedseg.site import extent, secure
from fedseg.site import predict as prediction
from fedseg.site.dp import SiteDP, draw_batches
from fedseg.site.workload import Workload


def poly_lr(opt: Any, rnd: int, rounds: int, exponent: float = 0.9) -> None:
    """nnU-Net's poly schedule for round ``rnd`` (1-based) of ``rounds``: every parameter group's learning
    rate becomes its first one (kept as ``initial_lr``, as torch's schedulers keep it) times
    ``(1 − (rnd − 1) / rounds)^exponent``.  An optimizer without parameter groups is left alone."""
    groups = getattr(opt, "param_groups", None)
    if not groups:
        return
    factor = (1.0 - (rnd - 1) / rounds) ** exponent
    for g in groups:
        g.setdefault("initial_lr", g["lr"])
        g["lr"] = g["initial_lr"] * factor


class SiteHalf(Protocol):
    """What a :class:`Site` needs from the run's algorithm: its site half (see
    :class:`fedseg.seams.algorithm.Algorithm`, which implements it).  The site layer does not import
    the algorithms; the algorithms build on the site."""

    name: str

    def site_handlers(self) -> dict[str, Callable[[Site, Task], Reply]]: ...

    def predictors(self) -> dict[str, Callable[[Site, Arrays, dict], Callable[[torch.Tensor], torch.Tensor]]]: ...

    def model_factory(self, site: Site, role: str) -> Callable[[], nn.Module] | None: ...

    def optimizer_params(self, site: Site, role: str) -> list[torch.Tensor]: ...

    def summed(self, task: Task) -> bool: ...


__all__ = [
    "LocalExecutor",
    "LossSums",
    "Site",
    "SiteData",
    "SiteExecutor",
    "batch_of",
    "dataset_len",
    "step_with_gradient",
    "steps_per_round",
]

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


class SiteExecutor(Protocol):
    """Who computes a :class:`Site`'s local training: its :meth:`Site.fit`, :meth:`Site.gradient` and
    :meth:`Site.step_with_gradient` calls are delegated to ``site.executor`` (:attr:`Site.executor`), which
    computes them at the site (:meth:`Site.fit_here` and the like) or together with other sites' calls
    (the vectorized simulation, :class:`fedseg.execution.vectorize.VectorizedExecutor`)."""

    def fit(
        self,
        site: Site,
        role: str,
        rnd: int,
        stream: str,
        optimizer: Any,
        extra_loss: Callable[[nn.Module], torch.Tensor] | None,
        after_backward: Callable[[nn.Module], None] | None,
        steps: int | None,
    ) -> dict[str, float]: ...

    def gradient(
        self,
        site: Site,
        role: str,
        x: torch.Tensor,
        target: Any,
        loss: Callable[[torch.Tensor, Any], torch.Tensor] | None,
        at: Mapping[str, torch.Tensor] | None,
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]: ...

    def step_with_gradient(
        self, site: Site, model: nn.Module, optimizer: torch.optim.Optimizer, grad: Mapping[str, torch.Tensor]
    ) -> None: ...


class LocalExecutor:
    """The default :class:`SiteExecutor`: every call computed at the site, in the calling thread (deployed
    sites, and simulations that run their sites one after another)."""

    def fit(
        self,
        site: Site,
        role: str,
        rnd: int,
        stream: str,
        optimizer: Any,
        extra_loss: Callable[[nn.Module], torch.Tensor] | None,
        after_backward: Callable[[nn.Module], None] | None,
        steps: int | None,
    ) -> dict[str, float]:
        return site.fit_here(role, rnd, stream, optimizer, extra_loss, after_backward, steps)

    def gradient(
        self,
        site: Site,
        role: str,
        x: torch.Tensor,
        target: Any,
        loss: Callable[[torch.Tensor, Any], torch.Tensor] | None,
        at: Mapping[str, torch.Tensor] | None,
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        return site.gradient_here(role, x, target, loss, at)

    def step_with_gradient(
        self, site: Site, model: nn.Module, optimizer: torch.optim.Optimizer, grad: Mapping[str, torch.Tensor]
    ) -> None:
        site.step_with_gradient_here(model, optimizer, grad)


LOCAL = LocalExecutor()
"""The executor every :class:`Site` starts with."""


def step_with_gradient(model: nn.Module, optimizer: torch.optim.Optimizer, grad: Mapping[str, torch.Tensor]) -> None:
    """One ``optimizer`` step with ``grad`` (parameter name → tensor; a parameter it does not name gets no
    gradient) as the model's gradient, here (:meth:`Site.step_with_gradient` is the delegated one)."""
    for name, p in model.named_parameters():
        g = grad.get(name)
        p.grad = None if g is None else g.to(device=p.device, dtype=p.dtype).clone()
    optimizer.step()


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
    if hasattr(ds, "images") and hasattr(ds, "labels"):
        return ds.images[idx], ds.labels[idx]
    tensors = getattr(ds, "tensors", None)
    if tensors is not None and len(tensors) == 2:
        return tensors[0][idx], tensors[1][idx]
    items = [ds[int(i)] for i in idx]
    return torch.stack([torch.as_tensor(a) for a, _ in items]), torch.stack([torch.as_tensor(b) for _, b in items])


class _Placed(Dataset):
    """A site split's tensors, moved once to the run's device."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]


class LossSums:
    """Losses summed on the device (float64) and read on the host once, by :meth:`means`:
    a training loop that adds every step's loss never waits for the device."""

    def __init__(self, device: torch.device):
        self.device = device
        self._sums: dict[str, torch.Tensor] = {}
        self._counts: dict[str, int] = {}

    def add(self, key: str, loss: torch.Tensor) -> None:
        if key not in self._sums:
            self._sums[key] = torch.zeros((), dtype=torch.float64, device=self.device)
            self._counts[key] = 0
        self._sums[key] += loss.detach()
        self._counts[key] += 1

    def count(self, key: str) -> int:
        return self._counts.get(key, 0)

    def means(self) -> dict[str, float]:
        """``{key: mean loss}`` (one host read for all keys)."""
        if not self._sums:
            return {}
        keys = list(self._sums)
        values = torch.stack([self._sums[k] for k in keys]).tolist()
        return {k: v / self._counts[k] for k, v in zip(keys, values)}


def steps_per_round(train: TrainConfig, n: int) -> int:
    """Local optimizer steps in one round of a site with ``n`` training cases: ``train.local_steps``, or
    ``train.local_epochs`` × batches per epoch (:meth:`Site.steps_per_round`; a deployed server checks
    the claims of lockstep sites against their declared counts with it)."""
    if train.local_steps is not None:
        return train.local_steps
    return max(1, round(train.local_epochs * math.ceil(n / train.batch_size)))


class Site:
    """One site's runtime.

    Parameters
    ----------
    name
        Site name (from the federation spec).
    index
        0-based position of the site in the federation (seeds its random streams;
        FedSM's selector label).
    data
        Its splits.
    workload
        Model factory, loss and metric.
    cfg
        The run configuration.
    algorithm
        The run's algorithm; its site half answers tasks.
    executor
        Who computes :meth:`fit`, :meth:`gradient` and :meth:`step_with_gradient` (:attr:`executor`;
        default :class:`LocalExecutor`: here).
    """

    def __init__(
        self,
        name: str,
        index: int,
        data: SiteData,
        workload: Workload,
        cfg: RunConfig,
        algorithm: SiteHalf,
        executor: SiteExecutor | None = None,
    ):
        self.name = name
        self.index = index
        self.data = data
        self.workload = workload
        self.cfg = cfg
        self.algorithm = algorithm
        self.scratch: dict[str, Any] = {}
        """Working state of the site half that is *not* saved with the site (caches, cursors rebuilt on
        demand, e.g. FGA's batch cursor); what must survive a restart belongs in :attr:`store`."""
        self.dtype = _DTYPES[cfg.train.dtype]
        self.device = resolve_device(cfg.device)
        configure_determinism(self.device, cfg.deterministic)
        self.precision = cfg.train.precision
        self.scalers: dict[str, torch.amp.GradScaler] = {}
        self._placed: dict[str, Dataset | None] = {}
        self.models: dict[str, nn.Module] = {}
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.store: Arrays = {}
        self._workload_models: dict[str, nn.Module] = {}
        self._template_role: str | None = None
        self._handlers = algorithm.site_handlers()
        self.executor: SiteExecutor = executor or LOCAL
        """Who computes this site's :meth:`fit`, :meth:`gradient` and :meth:`step_with_gradient` calls
        (a simulation that vectorizes its sites sets its :class:`SiteExecutor` here)."""
        self.dp = SiteDP(self)
        """The site's DP-SGD steps and ε (``privacy.dp = "sample"``; :mod:`fedseg.site.dp`)."""
        self.secagg_record = secure.Record()
        """What this site masked per (task kind, round, step) (:class:`fedseg.site.secure.Record`): not part of
        its saved state, so restoring a checkpoint does not rewind it; a deployed site keeps it in a file."""
        self.identity: Identity | None = None
        """The site's certificate and private key, which sign its secure-aggregation keys
        (:mod:`fedseg.privacy.identity`); set by a deployed site from its startup kit, None in simulation."""

    # ------------------------------------------------------------------ tasks
    def handle(self, task: Task) -> Reply:
        """Run one task and return the reply."""
        if task.kind == "evaluate":
            return self._evaluate(task)
        if task.kind == "privacy":  # the engine's question under privacy.dp: ε so far
            return Reply(metrics=self.dp.report(), num_samples=self.num_train)
        if task.kind in secure.KINDS:
            return secure.handle(self, task)
        handler = self._handlers.get(task.kind)
        if handler is None:
            raise PayloadError(
                f"site {self.name}: task kind {task.kind!r} is not handled by method {self.algorithm.name!r} "
                f"(known: {[*sorted(self._handlers), 'evaluate']}); server and site must run the same method"
            )
        if self.cfg.privacy.secure_aggregation and self.algorithm.summed(task):
            if "secagg" not in task.config:
                raise PayloadError(
                    f"site {self.name}: privacy.secure_aggregation is on in this site's config and the server sums "
                    f"the reply to {task.kind!r}; this task comes without secure aggregation, so the site refuses it "
                    "(it never sends such a reply unmasked)"
                )
            if task.config.get("steps") is not None:
                raise PayloadError(
                    f"site {self.name}: a {task.kind!r} task that the server sums securely sets steps = "
                    f"{task.config['steps']!r}; the site's local work comes from its own config "
                    "(train.local_steps / train.local_epochs), not from the task"
                )
        reply = handler(self, task)
        if self.cfg.privacy.dp != "off":  # no training loss leaves the site under DP (fedseg.site.dp)
            reply.metrics.update({k: None for k in reply.metrics if k.endswith("loss")})
        if "secagg" in task.config:  # the server sums this reply securely: mask it before it leaves the site
            reply = secure.mask_reply(self, task, reply)
        return reply

    # ----------------------------------------------------------------- models
    @property
    def num_train(self) -> int:
        return dataset_len(self.data.train)

    def model(self, role: str, factory: Callable[[], nn.Module] | None = None) -> nn.Module:
        """The site's model for ``role`` (created on first use from ``factory`` or the workload)."""
        m = self.models.get(role)
        if m is None:
            template = self._workload_models.get("any") if factory is None else None
            # another instance of the workload model: copy it (its weights are replaced
            # on load) instead of building and randomly initializing a new one
            m = (
                copy.deepcopy(template)
                if template is not None
                else (factory or self.workload.build_model)().to(device=self.device, dtype=self.dtype)
            )
            if factory is None and "any" not in self._workload_models:
                self._workload_models["any"] = m
                self._template_role = role
            self.models[role] = m
        return m

    def _bn_buffers(self, model: nn.Module) -> set[str]:
        names = set()
        for mod_name, mod in model.named_modules():
            if isinstance(mod, nn.modules.batchnorm._BatchNorm):
                for b, _ in mod.named_buffers(recurse=False):
                    names.add(f"{mod_name}.{b}" if mod_name else b)
        return names

    def _shared_names(self, model: nn.Module) -> set[str] | None:
        """Names exchanged with the server (None = all); 'local' BN policy keeps running stats at the site."""
        if self.cfg.train.bn_policy == "local":
            bn = self._bn_buffers(model)
            if bn:
                return set(model.state_dict()) - bn
        return None

    def load(
        self, role: str, arrays: Arrays, factory: Callable[[], nn.Module] | None = None, bn_from: str | None = None
    ) -> nn.Module:
        """Copy ``arrays`` into the role's model (validated: names, shapes, dtypes) and return the model.

        With ``train.bn_policy = "local"`` the arrays carry no batch-norm running statistics;
        a role the site trains keeps its own, and a role that only evaluates (``bn_from``
        given) takes the current ones of the site's role ``bn_from`` — otherwise an
        evaluation copy would keep the statistics it had when it was first built.
        """
        model = self.model(role, factory)
        own = model.state_dict()
        shared = self._shared_names(model)
        expected = {k: v for k, v in own.items() if shared is None or k in shared}
        incoming = {k: v for k, v in arrays.items() if k in expected} if shared is not None else arrays
        check_compatible(expected, incoming, what=f"site {self.name}: model '{role}'")
        with torch.no_grad():
            for k, v in incoming.items():
                own[k].copy_(v)
            source = self.models.get(bn_from) if bn_from is not None and bn_from != role else None
            if shared is not None and source is not None:
                theirs = source.state_dict()
                for k in set(own) - shared:
                    if k in theirs and theirs[k].shape == own[k].shape:
                        own[k].copy_(theirs[k])
        return model

    def arrays(self, role: str) -> Arrays:
        """Detached copies of the role's model weights that are shared with the server."""
        model = self.models[role]
        shared = self._shared_names(model)
        return {k: v.detach().clone() for k, v in model.state_dict().items() if shared is None or k in shared}

    def optimizer(
        self, role: str, reset: bool = False, params: list[torch.Tensor] | None = None, lr: float | None = None
    ) -> torch.optim.Optimizer:
        """The role's optimizer, created on first use (Adam by default) and kept across rounds unless ``reset``."""
        opt = self.optimizers.get(role)
        if opt is None or reset:
            t = self.cfg.train
            ps = params if params is not None else list(self.model(role).parameters())
            if t.optimizer == "adam":
                opt = torch.optim.Adam(ps, lr=lr or t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
            else:
                opt = torch.optim.SGD(
                    ps, lr=lr or t.lr, momentum=t.momentum, weight_decay=t.weight_decay, nesterov=t.nesterov
                )
            self.optimizers[role] = opt
        return opt

    # ------------------------------------------------------------------- data
    def split_data(self, split: str) -> Dataset | None:
        """A split as the training loop reads it: on a CUDA run, in-memory tensors are moved to the
        device once (``train.data = "device"``, or ``"auto"`` when they fit in half the free GPU
        memory) or kept on the host and copied per batch from pinned memory (``"stream"``).  On the
        CPU "device" wraps the same tensors (nothing is copied)."""
        ds = self.data.split(split)
        if ds is None:
            return ds
        key = split_name(split)
        if key not in self._placed:
            pair = (
                (ds.images, ds.labels)
                if hasattr(ds, "images") and hasattr(ds, "labels")
                else getattr(ds, "tensors", None)
            )
            if pair is None or len(pair) != 2:
                self._placed[key] = ds  # a generic dataset: each batch is copied to the device as it is used
            else:
                mode = self.cfg.train.data
                if mode == "auto":
                    mode = (
                        "device"
                        if fits_on_device(sum(t.numel() * t.element_size() for t in pair), self.device)
                        else "stream"
                    )
                # "stream": the host tensors; each batch is pinned and copied without blocking
                self._placed[key] = (
                    _Placed(pair[0].to(self.device), pair[1].to(self.device)) if mode == "device" else ds
                )
        return self._placed[key]

    def _to_device(self, t: torch.Tensor, cast: bool) -> torch.Tensor:
        """A batch tensor on the run's device (through pinned memory, non-blocking, when it comes from the host)."""
        if t.device.type == "cpu" and self.device.type == "cuda":
            t = t.pin_memory().to(self.device, non_blocking=True)
        elif t.device != self.device:
            t = t.to(self.device)
        return t.to(self.dtype) if cast else t

    def steps_per_round(self, split: str = "train") -> int:
        """Local optimizer steps in one round: ``local_steps``, or ``local_epochs`` × batches per epoch."""
        return steps_per_round(self.cfg.train, dataset_len(self.data.split(split)))

    def batches(
        self,
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
        ds = self.split_data(split)
        n = dataset_len(ds)
        if n == 0:
            raise PayloadError(f"site {self.name}: the {split} split is empty; add cases to its datalist")
        bs = batch_size or self.cfg.train.batch_size
        steps = self.steps_per_round(split) if steps is None else steps
        tf = self.workload.train_transform
        g_tf = generator(self.cfg.seed, self.index, rnd, stream, "transform") if tf is not None else None
        cases_aware = getattr(tf, "reads_cases", False)
        lazy = isinstance(ds, CachedVolumes) and cases_aware
        # padded volumes: each case's own shape, so that patches stay within it (the workload's patch crop)
        extents = getattr(self.data.split(split), "extents", None) if cases_aware and not lazy else None
        if self.cfg.privacy.dp == "sample":  # Poisson batches from the site's DP randomness (fedseg.site.dp)
            for idx in draw_batches(self.dp, rnd, stream, split, steps, n, bs):
                empty = idx.numel() == 0  # a batch of no case: one case's shapes, cut to zero rows
                take = torch.zeros(1, dtype=torch.int64) if empty else idx
                placed = take.to(self.device) if isinstance(ds, _Placed) else take
                x, y = self._batch_of(ds, placed, take, tf, g_tf, lazy, extents)
                yield (x[:0], y[:0]) if empty else (x, y)
            return
        done, epoch = 0, 0
        while done < steps:
            order = torch.randperm(
                n, generator=generator(self.cfg.seed, self.index, rnd, stream, epoch)
            )  # drawn on the CPU on every device
            perm = order.to(self.device) if isinstance(ds, _Placed) else order  # one copy per pass
            for start in range(0, n, bs):
                if done >= steps:
                    break
                yield self._batch_of(ds, perm[start : start + bs], order[start : start + bs], tf, g_tf, lazy, extents)
                done += 1
            epoch += 1

    def _batch_of(
        self, ds: Dataset, idx: torch.Tensor, order: torch.Tensor, tf: Any, g_tf: Any, lazy: bool, extents: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Training cases ``idx`` (on the dataset's device; ``order``: the same on the CPU) as a batch on the
        run's device, through the workload's transform."""
        if lazy:  # volumes in the site's cache: the transform reads only its patches
            cases = ds.batch(idx)
            cases.place = self._to_device
            return tf(cases, cases, g_tf)
        x, y = batch_of(ds, idx)
        x = self._to_device(x, cast=True)
        y = self._to_device(y, cast=y.is_floating_point())
        if extents is not None:
            return tf(x, y, g_tf, [extents[i] for i in order.tolist()])
        if tf is not None:
            return tf(x, y, g_tf)
        return x, y

    def fit(
        self,
        role: str,
        rnd: int,
        stream: str = "train",
        optimizer: torch.optim.Optimizer | None = None,
        extra_loss: Callable[[nn.Module], torch.Tensor] | None = None,
        after_backward: Callable[[nn.Module], None] | None = None,
        steps: int | None = None,
    ) -> dict[str, float]:
        """Train the role's model for one round of local work; returns ``{"loss": mean, "steps": n}``.

        ``extra_loss(model)`` is added to the workload loss (FedProx's proximal term);
        ``after_backward(model)`` may edit gradients before the step (SCAFFOLD's correction).

        The forward pass runs under ``train.precision``'s autocast (the proximal term outside
        it, in the weights' dtype); fp16 scales the loss (:attr:`scalers`, one per role, kept
        across rounds).  The loss is summed on the device and read once at the end of the
        round, so no step waits for the host.

        The call is delegated to :attr:`executor`: by default computed here (:meth:`fit_here`); in a
        vectorized simulation (``simulation.vectorize``) trained together with the other sites' calls.
        With ``privacy.dp = "sample"`` every step takes DP-SGD's privatized gradient, here
        (:meth:`fedseg.site.dp.SiteDP.fit`).
        """
        if self.cfg.train.lr_schedule == "poly":
            poly_lr(optimizer or self.optimizer(role), rnd, self.cfg.rounds)
        if self.cfg.privacy.dp == "sample":
            return self.dp.fit(role, rnd, stream, optimizer, extra_loss, after_backward, steps)
        return self.executor.fit(self, role, rnd, stream, optimizer, extra_loss, after_backward, steps)

    def fit_here(
        self,
        role: str,
        rnd: int,
        stream: str = "train",
        optimizer: torch.optim.Optimizer | None = None,
        extra_loss: Callable[[nn.Module], torch.Tensor] | None = None,
        after_backward: Callable[[nn.Module], None] | None = None,
        steps: int | None = None,
    ) -> dict[str, float]:
        """:meth:`fit` computed at this site, in the calling thread."""
        model = self.model(role)
        opt = optimizer or self.optimizer(role)
        scaler = self.scaler(role)
        if scaler is not None and not isinstance(opt, torch.optim.Optimizer):
            raise ConfigError(
                f"train.precision = 'fp16' needs a plain torch optimizer, but {self.algorithm.name!r} steps "
                f"with {type(opt).__name__}; use --set train.precision=bf16 (no loss scaling needed)"
            )
        model.train()
        sums = LossSums(self.device)
        for x, y in self.batches(rnd, stream, steps):
            opt.zero_grad(set_to_none=True)
            with self.autocast():
                loss = self.workload.loss(model(x), y)
            if extra_loss is not None:
                loss = loss + extra_loss(model)
            self.step(role, opt, loss, model, after_backward)
            sums.add("loss", loss)
        means = sums.means()
        return {"loss": means.get("loss", 0.0), "steps": sums.count("loss")}

    def gradient(
        self,
        role: str,
        x: torch.Tensor,
        target: Any,
        loss: Callable[[torch.Tensor, Any], torch.Tensor] | None = None,
        at: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The gradient of ``loss(model(x), target)`` (default: the workload loss) at the role's current
        weights — or at the weights ``at`` (every parameter's name → tensor; the model's buffers), e.g.
        Per-FedAvg's adapted w̃ — in training mode, without a step; returns ``({name: gradient}, loss)``
        (parameters the loss does not reach are left out; the loss detached, not read).  The forward
        pass and the loss run under ``train.precision``'s autocast.  ``target`` is a tensor or a
        tuple/list of tensors (anything ``loss`` needs besides the output, e.g. labels computed from
        frozen models).

        Lockstep gradient averaging (:func:`fedseg.algorithms.fga.gradient_step`) calls this once per
        step.  The call is delegated to :attr:`executor`: by default computed here (:meth:`gradient_here`);
        in a vectorized simulation together with the other sites' gradients, in one vmapped computation.
        With ``privacy.dp = "sample"`` it is DP-SGD's privatized gradient, computed here
        (:meth:`fedseg.site.dp.SiteDP.gradient`).
        """
        if self.cfg.privacy.dp == "sample":
            return self.dp.gradient(role, x, target, loss, at)
        return self.executor.gradient(self, role, x, target, loss, at)

    def gradient_here(
        self,
        role: str,
        x: torch.Tensor,
        target: Any,
        loss: Callable[[torch.Tensor, Any], torch.Tensor] | None = None,
        at: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """:meth:`gradient` computed at this site, in the calling thread."""
        model = self.model(role)
        model.train()
        if at is not None:  # leaves of their own: the model's parameters and .grad are not touched
            p = {k: t.detach().requires_grad_(True) for k, t in at.items()}
            with self.autocast():
                value = (self.workload.loss if loss is None else loss)(functional_call(model, p, (x,)), target)
            gs = torch.autograd.grad(value, list(p.values()), allow_unused=True)
            return {k: g for k, g in zip(p, gs) if g is not None}, value.detach()
        model.zero_grad(set_to_none=True)
        with self.autocast():
            value = (self.workload.loss if loss is None else loss)(model(x), target)
        value.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        return grads, value.detach()

    def step_with_gradient(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, grad: Mapping[str, torch.Tensor]
    ) -> None:
        """One ``optimizer`` step of ``model`` (one of this site's) with ``grad`` (parameter name → tensor; a
        parameter it does not name gets no gradient) as its gradient.  Delegated to :attr:`executor`: by
        default taken here (:meth:`step_with_gradient_here`); in a vectorized simulation together with the
        other sites' steps."""
        self.executor.step_with_gradient(self, model, optimizer, grad)

    def step_with_gradient_here(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, grad: Mapping[str, torch.Tensor]
    ) -> None:
        """:meth:`step_with_gradient` taken at this site (:func:`step_with_gradient`)."""
        step_with_gradient(model, optimizer, grad)

    def autocast(self):
        """``train.precision``'s autocast on the site's device (a no-op context for fp32): the
        forward pass of every local loop runs under it."""
        return autocast(self.device, self.precision)

    def step(
        self,
        role: str,
        opt: torch.optim.Optimizer,
        loss: torch.Tensor,
        model: nn.Module | None = None,
        after_backward: Callable[[nn.Module], None] | None = None,
    ) -> None:
        """``loss.backward()`` and one step of ``opt``; under fp16 through the role's gradient
        scaler (scaled backward, unscaled gradients for ``after_backward(model)``, a step skipped
        and the scale backed off when a gradient overflowed).  fp32 and bf16: the plain step."""
        scaler = self.scaler(role)
        if scaler is None:
            loss.backward()
            if after_backward is not None:
                after_backward(model)
            opt.step()
            return
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        if after_backward is not None:
            after_backward(model)
        scaler.step(opt)
        scaler.update()

    def scaler(self, role: str) -> torch.amp.GradScaler | None:
        """The role's fp16 gradient scaler (None unless ``train.precision = "fp16"``)."""
        if role not in self.scalers:
            sc = grad_scaler(self.device, self.precision)
            if sc is None:
                return None
            self.scalers[role] = sc
        return self.scalers[role]

    # ------------------------------------------------------------- evaluation
    def eval_batches(self, split: str, cast_labels: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """A split's cases in dataset order, ``eval.batch_size`` at a time, on the run's device: images in
        the run's dtype, labels as stored (cast too with ``cast_labels``, when they are floating point).
        Volumes whose dataset records ``extents``: each case cut to its own extent (padded up to
        ``model.roi_size`` where smaller), consecutive cases of one extent batched (:mod:`fedseg.site.extent`)."""
        for _, _, x, y in self._eval_groups(split, cast_labels):
            yield x, y

    def _eval_groups(self, split: str, cast_labels: bool = False) -> Iterator[extent.EvalGroup]:
        """:meth:`eval_batches` with each batch's first case index and extent (None: as stored)."""
        ds = self.split_data(split)
        extents = getattr(self.data.split(split), "extents", None)
        take = batch_of
        if isinstance(ds, CachedVolumes) and extents is not None:  # read each case's extent only

            def take(d: CachedVolumes, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                return d.read(idx, d.extents[int(idx[0])])  # a group's cases share one extent

        groups = extent.eval_groups(ds, extents, self.cfg.eval.batch_size, take, self.cfg.model.roi_size)
        for first, ext, x, y in groups:
            yield (
                first,
                ext,
                self._to_device(x, cast=True),
                self._to_device(y, cast=cast_labels and y.is_floating_point()),
            )

    def score(self, predict: Callable[[torch.Tensor], torch.Tensor], split: str) -> torch.Tensor:
        """Per-case metric (N, C) of ``predict`` on a split, in dataset order."""
        return self.score_cases(predict, split)[0]

    @torch.no_grad()
    def score_cases(
        self, predict: Callable[[torch.Tensor], torch.Tensor], split: str, test_metrics: bool = False
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-case metric (N, C) of ``predict`` on a split, in dataset order, and with ``test_metrics`` the
        workload's test metrics (``{name: (N, C)}``, e.g. HD95 in mm) computed on the same predictions.

        Volumes are scored in each scan's own grid (the prediction resampled back first), with that grid's
        voxel spacing; other data with unit spacing.  A volume is predicted over its own extent
        (:meth:`eval_batches`) and the prediction, cut back to that extent, resampled from there."""
        out = []
        extra: dict[str, list[torch.Tensor]] = {k: [] for k in (self.workload.test_metrics if test_metrics else {})}
        ds = self.data.split(split)
        restore = getattr(ds, "original_grid", None) if getattr(ds, "originals", None) is not None else None
        for first, ext, x, y in self._eval_groups(split):
            pred = prediction.logits(self, predict, x)
            if restore is None:
                if ext is not None:  # a volume split kept in the plan's grid: scored over the extents
                    pred, y = extent.crop_to_extent(pred, ext), extent.crop_to_extent(y, ext)
                out.append(self.workload.metric(pred, y).double())
                for k in extra:
                    extra[k].append(self.workload.test_metrics[k](pred, y, None).double())
            else:
                for j in range(pred.shape[0]):
                    pj = pred[j] if ext is None else extent.crop_to_extent(pred[j], ext)
                    # scored in the region of the scan's grid that either mask can reach (on the device)
                    p, t = restore(first + j, pj.float(), threshold=self.cfg.eval.threshold)
                    out.append(self.workload.metric(p[None], t[None]).double())
                    for k in extra:
                        grid = ds.originals[first + j]
                        m = self.workload.test_metrics[k]
                        fov = {"field_of_view": grid.shape} if getattr(m, "takes_field_of_view", False) else {}
                        extra[k].append(m(p[None], t[None], grid.spacing, **fov).double())
        out = [o.cpu() for o in out]  # one transfer per split, after every batch is queued
        width = len(self.workload.metric_names)
        scores = torch.cat(out) if out else torch.zeros(0, width, dtype=torch.float64)
        return scores, {
            k: torch.cat([v.cpu() for v in vs]) if vs else torch.zeros(0, width, dtype=torch.float64)
            for k, vs in extra.items()
        }

    def model_predictor(
        self, arrays: Arrays, role: str = "eval", bn_from: str | None = None
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """A predictor that runs the workload model with ``arrays`` (the default ``"model"`` predictor).

        ``bn_from``: the role whose batch-norm running statistics it uses under
        ``train.bn_policy = "local"`` (default: the site's first trained workload model,
        e.g. its ``global`` model).
        """
        model = self.load(role, arrays, bn_from=bn_from or self._template_role)
        model.eval()
        return lambda x: self.workload.predict(model, x)

    def _evaluate(self, task: Task) -> Reply:
        split = task.config["split"]
        results = {}
        extras: dict[str, dict[str, list[list[float]]]] = {}
        for cand in task.config["candidates"]:
            kind = cand.get("predictor", "model")
            predict = prediction.predictor(
                self, cand["name"], kind, strip_prefix(cand["name"], task.arrays), cand.get("config", {})
            )
            scores, extra = self.score_cases(predict, split, test_metrics=split == "testing")
            results[cand["name"]] = scores.tolist()
            for k, v in extra.items():
                extras.setdefault(k, {})[cand["name"]] = v.tolist()
        metrics: dict[str, Any] = {"per_case": results}
        if extras:  # e.g. {"hd95": {candidate: per-case (N, C)}}: the test split's further metrics
            metrics["test_metrics"] = extras
        return Reply(metrics=metrics, num_samples=dataset_len(self.data.split(split)))

    # ------------------------------------------------------------ persistence
    def state_arrays(self, copy: bool = True) -> tuple[Arrays, dict[str, Any]]:
        """Everything the site must remember, as flat host arrays + JSON metadata (device-independent:
        a state saved on a GPU loads on the CPU and back).  ``copy=False`` returns the live tensors
        (detached, on the run's device) for a caller that copies them at once (the checkpoint writer)."""
        take = (lambda v: v.detach().to("cpu", copy=True)) if copy else (lambda v: v.detach())
        arrays: Arrays = {}
        meta: dict[str, Any] = {
            "site": self.name,
            "models": sorted(self.models),
            "optimizers": {},
            "template_role": self._template_role,
        }
        if self.scalers:
            meta["scalers"] = {role: sc.state_dict() for role, sc in self.scalers.items()}
        for role, m in self.models.items():
            for k, v in m.state_dict().items():
                arrays[f"model/{role}/{k}"] = take(v)
        for role, opt in self.optimizers.items():
            sd = opt.state_dict()
            meta["optimizers"][role] = {"param_groups": sd["param_groups"], "type": type(opt).__name__}
            for idx, st in sd["state"].items():
                for key, v in st.items():
                    t = v if torch.is_tensor(v) else torch.tensor(v)
                    arrays[f"optim/{role}/{idx}/{key}"] = take(t)
        for k, v in self.store.items():
            arrays[f"store/{k}"] = take(v)
        return arrays, meta

    def load_state_arrays(self, arrays: Arrays, meta: dict[str, Any]) -> None:
        """Restore :meth:`state_arrays` output.  Models must be creatable by the workload or already exist."""
        template = meta.get("template_role")
        roles = sorted(meta["models"], key=lambda r: r != template)  # the template first, as when it was built
        for role in roles:
            sd = strip_prefix(f"model/{role}", arrays)
            if role not in self.models:
                factory = self.algorithm.model_factory(self, role)
                self.model(role, factory)
            self.models[role].load_state_dict(sd)
        for role, info in meta["optimizers"].items():
            opt = self.optimizer(role, reset=True, params=self.algorithm.optimizer_params(self, role))
            state: dict[int, dict[str, torch.Tensor]] = {}
            for k, v in strip_prefix(f"optim/{role}", arrays).items():
                idx, key = k.split("/", 1)
                state.setdefault(int(idx), {})[key] = v
            opt.load_state_dict(
                {"state": state, "param_groups": info["param_groups"]}
            )  # moves moments to the params' device
        for role, sd in meta.get("scalers", {}).items():
            sc = self.scaler(role)
            if sc is not None:
                sc.load_state_dict(sd)
        self.store = to_device(strip_prefix("store", arrays), self.device)
