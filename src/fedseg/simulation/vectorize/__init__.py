"""Vectorized simulation: the local steps of K sites run as one computation (``simulation.vectorize``).

The site halves of the algorithms stay written for one site: a handler asks for its local training as values
(:mod:`fedseg.site.calls`: ``yield from site.fit(...)``).  What changes is who answers: the in-process
transport hands an ask's tasks to the :class:`VectorizedExecutor`, which advances each site's handler, in site
order, to its next request or its end (:mod:`.scheduler`; every line of a handler outside its requests runs
exactly as it does sequentially); the pending requests that can be stacked are computed together (:mod:`.fit`)
and each handler goes on with its own result.  A handler that asks twice (Ditto's global and personal models)
meets the others twice.  No thread is started.

Trained together means: the K models' parameters are stacked into one flat buffer (:mod:`.layout`), each
site's parameters view its rows while it trains, the loss of all sites runs in one ``torch.func.vmap`` and a
stacked Adam or SGD steps them (:mod:`.optimizer`, per-site step counts).  When a site's round ends before the
others' (epoch mode, sites of different sizes), its rows are written back and the others go on as a smaller
stack (:func:`.fit.train_group`): no step computes a finished site's row.  At the end the rows are copied back
into each site's own model and the moments into its own optimizer state, so checkpoints, resume and results are
those of a sequential run to rounding (the arithmetic is the same, not bitwise the same kernels).

Lockstep steps (:mod:`.lockstep`: FGA, FedSM's ``"fga"`` selector, pFedMe's inner steps, Per-FedAvg's meta
step, APFL) ask :meth:`Site.gradient` and :meth:`Site.step_with_gradient` the same way: the gradients of
sites with the same model and loss are one ``vmap``, their Adam steps one fused Adam call.

On CUDA (``simulation.cuda_graphs = "on"``) a stacked fit group without per-site hooks keeps its buffers
across rounds and its local step is captured once as a CUDA graph and replayed (:mod:`.graphs`; one per stack
size).  How many sites are stacked at once follows the free memory (:mod:`.memory`).

A request that cannot be stacked is computed at its site, and the reason is logged once
(:mod:`.eligibility`): fp16 loss scaling, an optimizer other than plain Adam/SGD over exactly the model's
parameters, batch norm with running statistics, dropout, a site whose model differs from the others', or a
site alone in its group.  A handler that trains in its own loop runs sequentially as well.
"""

from fedseg.simulation.vectorize.eligibility import vectorize_reason
from fedseg.simulation.vectorize.executor import VectorizedExecutor
from fedseg.simulation.vectorize.memory import group_size_for
from fedseg.simulation.vectorize.policy import AUTO_MIN_SITES, resolve_vectorize
from fedseg.site.calls import ApplyCall, FitCall, GradientCall

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
