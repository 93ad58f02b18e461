"""Operators dispatched per round, by role and phase: what stands for kernel launches where no GPU is at hand.

:class:`OperatorCounter` is a ``TorchDispatchMode`` (``torch.utils._python_dispatch``): every ATen operator that
reaches the dispatcher (forward, backward, optimizer, copies, views) is counted once.

* the round (the engine's ``algorithm.server_round`` sets it),
* the phase: ``training`` (inside ``algorithm.server_round``), ``validation`` (the engine's ``_validate``),
  ``test`` (the engine's ``test_all``), ``other`` (initialization, checkpoints),
Views (``detach``, ``view``, ``select``, …: no kernel, no arithmetic) are counted apart from the other
operators, which are what a GPU launches kernels for.  Each dispatch is keyed by

* the role of the model last run: ``global``, ``personalized``, ``selector`` (trained), ``routing`` (the
  selector and the gating of a composite while it is evaluated or routes), ``server`` (the server's work outside
  the sites' tasks: aggregation), ``other`` (a site's work before its first model runs in a task: batches).

The role comes from the model a site holds under that role (``site.models``): a global forward pre-hook
(``torch.nn.modules.module.register_module_forward_pre_hook``) looks each top-level module up among the models of
the site whose task runs (the site's ``handle`` is wrapped on the instance), so the backward pass and the optimizer
step that follow a model's forward count for that model.  A model evaluated under a role that does not say whose
it is (``"eval"``, the default predictor's) takes the role of its candidate (``bn_role = "personal"``:
personalized, else global), from the algorithm's predictors, wrapped on the instance.  Nothing in ``fedseg`` is
edited: every hook is set on the engine, its algorithm and its sites from outside.

Approximations: operators of a model's backward and optimizer step count for the model whose forward ran last
(two models trained on one loss count for the second); in a vectorized round (``simulation.vectorize`` on CUDA) the
sites' stacked computation runs outside their models' modules, so its operators count for the role the task last
set.  The dispatch mode is entered in every thread a site's task runs in (the vectorized executor's).
"""

from __future__ import annotations

import collections
import re
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

ROLES = ("global", "personalized", "selector", "routing", "server", "other")
PHASES = ("training", "validation")


def role_of(name: str) -> str | None:
    """The reported role of a site's model role name, or None where the name does not say it (``"eval"``).

    ``global``, ``fedsm-eval/global``, ``frozen/global`` → global; ``personal``, ``fedsm-eval/p3``, ``frozen/p0``
    → personalized; any selector role → selector."""
    if "selector" in name:
        return "selector"
    last = name.rsplit("/", 1)[-1]
    if last == "global":
        return "global"
    if last in ("personal", "local") or re.fullmatch(r"p\d+", last):
        return "personalized"
    return None


