"""The stacked fit: K sites' :meth:`Site.fit` calls trained as one computation.

The K models' parameters are stacked into one flat buffer (:class:`Layout`) and each site's model
parameters become *views* of its rows for the duration of the call, so anything a handler's hook does to
its model (``extra_loss``, ``after_backward``, ``after_step``) acts on the stacked
weights.  Each local step draws every site's batch from its own seeded stream, runs the workload loss of
all sites in one ``torch.func.vmap`` over ``torch.func.functional_call``, adds each site's ``extra_loss``
gradient and lets its ``after_backward`` edit its row, then steps a stacked, masked Adam or SGD
(:class:`StackedOptimizer`) and lets each site's ``after_step`` edit its row of the weights.  Everything comes
from the calls (:class:`~fedseg.site.calls.FitCall`): their models, optimizers, batches, loss and precision.  At the end the rows are copied back into each site's own model and the
moments into each site's own optimizer state.

Sites of a group need not take the same number of steps (epoch mode with sites of different sizes).  When a
site's batches end, the group *regroups* (:func:`train_group`): the finished sites' rows and moments are copied
back as at the end, and the sites still training go on as a stack of their own without those rows, packed from
their rows of the larger stack (weights, moments, step counts; their batch streams and loss sums go with them).  A stacked step therefore computes only the rows of sites that
still train: a round costs the sites' Σ steps of arithmetic, as sequentially, in max(steps) stacked steps.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, vmap

from fedseg.foundation.device import autocast
from fedseg.simulation.vectorize.eligibility import optimizer_reason
from fedseg.simulation.vectorize.graphs import Arena, arena_for, graph_step
from fedseg.simulation.vectorize.layout import Layout
from fedseg.simulation.vectorize.optimizer import StackedOptimizer
from fedseg.simulation.vectorize.scheduler import SEQUENTIAL, ExecutorState, FitCall, site_names


@dataclass
class FitItem:
    index: int
    call: FitCall
    model: nn.Module
    opt: torch.optim.Optimizer
    params: list[torch.Tensor]  # the model's parameters, in order
    key: tuple  # (role, model signature, optimizer settings, device, precision): who can be stacked together


@dataclass
class _Progress:
    """Where one site's round stands, carried from stack to stack when its group regroups: its batch stream,
    its loss sum on the device and its steps taken."""

    batches: Iterator
    total: torch.Tensor
    count: int = 0


class _FirstStepFailed(Exception):
    """A group's first step failed (nothing has been updated yet): ``error`` says why."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def check_fit(ex: ExecutorState, index: int, call: FitCall) -> tuple[FitItem | None, str | None]:
    """The call as an :class:`FitItem` that can be stacked, or why it cannot."""
    model, opt = call.model, call.optimizer
    if call.precision == "fp16":
        return None, "fp16 loss scaling (a GradScaler per site)"
    if not isinstance(opt, torch.optim.Optimizer):
        return None, f"it steps with {type(opt).__name__}, not a torch optimizer"
    st = ex.structure(model)
    signature, reason = st.signature, st.reason
    params: list[torch.Tensor] = list(st.params)
    if reason is None and len({p.dtype for p in params}) > 1:
        reason = "its parameters have several dtypes"
    settings: tuple = ()
    if reason is None:
        reason, settings = optimizer_reason(opt, params)
    if reason is not None:
        return None, reason
    key = (call.role, signature, settings, str(call.device), call.precision)
    return FitItem(index, call, model, opt, params, key), None


def train(ex: ExecutorState, items: list[FitItem]) -> list[Any]:
    """Train a group; on a CUDA out-of-memory error at its first step, train its halves instead; on any other
    error at its first step, its sites train sequentially (``SEQUENTIAL``)."""
    try:
        return train_group(ex, items)
    except _FirstStepFailed as e:
        if isinstance(e.error, torch.OutOfMemoryError) and len(items) > 1:
            half = len(items) // 2
            ex.say(
                f"a group of {len(items)} sites does not fit in memory; training groups of at most {half} (set simulation.vectorize_group)"
            )
            return train(ex, items[:half]) + train(ex, items[half:])
        names = site_names([it.call.site for it in items])
        ex.say(
            f"role {items[0].call.role!r} of {names} trains sequentially: its loss does not run under torch.func.vmap ({type(e.error).__name__}: {e.error})"
        )
        return [SEQUENTIAL] * len(items)


def _arena_key(items: list[FitItem]) -> tuple:
    """A CUDA-graph arena serves every stack of one group key and size (its contents are copied in and out at
    each stack's start and end): one captured step per stack size."""
    return (items[0].key, len(items))


