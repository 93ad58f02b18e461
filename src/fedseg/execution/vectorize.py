"""Vectorized simulation: the local steps of K sites run as one computation (``simulation.vectorize``).

The site halves of the algorithms stay written for one site.  What changes is how the
in-process transport *executes* them: :class:`VectorizedExecutor` runs each site's handler
in its own thread, one thread at a time (a baton passed in site order, so every line of a
handler outside :meth:`Site.fit` runs exactly as it does sequentially, one site after
another).  When a handler calls :meth:`Site.fit`, its thread parks there (the hook in
``Site.fit``); once every site's handler has parked in ``fit`` or returned, the parked calls
that can be stacked are trained together, and each thread goes on with its own result.  A
handler that calls ``fit`` twice (Ditto's global and personal models) meets the others twice.

Trained together means: the K models' parameters are stacked into one flat buffer (parameter j
of all sites one contiguous ``K × shape`` block, :class:`_Layout`) and each site's model
parameters become *views* of its rows for the duration of the call, so anything a handler's
hook does to its model (``extra_loss``, ``after_backward``, an optimizer wrapper's
``after_step``) acts on the stacked weights.  Each local step

1. draws every site's batch from its own seeded stream (:meth:`Site.batches`: the same
   batches as sequentially);
2. runs the workload loss of all sites in one ``torch.func.vmap`` over
   ``torch.func.functional_call`` (sites whose batches differ in shape — the last, smaller
   batch of an epoch — run as separate vmaps over their rows);
3. adds each site's ``extra_loss(model)`` gradient (FedProx's proximal term, Ditto's) and lets
   its ``after_backward`` edit its gradient row (SCAFFOLD's gradient correction);
4. steps a stacked Adam or SGD with per-site step counts and moments, **masked**: a site
   whose round has ended (epoch mode with different n_k) keeps its parameters and optimizer
   state unchanged, exactly.

At the end the rows are copied back into each site's own model and the moments into each
site's own ``torch.optim`` optimizer state, so checkpoints, resume and results are those of a
sequential run (equal to rounding: the arithmetic is the same but not bitwise the same kernels).

Lockstep gradient averaging (FGA, FedSM's ``"fga"`` selector), pFedMe's inner steps and Per-FedAvg's
meta step (at w̃, ``at=``) take batch gradients without a step through :meth:`Site.gradient`; its threads park there the same way, and
:meth:`VectorizedExecutor.gradients_together` computes the parked calls of sites with the same
model and loss as one ``vmap`` of ``loss(functional_call(model, …)(x), target)`` over their stacked
weights (or the weights each call asks at), one ``autograd.grad`` of the summed losses giving each
site's gradient as its row.  What the handler does with it (FGA: reply; pFedMe: its inner update;
Per-FedAvg: its meta step) runs in its thread, site by site.  A lockstep step with the averaged gradient
(:func:`fedseg.algorithms.fga.apply_gradient`) parks as well, for models whose gradients were stacked:
:meth:`VectorizedExecutor.apply_together` takes the Adam steps of all sites as one call of torch's fused
Adam kernel over each site's own tensors, in place (the sites of a lockstep round stay bitwise in sync).

On CUDA (``simulation.cuda_graphs = "on"``, the default) a stacked fit group without per-site hooks keeps its
buffers across rounds (:class:`_Arena`) and its local step is captured once as a CUDA graph and replayed
(:meth:`VectorizedExecutor._graph_step`): a small U-Net's round there is bound by kernel launches, not arithmetic.

A ``fit`` call that cannot be stacked runs sequentially, in its own thread, and the reason is
logged once: fp16 loss scaling, an optimizer other than plain Adam/SGD over exactly the model's
parameters, batch norm with running statistics (its in-place buffer updates do not vectorize),
dropout (it draws from the global random stream), a site whose model differs from the others'
(architecture, dtype, optimizer settings), or a site alone in its group.  A handler that trains
without :meth:`Site.fit` or :meth:`Site.gradient` (its own loop) runs sequentially as well.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, vmap
from torch.optim.optimizer import _get_scalar_dtype

from fedseg.foundation.device import autocast
from fedseg.foundation.messages import Reply, Task
from fedseg.site.runtime import Site, _fit_hook

__all__ = [
    "AUTO_MIN_SITES",
    "ApplyCall",
    "FitCall",
    "GradientCall",
    "VectorizedExecutor",
    "group_size_for",
    "resolve_vectorize",
    "vectorize_reason",
]


AUTO_MIN_SITES = 4
"""``simulation.vectorize = auto`` vectorizes a CUDA run of at least this many sites.  Measured on an H100
(docs/results.md, "Vectorized simulation", GPU): 2 sites gained nothing (FedAvg 1.00×, FedSM 0.87× at
64²), 6 sites 1.4–1.9× at 64²–256²; 3–5 sites were not measured, 4 is between."""


def resolve_vectorize(setting: str, device: torch.device, num_sites: int | None = None) -> bool:
    """``simulation.vectorize``: 'on' / 'off', or 'auto' = on on CUDA with at least :data:`AUTO_MIN_SITES`
    sites (``num_sites`` None: any number), off on the CPU (where sites then run exactly as deployed
    sites do, and the bitwise deployment/resume guarantees hold) and for fewer sites."""
    if setting == "auto":
        return device.type == "cuda" and (num_sites is None or num_sites >= AUTO_MIN_SITES)
    return setting == "on"


@dataclass
class FitCall:
    """The arguments of one site's :meth:`Site.fit` call."""

    site: Site
    role: str
    rnd: int
    stream: str
    optimizer: Any
    extra_loss: Callable[[nn.Module], torch.Tensor] | None
    after_backward: Callable[[nn.Module], None] | None
    steps: int | None


@dataclass
class GradientCall:
    """The arguments of one site's :meth:`Site.gradient` call (a lockstep gradient-averaging step)."""

    site: Site
    role: str
    x: torch.Tensor
    target: Any
    loss: Callable[[torch.Tensor, Any], torch.Tensor] | None
    at: Any = None  # the weights to differentiate at (name → tensor), None: the model's own


@dataclass
class ApplyCall:
    """The arguments of one site's :func:`fedseg.algorithms.fga.apply_gradient` call (validated there):
    a lockstep step with the averaged gradient."""

    site: Site
    model: nn.Module
    optimizer: Any
    grad: Any  # parameter name → gradient


_SEQUENTIAL = object()
"""Result handed to a parked thread: run your ``fit`` yourself, sequentially."""


class _Aborted(BaseException):
    """Raised in a parked site thread when another site's handler failed (the ask is abandoned)."""


class _IntraOpThreads:
    """One intra-op thread in the site threads, all of them in the main thread (which runs the stacked steps).

    torch's CPU kernels parallelize with OpenMP, and every thread that enters a parallel region gets an
    OpenMP team of its own.  With K site threads each holding a team, the process manages more OpenMP
    threads than there are cores, and libgomp then lets the workers of *every* team (the main thread's
    as well) spin only briefly before sleeping, so each parallel region of the stacked step waits for its
    workers to be woken: at torch's default 2 threads on the 2-core development CPU the vectorized rounds
    were slower than sequential ones (docs/results.md, "Vectorized simulation").  The handlers'
    own work between parks is small, so their threads run with one intra-op thread (no team); a fit or
    gradient a site thread computes itself (the sequential fallback) gets the full count back while it runs.

    ``torch.set_num_threads`` sets the calling thread's OpenMP count and the process-wide default that a
    thread takes on its first parallel call; a site thread therefore takes its own value first
    (:func:`torch.get_num_threads`) and then sets 1, and the main thread puts the default back after it.
    """

    def __init__(self) -> None:
        self.full = torch.get_num_threads()  # in the main thread: its count
        self.changed = False

    def site_thread(self) -> None:
        """At the start of a site thread."""
        if self.full > 1:
            torch.get_num_threads()  # this thread's lazy initialization, with the process-wide default
            torch.set_num_threads(1)
            self.changed = True

    def restore_default(self) -> None:
        """In the main thread, after a site thread ran: the process-wide default back to the main thread's."""
        if self.changed:
            torch.set_num_threads(self.full)
            self.changed = False

    @contextlib.contextmanager
    def full_count(self) -> Iterator[None]:
        """``with``: the site thread computes with the full count (its sequential fallback), then one again."""
        if self.full == 1:
            yield
            return
        torch.set_num_threads(self.full)
        try:
            yield
        finally:
            torch.set_num_threads(1)
            self.changed = True