class OperatorCounter(TorchDispatchMode):
    """Counts dispatched operators (views apart) by (round, phase, role); :meth:`attach` an engine before its ``run``."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[tuple[int, str, str]] = collections.Counter()
        self.views: collections.Counter[tuple[int, str, str]] = collections.Counter()
        self.ops: collections.Counter[tuple[str, str, str]] = collections.Counter()  # (phase, role, op)
        self.round = 0
        self.phase = "other"
        self.role = "server"
        self.evaluating = False  # inside a composite's evaluation or routing: the selector routes
        self._site: Any = None
        self._hook: Any = None
        self._entered: set[int] = set()

    # ------------------------------------------------------------- dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        (self.views if func.is_view else self.counts)[(self.round, self.phase, self.role)] += 1
        self.ops[(self.phase, self.role, func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))

    # ------------------------------------------------------------- attribution
    def _forward_pre(self, module: torch.nn.Module, _inputs: Any) -> None:
        site = self._site
        if site is None:
            return
        for name, m in site.models.items():
            if m is module:
                role = role_of(name) or self._candidate_role
                if role == "selector" and (self.evaluating or self.phase != "training"):
                    role = "routing"
                self.role = role
                return

    _candidate_role = "global"

    def _wrap_handle(self, site: Any) -> None:
        inner = site.handle

        def handle(task: Any) -> Any:
            prev_site, prev_role, prev_eval = self._site, self.role, self.evaluating
            self._site, self.role = site, "other"
            self.evaluating = task.kind == "route"
            tid = threading.get_ident()
            enter = self not in _get_current_dispatch_mode_stack() and tid not in self._entered
            try:
                if enter:  # a thread of the vectorized executor: the mode is thread-local
                    self._entered.add(tid)
                    with self:
                        return inner(task)
                return inner(task)
            finally:
                if enter:
                    self._entered.discard(tid)
                self._site, self.role, self.evaluating = prev_site, prev_role, prev_eval

        site.handle = handle

    def _wrap_predictors(self, algorithm: Any) -> None:
        inner = algorithm.predictors

        def predictors() -> dict[str, Callable[..., Any]]:
            out = {}
            for kind, make in inner().items():
                out[kind] = self._wrap_maker(kind, make)
            return out

        algorithm.predictors = predictors

    def _wrap_maker(self, kind: str, make: Callable[..., Any]) -> Callable[..., Any]:
        def maker(site: Any, arrays: Any, config: dict) -> Callable[[torch.Tensor], torch.Tensor]:
            role = "personalized" if (config or {}).get("bn_role") == "personal" else "global"
            routes = kind != "model"
            predict = make(site, arrays, config)

            def run(x: torch.Tensor) -> torch.Tensor:
                prev = self._candidate_role, self.evaluating
                self._candidate_role, self.evaluating, self.role = role, routes, "routing" if routes else role
                try:
                    return predict(x)
                finally:
                    self._candidate_role, self.evaluating = prev

            return run

        return maker

    def _wrap_phase(self, obj: Any, name: str, phase: str, sets_round: bool = False) -> None:
        inner = getattr(obj, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            prev = self.phase, self.role
            self.phase, self.role = phase, "server"
            if sets_round:
                self.round = int(args[2])
            try:
                return inner(*args, **kwargs)
            finally:
                self.phase, self.role = prev

        setattr(obj, name, wrapped)

    def attach(self, engine: Any) -> OperatorCounter:
        """Wrap ``engine``'s algorithm (``server_round``, ``predictors``), phases (``_validate``, ``test_all``)
        and sites (``handle``) on the instances; returns self."""
        self._wrap_phase(engine.algorithm, "server_round", "training", sets_round=True)
        self._wrap_predictors(engine.algorithm)
        self._wrap_phase(engine, "_validate", "validation")
        self._wrap_phase(engine, "test_all", "test")
        transport = engine.transport
        sites = getattr(transport, "_sites", None) or {n: transport.site(n) for n in transport.sites}
        for site in sites.values():
            self._wrap_handle(site)
        return self

    def __enter__(self) -> OperatorCounter:
        super().__enter__()
        if self._hook is None:
            self._hook = torch.nn.modules.module.register_module_forward_pre_hook(self._forward_pre)
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if self._hook is not None and threading.get_ident() not in self._entered:
            self._hook.remove()
            self._hook = None

    # ------------------------------------------------------------- results
    def per_round(self, skip_first: bool = True, views: bool = False) -> dict[str, dict[str, float]]:
        """Mean operators per round by ``{role: {phase: count}}``: each phase's operators over the rounds that ran
        it, after the first (whose models and optimizers are built) when there are several.  Views (``detach``,
        ``view``, ``select``: no kernel, no arithmetic) are left out, or (``views``) the only ones counted."""
        counts = self.views if views else self.counts
        out: dict[str, dict[str, float]] = {r: {p: 0.0 for p in PHASES} for r in ROLES}
        for phase in PHASES:
            rounds = sorted({r for r, p, _ in (*self.counts, *self.views) if r > 0 and p == phase})
            use = set(rounds[1:] if skip_first and len(rounds) > 1 else rounds)
            for (rnd, ph, role), c in counts.items():
                if ph == phase and rnd in use:
                    out.setdefault(role, {p: 0.0 for p in PHASES})[phase] += c / len(use)
        return out

    def top_ops(self, phase: str, role: str, k: int = 5) -> list[tuple[str, int]]:
        """The ``k`` most dispatched operators of one phase and role (over every round)."""
        mine = [(op, c) for (ph, ro, op), c in self.ops.items() if ph == phase and ro == role]
        return sorted(mine, key=lambda t: -t[1])[:k]


def table(per_round: dict[str, dict[str, float]]) -> list[str]:
    """Markdown lines: operators per round, role × phase, with totals (roles that dispatched nothing left out)."""
    rows = []
    totals = {p: 0.0 for p in PHASES}
    for role, by in per_round.items():
        if not any(by.values()):
            continue
        rows.append([role, *(f"{by[p]:,.0f}" for p in PHASES), f"{sum(by.values()):,.0f}"])
        for p in PHASES:
            totals[p] += by[p]
    rows.append(["**total**", *(f"**{totals[p]:,.0f}**" for p in PHASES), f"**{sum(totals.values()):,.0f}**"])
    head = ["role", "training", "validation", "round"]
    return ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def total(per_round: dict[str, dict[str, float]]) -> float:
    """Operators of one round (training and validation) over all roles."""
    return sum(sum(by.values()) for by in per_round.values())
