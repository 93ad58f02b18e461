"""The vectorized executor: an ask's site handlers run so that their local training is one computation."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from fedseg.foundation.messages import Reply
from fedseg.simulation.vectorize import fit as stacked_fit
from fedseg.simulation.vectorize import lockstep, memory
from fedseg.simulation.vectorize.eligibility import Structure, optimizer_reason
from fedseg.simulation.vectorize.graphs import Arena
from fedseg.simulation.vectorize.scheduler import (
    SEQUENTIAL,
    ApplyCall,
    ExecutorState,
    FitCall,
    GradientCall,
    Handler,
    run_handlers,
    site_names,
)
from fedseg.site.calls import LocalExecutor


class VectorizedExecutor:
    r"""Drives one ask's handlers so that their requests (:mod:`fedseg.site.calls`) are computed together:
    :class:`~fedseg.site.calls.FitCall`\ s trained as one computation (:meth:`fit_together`),
    :class:`~fedseg.site.calls.GradientCall`\ s differentiated in one ``vmap`` (:meth:`gradients_together`),
    :class:`~fedseg.site.calls.ApplyCall`\ s stepped as one fused Adam step (:meth:`apply_together`), each
    computed from the call alone; a request that cannot be stacked is answered by its site's own executor
    (:attr:`Handler.executor <fedseg.simulation.vectorize.scheduler.Handler.executor>`).  Everything runs in the
    calling thread.

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
        masked step, see :func:`fedseg.simulation.vectorize.graphs.graph_step`); each is taken eagerly :data:`GRAPH_WARMUP_STEPS` times, then
        captured once as a CUDA graph over static buffers kept across rounds (:class:`Arena`) and replayed;
        any other step runs eagerly on the same buffers.  A capture that fails is logged and the group stays eager.
    """

    def __init__(self, group_size: int = 0, log: Callable[[str], None] = print, cuda_graphs: bool = True):
        self.group_size = group_size
        self.log = log
        self.state = ExecutorState(log, cuda_graphs)
        """What the stacked fit and the lockstep functions share with the executor (:class:`ExecutorState`)."""
        self._met: set[str] = set()  # task kinds whose handlers met in fit or gradient
        self._stacked_roles: set[str] = set()  # roles whose gradients were stacked at least once
        # gradient groups (key, loss) whose loss failed under vmap: sequential from then on
        self._no_vmap: list[tuple[tuple, Any]] = []
        self._site_bytes: dict[tuple, int] = {}  # estimated bytes per site of a stacked group, by group key
        self._group_sizes: dict[tuple, int] = {}  # the group size last said, by group key and sites

    @property
    def cuda_graphs(self) -> bool:
        return self.state.cuda_graphs

    @property
    def arenas(self) -> dict[tuple, Arena]:
        """The CUDA-graph arenas by group key and stack size, least recently used first."""
        return self.state.arenas

    @property
    def vectorized_fits(self) -> int:
        """Number of ``fit`` calls trained stacked so far (for tests and benchmarks)."""
        return self.state.vectorized_fits

    @property
    def vectorized_gradients(self) -> int:
        """Number of ``gradient`` calls computed stacked so far (for tests and benchmarks)."""
        return self.state.vectorized_gradients

    @property
    def vectorized_applies(self) -> int:
        """Number of ``apply_gradient`` steps taken stacked so far (for tests and benchmarks)."""
        return self.state.vectorized_applies

    def say(self, msg: str) -> None:
        """Log ``msg`` once per executor."""
        self.state.say(msg)

    # ------------------------------------------------------------ scheduling
    def run(self, handlers: Sequence[Handler]) -> list[Reply]:
        """Every handler driven together (:func:`~fedseg.simulation.vectorize.scheduler.run_handlers`), each request
        that is not stacked answered by its site's own executor; returns the replies in order.  Only the requests
        of sites whose own executor is a plain :class:`~fedseg.site.calls.LocalExecutor` are stacked: a site
        whose executor computes otherwise (DP-SGD's :class:`~fedseg.site.dpsgd.DPExecutor`) answers all of its
        own."""
        stackable = [type(h.executor) is LocalExecutor for h in handlers]
        for h, ok in zip(handlers, stackable):
            if not ok:
                self.say(
                    f"site {h.site} answers its own requests: its executor ({type(h.executor).__name__}) computes "
                    "them otherwise than a stacked step would"
                )
        replies, asked = run_handlers(
            [h.asks for h in handlers],
            {FitCall: self.fit_together, GradientCall: self.gradients_together, ApplyCall: self.apply_together},
            [h.executor.answer for h in handlers],
            stackable,
        )
        unfitted: dict[str, list[str]] = {}
        for h, did in zip(handlers, asked):
            if did:
                self._met.add(h.kind)
            else:
                unfitted.setdefault(h.kind, []).append(h.site)
        for kind, names in unfitted.items():
            if kind in self._met:  # e.g. the last, apply-only exchange of a lockstep round
                continue
            method = handlers[0].method
            self.say(
                f"task {kind!r} of {site_names(names)} runs sequentially: method {method!r} computes it in its own loop, not through Site.fit or Site.gradient"
            )
        return replies

    # -------------------------------------------------------------- planning
    def structure(self, model: nn.Module) -> Structure:
        """The :class:`Structure` of a model, walked once per model object (:meth:`ExecutorState.structure`)."""
        return self.state.structure(model)

    def fit_together(self, calls: Sequence[FitCall]) -> list[Any]:
        """Train the calls that can be stacked; the others get ``SEQUENTIAL`` (computed at their sites)."""
        results: list[Any] = [SEQUENTIAL] * len(calls)
        groups: list[tuple[tuple, list[stacked_fit.FitItem]]] = []
        for i, c in enumerate(calls):
            item, reason = stacked_fit.check_fit(self.state, i, c)
            if item is None:
                self.say(f"role {c.role!r} of site {c.site} trains sequentially: {reason}")
                continue
            key = item.key
            for gkey, members in groups:
                if gkey == key and members[0].call.loss == c.loss:
                    members.append(item)
                    break
            else:
                groups.append((key, [item]))
        for _, members in groups:
            if len(members) == 1:
                c = members[0].call
                self.say(
                    f"role {c.role!r} of site {c.site} trains sequentially: no other site's training of the same model meets it"
                )
                continue
            self.say(
                f"role {members[0].call.role!r} of {site_names([m.call.site for m in members])} trains as one vectorized computation"
            )
            size = self.group_size or self._memory_group_size(
                members[0].key,
                members[0].call.device,
                [m.call.site for m in members],
                members[0].call.role,
                functools.partial(memory.fit_site_bytes, members[0]),
            )
            for start in range(0, len(members), size):
                for item, out in zip(
                    members[start : start + size], stacked_fit.train(self.state, members[start : start + size])
                ):
                    results[item.index] = out
        return results

    def _memory_group_size(
        self, key: tuple, device: torch.device, names: list[str], role: str, site_bytes: Callable[[], int]
    ) -> int:
        """``simulation.vectorize_group = 0``: all sites together where the device's free memory is not known
        (the CPU); on CUDA as many as fit in the free memory (:func:`group_size_for`), the bytes per site
        estimated once per model and role (:func:`memory.fit_site_bytes`, :func:`memory.gradient_site_bytes`)."""
        free = memory.free_memory(device)
        if free is None:
            return len(names)
        if key not in self._site_bytes:
            self._site_bytes[key] = site_bytes()
        per_site = self._site_bytes[key]
        size = memory.group_size_for(free, per_site, len(names))
        said = (key, tuple(names))
        if self._group_sizes.get(said) != size:  # said once, and again only when the free memory changes it
            self._group_sizes[said] = size
            self.log(
                f"vectorize: role {role!r} of {site_names(names)}: about {per_site / 2**20:.0f} MiB per site and "
                f"{free / 2**30:.1f} GiB free on {device}: "
                f"{'all together' if size >= len(names) else f'groups of at most {size}'} "
                "(set simulation.vectorize_group to choose)"
            )
        return size

    # ----------------------------------------------------- lockstep gradients
    def gradients_together(self, calls: Sequence[GradientCall]) -> list[Any]:
        """Each call's ``(gradients, loss)`` — those that can be stacked computed in one vmapped call per
        group of sites with the same model and loss; the others get ``SEQUENTIAL`` (computed at their sites).  Computing a gradient changes nothing at the site, so any failure falls back safely."""
        results: list[Any] = [SEQUENTIAL] * len(calls)
        groups: list[tuple[tuple, Any, list[int]]] = []
        for i, c in enumerate(calls):
            signature, reason = lockstep.gradient_reason(self.state, c)
            if reason is not None:
                self.say(f"the gradient of role {c.role!r} of site {c.site} is computed sequentially: {reason}")
                continue
            key = (c.role, signature, str(c.device), c.precision, c.at is None)
            loss = c.loss
            for gkey, gloss, members in groups:
                if gkey == key and gloss == loss:
                    members.append(i)
                    break
            else:
                groups.append((key, loss, [i]))
        for key, loss, members in groups:
            role, names = calls[members[0]].role, site_names([calls[i].site for i in members])
            if len(members) == 1:
                if role not in self._stacked_roles:  # not merely the last site of a loop the others have left
                    self.say(
                        f"the gradient of role {role!r} of {names} is computed sequentially: no other site's gradient of the same model and loss meets it"
                    )
                continue
            if any(k == key and lo == loss for k, lo in self._no_vmap):
                continue
            self.say(f"the gradients of role {role!r} of {names} are computed as one vectorized computation")
            self._stacked_roles.add(role)
            size = self.group_size or self._memory_group_size(
                (*key, loss),
                calls[members[0]].device,
                [calls[i].site for i in members],
                role,
                functools.partial(memory.gradient_site_bytes, calls[members[0]], loss),
            )
            for start in range(0, len(members), size):
                chunk = members[start : start + size]
                for i, out in zip(chunk, self._gradients_split([calls[i] for i in chunk], loss, key)):
                    results[i] = out
        return results

    def _gradients_split(self, calls: list[GradientCall], loss: Any, key: tuple) -> list[Any]:
        """:meth:`gradient_group`; out of memory: in halves; any other error: sequentially from now on."""
        try:
            return lockstep.gradient_group(self.state, calls, loss)
        except Exception as e:
            if isinstance(e, torch.OutOfMemoryError) and len(calls) > 1:
                half = len(calls) // 2
                self.say(
                    f"a group of {len(calls)} sites' gradients does not fit in memory; computing groups of at most {half} (set simulation.vectorize_group)"
                )
                return self._gradients_split(calls[:half], loss, key) + self._gradients_split(calls[half:], loss, key)
            self._no_vmap.append((key, loss))
            self.say(
                f"the gradients of role {calls[0].role!r} of {site_names([c.site for c in calls])} are computed sequentially: "
                f"the loss does not run under torch.func.vmap ({type(e).__name__}: {e})"
            )
            return [SEQUENTIAL] * len(calls)

    # ------------------------------------------------- lockstep optimizer steps
    def apply_together(self, calls: Sequence[ApplyCall]) -> list[Any]:
        """Take the Adam steps of the calls with the same model and optimizer settings as one call of torch's
        fused Adam kernel (``Adam(fused=True)``'s) over every site's parameters; the others get
        ``SEQUENTIAL`` (stepped at their sites).  The kernel updates each site's own parameters, moments and
        step counts in place, tensor by tensor with the same arithmetic, so sites that hold the same
        weights and gradient (a lockstep round) stay bitwise identical to each other."""
        results: list[Any] = [SEQUENTIAL] * len(calls)
        groups: list[tuple[tuple, list[int]]] = []
        for i, c in enumerate(calls):
            st = self.structure(c.model)
            settings: tuple = ()
            if not st.stacked_gradient:  # said with the gradient; the exchange then runs as deployed, bitwise
                continue
            reason: str | None
            if len({p.dtype for p in st.params}) > 1:
                reason = "its parameters have several dtypes"
            else:
                reason, settings = optimizer_reason(c.optimizer, st.params)
                if reason is None and settings[0] != "adam":
                    reason = f"its optimizer is {type(c.optimizer).__name__} (only Adam steps are taken together)"
            if reason is not None:
                self.say(f"the averaged gradient at site {c.site} is applied sequentially: {reason}")
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
                self.say(
                    f"the averaged gradients of role {c.role!r} of {site_names([calls[i].site for i in members])} "
                    "are applied as one fused Adam step"
                )
                lockstep.apply_group(self.state, [calls[i] for i in members], settings)
                for i in members:
                    results[i] = True
        return results
