"""Vectorized simulation: the local steps of K sites run as one computation (``simulation.vectorize``).

The site halves of the algorithms stay written for one site.  What changes is how the in-process
transport *executes* them: each :class:`~fedseg.site.runtime.Site` gets the :class:`VectorizedExecutor` as
its executor (:attr:`Site.executor`), and the executor runs each site's handler in its own thread, one
thread at a time (:mod:`.scheduler`: a baton passed in site order, so every line of a handler outside
:meth:`Site.fit` runs exactly as it does sequentially).  When a handler calls :meth:`Site.fit`, the site
hands the call to the executor, which parks the thread; once every site's handler has parked or returned,
the parked calls that can be stacked are trained together (:mod:`.fit`), and each thread goes on with its
own result.  A handler that calls ``fit`` twice (Ditto's global and personal models) meets the others twice.

Trained together means: the K models' parameters are stacked into one flat buffer (:mod:`.layout`), each
site's parameters view its rows while it trains, the loss of all sites runs in one ``torch.func.vmap`` and a
stacked Adam or SGD steps them (:mod:`.optimizer`, per-site step counts).  When a site's round ends before the
others' (epoch mode, sites of different sizes), its rows are written back and the others go on as a smaller
stack (:func:`.fit.train_group`): no step computes a finished site's row.  At the end the rows are copied back
into each site's own model and the moments into its own optimizer state, so checkpoints, resume and results are
those of a sequential run to rounding (the arithmetic is the same, not bitwise the same kernels).

Lockstep steps (:mod:`.lockstep`: FGA, FedSM's ``"fga"`` selector, pFedMe's inner steps, Per-FedAvg's meta
step, APFL) park in :meth:`Site.gradient` and :meth:`Site.step_with_gradient` the same way: the gradients of
sites with the same model and loss are one ``vmap``, their Adam steps one fused Adam call.

On CUDA (``simulation.cuda_graphs = "on"``) a stacked fit group without per-site hooks keeps its buffers
across rounds and its local step is captured once as a CUDA graph and replayed (:mod:`.graphs`; one per stack
size).  How many sites are stacked at once follows the free memory (:mod:`.memory`).

A call that cannot be stacked runs sequentially, in its own thread, and the reason is logged once
(:mod:`.eligibility`): fp16 loss scaling, an optimizer other than plain Adam/SGD over exactly the model's
parameters, batch norm with running statistics, dropout, a site whose model differs from the others', or a
site alone in its group.  A handler that trains in its own loop runs sequentially as well.
"""

from fedseg.execution.vectorize.eligibility import vectorize_reason
from fedseg.execution.vectorize.executor import VectorizedExecutor
from fedseg.execution.vectorize.memory import group_size_for
from fedseg.execution.vectorize.policy import AUTO_MIN_SITES, resolve_vectorize
from fedseg.execution.vectorize.scheduler import ApplyCall, FitCall, GradientCall

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
