"""Site runtime: one institution's data, models, optimizers and persistent state.

A :class:`Site` answers tasks (``site.handle(task) -> reply``).  :meth:`Site.asks` dispatches the task to
the site half of the run's algorithm (``algorithm.site_handlers()``), to the built-in ``"evaluate"`` task
(:mod:`fedseg.site.scoring`) or to secure aggregation's steps (:mod:`fedseg.site.secure`, which also masks a
reply whose task asks for it); a handler asks for its local training as values (:mod:`fedseg.site.calls`),
which the site's executor — or a vectorized simulation's, for all sites of an ask — answers.  The site owns
its models (``site.model(role)``, batch-norm policy), optimizers and fp16 scalers; its batches come from
:mod:`fedseg.site.batches`, its saved state from :mod:`fedseg.site.state` (flat host arrays + JSON, written by
:mod:`fedseg.seams.checkpoint`, so a restarted site resumes exactly).  The site does no file I/O.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, TypeVar

import torch
from torch import nn
from torch.utils.data import Dataset

from fedseg.foundation.arrays import Arrays, check_compatible
from fedseg.foundation.config import RunConfig
from fedseg.foundation.device import (
    DTYPES,
    autocast,
    configure_determinism,
    grad_scaler,
    resolve_device,
)
from fedseg.foundation.errors import PayloadError
from fedseg.foundation.messages import Reply, Task
from fedseg.privacy.identity import Identity
from fedseg.site import scoring, secure, state
from fedseg.site.batches import SiteData, batch_of, dataset_len, placed_split, steps_per_round, training_batches
from fedseg.site.calls import ApplyCall, Asks, Executor, FitCall, GradientCall, LocalExecutor, LossSums, as_asks, drive
from fedseg.site.dp import DPExecutor, SiteDP
from fedseg.site.workload import Workload


def poly_lr(opt: Any, rnd: int, rounds: int, exponent: float = 0.9) -> None:
    """nnU-Net's poly schedule for round ``rnd`` (1-based) of ``rounds``: every parameter group's learning
    rate becomes its first one (kept as ``initial_lr``, as torch's schedulers keep it) times
    ``(1 − (rnd − 1) / rounds)^exponent``.  A wrapper exposing its optimizer as ``opt`` (SCAFFOLD's corrected
    step) schedules that optimizer; one without parameter groups is left alone."""
    groups = getattr(opt, "param_groups", None) or getattr(getattr(opt, "opt", None), "param_groups", None)
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

    @property
    def name(self) -> str: ...  # read-only: the algorithms' name is a class attribute

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
        self.dtype = DTYPES[cfg.train.dtype]
        self.device = resolve_device(cfg.device)
        configure_determinism(self.device, cfg.deterministic)
        self.precision = cfg.train.precision
        self.scalers: dict[str, torch.amp.GradScaler] = {}
        self.placed: dict[str, Dataset | None] = {}
        """Each split as the training loop reads it, once placed (:func:`fedseg.site.batches.placed_split`)."""
        self.models: dict[str, nn.Module] = {}
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.store: Arrays = {}
        self._workload_models: dict[str, nn.Module] = {}
        self.template_role: str | None = None
        self._handlers = algorithm.site_handlers()
        self.executor: Executor = executor or (DPExecutor() if cfg.privacy.dp == "sample" else LocalExecutor())
        """Who answers this site's requests in :meth:`handle` and :meth:`now` (a simulation that vectorizes its
        sites drives their handlers with its own executor instead: :meth:`asks`)."""
        self.dp = SiteDP(self)
        """The site's DP-SGD steps and ε (``privacy.dp = "sample"``; :mod:`fedseg.site.dp`)."""
        self.secagg_record = secure.Record()
        """What this site masked per (task kind, round, step) (:class:`fedseg.site.secure.Record`): not part of
        its saved state, so restoring a checkpoint does not rewind it; a deployed site keeps it in a file."""
        self.salt: int | None = None
        """A deployed site's own random salt for this run (from the operating system, kept in its work folder,
        mixed with the run id): mixed into its non-DP batch order and augmentation
        (:func:`fedseg.site.batches.training_batches`) so that two runs never give bitwise-equal updates.  None
        (simulation; a site whose policy has ``reproducible = true``): the run seed alone drives them."""
        self.epoch = ""
        """What the site's secure-aggregation record files this run's replies under (a deployed site's run id;
        empty in simulation): :class:`fedseg.site.secure.Record`."""
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
            return scoring.evaluate(self, task)
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
                self.template_role = role
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
                opt = torch.optim.Adam(ps, lr=lr or t.lr, betas=(t.betas[0], t.betas[1]), weight_decay=t.weight_decay)
            else:
                opt = torch.optim.SGD(
                    ps, lr=lr or t.lr, momentum=t.momentum, weight_decay=t.weight_decay, nesterov=t.nesterov
                )
            self.optimizers[role] = opt
        return opt

    # ------------------------------------------------------------------- data
    def split_data(self, split: str) -> Dataset | None:
        """A split as the training loop reads it (:func:`fedseg.site.batches.placed_split`)."""
        return placed_split(self, split)

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
        """Training batches of one round (:func:`fedseg.site.batches.training_batches`)."""
        return training_batches(self, rnd, stream, steps, split, batch_size)

    # ------------------------------------------------------------- local work
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
        ``after_backward(model)`` may edit gradients before the step (SCAFFOLD's correction).  Under
        ``train.lr_schedule = "poly"`` the optimizer's learning rate is set for the round first (:func:`poly_lr`)."""
        if self.cfg.train.lr_schedule == "poly":
            poly_lr(optimizer or self.optimizer(role), rnd, self.cfg.rounds)
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
            if after_backward is not None and model is not None:
                after_backward(model)
            opt.step()
            return
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        if after_backward is not None and model is not None:
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
        for _, _, x, y in scoring.eval_groups(self, split, cast_labels):
            yield x, y

    def score(self, predict: Callable[[torch.Tensor], torch.Tensor], split: str) -> torch.Tensor:
        """Per-case metric (N, C) of ``predict`` on a split, in dataset order."""
        return scoring.score_cases(self, predict, split)[0]

    def score_cases(
        self, predict: Callable[[torch.Tensor], torch.Tensor], split: str, test_metrics: bool = False
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-case metric (N, C) of ``predict`` on a split and with ``test_metrics`` the workload's test metrics
        (:func:`fedseg.site.scoring.score_cases`)."""
        return scoring.score_cases(self, predict, split, test_metrics)

    def model_predictor(
        self, arrays: Arrays, role: str = "eval", bn_from: str | None = None
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """A predictor that runs the workload model with ``arrays`` (the default ``"model"`` predictor).

        ``bn_from``: the role whose batch-norm running statistics it uses under
        ``train.bn_policy = "local"`` (default: the site's first trained workload model,
        e.g. its ``global`` model).
        """
        model = self.load(role, arrays, bn_from=bn_from or self.template_role)
        model.eval()
        return lambda x: self.workload.predict(model, x)

    # ------------------------------------------------------------ persistence
    def state_arrays(self, copy: bool = True) -> tuple[Arrays, dict[str, Any]]:
        """Everything the site must remember, as flat host arrays + JSON metadata
        (:func:`fedseg.site.state.state_arrays`; ``copy=False``: the live tensors, detached)."""
        return state.state_arrays(self, copy)

    def load_state_arrays(self, arrays: Arrays, meta: dict[str, Any]) -> None:
        """Restore :meth:`state_arrays` output (:func:`fedseg.site.state.load_state_arrays`)."""
        state.load_state_arrays(self, arrays, meta)
