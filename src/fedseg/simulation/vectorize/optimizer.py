"""K sites' Adam and SGD over stacked parameters, and the one Adam step everything goes through (:func:`adam_`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch.optim.adam import adam as _torch_adam

from fedseg.simulation.vectorize.layout import Layout


class StaticBuffers(Protocol):
    """The static buffers a stacked Adam steps in when its step is captured as a CUDA graph
    (:class:`fedseg.simulation.vectorize.graphs.Arena`): the moments, the fused kernel's step count, and the
    masked step's per-element mask, step sizes and bias corrections (made at their first use)."""

    m: torch.Tensor
    v: torch.Tensor
    step: torch.Tensor
    mask: torch.Tensor | None
    step_size: torch.Tensor | None
    bc2: torch.Tensor | None


_CPU_CHUNK = 1 << 16
"""Elements per piece of an Adam step on the CPU: each op's pass stays in cache (one pass per op over a
K·P buffer would stream it from memory seven times); on CUDA a step is one piece."""


def scalar_dtype() -> torch.dtype:
    """The dtype ``torch.optim.Adam`` gives a parameter's step count (not fused): float64 under a float64
    default dtype, else float32."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def adam_factors(steps: Sequence[float], lr: float, b1: float, b2: float) -> tuple[list[float], list[float]]:
    """Per site, Adam's signed step size −lr / (1 − β₁ᵗ) and √(1 − β₂ᵗ) at step count t (t ≥ 1; a site still at
    t = 0 gets t = 1's, it is masked anyway) — ``torch.optim.Adam``'s bias corrections, in Python floats as torch
    computes them."""
    t = [max(s, 1.0) for s in steps]
    return [-(lr / (1 - b1**ti)) for ti in t], [(1 - b2**ti) ** 0.5 for ti in t]


def adam_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    m: list[torch.Tensor],
    v: list[torch.Tensor],
    *,
    lr: float,
    b1: float,
    b2: float,
    eps: float,
    weight_decay: float = 0.0,
    steps: list[torch.Tensor] | None = None,
    factors: tuple[float | torch.Tensor, float | torch.Tensor] | None = None,
    mask: torch.Tensor | None = None,
) -> None:
    """One plain Adam step (no amsgrad, not maximizing), in place — the only Adam step of the package.

    With ``steps`` (one step-count tensor per parameter tensor, advanced by one here) every element of every
    tensor steps: torch's fused Adam kernel, through the public functional ``torch.optim.adam.adam(fused=True)``
    (``Adam(fused=True)``'s arithmetic; the tensors may be any number, e.g. every site's own).

    Otherwise ``factors`` = (step size, √bias correction 2) of :func:`adam_factors`, floats or per-element
    tensors, and one tensor each (a flat buffer): torch's single-tensor arithmetic, m ← m + (1 − β₁)(g − m),
    v ← β₂ v + (1 − β₂) g², p ← p + step_size · m / (√v / bc2_sqrt + eps), at the elements where ``mask`` is
    true (None: all); elsewhere ``p``, ``m`` and ``v`` stay bitwise as they are.  No host synchronization.
    On the CPU the buffer is stepped in cache-sized pieces."""
    if steps is not None:
        _torch_adam(
            params,
            grads,
            m,
            v,
            [],
            steps,
            fused=True,
            amsgrad=False,
            beta1=b1,
            beta2=b2,
            lr=lr,
            weight_decay=weight_decay,
            eps=eps,
            maximize=False,
        )
        return
    assert factors is not None and len(params) == 1
    p, g, mm, vv = params[0], grads[0], m[0], v[0]
    if weight_decay != 0:
        g = g.add(p, alpha=weight_decay)
    n = p.numel()
    chunk = n if p.device.type == "cuda" else _CPU_CHUNK
    for a in range(0, n, chunk):
        sl = slice(a, a + chunk)
        size, bc2 = (f if isinstance(f, float) else f[sl] for f in factors)
        _adam_piece_(p[sl], g[sl], mm[sl], vv[sl], None if mask is None else mask[sl], size, bc2, eps, b1, b2)


def _adam_piece_(p, g, m, v, mask, step_size, bc2_sqrt, eps: float, b1: float, b2: float) -> None:
    if mask is None:  # every element steps: in place, torch's single-tensor sequence of operations
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = v.sqrt().div_(bc2_sqrt).add_(eps)
        if isinstance(step_size, float):
            p.addcdiv_(m, denom, value=step_size)
        else:
            p.add_(torch.div(m, denom, out=denom).mul_(step_size))
        return
    m_new = m.lerp(g, 1 - b1)
    v_new = v.mul(b2).addcmul_(g, g, value=1 - b2)
    denom = (v_new.sqrt() / bc2_sqrt).add_(eps)
    update = step_size * m_new / denom
    p.copy_(torch.where(mask, p + update, p))
    m.copy_(torch.where(mask, m_new, m))
    v.copy_(torch.where(mask, v_new, v))


class StackedOptimizer:
    """K sites' Adam (or SGD) as stacked moments and per-site step counts; steps only the active sites.

    Weights and moments are flat buffers (:class:`Layout`), so a step is a handful of kernels
    whatever the number of parameter tensors.  Every Adam step is :func:`adam_`: with every site active at
    one step count torch's fused kernel over the whole buffer, otherwise the single-tensor arithmetic with
    per-site factors and a mask of the active sites.  Both equal a sequential step to rounding."""

    def __init__(
        self,
        opts: Sequence[torch.optim.Optimizer],
        plist: Sequence[Sequence[torch.Tensor]],
        flat: torch.Tensor,
        layout: Layout,
        arena: StaticBuffers | None = None,
        carry: tuple[StackedOptimizer, Sequence[int]] | None = None,
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

        self._factors: dict[tuple[float, ...], torch.Tensor] = {}
        # set below for the optimizer's kind: Adam's step counts and stacked moments, or SGD's momentum buffers
        self.s: list[float]
        self.m: torch.Tensor
        self.v: torch.Tensor
        self.has: list[bool]
        self.buf: torch.Tensor
        self.taken = [0] * len(opts)
        # the fused kernel's step count (a tensor, as it asks; a captured step reads the arena's)
        self._step: torch.Tensor | None = None if arena is None else arena.step
        if carry is not None:  # the rows ``rows`` of a larger stack's optimizer, whose sites go on in this one
            old, rows = carry
            with torch.no_grad():
                if self.adam:
                    self.s = [old.s[i] for i in rows]
                    self.m = old.rows(old.m, rows, layout, None if arena is None else arena.m)
                    self.v = old.rows(old.v, rows, layout, None if arena is None else arena.v)
                else:
                    self.has = [old.has[i] for i in rows]
                    self.buf = old.rows(old.buf, rows, layout)
            return
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

    def rows(
        self, flat: torch.Tensor, rows: Sequence[int], layout: Layout, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The sites ``rows`` of a flat buffer of this stack's layout, as a flat buffer of ``layout``, a stack of
        those sites (``out``: into that one)."""
        blocks = self.layout.blocks(flat)
        return layout.pack([[b[i] for b in blocks] for i in rows], out=out)

    def _adam_settings(self) -> dict:
        g = self.g
        b1, b2 = g["betas"]
        return {"lr": float(g["lr"]), "b1": b1, "b2": b2, "eps": float(g["eps"])}

    def _decay(self, grad: torch.Tensor) -> None:
        """Adam's (L2) weight decay added to ``grad`` in place (the executor's own buffer), before every step."""
        if self.g["weight_decay"] != 0:
            grad.add_(self.flat, alpha=self.g["weight_decay"])

    def fused_ready(self, active: Sequence[int]) -> bool:
        """Whether the next step of ``active`` is one call of the fused Adam kernel (every site, one step count)."""
        return self.adam and len(active) == len(self.opts) and len(set(self.s)) == 1

    @torch.no_grad()
    def begin_fused(self) -> None:
        """The host side of a fused step (:meth:`fused_ready`): step counts, the kernel's step tensor set to the
        count before the step (the kernel advances it).  :meth:`fused_kernels` is the device side (what a CUDA
        graph captures)."""
        for i in range(len(self.opts)):
            self.taken[i] += 1
        if self._step is None:
            self._step = torch.zeros((), dtype=torch.float32, device=self.flat.device)
        self._step.fill_(self.s[0])
        self.s = [si + 1.0 for si in self.s]

    @torch.no_grad()
    def fused_kernels(self, grad: torch.Tensor) -> None:
        """The device work of a fused Adam step of every site (after :meth:`begin_fused`); no host sync."""
        assert self._step is not None
        self._decay(grad)
        adam_([self.flat], [grad], [self.m], [self.v], steps=[self._step], **self._adam_settings())

    @torch.no_grad()
    def begin_masked(self, active: Sequence[int], arena: StaticBuffers) -> None:
        """The host side of an Adam step of ``active`` only (the others' rows, parameters and moments, stay
        exactly as they are), for :meth:`masked_kernels`: step counts, and the arena's per-element mask,
        step sizes and bias corrections (static tensors a CUDA graph reads) filled for this step."""
        b1, b2 = self.g["betas"]
        k = len(self.opts)
        for i in active:
            self.taken[i] += 1
        on = [i in active for i in range(k)]
        self.s = [si + (1.0 if a else 0.0) for si, a in zip(self.s, on)]
        step_size, bc2 = adam_factors(self.s, self.g["lr"], b1, b2)
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
    def masked_kernels(self, grad: torch.Tensor, arena: StaticBuffers) -> None:
        """The device work of :meth:`begin_masked`'s step (the arithmetic of :meth:`step` for a subset of
        sites, with per-element factors); no host sync."""
        assert arena.step_size is not None and arena.bc2 is not None
        factors = (arena.step_size, arena.bc2)
        self._decay(grad)
        adam_([self.flat], [grad], [self.m], [self.v], factors=factors, mask=arena.mask, **self._adam_settings())

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

    def _mask(self, active: Sequence[int]) -> torch.Tensor | None:
        """Per element, whether its site is active (None when every site is)."""
        k = len(self.opts)
        if len(active) == k:
            return None
        return self.layout.per_element(torch.tensor([i in active for i in range(k)], device=self.flat.device))

    @torch.no_grad()
    def step(self, grad: torch.Tensor, active: Sequence[int]) -> None:
        """One eager step of the ``active`` sites with the flat gradient ``grad`` (the executor's own buffer)."""
        if not self.adam:
            self._sgd_step(grad, active)
            return
        if self.fused_ready(active):
            self.begin_fused()
            self.fused_kernels(grad)
            return
        for i in active:
            self.taken[i] += 1
        b1, b2 = self.g["betas"]
        self.s = [si + (1.0 if i in active else 0.0) for i, si in enumerate(self.s)]
        sizes, bc2s = adam_factors(self.s, self.g["lr"], b1, b2)
        self._decay(grad)
        if self.flat.device.type == "cpu":
            self._adam_by_rows(grad, active, sizes, bc2s)
            return
        factors = (self._factor(sizes), self._factor(bc2s))
        adam_(
            [self.flat], [grad], [self.m], [self.v], factors=factors, mask=self._mask(active), **self._adam_settings()
        )

    def _adam_by_rows(self, grad: torch.Tensor, active: Sequence[int], sizes: list[float], bc2s: list[float]) -> None:
        """The Adam step of the ``active`` sites at their own step counts, on the CPU: parameter block by block,
        each run of consecutive active sites with the same factors one :func:`adam_` call on its rows (contiguous
        in the block) with the factors as Python floats — torch's single-tensor arithmetic, as at one step count —
        and the other rows not touched.  Per-element factor and mask tensors would cost a pass over the whole
        K·P buffer each to build, more than the step itself."""
        runs: list[tuple[int, int]] = []  # [first, last + 1) of consecutive active sites with equal factors
        for i in sorted(active):
            if runs and runs[-1][1] == i and (sizes[i], bc2s[i]) == (sizes[runs[-1][0]], bc2s[runs[-1][0]]):
                runs[-1] = (runs[-1][0], i + 1)
            else:
                runs.append((i, i + 1))
        settings = self._adam_settings()
        for start, n in zip(self.layout.starts, self.layout.sizes):
            for a, b in runs:
                sl = slice(start + a * n, start + b * n)
                adam_([self.flat[sl]], [grad[sl]], [self.m[sl]], [self.v[sl]], factors=(sizes[a], bc2s[a]), **settings)

    def _sgd_step(self, grad: torch.Tensor, active: Sequence[int]) -> None:
        for i in active:
            self.taken[i] += 1
        mask = self._mask(active)
        g, p = self.g, self.flat
        if g["weight_decay"] != 0:
            grad.add_(p, alpha=g["weight_decay"])
        mom, damp, nesterov = g["momentum"], g["dampening"], g["nesterov"]
        if mom != 0:
            if all(self.has):
                buf = self.buf.mul(mom).add_(grad, alpha=1 - damp)
            elif not any(self.has):
                buf = grad.clone()
            else:
                has = self.layout.per_element(torch.tensor(self.has, device=p.device))
                buf = torch.where(has, self.buf.mul(mom).add(grad, alpha=1 - damp), grad)
            self.buf.copy_(buf if mask is None else torch.where(mask, buf, self.buf))
            grad = grad.add(buf, alpha=mom) if nesterov else buf
        new = p.add(grad, alpha=-g["lr"])
        p.copy_(new if mask is None else torch.where(mask, new, p))
        self.has = [h or i in active for i, h in enumerate(self.has)]

    @torch.no_grad()
    def write_back(self, sites: Sequence[int] | None = None) -> None:
        """Each site's (``sites``: those sites') moments into its own optimizer's state (as ``torch.optim`` keeps
        them)."""
        blocks = (
            {key: self.layout.blocks(t) for key, t in (("exp_avg", self.m), ("exp_avg_sq", self.v))}
            if self.adam
            else ({"momentum_buffer": self.layout.blocks(self.buf)} if self.g["momentum"] != 0 else {})
        )
        for i, (opt, ps) in enumerate(zip(self.opts, self.plist)):
            if self.taken[i] == 0 or (sites is not None and i not in sites):
                continue
            for j, p in enumerate(ps):
                st = opt.state[p]
                if self.adam:
                    dtype = st["step"].dtype if "step" in st else scalar_dtype()
                    st["step"] = torch.tensor(self.s[i], dtype=dtype)
                for key, bl in blocks.items():
                    st[key] = bl[j][i].clone()
