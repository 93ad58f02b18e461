"""Site runtime: one institution's data, models, optimizers and persistent state.

A :class:`Site` answers tasks (``site.handle(task) -> reply``).  :meth:`Site.asks` dispatches the task to
the site half of the run's algorithm (``algorithm.site_handlers()``), to the built-in ``"evaluate"`` task
(:mod:`fedseg.site.scoring`) or to secure aggregation's steps (:mod:`fedseg.site.secure`, which also masks a
reply whose task asks for it); a handler asks for its local training as values (:mod:`fedseg.site.calls`),
which the site's executor — or a vectorized simulation's, for all sites of an ask — answers.  The site's
models, optimizers and fp16 scalers by role are :mod:`fedseg.site.models`' (``site.roles``); its batches come from
:mod:`fedseg.site.batches`, its saved state from :mod:`fedseg.site.state` (flat host arrays + JSON, written by
:mod:`fedseg.seams.checkpoint`, so a restarted site resumes exactly).  The site does no file I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar

import torch
from torch import nn
from torch.utils.data import Dataset

from fedseg.foundation.arrays import Arrays
from fedseg.foundation.config import RunConfig
from fedseg.foundation.device import configure_determinism, resolve_device
from fedseg.foundation.errors import PayloadError
from fedseg.foundation.messages import Reply, Task
from fedseg.privacy.identity import Identity
from fedseg.site import scoring, secure, state
from fedseg.site.batches import RoundBatches, Sampler, SeededOrder, SiteData, Splits, Streams, dataset_len
from fedseg.site.calls import (
    ApplyCall,
    Asks,
    Executor,
    FitCall,
    Flag,
    GradientCall,
    Hook,
    LocalExecutor,
    Loss,
    as_asks,
    drive,
)
from fedseg.site.dp import SiteDP
from fedseg.site.dpsgd import DPExecutor, PoissonSampler
from fedseg.site.models import SiteModels
from fedseg.site.workload import Workload


def poly_lr(opt: torch.optim.Optimizer, rnd: int, rounds: int, exponent: float = 0.9) -> None:
    """nnU-Net's poly schedule for round ``rnd`` (1-based) of ``rounds``: every parameter group's learning
    rate becomes its first one (kept as ``initial_lr``, as torch's schedulers keep it) times
    ``(1 − (rnd − 1) / rounds)^exponent``."""
    factor = (1.0 - (rnd - 1) / rounds) ** exponent
    for g in opt.param_groups:
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


__all__ = ["Site", "SiteHalf", "poly_lr"]

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
        :class:`~fedseg.site.dpsgd.DPExecutor`.
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
        self.workload = workload
        self.cfg = cfg
        self.algorithm = algorithm
        self.scratch: dict[str, Any] = {}
        """Working state of the site half that is *not* saved with the site (caches, cursors rebuilt on
        demand, e.g. FGA's batch cursor); what must survive a restart belongs in :attr:`store`."""
        self.device = resolve_device(cfg.device)
        configure_determinism(self.device, cfg.deterministic)
        self.roles = SiteModels(name, workload, cfg.train, self.device)
        """Its models, optimizers and fp16 scalers by role (:class:`fedseg.site.models.SiteModels`)."""
        self.dtype = self.roles.dtype
        self.splits = Splits(data, self.device, self.dtype, cfg.train.data)
        """Its splits, each placed once where the training loop reads it (:class:`fedseg.site.batches.Splits`)."""
        self.store: Arrays = {}
        self._handlers = algorithm.site_handlers()
        self.dp = SiteDP(self)
        """The site's DP-SGD steps and ε (``privacy.dp = "sample"``; :mod:`fedseg.site.dp`)."""
        self.streams = Streams(cfg.seed, index, self.dp.random if cfg.privacy.dp != "off" else None)
        """The generators of its training streams (:class:`fedseg.site.batches.Streams`)."""
        sample = cfg.privacy.dp == "sample"
        self.sampler: Sampler = PoissonSampler(self.dp) if sample else SeededOrder(self.streams)
        """Which cases make each training batch: seeded permutations, or DP-SGD's Poisson samples."""
        self.executor: Executor = executor or (DPExecutor(self.dp) if sample else LocalExecutor())
        """Who answers this site's requests in :meth:`handle` and :meth:`now` (a simulation that vectorizes its
        sites drives their handlers with its own executor instead, and hands it what it does not stack:
        :meth:`asks`)."""
        self.progress_said = Flag()
        """Whether its first round of local training has said what a step costs
        (:class:`fedseg.site.calls.RoundProgress`)."""
        self.secagg_record = secure.Record()
        """What this site masked per (task kind, round, step) (:class:`fedseg.site.secure.Record`): not part of
        its saved state, so restoring a checkpoint does not rewind it; a deployed site keeps it in a file."""
        self.epoch = ""
        """What the site's secure-aggregation record files this run's replies under (a deployed site's run id;
        empty in simulation): :class:`fedseg.site.secure.Record`."""
        self.identity: Identity | None = None
        """The site's certificate and private key, which sign its secure-aggregation keys
        (:mod:`fedseg.privacy.identity`); set by a deployed site from its startup kit, None in simulation."""

    @property
    def data(self) -> SiteData:
        """Its splits (:class:`fedseg.site.batches.SiteData`)."""
        return self.splits.data

    @property
    def salt(self) -> int | None:
        """A deployed site's own random salt for this run (from the operating system, kept in its work folder,
        mixed with the run id): mixed into its non-DP batch order and augmentation
        (:class:`fedseg.site.batches.Streams`) so that two runs never give bitwise-equal updates.  None
        (simulation; a site whose policy has ``reproducible = true``): the run seed alone drives them."""
        return self.streams.salt

    @salt.setter
    def salt(self, value: int | None) -> None:
        self.streams.salt = value

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

    @property
    def models(self) -> dict[str, nn.Module]:
        """Its models by role (:attr:`SiteModels.models <fedseg.site.models.SiteModels.models>`)."""
        return self.roles.models

    @property
    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """Its optimizers by role (:attr:`SiteModels.optimizers <fedseg.site.models.SiteModels.optimizers>`)."""
        return self.roles.optimizers

    def model(self, role: str, factory: Callable[[], nn.Module] | None = None) -> nn.Module:
        """:meth:`SiteModels.model <fedseg.site.models.SiteModels.model>`."""
        return self.roles.model(role, factory)

    def load(
        self, role: str, arrays: Arrays, factory: Callable[[], nn.Module] | None = None, bn_from: str | None = None
    ) -> nn.Module:
        """:meth:`SiteModels.load <fedseg.site.models.SiteModels.load>`."""
        return self.roles.load(role, arrays, factory, bn_from)

    def arrays(self, role: str) -> Arrays:
        """:meth:`SiteModels.arrays <fedseg.site.models.SiteModels.arrays>`."""
        return self.roles.arrays(role)

    def optimizer(
        self, role: str, reset: bool = False, params: list[torch.Tensor] | None = None, lr: float | None = None
    ) -> torch.optim.Optimizer:
        """:meth:`SiteModels.optimizer <fedseg.site.models.SiteModels.optimizer>`."""
        return self.roles.optimizer(role, reset, params, lr)

    def autocast(self) -> AbstractContextManager[Any]:
        """:meth:`SiteModels.autocast <fedseg.site.models.SiteModels.autocast>`."""
        return self.roles.autocast()

    # ------------------------------------------------------------------- data
    def split_data(self, split: str) -> Dataset | None:
        """A split as the training loop reads it (:meth:`fedseg.site.batches.Splits.placed`)."""
        return self.splits.placed(split)

    def steps_per_round(self, split: str = "train") -> int:
        """Local optimizer steps in one round: ``local_steps``, or ``local_epochs`` × batches per epoch."""
        return self.splits.steps_per_round(self.cfg.train, split)

    def round_batches(
        self,
        rnd: int,
        stream: str = "train",
        steps: int | None = None,
        split: str = "train",
        batch_size: int | None = None,
    ) -> RoundBatches:
        """The training batches of one round, drawn lazily (:class:`fedseg.site.batches.RoundBatches`): its
        ``steps`` (default :meth:`steps_per_round`) batches of ``batch_size`` (default ``train.batch_size``)
        cases, chosen by the site's :attr:`sampler`."""
        return RoundBatches(
            self.name,
            self.splits,
            self.streams,
            self.sampler,
            self.workload.train_transform,
            rnd,
            stream,
            self.steps_per_round(split) if steps is None else steps,
            batch_size or self.cfg.train.batch_size,
            split,
        )

    def batches(
        self,
        rnd: int,
        stream: str = "train",
        steps: int | None = None,
        split: str = "train",
        batch_size: int | None = None,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Training batches of one round (:meth:`round_batches`), as an iterator."""
        return iter(self.round_batches(rnd, stream, steps, split, batch_size))

    # ------------------------------------------------------------- local work
    def fit(
        self,
        role: str,
        rnd: int,
        stream: str = "train",
        optimizer: torch.optim.Optimizer | None = None,
        extra_loss: Callable[[nn.Module], torch.Tensor] | None = None,
        after_backward: Hook | None = None,
        steps: int | None = None,
        after_step: Hook | None = None,
    ) -> Asks[dict[str, float]]:
        """Ask for one round of local training of the role's model (``stats = yield from site.fit(...)`` in a
        handler): ``{"loss": mean, "steps": n}``, computed by the executor that drives the handler
        (:func:`fedseg.site.calls.local_fit` at the site; stacked with other sites' in a vectorized
        simulation; DP-SGD's steps under ``privacy.dp = "sample"``).  The request is complete
        (:class:`~fedseg.site.calls.FitCall`): the model, the optimizer (default: the role's), the round's batches,
        the loss, the precision and the scaler are worked out here.

        ``extra_loss(model)`` is added to the workload loss (FedProx's proximal term);
        ``after_backward(model)`` may edit gradients before the step (SCAFFOLD's gradient correction);
        ``after_step(model)`` edits the weights after each step (SCAFFOLD's step correction).  Under
        ``train.lr_schedule = "poly"`` the optimizer's learning rate is set for the round first (:func:`poly_lr`)."""
        opt = optimizer or self.optimizer(role)
        if self.cfg.train.lr_schedule == "poly":
            poly_lr(opt, rnd, self.cfg.rounds)
        call = FitCall(
            self.name,
            role,
            rnd,
            self.model(role),
            opt,
            self.round_batches(rnd, stream, steps),
            self.workload.loss,
            self.device,
            self.roles.precision,
            self.autocast,
            self.roles.scaler(role),
            extra_loss,
            after_backward,
            after_step,
            self.progress_said,
        )
        return (yield call)

    def gradient(
        self,
        role: str,
        x: torch.Tensor,
        target: Any,
        loss: Loss | None = None,
        at: Mapping[str, torch.Tensor] | None = None,
    ) -> Asks[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        """Ask for the gradient of ``loss(model(x), target)`` (default: the workload loss) at the role's current
        weights — or at the weights ``at`` (every parameter's name → tensor), e.g. Per-FedAvg's adapted w̃ — in
        training mode, without a step: ``grads, loss = yield from site.gradient(...)`` gives
        ``({name: gradient}, loss)`` (parameters the loss does not reach are left out; the loss detached, not
        read).  The forward pass and the loss run under ``train.precision``'s autocast.  ``target`` is a tensor
        or a tuple/list of tensors.  Under ``privacy.dp = "sample"`` it is DP-SGD's privatized gradient
        (:class:`fedseg.site.dpsgd.DPExecutor`)."""
        model = self.model(role)
        value = self.workload.loss if loss is None else loss
        return (
            yield GradientCall(
                self.name, role, model, x, target, value, self.device, self.roles.precision, self.autocast, at
            )
        )

    def step_with_gradient(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, grad: Mapping[str, torch.Tensor]
    ) -> Asks[None]:
        """Ask for one ``optimizer`` step of ``model`` (one of this site's) with ``grad`` (parameter name →
        tensor; a parameter it does not name gets no gradient) as its gradient
        (``yield from site.step_with_gradient(...)``)."""
        yield ApplyCall(self.name, self.roles.role_of(model), model, optimizer, grad)

    def now(self, asks: Asks[T]) -> T:
        """Run ``asks`` (e.g. ``site.fit(role, rnd)``) to its end with the site's own executor
        (:attr:`executor`) and return its result: a call outside a handler."""
        return drive(asks, self.executor.answer)

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
        model = self.load(role, arrays, bn_from=bn_from or self.roles.template_role)
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
