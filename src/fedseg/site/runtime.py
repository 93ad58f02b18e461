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
from typing import Any, Protocol, TypeVar

import torch
from torch import nn
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
from fedseg.foundation.errors import PayloadError
from fedseg.foundation.messages import Reply, Task, split_name
from fedseg.foundation.seeding import generator
from fedseg.privacy.identity import Identity
from fedseg.site import extent, secure
from fedseg.site.calls import ApplyCall, Asks, Executor, FitCall, GradientCall, LocalExecutor, LossSums, as_asks, drive
from fedseg.site.dp import DPExecutor, SiteDP, draw_batches
from fedseg.site.workload import Workload


class SiteHalf(Protocol):
    """What a :class:`Site` needs from the run's algorithm: its site half (see
    :class:`fedseg.seams.algorithm.Algorithm`, which implements it).  The site layer does not import
    the algorithms; the algorithms build on the site."""

    name: str

    def site_handlers(self) -> dict[str, Callable[[Site, Task], Reply | Asks[Reply]]]: ...

    def predictors(self) -> dict[str, Callable[[Site, Arrays, dict], Callable[[torch.Tensor], torch.Tensor]]]: ...

    def model_factory(self, site: Site, role: str) -> Callable[[], nn.Module] | None: ...

    def optimizer_params(self, site: Site, role: str) -> list[torch.Tensor]: ...

    def summed(self, task: Task) -> bool: ...


__all__ = [
    "LossSums",
    "Site",
    "SiteData",
    "batch_of",
    "dataset_len",
    "steps_per_round",
]

T = TypeVar("T")

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


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
        Who answers the requests of this site's handlers when it handles a task alone (:meth:`handle`;
        :attr:`executor`): default :class:`~fedseg.site.calls.LocalExecutor`, under ``privacy.dp = "sample"``
        :class:`~fedseg.site.dp.DPExecutor`.
    """

    def __init__(
        self,
        name: str,
        index: int,
        data: SiteData,
        workload: Workload,
        cfg: RunConfig,
        algorithm: SiteHalf,
        executor: Executor | None = None,
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
        self.executor: Executor = executor or (DPExecutor() if cfg.privacy.dp == "sample" else LocalExecutor())
        """Who answers this site's requests in :meth:`handle` and :meth:`now` (a simulation that vectorizes its
        sites drives their handlers with its own executor instead: :meth:`asks`)."""
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
        """Run one task with the site's :attr:`executor` and return the reply."""
        return self.executor.run([self.asks(task)])[0]

    def asks(self, task: Task) -> Asks[Reply]:
        """The handler of one task, as a generator of requests (:mod:`fedseg.site.calls`) that returns the
        reply: the built-in ``"evaluate"`` and ``"privacy"`` tasks, secure aggregation's steps, or the method's
        handler (:meth:`SiteHalf.site_handlers`)."""
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
            secure.check_summed(self, task)
        reply = yield from as_asks(handler(self, task))
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
                opt = torch.optim.SGD(ps, lr=lr or t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
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
    ) -> Asks[dict[str, float]]:
        """Ask for one round of local training of the role's model (``stats = yield from site.fit(...)`` in a
        handler): ``{"loss": mean, "steps": n}``, computed by the executor that drives the handler
        (:func:`fedseg.site.calls.local_fit` at the site; stacked with other sites' in a vectorized
        simulation; DP-SGD's steps under ``privacy.dp = "sample"``).

        ``extra_loss(model)`` is added to the workload loss (FedProx's proximal term);
        ``after_backward(model)`` may edit gradients before the step (SCAFFOLD's correction)."""
        return (yield FitCall(self, role, rnd, stream, optimizer, extra_loss, after_backward, steps))

    def gradient(
        self,
        role: str,
        x: torch.Tensor,
        target: Any,
        loss: Callable[[torch.Tensor, Any], torch.Tensor] | None = None,
        at: Mapping[str, torch.Tensor] | None = None,
    ) -> Asks[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        """Ask for the gradient of ``loss(model(x), target)`` (default: the workload loss) at the role's current
        weights — or at the weights ``at`` (every parameter's name → tensor), e.g. Per-FedAvg's adapted w̃ — in
        training mode, without a step: ``grads, loss = yield from site.gradient(...)`` gives
        ``({name: gradient}, loss)`` (parameters the loss does not reach are left out; the loss detached, not
        read).  The forward pass and the loss run under ``train.precision``'s autocast.  ``target`` is a tensor
        or a tuple/list of tensors.  Under ``privacy.dp = "sample"`` it is DP-SGD's privatized gradient
        (:class:`fedseg.site.dp.DPExecutor`)."""
        return (yield GradientCall(self, role, x, target, loss, at))

    def step_with_gradient(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, grad: Mapping[str, torch.Tensor]
    ) -> Asks[None]:
        """Ask for one ``optimizer`` step of ``model`` (one of this site's) with ``grad`` (parameter name →
        tensor; a parameter it does not name gets no gradient) as its gradient
        (``yield from site.step_with_gradient(...)``)."""
        yield ApplyCall(self, model, optimizer, grad)

    def now(self, asks: Asks[T]) -> T:
        """Run ``asks`` (e.g. ``site.fit(role, rnd)``) to its end with the site's own executor
        (:attr:`executor`) and return its result: a call outside a handler."""
        return drive(asks, self.executor.answer)

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
            with self.autocast():
                pred = predict(x)
            if restore is None:
                if ext is not None:  # a volume split kept in the plan's grid: scored over the extents
                    pred, y = extent.crop_to_extent(pred, ext), extent.crop_to_extent(y, ext)
                out.append(self.workload.metric(pred, y).double())
                for k in extra:
                    extra[k].append(self.workload.test_metrics[k](pred, y, None).double())
            else:
                for j in range(pred.shape[0]):
                    pj = pred[j] if ext is None else extent.crop_to_extent(pred[j], ext)
                    p, t = restore(first + j, pj.float())
                    out.append(self.workload.metric(p[None], t[None]).double())
                    for k in extra:
                        spacing = ds.originals[first + j].spacing
                        extra[k].append(self.workload.test_metrics[k](p[None], t[None], spacing).double())
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
        predictors = self.algorithm.predictors()
        for cand in task.config["candidates"]:
            kind = cand.get("predictor", "model")
            make = predictors.get(kind)
            if make is None:
                raise PayloadError(f"site {self.name}: unknown predictor {kind!r} for candidate {cand['name']!r}")
            predict = make(self, strip_prefix(cand["name"], task.arrays), cand.get("config", {}))
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
