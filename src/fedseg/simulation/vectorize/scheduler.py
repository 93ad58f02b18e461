"""Driving the handlers of one ask together: each advanced to its next request, the requests computed
together, the results sent back; all in the calling thread.

Every handler runs in site order until it asks (:mod:`fedseg.site.calls`: ``yield from site.fit(...)``,
``site.gradient``, ``site.step_with_gradient``) or returns; then each kind of request is computed together
(the executor's ``together`` functions), a request they cannot stack by its site's own executor
(:data:`SEQUENTIAL`), and
each handler goes on with its own result.  Every line of a handler outside those requests runs exactly as it
does sequentially, one site after another.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from fedseg.foundation.messages import Reply
from fedseg.simulation.vectorize.eligibility import Structure
from fedseg.site.calls import ApplyCall, Asks, Call, Executor, FitCall, GradientCall

__all__ = [
    "SEQUENTIAL",
    "ApplyCall",
    "ExecutorState",
    "FitCall",
    "GradientCall",
    "Handler",
    "run_handlers",
    "site_names",
]


@dataclass
class ExecutorState:
    """What the stacked fit loop (``fit``) and the lockstep functions (``lockstep``) share with the
    :class:`~fedseg.simulation.vectorize.executor.VectorizedExecutor` they work for: where the log goes (each
    message said once), whether steps are captured as CUDA graphs, the counts of stacked requests, the CUDA-graph
    arenas and every model's :class:`Structure`."""

    log: Callable[[str], None] = print
    cuda_graphs: bool = True
    vectorized_fits: int = 0
    """Number of ``fit`` calls trained stacked so far (for tests and benchmarks)."""
    vectorized_gradients: int = 0
    """Number of ``gradient`` calls computed stacked so far (for tests and benchmarks)."""
    vectorized_applies: int = 0
    """Number of ``apply_gradient`` steps taken stacked so far (for tests and benchmarks)."""
    arenas: dict[tuple, Any] = field(default_factory=dict)
    """CUDA-graph arenas by group key and stack size, least recently used first."""
    structures: dict[nn.Module, Structure] = field(default_factory=dict)
    """Every model met, walked once (a plain dict: the entries hold their models; the executor lives one run)."""
    said: set[str] = field(default_factory=set)

    def say(self, msg: str) -> None:
        """Log ``msg`` once."""
        if msg not in self.said:
            self.said.add(msg)
            self.log(f"vectorize: {msg}")

    def structure(self, model: nn.Module) -> Structure:
        """The :class:`Structure` of a model, walked once per model object (every round's fits and every
        lockstep step ask for it)."""
        known = self.structures.get(model)
        if known is None:
            known = self.structures[model] = Structure(model)
        return known


@dataclass
class Handler:
    """One site's handler of an ask, as the vectorized executor drives it: the site's name, the task's kind,
    the handler's requests and the site's own executor, which answers every request that is not stacked (a
    :class:`~fedseg.site.calls.LocalExecutor`; under ``privacy.dp = "sample"`` the site's
    :class:`~fedseg.site.dpsgd.DPExecutor`).  ``method``: the run's method, for the log."""

    site: str
    kind: str
    asks: Asks[Reply]
    executor: Executor
    method: str = ""


SEQUENTIAL = object()
"""A ``together`` function's result for a request it does not compute: computed by its site's own executor
instead."""


def run_handlers(
    handlers: Sequence[Asks[Reply]],
    together: dict[type, Callable[[list[Any]], list[Any]]],
    answers: Sequence[Callable[[Call], Any]],
    stackable: Sequence[bool] | None = None,
) -> tuple[list[Reply], list[bool]]:
    """Advance every handler in order to its next request or its end; hand each kind of pending request of the
    ``stackable`` handlers (default: all) to its function (``together``: call type → the function computing a
    list of them); send each handler its result (:data:`SEQUENTIAL`, and every request of a handler that is not
    stackable: computed by the handler's own ``answers[i]``, in site order); until all are done.  Returns the
    replies and, per handler, whether it asked for anything.  A handler's error closes the others and is raised
    here."""
    n = len(handlers)
    pending: list[Any] = [None] * n
    replies: list[Any] = [None] * n
    asked = [False] * n
    done = [False] * n
    stacks = list(stackable) if stackable is not None else [True] * n

    def advance(i: int, value: Any) -> None:
        try:
            pending[i] = handlers[i].send(value)
            asked[i] = True
        except StopIteration as stop:
            replies[i], pending[i], done[i] = stop.value, None, True

    try:
        for i in range(n):
            advance(i, None)
        while not all(done):
            live = [i for i in range(n) if not done[i]]
            results: dict[int, Any] = {}
            for kind, compute in together.items():
                group = [i for i in live if stacks[i] and isinstance(pending[i], kind)]
                if group:
                    for i, r in zip(group, compute([pending[i] for i in group])):
                        results[i] = r
            for i in live:
                r = results.get(i, SEQUENTIAL)
                advance(i, answers[i](pending[i]) if r is SEQUENTIAL else r)
    except BaseException:
        for h in handlers:
            h.close()
        raise
    return replies, asked


def site_names(names: Sequence[str]) -> str:
    """ "site a" or "sites a, b, c", for the log."""
    return ("site " if len(names) == 1 else "sites ") + ", ".join(names)
