"""Lockstep gradient averaging: every local step one exchange, the server averaging the sites' batch
gradients and every site applying the average with its own optimizer.  FGA (:mod:`fedseg.algorithms.fga`) is
this exchange for the global model; FedSM trains its selector (``fedsm.selector_training = "fga"``) and,
under ``fedsm.global_training = "fga"``, its global model with it.

The site half is :func:`gradient_step` (apply the previous average, compute this step's batch gradient), the
server half :func:`lockstep_round` (one round of exchanges, averaged as
:data:`~fedseg.algorithms.weighting.GradientWeighting` says), with the resync of a stale site; the
arithmetic (the average, the gradient's checks, the optimizer state as arrays, the digest of a site's state)
is :mod:`fedseg.algorithms.gradients`.

Protocol (one round = one epoch of lockstep steps)::

    step 0      server → sites  Task("fga_step", {global/… on round 1}, step=0)
                sites  → server  g_k(0), b_k, steps_per_round_k
    step t ≥ 1  server → sites  Task("fga_step", {avg/…: g_{t-1}}, step=t)   apply g_{t-1}, then compute g_k(t)
    end         server → sites  Task("fga_step", {avg/…: g_{T-1}}, step=None) apply only; site 1 returns Θ_T

So a round of T steps is T + 1 messages per site; each carries one gradient each
way.  Steps per round T = max over sites of their steps per round
(``fga.steps = "max"``, default): every sample of every site is used at least
once per round; sites with fewer batches continue into their next seeded
permutation (``Site.batches`` cycles).  ``"min"`` stops with the smallest site.

The server keeps Θ for evaluation and checkpoints by asking the first site for
its weights with the last message of the round (model bytes once per round); the
sites send a SHA-256 digest of their parameters and optimizer state, and the
server warns if they are not all identical (``fga.check_sync``).  Buffers are
not synchronized: with batch norm each site keeps its own running statistics and
the server's copy holds the first site's.

Deployed, a site left out of one exchange (error, deadline, rejected reply) takes no
further part in that round and is *stale* (it may have missed an averaged gradient);
the round ends by asking a site that answered every exchange for its weights and
optimizer state (:func:`optimizer_moments`), which every site receives with its
next step-0 task (:func:`lockstep_round`; the in-sync sites hold the same already, and under secure
aggregation every site of an exchange must answer the same task).  A simulation never has a stale site.

With ``privacy.secure_aggregation = true`` each step's gradients are one secure sum
(:func:`fedseg.algorithms.secure.secure_ask`, weighted by the public batch sizes): the server learns the
averaged gradient it sends back and no site's own, at the price of three more exchanges per step
(keys, shares, reveal).  The average equals the plain one to within the fixed-point bound, so FGA stays
centralized training to that rounding rather than to float rounding.  A step whose secure sum fails its check
word (a masked gradient replayed from another step) sends no average: no site applies a gradient for it, and the
sites stay in lockstep.

Site-side working state lives in ``site.scratch`` and is not saved with the site:
``site.scratch["fga/cursor"]`` is the site's position in the round's batches (rebuilt
from the seeded permutations when it does not match the step asked for, e.g. after a
restart mid-round, so a restart never changes a batch), and
``site.scratch["fga/checked"]`` holds the roles whose model and loss were already
checked by :func:`equivalence_problems` (a restarted site warns once more).
"""

from __future__ import annotations

import itertools
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from fedseg.algorithms.gradients import (
    FGAEquivalenceWarning,
    average_gradients,
    check_gradient,
    equivalence_problems,
    federation_steps,
    optimizer_moments,
    set_optimizer_moments,
    state_digest,
)
from fedseg.algorithms.secure import secure_ask
from fedseg.algorithms.weighting import GradientWeighting
from fedseg.foundation.arrays import Arrays, prefixed, strip_prefix
from fedseg.foundation.errors import PayloadError
from fedseg.foundation.messages import Reply, Task
from fedseg.seams.algorithm import ServerContext
from fedseg.site.calls import Asks
from fedseg.site.runtime import Site

__all__ = ["RESYNC", "ROLE", "gradient_step", "lockstep_round", "without_resync"]