class StackedFit:
    """One stack's training state: the flat weights and their ``K × shape`` differentiable blocks (each site's
    parameters viewing its row while it trains), the stacked buffers, the stacked optimizer, the vmapped
    loss, and each site's :class:`_Progress` (its batch stream and loss sum, carried over from the stack
    before it when its group regroups)."""

    def __init__(
        self,
        ex: ExecutorState,
        items: list[FitItem],
        progress: list[_Progress],
        carry: tuple[StackedOptimizer, list[int]] | None = None,
    ):
        self.items = items
        self.progress = progress
        self.calls = [it.call for it in items]
        self.models = [it.model for it in items]
        self.k = k = len(items)
        call0 = self.calls[0]
        dev, precision, loss_fn = call0.device, call0.precision, call0.loss
        template = self.models[0]
        st = ex.structure(template)
        self.pnames, tied = st.pnames, st.tied
        self.plist = plist = [it.params for it in items]
        self.layout = layout = Layout(plist[0], k)
        for m in self.models:
            ex.structure(m).train()
        blist = [ex.structure(m).buffers() for m in self.models]
        with torch.no_grad():
            buffers = {n: torch.stack([b[n] for b in blist]) for n in st.bnames}
        arena: Arena | None = None
        # the CPU keeps a stack's buffers across rounds too (:func:`arena_for`); only CUDA captures its step
        self.capture = ex.cuda_graphs and dev.type == "cuda"
        if self.capture or dev.type == "cpu":
            arena = arena_for(ex.arenas, _arena_key(items), dev, items[0].opt, layout, plist[0][0], buffers, ex.say)
        self.arena = arena
        with torch.no_grad():
            self.flat = layout.pack(plist, out=None if arena is None else arena.flat)  # every site's parameters
            if arena is not None:
                for n, b in buffers.items():
                    arena.buffers[n].copy_(b)
                buffers = arena.buffers
        self.buffers = buffers
        self.weights = (
            arena.weights if arena is not None else [b.requires_grad_(True) for b in layout.blocks(self.flat)]
        )
        for i, ps in enumerate(plist):  # each site's parameters view its row while it trains
            for p, w in zip(ps, self.weights):
                p.data = w.detach()[i]
        self.opt = StackedOptimizer([it.opt for it in items], plist, self.flat, layout, arena, carry)
        self.gbuf = torch.empty_like(self.flat) if arena is None else arena.gbuf
        self.active = list(range(k))

        def site_loss(
            params: dict[str, torch.Tensor], bufs: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
        ) -> torch.Tensor:
            with autocast(dev, precision, cache=not self.capture):
                return loss_fn(functional_call(template, (params, bufs), (x,), tie_weights=tied), y)

        self.losses_of = vmap(site_loss, randomness="error")
        # no per-site hook (FedProx's term, SCAFFOLD's correction): a step is one fixed computation
        self.hookless = not any(c.extra_loss or c.after_backward or c.after_step for c in self.calls)

    def next_batches(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The next batch of every active site (site index → (x, y)); a site whose stream has ended leaves."""
        batch: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i in list(self.active):
            b = next(self.progress[i].batches, None)
            if b is None:
                self.active.remove(i)
            else:
                batch[i] = b
        return batch

    def step(self, ex: ExecutorState, batch: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """One local step of the sites in ``batch``: the captured step where it applies, else the eager one
        (:func:`stacked_gradients` and :meth:`StackedOptimizer.step`); returns the per-site losses."""
        arena = self.arena
        if (
            arena is not None
            and self.capture
            and self.hookless
            and arena.failed is None
            and arena.load_batch(batch, self.k)
        ):
            variant = "fused" if self.opt.fused_ready(list(batch)) else "masked"
            role = self.calls[0].role
            losses = graph_step(arena, self.opt, self.losses_of, self.pnames, role, variant, list(batch), ex.say)
            if losses is not None:
                return losses
        grads, losses = stacked_gradients(
            batch,
            self.weights,
            self.pnames,
            self.layout,
            self.buffers,
            self.losses_of,
            self.calls,
            self.models,
            self.plist,
            self.gbuf,
        )
        self.opt.step(grads, list(batch))
        return losses

    def after_step(self, batch: dict[int, Any], losses: Any) -> None:
        """Each stepped site's ``after_step`` (acting on its model, whose parameters view its row) and its loss
        sum."""
        for i in batch:
            hook = self.calls[i].after_step
            if hook is not None:
                hook(self.models[i])
            self.progress[i].total += losses[i]
            self.progress[i].count += 1

    def regroup(self, ex: ExecutorState, rest: list[int]) -> StackedFit:
        """The sites ``rest`` as a stack of their own, going on from where they are (their rows of the weights
        and moments, their step counts, batch streams and loss sums); the others' rows written back, as at
        the end of the round."""
        gone = [i for i in range(self.k) if i not in rest]
        with torch.no_grad():
            for i in gone:
                for p, w in zip(self.plist[i], self.weights):
                    p.data = w.detach()[i].clone()
            self.opt.write_back(gone)
        # the sites in ``rest`` still view their rows here: the new stack packs its weights from them
        return StackedFit(ex, [self.items[i] for i in rest], [self.progress[i] for i in rest], (self.opt, rest))

    @torch.no_grad()
    def finish(self, done: bool) -> None:
        """Every site's parameters back to tensors of their own; when the stack's work completed (its round,
        or its part before a regroup), the moments too."""
        for i, ps in enumerate(self.plist):
            for p, w in zip(ps, self.weights):
                p.data = w.detach()[i].clone()
        if done:
            self.opt.write_back()


def train_group(ex: ExecutorState, items: list[FitItem]) -> list[dict[str, float]]:
    """Train the group's sites together for their round; an error at the first step is :class:`_FirstStepFailed`.

    When some sites' batches have ended, the others regroup (:meth:`StackedFit.regroup`): the finished sites'
    rows and moments are written back and a stack of the sites still training, packed from their rows, takes
    their next step, so no step computes a finished site's row."""
    progress = [
        _Progress(iter(c.batches), torch.zeros((), dtype=torch.float64, device=c.device))
        for c in (it.call for it in items)
    ]
    fit = StackedFit(ex, items, progress)
    first, done = True, False
    try:
        while batch := fit.next_batches():
            if len(batch) < fit.k:  # some sites have finished their round: go on without their rows
                rest = sorted(batch)
                fit = fit.regroup(ex, rest)
                batch = {j: batch[i] for j, i in enumerate(rest)}
            try:
                losses = fit.step(ex, batch)
            except Exception as e:
                if first:
                    # the stack's arena (CUDA graphs) goes with it: its memory is what did not fit, or it never stepped
                    ex.arenas.pop(_arena_key(fit.items), None)
                    raise _FirstStepFailed(e) from e
                raise
            first = False
            fit.after_step(batch, losses)
        done = True
    finally:
        fit.finish(done)
    ex.vectorized_fits += len(items)
    return [{"loss": float(p.total) / max(p.count, 1), "steps": p.count} for p in progress]


def stacked_gradients(batch, weights, pnames, layout, buffers, losses_of, calls, models, plist, gbuf):
    """The flat gradient (:class:`Layout`) of every site's loss (plus its ``extra_loss``, edited by its
    ``after_backward``) at the current weights, and each site's loss."""
    k = weights[0].shape[0]
    by_shape: dict[tuple, list[int]] = {}
    for i, (x, y) in batch.items():
        by_shape.setdefault((x.shape, x.dtype, y.shape, y.dtype), []).append(i)
    losses: dict[int, torch.Tensor] = {}
    if sum(len(idx) for idx in by_shape.values()) < k:  # a row no batch writes: its gradient is zero
        gbuf.zero_()
    for idx in by_shape.values():
        if idx == list(range(k)):
            leaves, bufs = weights, buffers
        else:  # some sites' batches differ in shape (an epoch's smaller last batch): a vmap over their rows
            rows: Any = slice(idx[0], idx[-1] + 1) if idx == list(range(idx[0], idx[-1] + 1)) else None
            sel = torch.tensor(idx, device=weights[0].device)
            # the rows' weights as leaves of their own: the gradient comes back for these rows only
            leaves = [(w.detach()[rows] if rows is not None else w.detach().index_select(0, sel)) for w in weights]
            leaves = [t.requires_grad_(True) for t in leaves]
            bufs = {n: (b[rows] if rows is not None else b.index_select(0, sel)) for n, b in buffers.items()}
        x = torch.stack([batch[i][0] for i in idx])
        y = torch.stack([batch[i][1] for i in idx])
        out = losses_of(dict(zip(pnames, leaves)), bufs, x, y)
        gs = torch.autograd.grad(out.sum(), leaves, allow_unused=True)
        if leaves is weights:
            parts = [(torch.zeros_like(w) if gj is None else gj).reshape(-1) for gj, w in zip(gs, weights)]
            torch.cat(parts, out=gbuf)  # the flat layout, in the executor's buffer
        else:
            with torch.no_grad():
                for blk, gj, leaf in zip(layout.blocks(gbuf), gs, leaves):
                    gj = torch.zeros_like(leaf) if gj is None else gj
                    if rows is not None:
                        blk[rows].copy_(gj)
                    else:
                        blk.index_copy_(0, sel, gj)
        for j, i in enumerate(idx):
            losses[i] = out[j].detach()
    grads = gbuf
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