class _Worker:
    """One site's handler in its own thread; it runs only between :meth:`resume` and its next park."""

    def __init__(self, site: Site, task: Task, threads: _IntraOpThreads):
        self.site, self.task, self.threads = site, task, threads
        self._go, self._yielded = threading.Event(), threading.Event()
        self.call: FitCall | GradientCall | ApplyCall | None = None
        self.result: Any = None
        self.reply: Reply | None = None
        self.error: BaseException | None = None
        self.done = self.fitted = self.abort = False
        self.thread = threading.Thread(target=self._main, daemon=True, name=f"fedseg-site-{site.name}")

    def _main(self) -> None:
        self._go.wait()
        self._go.clear()
        try:
            if self.abort:
                raise _Aborted
            self.threads.site_thread()
            _fit_hook.call, _fit_hook.gradient, _fit_hook.apply = self._park, self._park_gradient, self._park_apply
            self.reply = self.site.handle(self.task)
        except _Aborted:
            pass
        except BaseException as e:  # handed to the main thread, re-raised there
            self.error = e
        finally:
            _fit_hook.call = _fit_hook.gradient = _fit_hook.apply = None
            self.done = True
            self._yielded.set()

    def _park(
        self,
        site: Site,
        role: str,
        rnd: int,
        stream: str,
        optimizer: Any,
        extra_loss: Any,
        after_backward: Any,
        steps: int | None,
    ) -> dict[str, float]:
        result = self._wait(FitCall(site, role, rnd, stream, optimizer, extra_loss, after_backward, steps))
        if result is _SEQUENTIAL:
            _fit_hook.call = None
            try:
                with self.threads.full_count():
                    return site.fit(role, rnd, stream, optimizer, extra_loss, after_backward, steps)
            finally:
                _fit_hook.call = self._park
        return result

    def _park_gradient(
        self, site: Site, role: str, x: torch.Tensor, target: Any, loss: Any, at: Any = None
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        result = self._wait(GradientCall(site, role, x, target, loss, at))
        if result is _SEQUENTIAL:
            _fit_hook.gradient = None
            try:
                with self.threads.full_count():
                    return site.gradient(role, x, target, loss, at)
            finally:
                _fit_hook.gradient = self._park_gradient
        return result

    def _park_apply(self, model: nn.Module, optimizer: Any, grad: Any) -> bool:
        """True when the step was taken together with the other sites' (False: take it yourself)."""
        return self._wait(ApplyCall(self.site, model, optimizer, grad)) is not _SEQUENTIAL

    def _wait(self, call: FitCall | GradientCall | ApplyCall) -> Any:
        """Park this thread with ``call`` until the main thread hands it a result (or aborts the ask)."""
        self.fitted = True
        self.call = call
        self._yielded.set()
        self._go.wait()
        self._go.clear()
        self.call = None
        if self.abort:
            raise _Aborted
        result, self.result = self.result, None
        return result

    def resume(self) -> None:
        """Let the thread run until it parks in ``fit`` or its handler returns (called by the main thread)."""
        self._yielded.clear()
        if not self.thread.is_alive() and not self.done:
            self.thread.start()
        self._go.set()
        self._yielded.wait()
        self.threads.restore_default()


class _Structure:
    """What the executor reads of a model, walked once per model object (a site's model keeps its
    architecture and its parameter objects: loads copy into them): its signature (who can be stacked
    together), why it cannot run under vmap, whether it ties tensors, its parameters and buffers."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.signature = _model_signature(model)
        self.reason = vectorize_reason(model)
        self.tied = _tied(model)
        named = list(model.named_parameters())
        self.pnames = [n for n, _ in named]
        self.params = [p for _, p in named]
        self._owners = []  # (name, owning module, attribute): a buffer is read where it lives now
        for name, _ in model.named_buffers():
            path, _, attr = name.rpartition(".")
            self._owners.append((name, model.get_submodule(path), attr))
        self.bnames = [n for n, _, _ in self._owners]
        self.modules = list(model.modules())
        self.stacked_gradient = False  # its gradient was computed stacked (then its lockstep step is too)

    def buffers(self) -> dict[str, torch.Tensor]:
        return {n: owner._buffers[attr] for n, owner, attr in self._owners}  # type: ignore[misc]

    def train(self) -> None:
        """``model.train()``, unless every module is in training mode already (its walk costs per call)."""
        if not all(m.training for m in self.modules):
            self.model.train()

    def zero_grad(self) -> None:
        """``model.zero_grad(set_to_none=True)``."""
        for p in self.params:
            p.grad = None


def _model_signature(model: nn.Module) -> tuple:
    return (
        tuple((n, tuple(t.shape), t.dtype, t.device) for n, t in model.state_dict().items()),
        tuple(type(m).__qualname__ for m in model.modules()),
    )


def vectorize_reason(model: nn.Module) -> str | None:
    """Why a model cannot train under ``vmap`` (None when it can)."""
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
            return f"batch norm with running statistics ({name or type(m).__name__}: its in-place buffer updates do not vectorize)"
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return f"dropout ({name}: it draws from the global random stream)"
    return None


_FUSED_ADAM = getattr(torch, "_fused_adam_", None)
"""The kernel of ``torch.optim.Adam(fused=True)`` (CPU and CUDA), None where this torch lacks it."""


def _fused_adam(params, grads, m, v, steps, lr: float, b1: float, b2: float, eps: float, wd: float) -> None:
    """One plain Adam step (no amsgrad, not maximizing) of every tensor, in place: :data:`_FUSED_ADAM`."""
    _FUSED_ADAM(  # type: ignore[misc]
        params,
        grads,
        m,
        v,
        [],
        steps,
        lr=lr,
        beta1=b1,
        beta2=b2,
        weight_decay=wd,
        eps=eps,
        amsgrad=False,
        maximize=False,
    )


def _adam_factors(steps: Sequence[float], lr: float, b1: float, b2: float) -> tuple[list[float], list[float]]:
    """Per site, Adam's signed step size −lr / (1 − β₁ᵗ) and √(1 − β₂ᵗ) at step count t (t ≥ 1; a site still at
    t = 0 gets t = 1's, it is masked anyway) — ``torch.optim.Adam``'s bias corrections, in Python floats as torch
    computes them."""
    t = [max(s, 1.0) for s in steps]
    return [-(lr / (1 - b1**ti)) for ti in t], [(1 - b2**ti) ** 0.5 for ti in t]


def _masked_adam_(p, m, v, grad, mask, step_size, bc2_sqrt, eps: float, b1: float, b2: float) -> None:
    """One Adam step, in place, of the elements where ``mask`` is true; the others' ``p``, ``m`` and ``v`` stay
    bitwise as they are.  ``step_size`` and ``bc2_sqrt`` (:func:`_adam_factors`) are floats or per-element
    tensors.  Where ``mask`` holds, this is torch's single-tensor Adam: m ← m + (1 − β₁)(g − m),
    v ← β₂ v + (1 − β₂) g², p ← p + step_size · m / (√v / bc2_sqrt + eps).  No host synchronization."""
    m_new = m.lerp(grad, 1 - b1)
    v_new = v.mul(b2).addcmul_(grad, grad, value=1 - b2)
    denom = (v_new.sqrt() / bc2_sqrt).add_(eps)
    update = step_size * m_new / denom
    p.copy_(torch.where(mask, p + update, p))
    m.copy_(torch.where(mask, m_new, m))
    v.copy_(torch.where(mask, v_new, v))


_ADAM_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable", "fused", "decoupled_weight_decay")
_SGD_FLAGS = ("maximize", "differentiable", "fused")


def _optimizer_reason(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> tuple[str | None, tuple]:
    """Why the optimizer cannot be stacked (None when it can) and its settings (the group key)."""
    if type(opt) not in (torch.optim.Adam, torch.optim.SGD):
        return f"optimizer {type(opt).__name__} (only plain Adam and SGD are stacked)", ()
    if len(opt.param_groups) != 1:
        return "its optimizer has several parameter groups", ()
    g = opt.param_groups[0]
    if [id(p) for p in g["params"]] != [id(p) for p in params]:
        return "its optimizer does not update exactly the model's parameters", ()
    if not all(p.requires_grad for p in params):
        return "the model has frozen parameters", ()
    flags = _ADAM_FLAGS if type(opt) is torch.optim.Adam else _SGD_FLAGS
    on = [f for f in flags if g.get(f)]
    if on:
        return f"optimizer option(s) {', '.join(on)}", ()
    states = [opt.state.get(p) for p in params]
    if any(states) and not all(states):
        return "its optimizer holds state for some parameters only", ()
    if type(opt) is torch.optim.Adam:
        if all(states) and len({float(s["step"]) for s in states}) != 1:  # type: ignore[index]
            return "its Adam step counts differ between parameters", ()
        return None, ("adam", float(g["lr"]), tuple(g["betas"]), float(g["eps"]), float(g["weight_decay"]))
    return None, (
        "sgd",
        float(g["lr"]),
        float(g["momentum"]),
        float(g["dampening"]),
        float(g["weight_decay"]),
        bool(g["nesterov"]),
    )


class _Layout:
    """Where each site's parameters live in one flat buffer, parameter-major: parameter j of all K
    sites is one contiguous ``K × shape`` block (a contiguous weight for the vmapped convolution),
    site i's copy of it the block's row i."""

    def __init__(self, params: Sequence[torch.Tensor], k: int):
        self.k = k
        self.shapes = [p.shape for p in params]
        self.sizes = [p.numel() for p in params]
        self.starts = [k * o for o in itertools.accumulate([0, *self.sizes[:-1]])]
        self.numel = k * sum(self.sizes)
        self._reps = torch.tensor([n for n in self.sizes for _ in range(k)], device=params[0].device)

    def pack(self, rows: Sequence[Sequence[torch.Tensor]], out: torch.Tensor | None = None) -> torch.Tensor:
        """``rows[i][j]`` (site i, parameter j) into a flat buffer (``out``: into that one)."""
        parts = [torch.stack([r[j].reshape(-1) for r in rows]).reshape(-1) for j in range(len(self.sizes))]
        return torch.cat(parts) if out is None else torch.cat(parts, out=out)

    def blocks(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The ``K × shape`` view of every parameter."""
        return [
            flat[a : a + self.k * n].view(self.k, *shape) for a, n, shape in zip(self.starts, self.sizes, self.shapes)
        ]

    def per_element(self, per_site: torch.Tensor) -> torch.Tensor:
        """A per-site value (``K``) for every element of a flat buffer."""
        return torch.repeat_interleave(per_site.repeat(len(self.sizes)), self._reps, output_size=self.numel)


class _StackedOptimizer:
    """K sites' Adam (or SGD) as stacked moments and per-site step counts; steps only the active sites.

    Weights and moments are flat buffers (:class:`_Layout`), so a step is a handful of kernels
    whatever the number of parameter tensors.  An Adam step of every site at the same step count is
    one call of torch's fused Adam kernel (``Adam(fused=True)``'s, one pass over the buffer); otherwise
    the arithmetic is ``torch.optim``'s single-tensor implementation, site by site (its bias corrections
    computed in Python floats as torch does).  Both equal a sequential step to rounding."""

    def __init__(
        self,
        opts: Sequence[torch.optim.Optimizer],
        plist: Sequence[Sequence[torch.Tensor]],
        flat: torch.Tensor,
        layout: _Layout,
        arena: _Arena | None = None,
    ):
        self.opts, self.plist, self.flat, self.layout = opts, plist, flat, layout
        g = opts[0].param_groups[0]
        self.adam = type(opts[0]) is torch.optim.Adam
        self.g = dict(g)

        def stacked(key: str, present: Sequence[bool]) -> torch.Tensor:
            out = None if arena is None else (arena.m if key == "exp_avg" else arena.v)
            return layout.pack(
                [[o.state[p][key] if h else torch.zeros_like(p) for p in ps] for o, ps, h in zip(opts, plist, present)],
                out=out,
            )

        # reused every step: no K·P-sized allocation per step
        self.scratch = torch.empty_like(flat) if arena is None else arena.scratch
        self._factors: dict[tuple[float, ...], torch.Tensor] = {}
        with torch.no_grad():
            if self.adam:
                present = [bool(o.state.get(ps[0])) for o, ps in zip(opts, plist)]
                self.s = [float(o.state[ps[0]]["step"]) if h else 0.0 for o, ps, h in zip(opts, plist, present)]
                self.m, self.v = stacked("exp_avg", present), stacked("exp_avg_sq", present)
            else:
                self.has = [
                    bool(o.state.get(ps[0])) and o.state[ps[0]].get("momentum_buffer") is not None
                    for o, ps in zip(opts, plist)
                ]
                self.buf = stacked("momentum_buffer", self.has)
        self.taken = [0] * len(opts)
        # the fused kernel's step count (a tensor, as it asks; a captured step reads the arena's)
        self._step: torch.Tensor | None = None if arena is None else arena.step

    def fused_ready(self, active: Sequence[int]) -> bool:
        """Whether the next step of ``active`` is one call of the fused Adam kernel (every site, one step count)."""
        return self.adam and _FUSED_ADAM is not None and len(active) == len(self.opts) and len(set(self.s)) == 1

    @torch.no_grad()
    def begin_fused(self) -> None:
        """The host side of a fused step (:meth:`fused_ready`): step counts, the kernel's step tensor set.
        :meth:`fused_kernels` is the device side (what a CUDA graph captures)."""
        for i in range(len(self.opts)):
            self.taken[i] += 1
        self.s = [si + 1.0 for si in self.s]
        if self._step is None:
            self._step = torch.zeros((), dtype=torch.float32, device=self.flat.device)
        self._step.fill_(self.s[0])

    @torch.no_grad()
    def fused_kernels(self, grad: torch.Tensor) -> None:
        """The device work of a fused Adam step of every site (after :meth:`begin_fused`); no host sync."""
        g = self.g
        if g["weight_decay"] != 0:
            grad.add_(self.flat, alpha=g["weight_decay"])
        b1, b2 = g["betas"]
        _fused_adam([self.flat], [grad], [self.m], [self.v], [self._step], float(g["lr"]), b1, b2, float(g["eps"]), 0.0)

    @torch.no_grad()
    def begin_masked(self, active: Sequence[int], arena: _Arena) -> None:
        """The host side of an Adam step of ``active`` only (the others' rows, parameters and moments, stay
        exactly as they are), for :meth:`masked_kernels`: step counts, and the arena's per-element mask,
        step sizes and bias corrections (static tensors a CUDA graph reads) filled for this step."""
        b1, b2 = self.g["betas"]
        k = len(self.opts)
        for i in active:
            self.taken[i] += 1
        on = [i in active for i in range(k)]
        self.s = [si + (1.0 if a else 0.0) for si, a in zip(self.s, on)]
        step_size, bc2 = _adam_factors(self.s, self.g["lr"], b1, b2)
        dev = self.flat.device
        if arena.mask is None:
            arena.mask = torch.empty(self.flat.shape, dtype=torch.bool, device=dev)
            arena.step_size, arena.bc2 = torch.empty_like(self.flat), torch.empty_like(self.flat)
        assert arena.step_size is not None and arena.bc2 is not None
        per = self.layout.per_element
        arena.mask.copy_(per(torch.tensor(on, device=dev)))
        arena.step_size.copy_(per(torch.tensor(step_size, dtype=torch.float64, device=dev)))
        arena.bc2.copy_(per(torch.tensor(bc2, dtype=torch.float64, device=dev)))

    @torch.no_grad()
    def masked_kernels(self, grad: torch.Tensor, arena: _Arena) -> None:
        """The device work of :meth:`begin_masked`'s step (the arithmetic of :meth:`step` for a subset of
        sites, with per-element factors); no host sync."""
        g = self.g
        if g["weight_decay"] != 0:
            grad.add_(self.flat, alpha=g["weight_decay"])
        b1, b2 = g["betas"]
        _masked_adam_(self.flat, self.m, self.v, grad, arena.mask, arena.step_size, arena.bc2, float(g["eps"]), b1, b2)

    def _factor(self, values: Sequence[float]) -> float | torch.Tensor:
        """A Python float when every site has the same value (torch's own scalar arithmetic), else per element."""
        if len(set(values)) == 1:
            return values[0]
        key = tuple(values)
        if key not in self._factors:
            if len(self._factors) > 4:
                self._factors.clear()
            self._factors[key] = self.layout.per_element(
                torch.tensor(values, dtype=torch.float64, device=self.flat.device)
            ).to(self.flat.dtype)
        return self._factors[key]

    @torch.no_grad()
    def step(self, grad: torch.Tensor, active: Sequence[int]) -> None:
        k = len(self.opts)
        for i in active:
            self.taken[i] += 1
        full = len(active) == k  # every site steps: in place, no masking
        mask = (
            None
            if full
            else self.layout.per_element(torch.tensor([i in active for i in range(k)], device=self.flat.device))
        )
        g, p = self.g, self.flat
        wd = g["weight_decay"]
        if wd != 0:
            grad.add_(p, alpha=wd)  # ``grad`` is the executor's own buffer
        if self.adam:
            b1, b2 = g["betas"]
            s = [si + (1.0 if i in active else 0.0) for i, si in enumerate(self.s)]
            sizes, bc2s = _adam_factors(s, g["lr"], b1, b2)
            step_size, bc2_sqrt = self._factor(sizes), self._factor(bc2s)
            if full and len(set(s)) == 1 and _FUSED_ADAM is not None:
                # every site at the same step count: torch's fused Adam kernel (``Adam(fused=True)``'s) over
                # the whole flat buffer, one pass over memory; ``grad`` already holds the weight decay
                if self._step is None:
                    self._step = torch.zeros((), dtype=torch.float32, device=p.device)
                self._step.fill_(s[0])
                _fused_adam([p], [grad], [self.m], [self.v], [self._step], float(g["lr"]), b1, b2, float(g["eps"]), 0.0)
                self.s = s
                return
            if full:  # in place, into preallocated memory (torch's own single-tensor sequence)
                # on the CPU in cache-sized chunks (one pass per op over a K·P buffer would stream it
                # from memory seven times); on CUDA in one piece
                n = p.numel()
                chunk = n if p.device.type == "cuda" else 1 << 16
                for a in range(0, n, chunk):
                    sl = slice(a, a + chunk)
                    m, v = self.m[sl], self.v[sl]
                    m.lerp_(grad[sl], 1 - b1)
                    v.mul_(b2).addcmul_(grad[sl], grad[sl], value=1 - b2)
                    denom = (
                        torch.sqrt(v, out=self.scratch[sl])
                        .div_(bc2_sqrt if isinstance(bc2_sqrt, float) else bc2_sqrt[sl])
                        .add_(float(g["eps"]))
                    )
                    if isinstance(step_size, float):
                        p[sl].addcdiv_(m, denom, value=step_size)
                    else:
                        p[sl].add_(torch.div(m, denom, out=denom).mul_(step_size[sl]))
                self.s = s
                return
            _masked_adam_(p, self.m, self.v, grad, mask, step_size, bc2_sqrt, float(g["eps"]), b1, b2)
            self.s = s
        else:
            mom, damp, nesterov = g["momentum"], g["dampening"], g["nesterov"]
            if mom != 0:
                if all(self.has):
                    buf = self.buf.mul(mom).add_(grad, alpha=1 - damp)
                elif not any(self.has):
                    buf = grad.clone()
                else:
                    has = self.layout.per_element(torch.tensor(self.has, device=p.device))
                    buf = torch.where(has, self.buf.mul(mom).add(grad, alpha=1 - damp), grad)
                self.buf.copy_(buf if full else torch.where(mask, buf, self.buf))
                grad = grad.add(buf, alpha=mom) if nesterov else buf
            new = p.add(grad, alpha=-g["lr"])
            p.copy_(new if full else torch.where(mask, new, p))
            self.has = [h or i in active for i, h in enumerate(self.has)]

    @torch.no_grad()
    def write_back(self) -> None:
        """Each site's moments into its own optimizer's state (as ``torch.optim`` keeps them)."""
        blocks = (
            {key: self.layout.blocks(t) for key, t in (("exp_avg", self.m), ("exp_avg_sq", self.v))}
            if self.adam
            else ({"momentum_buffer": self.layout.blocks(self.buf)} if self.g["momentum"] != 0 else {})
        )
        for i, (opt, ps) in enumerate(zip(self.opts, self.plist)):
            if self.taken[i] == 0:
                continue
            for j, p in enumerate(ps):
                st = opt.state[p]
                if self.adam:
                    dtype = st["step"].dtype if "step" in st else _get_scalar_dtype()
                    st["step"] = torch.tensor(self.s[i], dtype=dtype)
                for key, bl in blocks.items():
                    st[key] = bl[j][i].clone()


GRAPH_WARMUP_STEPS = 2
"""Eager steps a group takes (on a side stream, as CUDA graph capture asks) before its step is captured."""

_MAX_ARENAS = 4
"""Captured groups kept (each holds its stacked buffers and its graph's memory); the least recently used goes."""


class _Arena:
    """The static tensors of one vectorized group on CUDA, kept across rounds so that its local step can be
    captured once as a CUDA graph and replayed: the flat weights (with their ``K × shape`` differentiable
    views), Adam's moments, the gradient and scratch buffers, the step count, the stacked batch and the
    per-site losses.  Each round copies the sites' weights and moments in and out, as without an arena."""

    def __init__(self, layout: _Layout, flat_like: torch.Tensor, buffers: dict[str, torch.Tensor]):
        self.flat = torch.empty(layout.numel, dtype=flat_like.dtype, device=flat_like.device)
        self.m, self.v = torch.zeros_like(self.flat), torch.zeros_like(self.flat)
        self.gbuf, self.scratch = torch.empty_like(self.flat), torch.empty_like(self.flat)
        self.step = torch.zeros((), dtype=torch.float32, device=self.flat.device)
        self.weights = [b.requires_grad_(True) for b in layout.blocks(self.flat)]
        self.buffers = {n: torch.empty_like(b) for n, b in buffers.items()}
        self.x: torch.Tensor | None = None
        self.y: torch.Tensor | None = None
        self.loss: torch.Tensor | None = None
        # the masked step's per-element mask, step sizes and bias corrections (made at its first use)
        self.mask: torch.Tensor | None = None
        self.step_size: torch.Tensor | None = None
        self.bc2: torch.Tensor | None = None
        self.graphs: dict[str, Any] = {}  # torch.cuda.CUDAGraph by variant ("fused", "masked") once captured
        self.warm: dict[str, int] = {}  # eager steps taken so far, by variant
        self.failed: str | None = None  # why capture failed (then this group steps eagerly)

    def load_batch(self, batch: dict[int, tuple[torch.Tensor, torch.Tensor]], k: int) -> bool:
        """Copy the active sites' batches (``batch``: site index → (x, y)) into their rows of the static batch;
        a finished site's row keeps its last batch (its step is computed and masked away).  False, and nothing
        copied, when a batch's shape or dtype is not the static one's, or before every site has filled its row."""
        xs, ys = [b[0] for b in batch.values()], [b[1] for b in batch.values()]
        if self.x is None:
            if len(batch) != k or any(x.shape != xs[0].shape for x in xs) or any(y.shape != ys[0].shape for y in ys):
                return False
            self.x, self.y = torch.stack(xs), torch.stack(ys)
            return True
        assert self.y is not None
        if any(
            x.shape != self.x.shape[1:]
            or y.shape != self.y.shape[1:]
            or x.dtype != self.x.dtype
            or y.dtype != self.y.dtype
            for x, y in zip(xs, ys)
        ):
            return False
        if len(batch) == k:
            torch.stack(xs, out=self.x)
            torch.stack(ys, out=self.y)
        else:
            for i, (x, y) in batch.items():
                self.x[i].copy_(x)
                self.y[i].copy_(y)
        return True


@dataclass
class _Item:
    index: int
    call: FitCall
    model: nn.Module
    opt: torch.optim.Optimizer
    wrapper: Any  # an optimizer wrapper with ``after_step()`` (SCAFFOLD's corrected step), or None
    params: list[torch.Tensor]  # the model's parameters, in order
    key: tuple  # (role, model signature, optimizer settings, device, precision): who can be stacked together


class VectorizedExecutor:
    """Runs one ask's handlers so that their :meth:`Site.fit` calls train as one computation.

    Parameters
    ----------
    group_size
        Most sites stacked together; 0 = all on the CPU, and on CUDA as many as fit in the free memory
        (estimated once per model and role: :func:`group_size_for`).  A group that still runs out of
        memory at its first step is split in halves and retried (nothing has been updated yet).
    log
        Where the plan (which roles of which sites are vectorized, and why not) is said, once.
    cuda_graphs
        ``simulation.cuda_graphs``: on CUDA, the local step of a group with no per-site hook (``extra_loss``,
        ``after_backward``, an optimizer wrapper) and a plain Adam, whose active sites' batches have the static
        shape, is one of two fixed computations (every site at one step count: the fused Adam kernel; else a
        masked step, see :meth:`_graph_step`); each is taken eagerly :data:`GRAPH_WARMUP_STEPS` times, then
        captured once as a CUDA graph over static buffers kept across rounds (:class:`_Arena`) and replayed;
        any other step runs eagerly on the same buffers.  A capture that fails is logged and the group stays eager.
    """

    def __init__(self, group_size: int = 0, log: Callable[[str], None] = print, cuda_graphs: bool = True):
        self.group_size = group_size
        self.log = log
        self.cuda_graphs = cuda_graphs
        self._arenas: dict[tuple, _Arena] = {}  # by group key and sites, least recently used first
        self._said: set[str] = set()
        self.vectorized_fits = 0
        """Number of ``fit`` calls trained stacked so far (for tests and benchmarks)."""
        self.vectorized_gradients = 0
        """Number of ``gradient`` calls computed stacked so far (for tests and benchmarks)."""
        self.vectorized_applies = 0
        """Number of ``apply_gradient`` steps taken stacked so far (for tests and benchmarks)."""
        self._met: set[str] = set()  # task kinds whose handlers met in fit or gradient
        self._stacked_roles: set[str] = set()  # roles whose gradients were stacked at least once
        # gradient groups (key, loss) whose loss failed under vmap: sequential from then on
        self._no_vmap: list[tuple[tuple, Any]] = []
        self._site_bytes: dict[tuple, int] = {}  # estimated bytes per site of a stacked group, by group key
        self._group_sizes: dict[tuple, int] = {}  # the group size last said, by group key and sites
        # every model met, walked once (a plain dict: the entries hold their models; the executor lives one run)
        self._structures: dict[nn.Module, _Structure] = {}

    def _say(self, msg: str) -> None:
        if msg not in self._said:
            self._said.add(msg)
            self.log(f"vectorize: {msg}")

    # ------------------------------------------------------------ scheduling
    def run(self, calls: Sequence[tuple[Site, Task]]) -> list[Reply]:
        """Every ``site.handle(task)``; returns the replies in order."""
        threads = _IntraOpThreads()
        workers = [_Worker(s, t, threads) for s, t in calls]
        try:
            live = list(workers)
            while live:
                for w in live:
                    w.resume()
                    if w.error is not None:
                        raise w.error
                live = [w for w in workers if not w.done]
                if not live:
                    break
                fits = [w for w in live if isinstance(w.call, FitCall)]
                grads = [w for w in live if isinstance(w.call, GradientCall)]
                steps = [w for w in live if isinstance(w.call, ApplyCall)]
                for group, together in (
                    (fits, self.fit_together),
                    (grads, self.gradients_together),
                    (steps, self.apply_together),
                ):
                    if group:
                        for w, r in zip(group, together([w.call for w in group])):  # type: ignore[arg-type]
                            w.result = r
        except BaseException:
            for w in workers:
                if not w.done:
                    w.abort = True
                    w.resume()
            raise
        finally:
            for w in workers:
                if w.thread.is_alive():
                    w.thread.join()
        unfitted: dict[str, list[str]] = {}
        for w in workers:
            if w.fitted:
                self._met.add(w.task.kind)
            else:
                unfitted.setdefault(w.task.kind, []).append(w.site.name)
        for kind, names in unfitted.items():
            if kind in self._met:  # e.g. the last, apply-only exchange of a lockstep round
                continue
            method = workers[0].site.algorithm.name
            self._say(
                f"task {kind!r} of {_names(names)} runs sequentially: method {method!r} computes it in its own loop, not through Site.fit or Site.gradient"
            )
        return [w.reply for w in workers]  # type: ignore[misc]

    # -------------------------------------------------------------- planning
    def _check(self, index: int, call: FitCall) -> tuple[_Item | None, str | None]:
        site = call.site
        model = site.model(call.role)
        opt = call.optimizer or site.optimizer(call.role)
        if site.precision == "fp16":
            return None, "fp16 loss scaling (a GradScaler per site)"
        wrapper = None
        if not isinstance(opt, torch.optim.Optimizer):
            inner = getattr(opt, "opt", None)
            if isinstance(inner, torch.optim.Optimizer) and callable(getattr(opt, "after_step", None)):
                wrapper, opt = opt, inner
            else:
                return None, f"it steps with {type(opt).__name__}, not a torch optimizer"
        st = self._structure(model)
        signature, reason, params = st.signature, st.reason, list(st.params)
        if reason is None and len({p.dtype for p in params}) > 1:
            reason = "its parameters have several dtypes"
        settings: tuple = ()
        if reason is None:
            reason, settings = _optimizer_reason(opt, params)
        if reason is not None:
            return None, reason
        key = (call.role, signature, settings, str(site.device), site.precision)
        return _Item(index, call, model, opt, wrapper, params, key), None

    def fit_together(self, calls: Sequence[FitCall]) -> list[Any]:
        """Train the calls that can be stacked; the others get ``_SEQUENTIAL`` (their thread trains them)."""
        results: list[Any] = [_SEQUENTIAL] * len(calls)
        groups: list[tuple[tuple, list[_Item]]] = []
        for i, c in enumerate(calls):
            item, reason = self._check(i, c)
            if item is None:
                self._say(f"role {c.role!r} of site {c.site.name} trains sequentially: {reason}")
                continue
            key = item.key
            for gkey, members in groups:
                if gkey == key and members[0].call.site.workload.loss == c.site.workload.loss:
                    members.append(item)
                    break
            else:
                groups.append((key, [item]))
        for _, members in groups:
            if len(members) == 1:
                c = members[0].call
                self._say(
                    f"role {c.role!r} of site {c.site.name} trains sequentially: no other site's training of the same model meets it"
                )
                continue
            self._say(
                f"role {members[0].call.role!r} of {_names([m.call.site.name for m in members])} trains as one vectorized computation"
            )
            size = self.group_size or self._memory_group_size(
                members[0].key,
                members[0].call.site.device,
                [m.call.site.name for m in members],
                members[0].call.role,
                lambda m=members[0]: _fit_site_bytes(m),
            )
            for start in range(0, len(members), size):
                for item, out in zip(members[start : start + size], self._train(members[start : start + size])):
                    results[item.index] = out
        return results

    def _memory_group_size(
        self, key: tuple, device: torch.device, names: list[str], role: str, site_bytes: Callable[[], int]
    ) -> int:
        """``simulation.vectorize_group = 0``: all sites together where the device's free memory is not known
        (the CPU); on CUDA as many as fit in the free memory (:func:`group_size_for`), the bytes per site
        estimated once per model and role (:func:`_fit_site_bytes`, :func:`_gradient_site_bytes`)."""
        free = _free_memory(device)
        if free is None:
            return len(names)
        if key not in self._site_bytes:
            self._site_bytes[key] = site_bytes()
        per_site = self._site_bytes[key]
        size = group_size_for(free, per_site, len(names))
        said = (key, tuple(names))
        if self._group_sizes.get(said) != size:  # said once, and again only when the free memory changes it
            self._group_sizes[said] = size
            self.log(
                f"vectorize: role {role!r} of {_names(names)}: about {per_site / 2**20:.0f} MiB per site and "
                f"{free / 2**30:.1f} GiB free on {device}: "
                f"{'all together' if size >= len(names) else f'groups of at most {size}'} "
                "(set simulation.vectorize_group to choose)"
            )
        return size

    # -------------------------------------------------------------- training
    def _train(self, items: list[_Item]) -> list[Any]:
        """Train a group; on a CUDA out-of-memory error at its first step, train its halves instead."""
        try:
            return self._train_group(items)
        except _FirstStepFailed as e:
            # the group's arena (CUDA graphs) goes with it: its memory is what did not fit, or it never stepped
            self._arenas.pop((items[0].key, tuple(it.call.site.name for it in items)), None)
            if isinstance(e.error, torch.OutOfMemoryError) and len(items) > 1:
                half = len(items) // 2
                self._say(
                    f"a group of {len(items)} sites does not fit in memory; training groups of at most {half} (set simulation.vectorize_group)"
                )
                return self._train(items[:half]) + self._train(items[half:])
            names = _names([it.call.site.name for it in items])
            self._say(
                f"role {items[0].call.role!r} of {names} trains sequentially: its loss does not run under torch.func.vmap ({type(e.error).__name__}: {e.error})"
            )
            return [_SEQUENTIAL] * len(items)

    def _train_group(self, items: list[_Item]) -> list[dict[str, float]]:
        calls = [it.call for it in items]
        models = [it.model for it in items]
        k = len(items)
        site0 = calls[0].site
        dev, precision, loss_fn = site0.device, site0.precision, site0.workload.loss
        template = models[0]
        st = self._structure(template)
        pnames, bnames, tied = st.pnames, st.bnames, st.tied
        plist = [it.params for it in items]
        layout = _Layout(plist[0], k)
        for m in models:
            self._structure(m).train()
        blist = [self._structure(m).buffers() for m in models]
        with torch.no_grad():
            buffers = {n: torch.stack([b[n] for b in blist]) for n in bnames}
        arena = self._arena(items, layout, plist[0][0], buffers)
        with torch.no_grad():
            flat = layout.pack(plist, out=None if arena is None else arena.flat)  # every site's parameters
            if arena is not None:
                for n, b in buffers.items():
                    arena.buffers[n].copy_(b)
                buffers = arena.buffers
        # the differentiable K × shape leaves
        weights = arena.weights if arena is not None else [b.requires_grad_(True) for b in layout.blocks(flat)]
        for i, ps in enumerate(plist):  # each site's parameters view its row while it trains
            for p, w in zip(ps, weights):
                p.data = w.detach()[i]
        opt = _StackedOptimizer([it.opt for it in items], plist, flat, layout, arena)
        gbuf = torch.empty_like(flat) if arena is None else arena.gbuf
        iters = [c.site.batches(c.rnd, c.stream, c.steps) for c in calls]
        totals = [torch.zeros((), dtype=torch.float64, device=dev) for _ in calls]
        counts = [0] * k

        def site_loss(
            params: dict[str, torch.Tensor], bufs: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
        ) -> torch.Tensor:
            with autocast(dev, precision, cache=arena is None):
                return loss_fn(functional_call(template, (params, bufs), (x,), tie_weights=tied), y)

        losses_of = vmap(site_loss, randomness="error")
        # no per-site hook (FedProx's term, SCAFFOLD's correction): a step is one fixed computation
        hookless = not any(c.extra_loss or c.after_backward for c in calls) and all(it.wrapper is None for it in items)
        active = list(range(k))
        first = True
        done = False
        try:
            while True:
                batch: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
                for i in list(active):
                    b = next(iters[i], None)
                    if b is None:
                        active.remove(i)
                    else:
                        batch[i] = b
                if not batch:
                    break
                try:
                    losses = None
                    if arena is not None and hookless and arena.failed is None and arena.load_batch(batch, k):
                        variant = "fused" if opt.fused_ready(list(batch)) else "masked"
                        losses = self._graph_step(
                            arena, opt, losses_of, pnames, items[0].call.role, variant, list(batch)
                        )
                    if losses is None:
                        grads, losses = self._gradients(
                            batch, weights, pnames, layout, buffers, losses_of, calls, models, plist, gbuf
                        )
                except Exception as e:
                    if first:
                        raise _FirstStepFailed(e) from e
                    raise
                first = False
                if not isinstance(losses, torch.Tensor):  # the eager step's gradients: its optimizer step
                    opt.step(grads, list(batch))
                for i in batch:
                    wrapper = items[i].wrapper
                    if wrapper is not None:
                        wrapper.after_step()  # acts on the site's parameters, i.e. on its row
                    totals[i] += losses[i]
                    counts[i] += 1
            done = True
        finally:
            with torch.no_grad():
                for i, ps in enumerate(plist):  # back to the site's own tensors
                    for p, w in zip(ps, weights):
                        p.data = w.detach()[i].clone()
            if done:
                opt.write_back()
        self.vectorized_fits += k
        return [{"loss": float(t) / max(n, 1), "steps": n} for t, n in zip(totals, counts)]

    # ------------------------------------------------------------ CUDA graphs
    def _arena(
        self, items: list[_Item], layout: _Layout, like: torch.Tensor, buffers: dict[str, torch.Tensor]
    ) -> _Arena | None:
        """The group's :class:`_Arena` on CUDA with ``cuda_graphs`` on (made at its first fit, kept across
        rounds), None otherwise (the CPU, graphs off, an optimizer whose step is not the fused Adam kernel)."""
        dev = items[0].call.site.device
        if (
            not self.cuda_graphs
            or dev.type != "cuda"
            or _FUSED_ADAM is None
            or type(items[0].opt) is not torch.optim.Adam
        ):
            return None
        key = (items[0].key, tuple(it.call.site.name for it in items))
        arena = self._arenas.pop(key, None)
        if arena is None:
            arena = _Arena(layout, like, buffers)
            if len(self._arenas) >= _MAX_ARENAS:  # the least recently used group's memory goes
                self._arenas.pop(next(iter(self._arenas)))
        self._arenas[key] = arena  # now the most recently used
        return arena

    def _graph_step(
        self,
        arena: _Arena,
        opt: _StackedOptimizer,
        losses_of: Any,
        pnames: list[str],
        role: str,
        variant: str,
        active: list[int],
    ):
        """One local step of the group from the arena's static batch: every site's row is computed (a finished
        site's on its last batch) and the step is ``"fused"`` (every site active at one Adam step count: torch's
        fused Adam kernel) or ``"masked"`` (the others: :meth:`_StackedOptimizer.masked_kernels`, inactive rows
        unchanged).  Each variant runs eagerly on a side stream for its first :data:`GRAPH_WARMUP_STEPS` steps,
        then is captured once as a CUDA graph and replayed.  Returns the per-site losses (the arena's tensor,
        rewritten by the next step), or None when a capture failed (nothing was computed: the caller takes the
        step eagerly, and the group stays eager)."""

        def step() -> None:
            out = losses_of(dict(zip(pnames, arena.weights)), arena.buffers, arena.x, arena.y)
            gs = torch.autograd.grad(out.sum(), arena.weights, allow_unused=True)
            parts = [(torch.zeros_like(w) if g is None else g).reshape(-1) for g, w in zip(gs, arena.weights)]
            torch.cat(parts, out=arena.gbuf)
            if variant == "fused":
                opt.fused_kernels(arena.gbuf)
            else:
                opt.masked_kernels(arena.gbuf, arena)
            with torch.no_grad():
                if arena.loss is None:
                    arena.loss = out.detach().clone()
                else:
                    arena.loss.copy_(out.detach())

        dev = arena.flat.device
        graph = arena.graphs.get(variant)
        saved = (list(opt.s), list(opt.taken))  # the host-side step counts, restored if the capture fails
        if variant == "fused":
            opt.begin_fused()
        else:
            opt.begin_masked(active, arena)
        if graph is None and arena.warm.get(variant, 0) >= GRAPH_WARMUP_STEPS:
            graph = torch.cuda.CUDAGraph()
            try:
                torch.cuda.synchronize(dev)
                with torch.cuda.graph(graph):
                    step()
            except Exception as e:  # e.g. an operation that synchronizes with the host: eager from now on
                arena.failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                self._say(
                    f"role {role!r}: its local step could not be captured as a CUDA graph; it runs eagerly ({arena.failed})"
                )
                opt.s, opt.taken = saved
                return None
            arena.graphs[variant] = graph
            what = (
                "every site at one step count" if variant == "fused" else "some sites finished or at other step counts"
            )
            self._say(
                f"role {role!r}: the vectorized local step runs as a captured CUDA graph ({what}; simulation.cuda_graphs)"
            )
        if graph is not None:
            graph.replay()
        else:  # warm-up, on a side stream as capture asks (lazy initializations happen on it)
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                step()
            torch.cuda.current_stream(dev).wait_stream(side)
            arena.warm[variant] = arena.warm.get(variant, 0) + 1
        assert arena.loss is not None
        return arena.loss

    @staticmethod
    def _gradients(batch, weights, pnames, layout, buffers, losses_of, calls, models, plist, gbuf):
        """The flat gradient (:class:`_Layout`) of every site's loss (plus its ``extra_loss``, edited by its
        ``after_backward``) at the current weights, and each site's loss."""
        k = weights[0].shape[0]
        by_shape: dict[tuple, list[int]] = {}
        for i, (x, y) in batch.items():
            by_shape.setdefault((x.shape, x.dtype, y.shape, y.dtype), []).append(i)
        grads: torch.Tensor | None = None
        losses: dict[int, torch.Tensor] = {}
        for idx in by_shape.values():
            if idx == list(range(k)):
                params, bufs = dict(zip(pnames, weights)), buffers
            else:  # some sites' batches differ in shape (or their round has ended): a vmap over their rows
                sel = torch.tensor(idx, device=weights[0].device)
                params = {n: w.index_select(0, sel) for n, w in zip(pnames, weights)}
                bufs = {n: b.index_select(0, sel) for n, b in buffers.items()}
            x = torch.stack([batch[i][0] for i in idx])
            y = torch.stack([batch[i][1] for i in idx])
            out = losses_of(params, bufs, x, y)
            gs = torch.autograd.grad(out.sum(), weights, allow_unused=True)
            parts = [(torch.zeros_like(w) if gj is None else gj).reshape(-1) for gj, w in zip(gs, weights)]
            if grads is None:
                grads = torch.cat(parts, out=gbuf)  # the flat layout, in the executor's buffer
            else:
                grads += torch.cat(parts)
            for j, i in enumerate(idx):
                losses[i] = out[j].detach()
        assert grads is not None
        blocks = layout.blocks(grads) if any(calls[i].extra_loss or calls[i].after_backward for i in batch) else []
        for i in batch:
            c = calls[i]
            views = [b[i] for b in blocks]
            if c.extra_loss is not None:  # evaluated on the site's model, whose parameters view its row
                extra = c.extra_loss(models[i])
                ge = torch.autograd.grad(extra, plist[i], allow_unused=True)
                with torch.no_grad():
                    for view, gj in zip(views, ge):
                        if gj is not None:
                            view += gj
                losses[i] = losses[i] + extra.detach()
            if c.after_backward is not None:
                for p, view in zip(plist[i], views):
                    p.grad = view
                c.after_backward(models[i])
                with torch.no_grad():
                    for p, view in zip(plist[i], views):
                        if p.grad is None:
                            view.zero_()
                        elif p.grad.data_ptr() != view.data_ptr():
                            view.copy_(p.grad)
                        p.grad = None
        return grads, losses

    # ----------------------------------------------------- lockstep gradients
    def _structure(self, model: nn.Module) -> _Structure:
        """The :class:`_Structure` of a model, walked once per model object (every round's fits and every
        lockstep step ask for it)."""
        known = self._structures.get(model)
        if known is None:
            known = self._structures[model] = _Structure(model)
        return known

    def _gradient_reason(self, call: GradientCall) -> tuple[tuple, str | None]:
        site = call.site
        model = site.model(call.role)
        st = self._structure(model)
        signature, reason = st.signature, st.reason
        if site.precision == "fp16":
            return signature, "fp16 loss scaling (a GradScaler per site)"
        if not _is_tree(call.x) or not _is_tree(call.target):
            return signature, "its batch or target is not a tensor or a tuple/list of tensors"
        if reason is None and len({p.dtype for p in st.params}) > 1:
            reason = "its parameters have several dtypes"
        if reason is None and not all(p.requires_grad for p in st.params):
            reason = "the model has frozen parameters"
        if reason is None and call.at is not None:
            names = st.pnames
            if not isinstance(call.at, dict) or sorted(call.at) != sorted(names):
                reason = "the weights it is asked at do not name exactly the model's parameters"
            elif any(call.at[n].shape != p.shape for n, p in zip(st.pnames, st.params)):
                reason = "the weights it is asked at do not have the model's shapes"
        return signature, reason

    def gradients_together(self, calls: Sequence[GradientCall]) -> list[Any]:
        """Each call's ``(gradients, loss)`` — those that can be stacked computed in one vmapped call per
        group of sites with the same model and loss; the others get ``_SEQUENTIAL`` (their thread computes
        them).  Computing a gradient changes nothing at the site, so any failure falls back safely."""
        results: list[Any] = [_SEQUENTIAL] * len(calls)
        groups: list[tuple[tuple, Any, list[int]]] = []
        for i, c in enumerate(calls):
            signature, reason = self._gradient_reason(c)
            if reason is not None:
                self._say(f"the gradient of role {c.role!r} of site {c.site.name} is computed sequentially: {reason}")
                continue
            key = (c.role, signature, str(c.site.device), c.site.precision, c.at is None)
            loss = c.site.workload.loss if c.loss is None else c.loss
            for gkey, gloss, members in groups:
                if gkey == key and gloss == loss:
                    members.append(i)
                    break
            else:
                groups.append((key, loss, [i]))
        for key, loss, members in groups:
            role, names = calls[members[0]].role, _names([calls[i].site.name for i in members])
            if len(members) == 1:
                if role not in self._stacked_roles:  # not merely the last site of a loop the others have left
                    self._say(
                        f"the gradient of role {role!r} of {names} is computed sequentially: no other site's gradient of the same model and loss meets it"
                    )
                continue
            if any(k == key and lo == loss for k, lo in self._no_vmap):
                continue
            self._say(f"the gradients of role {role!r} of {names} are computed as one vectorized computation")
            self._stacked_roles.add(role)
            size = self.group_size or self._memory_group_size(
                (*key, loss),
                calls[members[0]].site.device,
                [calls[i].site.name for i in members],
                role,
                lambda c=calls[members[0]], loss=loss: _gradient_site_bytes(c, loss),
            )
            for start in range(0, len(members), size):
                chunk = members[start : start + size]
                for i, out in zip(chunk, self._gradients_split([calls[i] for i in chunk], loss, key)):
                    results[i] = out
        return results

    def _gradients_split(self, calls: list[GradientCall], loss: Any, key: tuple) -> list[Any]:
        """:meth:`_gradient_group`; out of memory: in halves; any other error: sequentially from now on."""
        try:
            return self._gradient_group(calls, loss)
        except Exception as e:
            if isinstance(e, torch.OutOfMemoryError) and len(calls) > 1:
                half = len(calls) // 2
                self._say(
                    f"a group of {len(calls)} sites' gradients does not fit in memory; computing groups of at most {half} (set simulation.vectorize_group)"
                )
                return self._gradients_split(calls[:half], loss, key) + self._gradients_split(calls[half:], loss, key)
            self._no_vmap.append((key, loss))
            self._say(
                f"the gradients of role {calls[0].role!r} of {_names([c.site.name for c in calls])} are computed sequentially: "
                f"the loss does not run under torch.func.vmap ({type(e).__name__}: {e})"
            )
            return [_SEQUENTIAL] * len(calls)

    def _gradient_group(
        self, calls: list[GradientCall], loss: Any
    ) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        """The gradients of K sites' losses in one ``vmap`` over their stacked weights (the sites of a lockstep
        round hold the same weights, but nothing here relies on it): each site's loss depends only on its
        row, so the gradient of their sum with respect to the stacked ``K × shape`` weights is, row by row,
        each site's own gradient.  Parameters the loss does not reach get no gradient, as sequentially."""
        site0 = calls[0].site
        dev, precision = site0.device, site0.precision
        models = [c.site.model(c.role) for c in calls]
        template = models[0]
        sts = [self._structure(m) for m in models]
        pnames, tied = sts[0].pnames, sts[0].tied
        plist = [st.params for st in sts]
        blist = [st.buffers() for st in sts]
        own = calls[0].at is None  # at the models' own weights (else at each call's ``at``, as a group)
        for st in sts:
            st.train()
            if own:
                st.zero_grad()

        def site_loss(params: dict[str, torch.Tensor], bufs: dict[str, torch.Tensor], x: torch.Tensor, t: Any):
            with autocast(dev, precision):
                return loss(functional_call(template, (params, bufs), (x,), tie_weights=tied), t)

        losses_of = vmap(site_loss, randomness="error")
        by_shape: dict[tuple, list[int]] = {}  # the last, smaller batch of an epoch: its own vmap
        for i, c in enumerate(calls):
            by_shape.setdefault((_tree_key(c.x), _tree_key(c.target)), []).append(i)
        results: list[Any] = [None] * len(calls)
        for idx in by_shape.values():
            with torch.no_grad():
                weights = [
                    torch.stack([plist[i][j] if own else calls[i].at[n] for i in idx]) for j, n in enumerate(pnames)
                ]
                bufs = {n: torch.stack([blist[i][n] for i in idx]) for n in blist[0]}
            for w in weights:
                w.requires_grad_(True)
            out = losses_of(
                dict(zip(pnames, weights)),
                bufs,
                torch.stack([calls[i].x for i in idx]),
                _stack_tree([calls[i].target for i in idx]),
            )
            gs = torch.autograd.grad(out.sum(), weights, allow_unused=True)
            for j, i in enumerate(idx):
                # each site its own row (views: rows are disjoint, and the replies are copied on the way out)
                results[i] = ({n: g[j] for n, g in zip(pnames, gs) if g is not None}, out[j].detach())
        for st in sts:
            st.stacked_gradient = True
        self.vectorized_gradients += len(calls)
        return results

    # ------------------------------------------------- lockstep optimizer steps
    def apply_together(self, calls: Sequence[ApplyCall]) -> list[Any]:
        """Take the Adam steps of the calls with the same model and optimizer settings as one call of torch's
        fused Adam kernel (``Adam(fused=True)``'s) over every site's parameters; the others get
        ``_SEQUENTIAL`` (their thread steps).  The kernel updates each site's own parameters, moments and
        step counts in place, tensor by tensor with the same arithmetic, so sites that hold the same
        weights and gradient (a lockstep round) stay bitwise identical to each other."""
        results: list[Any] = [_SEQUENTIAL] * len(calls)
        groups: list[tuple[tuple, list[int]]] = []
        for i, c in enumerate(calls):
            st = self._structure(c.model)
            settings: tuple = ()
            if not st.stacked_gradient:  # said with the gradient; the exchange then runs as deployed, bitwise
                continue
            if _FUSED_ADAM is None:
                reason: str | None = "this torch has no fused Adam kernel"
            elif len({p.dtype for p in st.params}) > 1:
                reason = "its parameters have several dtypes"
            else:
                reason, settings = _optimizer_reason(c.optimizer, st.params)
                if reason is None and settings[0] != "adam":
                    reason = f"its optimizer is {type(c.optimizer).__name__} (only Adam steps are taken together)"
            if reason is not None:
                self._say(f"the averaged gradient at site {c.site.name} is applied sequentially: {reason}")
                continue
            key = (st.signature, settings)
            for gkey, members in groups:
                if gkey == key:
                    members.append(i)
                    break
            else:
                groups.append((key, [i]))
        for (_, settings), members in groups:
            if len(members) > 1:
                c = calls[members[0]]
                role = next((r for r, m in c.site.models.items() if m is c.model), "?")
                self._say(
                    f"the averaged gradients of role {role!r} of {_names([calls[i].site.name for i in members])} "
                    "are applied as one fused Adam step"
                )
                self._apply_group([calls[i] for i in members], settings)
                for i in members:
                    results[i] = True
        return results

    def _apply_group(self, calls: list[ApplyCall], settings: tuple) -> None:
        """``apply_gradient``'s step for every call: each parameter's ``.grad`` set to its gradient, then
        ``torch.optim.Adam``'s step (lazy state, parameters without a gradient skipped) in one kernel call."""
        _, lr, (b1, b2), eps, wd = settings
        params, grads, m, v, steps, own = [], [], [], [], [], []
        with torch.no_grad():
            for c in calls:
                opt, st = c.optimizer, self._structure(c.model)
                for n, p in zip(st.pnames, st.params):
                    g = c.grad.get(n)
                    if g is None:
                        p.grad = None
                        continue
                    p.grad = g.to(device=p.device, dtype=p.dtype).clone()
                    state = opt.state[p]
                    if not state:  # as torch.optim.Adam initializes a parameter's state
                        state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
                        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    params.append(p)
                    grads.append(p.grad)
                    m.append(state["exp_avg"])
                    v.append(state["exp_avg_sq"])
                    step = state["step"]
                    own.append(step)
                    steps.append(step if step.device == p.device else step.to(p.device))  # the kernel reads it there
            if params:
                torch._foreach_add_(steps, 1)
                _fused_adam(params, grads, m, v, steps, lr, b1, b2, eps, wd)
                for mine, used in zip(own, steps):
                    if mine is not used:
                        mine.copy_(used)
        self.vectorized_applies += len(calls)


def _tied(model: nn.Module) -> bool:
    """Whether the model holds one tensor under several names: only then must ``functional_call`` tie
    the names (its untying walks the model at every call)."""
    seen: set[int] = set()
    for _, t in itertools.chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
    ):
        if id(t) in seen:
            return True
        seen.add(id(t))
    return False