ROLE = "global"
"""The role (and the arrays' prefix) a lockstep exchange trains unless told another: FGA's global model."""
STREAM = "train"


# ------------------------------------------------------------------------ site half
@dataclass
class _Cursor:
    rnd: int
    next_step: int
    it: Iterator[tuple[torch.Tensor, torch.Tensor]]


_CURSOR = "fga/cursor"
_CHECKED = "fga/checked"
"""Keys of the site's working state in ``site.scratch`` (module docstring)."""


def _batch(site: Site, rnd: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``step`` (0-based) of round ``rnd``: ``site.batches`` cycles permutations as long as asked."""
    cur: _Cursor | None = site.scratch.get(_CURSOR)
    if cur is None or cur.rnd != rnd or cur.next_step != step:
        it = site.batches(rnd, STREAM, steps=sys.maxsize)
        cur = _Cursor(rnd, step, itertools.islice(it, step, None))
        site.scratch[_CURSOR] = cur
    cur.next_step += 1
    return next(cur.it)


def gradient_step(
    site: Site,
    task: Task,
    role: str = ROLE,
    prefix: str = ROLE,
    loss: Callable[[torch.Tensor, Any], torch.Tensor] | None = None,
    factory: Callable[[], nn.Module] | None = None,
    lr: float | None = None,
    check_loss: Any = None,
    target: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
    transform: Callable[[torch.Tensor, Any, int, int], tuple[torch.Tensor, Any]] | None = None,
) -> Asks[Reply]:
    """Site half of one lockstep exchange for the model of ``role`` (FGA's, or any other model trained
    by gradient averaging, e.g. FedSM's selector): apply the previous averaged gradient, then compute
    the gradient of ``loss(model(x), target(x, y))`` (default: the workload loss of the output and
    ``y``) on this step's batch, by :meth:`Site.gradient` (one vmapped computation for all sites in a
    vectorized simulation).  ``target`` runs under the run's autocast, without gradients needed
    (e.g. labels from frozen models); ``loss`` must depend on the site only through the target.

    ``task.config``: ``round``; ``step`` (batch index to compute, or None to only
    apply); ``send_weights`` (return Θ); ``send_moments`` (return the optimizer state,
    ``optim/…``); ``digest`` (return the state digest).
    ``task.arrays``: ``<prefix>/…`` initial weights (first round, or a resync), ``optim/…``
    the optimizer state of a resync, ``avg/…`` the averaged gradient to apply.  ``lr`` overrides ``train.lr`` for this role's optimizer;
    ``check_loss`` is the loss checked by :func:`equivalence_problems` (default: the workload loss);
    ``transform(x, y, round, step)`` returns the batch ``(x, y)`` changed before the target and the gradient
    (e.g. the selector's flips of images and masks).
    """
    cfg = task.config
    rnd, step = int(cfg["round"]), cfg.get("step")
    init = strip_prefix(prefix, task.arrays)
    if init:
        site.load(role, init, factory)
    model = site.model(role, factory)
    # the optimizer persists across rounds (Alg. 1 initializes m, v once) unless train.reset_optimizer
    reset = step == 0 and site.cfg.train.reset_optimizer
    opt = site.optimizer(role, reset=reset, params=list(model.parameters()), lr=lr)
    moments = strip_prefix("optim", task.arrays)
    if moments and not reset:  # a resync after missed exchanges: the other sites' optimizer state
        set_optimizer_moments(opt, model, moments)
    avg = strip_prefix("avg", task.arrays)
    if avg:
        check_gradient(model, avg)
        yield from site.step_with_gradient(model, opt, avg)
    arrays: Arrays = {}
    metrics: dict[str, Any] = {}
    num = 0
    if step is not None:
        checked: set[str] = site.scratch.setdefault(_CHECKED, set())
        if role not in checked:
            checked.add(role)
            for problem in equivalence_problems(model, site.workload.loss if check_loss is None else check_loss):
                warnings.warn(f"FGA at site {site.name}: {problem}", FGAEquivalenceWarning, stacklevel=2)
        x, y = _batch(site, rnd, int(step))
        if transform is not None:
            x, y = transform(x, y, rnd, int(step))
        if target is not None:
            with site.autocast(), torch.no_grad():
                y = target(x, y)
        grads, value = yield from site.gradient(role, x, y, loss)
        arrays = {f"grad/{n}": g for n, g in grads.items()}
        # under DP-SGD the expected batch size B: a Poisson batch's own size depends on who is in it
        num = site.cfg.train.batch_size if site.cfg.privacy.dp == "sample" else int(x.shape[0])
        metrics["loss"] = float(value.detach())  # one read per task: the reply's only scalar
        if step == 0:
            metrics["steps_per_round"] = site.steps_per_round()
    if cfg.get("send_weights"):
        arrays.update(prefixed(prefix, site.arrays(role)))
    if cfg.get("send_moments"):
        arrays.update(prefixed("optim", optimizer_moments(opt, model)))
    if cfg.get("digest"):
        metrics["digest"] = state_digest(model, opt)
    return Reply(arrays=arrays, metrics=metrics, num_samples=num)


RESYNC = "resync"
"""Server-state namespace of a lockstep role's resync (``resync/<prefix>/…``, :func:`lockstep_round`)."""


def lockstep_round(
    ctx: ServerContext,
    rnd: int,
    kind: str = "fga_step",
    first: Arrays | None = None,
    config: Mapping[str, Any] | None = None,
    weighting: GradientWeighting = "samples",
    steps: str = "max",
    check_sync: bool = True,
    prefix: str = ROLE,
    max_steps: int | None = None,
    state: Mapping[str, torch.Tensor] | None = None,
) -> tuple[Arrays, dict[str, Any], dict[str, dict[str, Any]]]:
    """Server half of one round of lockstep gradient averaging over ``ctx.sites`` (protocol above).

    ``first``: arrays sent with step 0 (initial weights on the first round, anything
    else the site needs for the round); ``config``: added to every task's config;
    ``max_steps`` caps the round's steps.  Returns the weights the reference site sent at the end
    (``<prefix>/…``) with the resync entries (below), the metrics (``train_loss`` per site,
    ``steps``, ``in_sync``) and each site's step-0 reply metrics.

    **Sites left out** (deployment: a site that errs, times out or sends a rejected reply) take no
    further part in the round: the gradients are averaged over the sites that answered each step, and
    the reference site (the first that answered every exchange) sends the weights.  A left-out site
    may have missed an averaged gradient, so its weights and optimizer state no longer match: it is
    *stale*.  While any site is stale the round ends by asking the reference site for its weights and
    optimizer state, kept in the server state as ``resync/<prefix>/{weights,optim}/…`` with the mask
    ``resync/<prefix>/stale`` (one entry per site of ``ctx.sites``; read from ``state``), and every site
    gets both with its next step-0 task — a stale one is back in sync from that round on.  Without
    left-out sites (every simulation) nothing is added and no byte more is sent.
    """
    sites = list(ctx.sites)
    base = {"round": rnd, **(config or {})}
    ns = f"{RESYNC}/{prefix}"
    prev = state or {}
    stale_mask = prev.get(f"{ns}/stale")
    stale = {s for i, s in enumerate(sites) if stale_mask is not None and bool(stale_mask[i])}
    sync_w, sync_o = strip_prefix(f"{ns}/weights", prev), strip_prefix(f"{ns}/optim", prev)

    secure: dict[str, Arrays] = {}  # the latest securely summed average (privacy.secure_aggregation)

    def gather(tasks: dict[str, Task]) -> dict[str, Reply]:
        """Ask for one step's gradients: plainly, or as one secure sum whose average is kept for ``average``."""
        if not ctx.cfg.privacy.secure_aggregation:
            return ctx.ask(tasks)
        result = secure_ask(ctx, tasks, weighting)
        secure["avg"] = prefixed("avg", strip_prefix("grad", result.mean()))  # empty when rejected
        if result.rejected:  # a replayed or misdirected masked input: the sites apply nothing for this step
            step = next(iter(tasks.values())).config.get("step")
            ctx.log(f"[secagg] {kind} round {rnd} step {step}: no gradient is applied for this step")
        return result.replies

    def average(replies: Mapping[str, Reply], active: Sequence[str]) -> Arrays:
        if "avg" in secure:
            return secure["avg"]
        return prefixed(
            "avg",
            average_gradients(
                [strip_prefix("grad", replies[s].arrays) for s in active],
                [replies[s].num_samples for s in active],
                weighting,
            ),
        )

    def step0(s: str) -> Task:
        arrays = dict(first or {})
        # every site gets the resync (the in-sync ones hold the same weights and moments): under secure
        # aggregation each site reveals only when every survivor answered the same task
        if stale and sync_w:
            arrays.update(prefixed(prefix, sync_w))
            arrays.update(prefixed("optim", sync_o))
        return Task(kind, arrays, {**base, "step": 0})

    replies = gather({s: step0(s) for s in sites})
    active = [s for s in sites if s in replies]
    if not active:
        raise PayloadError(f"{kind}: no site answered step 0 of round {rnd}")
    start = {s: dict(replies[s].metrics) for s in active}
    total = federation_steps([replies[s].metrics["steps_per_round"] for s in active], steps)
    if max_steps is not None:
        total = min(total, max_steps)
    losses = {s: [replies[s].metrics.get("loss")] for s in active}
    for step in range(1, total):
        avg = average(replies, active)  # once per step (the transport copies it for each site)
        replies = gather({s: Task(kind, avg, {**base, "step": step}) for s in active})
        active = [s for s in active if s in replies]
        if not active:
            raise PayloadError(f"{kind}: no site answered step {step} of round {rnd}")
        for s in active:
            losses[s].append(replies[s].metrics.get("loss"))
    avg = average(replies, active)
    ref = active[0]
    last = ctx.ask(
        {s: Task(kind, avg, {**base, "step": None, "send_weights": s == ref, "digest": check_sync}) for s in active}
    )
    done = [s for s in active if s in last]
    stale = (stale - set(done)) | {s for s in sites if s not in done}
    if ref not in last or stale:  # another reference, or the resync's state: ask without anything to apply
        for cand in ([ref] if ref in last else []) + [s for s in done if s != ref]:
            got = ctx.ask(
                {cand: Task(kind, {}, {**base, "step": None, "send_weights": True, "send_moments": bool(stale)})},
                optional=True,
            )
            if cand in got:
                ref, last = cand, {**last, cand: got[cand]}
                break
        else:
            raise PayloadError(f"{kind}: no site sent its weights at the end of round {rnd}")
    weights = {k: v for k, v in last[ref].arrays.items() if k.startswith(prefix + "/")}
    if stale:
        weights.update(prefixed(f"{ns}/weights", strip_prefix(prefix, last[ref].arrays)))
        weights.update(prefixed(f"{ns}/optim", strip_prefix("optim", last[ref].arrays)))
        weights[f"{ns}/stale"] = torch.tensor([s in stale for s in sites], dtype=torch.int8)
    # None: not sent (DP)
    mean_loss = {s: None if None in v else sum(cast("list[float]", v)) / len(v) for s, v in losses.items()}
    metrics: dict[str, Any] = {"train_loss": mean_loss, "steps": total}
    if stale:
        metrics["stale"] = sorted(stale, key=sites.index)
    if check_sync:
        digests = {s: last[s].metrics["digest"] for s in done if "digest" in last[s].metrics}
        in_sync = len(set(digests.values())) == 1
        metrics["in_sync"] = in_sync
        if not in_sync:
            warnings.warn(
                f"FGA round {rnd}: sites hold different weights or optimizer states (digests {digests}); "
                "this happens across different hardware or library versions, or if a site changed its model outside FGA",
                FGAEquivalenceWarning,
                stacklevel=2,
            )
    return weights, metrics, start


def without_resync(state: Mapping[str, torch.Tensor], prefix: str) -> Arrays:
    """``state`` without the resync entries of ``prefix`` (:func:`lockstep_round` returns them again while
    a site is stale)."""
    head = f"{RESYNC}/{prefix}/"
    return {k: v for k, v in state.items() if not k.startswith(head)}
