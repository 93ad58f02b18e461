"""CUDA graphs: a stack's static buffers kept across rounds (:class:`Arena`, one per group key and stack size)
and its local step captured once and replayed (:func:`graph_step`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fedseg.simulation.vectorize.layout import Layout
from fedseg.simulation.vectorize.optimizer import StackedOptimizer

GRAPH_WARMUP_STEPS = 2
"""Eager steps a group takes (on a side stream, as CUDA graph capture asks) before its step is captured."""

_CPU_KEEP_BYTES = 32 << 20
"""On the CPU, a stack keeps its buffers across rounds when one of them is at least this large: glibc's largest
mmap threshold on 64-bit Linux (``DEFAULT_MMAP_THRESHOLD_MAX``), above which every allocation is fresh pages
from the kernel, returned to it when freed; smaller buffers are reused from the heap."""

_MAX_ARENAS = 16
"""Arenas kept (each holds its stack's buffers and its captured steps): one per role and stack size, so a group
that regroups as its sites finish (epoch mode, sites of different sizes) keeps one per size it passes through;
beyond this many the least recently used goes."""


class Arena:
    """The static tensors of one vectorized group on CUDA, kept across rounds so that its local step can be
    captured once as a CUDA graph and replayed: the flat weights (with their ``K × shape`` differentiable
    views), Adam's moments, the gradient buffer, the step count, the stacked batch and the
    per-site losses.  Each round copies the sites' weights and moments in and out, as without an arena, so one
    arena serves any stack of its size.  Its captured steps allocate their intermediate tensors from ``pool``, a
    CUDA graph memory pool shared by all the executor's arenas on the device: a captured step leaves nothing
    allocated in it (its results go to the arena's own tensors, made outside capture) and steps run one at a
    time, so the pool holds the largest step's intermediates, not the sum over stacks."""

    def __init__(self, layout: Layout, flat_like: torch.Tensor, buffers: dict[str, torch.Tensor], pool: Any = None):
        self.pool = pool
        self.flat = torch.empty(layout.numel, dtype=flat_like.dtype, device=flat_like.device)
        self.m, self.v = torch.zeros_like(self.flat), torch.zeros_like(self.flat)
        self.gbuf = torch.empty_like(self.flat)
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
        a row without a batch keeps its last one (its step is computed and masked away; the stacks of a group that
        regroups as its sites finish have no such row).  False, and nothing copied, when a batch's shape or dtype
        is not the static one's, or before every site has filled its row."""
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


def arena_for(
    arenas: dict[tuple, Arena],
    key: tuple,
    device: torch.device,
    opt: torch.optim.Optimizer,
    layout: Layout,
    like: torch.Tensor,
    buffers: dict[str, torch.Tensor],
    say: Callable[[str], None] = print,
) -> Arena | None:
    """The stack's :class:`Arena` (``key``: its group key and size) for a plain Adam (made at its first fit,
    kept in ``arenas`` across rounds, at most :data:`_MAX_ARENAS`), None for SGD, and None (the stack steps
    eagerly, said once) when its buffers do not fit in memory.

    On CUDA its step is captured (:func:`graph_step`).  On the CPU it only keeps the stack's buffers, and only
    when they are of :data:`_CPU_KEEP_BYTES` or more (the weights of 5 sites of the default U-Net): glibc
    allocates such a buffer as fresh pages from the kernel and frees it back, so a stack that allocated them
    anew every round would fault in every page of them every round (about a tenth of a round at 64²)."""
    if device.type not in ("cuda", "cpu") or type(opt) is not torch.optim.Adam:
        return None
    if device.type == "cpu" and layout.numel * like.element_size() < _CPU_KEEP_BYTES:
        return None
    arena = arenas.pop(key, None)
    if arena is None:
        if len(arenas) >= _MAX_ARENAS:  # the least recently used stack's memory goes
            arenas.pop(next(iter(arenas)))
        pool = next((a.pool for a in arenas.values() if a.flat.device == device), None)
        try:
            if device.type == "cuda" and pool is None:
                pool = torch.cuda.graph_pool_handle()
            arena = Arena(layout, like, buffers, pool)
        except torch.OutOfMemoryError:
            say(f"a stack of {layout.k} sites has no memory for a captured step's buffers; it steps eagerly")
            return None
    arenas[key] = arena  # now the most recently used
    return arena


def graph_step(
    arena: Arena,
    opt: StackedOptimizer,
    losses_of: Any,
    pnames: list[str],
    role: str,
    variant: str,
    active: list[int],
    say: Callable[[str], None],
):
    """One local step of the stack from the arena's static batch: every row is computed (a site that is not
    ``active`` on its last batch, which a stack that regroups as its sites finish never has) and the step is
    ``"fused"`` (every site active at one Adam step count: torch's fused Adam kernel) or ``"masked"`` (the
    others: sites at different step counts, :meth:`StackedOptimizer.masked_kernels`, inactive rows
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
            with torch.cuda.graph(graph, pool=arena.pool):
                step()
        except Exception as e:  # e.g. an operation that synchronizes with the host: eager from now on
            arena.failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            say(
                f"role {role!r}: its local step could not be captured as a CUDA graph; it runs eagerly ({arena.failed})"
            )
            opt.s, opt.taken = saved
            return None
        arena.graphs[variant] = graph
        what = "every site at one step count" if variant == "fused" else "sites at different step counts"
        say(f"role {role!r}: the vectorized local step runs as a captured CUDA graph ({what}; simulation.cuda_graphs)")
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