def _is_tree(t: Any) -> bool:
    return torch.is_tensor(t) or (isinstance(t, (tuple, list)) and all(_is_tree(e) for e in t))


def _tree_key(t: Any) -> tuple:
    if torch.is_tensor(t):
        return (tuple(t.shape), t.dtype)
    return (type(t).__name__, *(_tree_key(e) for e in t))


def _stack_tree(items: Sequence[Any]) -> Any:
    """Stack K same-shaped trees (tensors, tuples/lists of them) leaf by leaf along a new first dimension."""
    if torch.is_tensor(items[0]):
        return torch.stack(list(items))
    return type(items[0])(_stack_tree([it[j] for it in items]) for j in range(len(items[0])))


def _free_memory(device: torch.device) -> int | None:
    """Bytes a stacked group may take on ``device``: CUDA's free memory plus what torch's caching allocator
    holds unused; None where it is not known (the CPU: no grouping by memory)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def group_size_for(free_bytes: int, site_bytes: int, k: int, headroom: float = 0.8) -> int:
    """Most sites per group so that a group's ``site_bytes`` each fit in ``headroom · free_bytes``, the number
    of groups the least that fit (``ceil(k / fits)``) and their sizes as even as slicing allows (at least 1
    site, at most ``k``).  E.g. 10 sites of which 4 fit: 3 groups of at most 4 → groups of 4, 4, 2."""
    if k <= 1 or site_bytes <= 0:
        return max(k, 1)
    fits = int(free_bytes * headroom) // site_bytes
    if fits >= k:
        return k
    groups = -(-k // max(fits, 1))
    return -(-k // groups)


def _activation_bytes(
    model: nn.Module, x: Any, target: Any, loss: Callable, device: torch.device, precision: str
) -> int:
    """Bytes autograd keeps for the backward pass of ``loss(model(x), target)`` — the tensors saved for
    backward, each storage counted once — from one forward pass on one site's batch (the model and its
    parameters are not changed: they are read through detached copies)."""
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        kept[st.data_ptr()] = st.nbytes()
        return t

    params = {n: p.detach().requires_grad_(True) for n, p in model.named_parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(device, precision):
        loss(functional_call(model, params, (x,)), target)
    return sum(kept.values())


def _fit_site_bytes(item: _Item) -> int:
    """Bytes one site adds to a stacked training group: its weights six times (the stacked weights, their
    gradients as autograd returns them and in the flat buffer, two Adam moments, the step's scratch) and
    twice the activations of one batch (those saved for backward, and the gradients flowing back)."""
    c = item.call
    x, y = next(iter(c.site.batches(c.rnd, c.stream, 1)))  # the site's first batch (a fresh seeded stream)
    params = sum(p.numel() * p.element_size() for p in item.params)
    return 6 * params + 2 * _activation_bytes(item.model, x, y, c.site.workload.loss, c.site.device, c.site.precision)


def _gradient_site_bytes(call: GradientCall, loss: Callable) -> int:
    """Bytes one site adds to a stacked lockstep-gradient group: its weights three times (stacked, their
    gradients, the gradients handed back) and twice the activations of its batch."""
    model = call.site.model(call.role)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return 3 * params + 2 * _activation_bytes(model, call.x, call.target, loss, call.site.device, call.site.precision)


class _FirstStepFailed(Exception):
    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def _names(names: Sequence[str]) -> str:
    return ("site " if len(names) == 1 else "sites ") + ", ".join(names)
