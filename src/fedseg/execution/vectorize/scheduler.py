"""Driving the handlers of one ask together: each advanced to its next request, the requests computed
together, the results sent back; all in the calling thread.

Every handler runs in site order until it asks (:mod:`fedseg.site.calls`: ``yield from site.fit(...)``,
``site.gradient``, ``site.step_with_gradient``) or returns; then each kind of request is computed together
(the executor's ``together`` functions), a request they cannot stack at its site (:data:`SEQUENTIAL`), and
each handler goes on with its own result.  Every line of a handler outside those requests runs exactly as it
does sequentially, one site after another.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from torch import nn

from fedseg.foundation.messages import Reply
from fedseg.site.calls import ApplyCall, Asks, Call, FitCall, GradientCall

__all__ = ["SEQUENTIAL", "ApplyCall", "ExecutorState", "FitCall", "GradientCall", "run_handlers", "site_names"]


class ExecutorState(Protocol):
    """What the stacked fit loop (``fit``) and the lockstep functions (``lockstep``) use of the
    :class:`~fedseg.execution.vectorize.executor.VectorizedExecutor` they work for; its module imports theirs,
    so they name it by this protocol."""

    cuda_graphs: bool
    vectorized_fits: int
    vectorized_gradients: int
    vectorized_applies: int
    arenas: dict[tuple, Any]  # CUDA-graph arenas by group key and stack size, least recently used first

    def say(self, msg: str) -> None: ...

    def structure(self, model: nn.Module) -> Any: ...

    def train_group(self, items: list[Any]) -> list[dict[str, float]]: ...

    def stacked_gradients(self, *args: Any) -> tuple[Any, Any]: ...


SEQUENTIAL = object()
"""A ``together`` function's result for a request it does not compute: computed at its site instead."""


def run_handlers(
    handlers: Sequence[Asks[Reply]],
    together: dict[type, Callable[[list[Any]], list[Any]]],
    answer: Callable[[Call], Any],
) -> tuple[list[Reply], list[bool]]:
    """Advance every handler in order to its next request or its end; hand each kind of pending request
    (``together``: call type → the function computing a list of them) to its function; send each handler its
    result (:data:`SEQUENTIAL`: computed by ``answer`` at its site, in site order); until all are done.
    Returns the replies and, per handler, whether it asked for anything.  A handler's error closes the others
    and is raised here."""
    n = len(handlers)
    pending: list[Any] = [None] * n
    replies: list[Any] = [None] * n
    asked = [False] * n
    done = [False] * n

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
                group = [i for i in live if isinstance(pending[i], kind)]
                if group:
                    for i, r in zip(group, compute([pending[i] for i in group])):
                        results[i] = r
            for i in live:
                r = results.get(i, SEQUENTIAL)
                advance(i, answer(pending[i]) if r is SEQUENTIAL else r)
    except BaseException:
        for h in handlers:
            h.close()
        raise
    return replies, asked


def site_names(names: Sequence[str]) -> str:
    """ "site a" or "sites a, b, c", for the log."""
    return ("site " if len(names) == 1 else "sites ") + ", ".join(names)
