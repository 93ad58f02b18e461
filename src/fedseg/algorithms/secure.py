"""The server's half of secure aggregation: one exchange that returns the weighted sum of the sites' replies
and nothing of any one of them (protocol and guarantees: :mod:`fedseg.privacy.protocol`,
:mod:`fedseg.privacy.secagg`; the sites' half: :mod:`fedseg.site.secure`).

:func:`secure_ask` replaces ``ctx.ask(tasks)`` for a server step that needs only Σ_k c_k · arrays_k: it runs
the key and share steps, sends the tasks with the shares (the sites mask their replies before they leave),
sends the survivor set to the survivors (each attests it), asks the survivors that attested for the shares
of the secrets it may rebuild, with the attestations (a site reveals only after t of them), and returns the
unmasked sum.  A site that
fails a step is left out of the rest of the exchange (a deployed transport has already logged why); one
whose step-3 reply does not arrive is removed from the sum with its masks.  A site whose signed keys another
site refused (:mod:`fedseg.privacy.identity`: a certificate from another CA or naming another site, keys
replaced on the way) is left out before anyone masks, logged with the refusing site's reason and the fix.  The weights c_k are public:
the sample count n_k each site declares (``weighting = "samples"``) or 1 (``"even"``).

A sum whose check word is wrong (:class:`fedseg.privacy.protocol.SumRejected`: an input replayed from another
exchange, or masked with another list of sites) is never returned: :func:`secure_ask` logs which exchange
failed and what to do, and returns a :class:`SecureSum` with :attr:`~SecureSum.rejected` set and nothing to
sum.  Each method then goes on without that aggregate: FedAvg, FedProx, FWA and SCAFFOLD keep the previous
global model (and control variate) for the round, FGA's lockstep step applies no gradient (every site keeps
its weights and optimizer state), FedSM keeps its previous global model and selector and leaves each site
the personalized model it trained (no SoftPull that round).  The exchange is not retried: the sites' work
for it (training, optimizer state, DP steps) is already spent, and a site that replays on purpose would
replay again.

A method whose server needs one site's arrays says why in ``Algorithm.secure_aggregation_unsupported``
and a run asking for secure aggregation stops before training with that reason.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fedseg.foundation.arrays import Arrays
from fedseg.foundation.errors import PayloadError
from fedseg.foundation.messages import Reply, Task
from fedseg.privacy.protocol import ServerParty, SumRejected
from fedseg.seams.algorithm import ServerContext

__all__ = ["SecureSum", "secure_ask"]


@dataclass
class SecureSum:
    """What a secure exchange gives the server.

    replies
        The summed sites' replies without arrays (their metrics and sample counts), in the order asked.
    total
        Σ_k c_k · arrays_k over them: floating tensors as float64, integer tensors summed.
    weight
        Σ_k c_k.
    dtypes
        Each name's dtype at the sites.
    rejected
        None, or why the sum was rejected (its check word was wrong); ``total`` is then empty and ``weight``
        0: the caller goes on without this aggregate.
    exchange
        The exchange's id (task kind, round, step and a random suffix), as the log names it.
    """

    replies: dict[str, Reply]
    total: Arrays
    weight: float
    dtypes: dict[str, str] = field(default_factory=dict)
    rejected: str | None = None
    exchange: str = ""

    def weight_of(self, weighting: str) -> float:
        """Σ_k c_k over the summed sites for a weighting: Σ n_k (``"samples"``) or their number (``"even"``)."""
        if weighting == "samples":
            return float(sum(r.num_samples for r in self.replies.values()))
        return float(len(self.replies))

    def mean(self) -> Arrays:
        """Σ c_k x_k / Σ c_k in each tensor's own dtype (integer tensors: the floor of their plain mean,
        e.g. a batch-norm step counter)."""
        out: Arrays = {}
        for name, t in self.total.items():
            dtype = getattr(torch, self.dtypes.get(name, "float64"))
            if dtype.is_floating_point:
                out[name] = (t / self.weight).to(dtype)
            else:
                out[name] = torch.div(t, len(self.replies), rounding_mode="floor").to(dtype)
        return out


def secure_ask(
    ctx: ServerContext, tasks: dict[str, Task], weighting: str, prefix_weighting: dict[str, str] | None = None
) -> SecureSum:
    """Ask ``tasks`` so that the server learns only the weighted sum of the replies' arrays (see the module).

    ``prefix_weighting`` ({name prefix: ``"samples"`` or ``"even"``}) weighs the arrays under those
    prefixes otherwise than ``weighting`` (:func:`fedseg.site.secure.weights_by_name`); their Σ_k c_k is
    then :meth:`SecureSum.weight_of`, not :attr:`SecureSum.weight`."""
    first = next(iter(tasks.values()))
    rnd, step = first.config.get("round"), first.config.get("step")
    exchange = f"{first.kind}-r{rnd}{'' if step is None else f'-s{step}'}-{os.urandom(8).hex()}"
    server = ServerParty(exchange, ctx.cfg.privacy.secagg_fraction_bits)

    def ask_each(kind: str, sites: Iterable[str], config: Callable[[str], Mapping[str, Any]]) -> dict[str, Reply]:
        return ctx.ask({s: Task(kind, {}, {**config(s), "round": rnd}) for s in sites})

    for s, r in ask_each("secagg/keys", tasks, lambda s: {"exchange": exchange}).items():
        _accept(ctx, s, "key message", server.accept_keys, s, r.metrics.get("secagg"))
    request = server.share_request()
    for s, r in ask_each("secagg/shares", server.order, lambda s: request).items():
        _accept(ctx, s, "share message", server.accept_shares, s, r.metrics.get("secagg"))
    for s, why in server.left_out.items():
        ctx.log(
            f"[secagg] site {s} left out of exchange {exchange}: "
            + "; ".join(f"site {u} refused its keys: {reason}" for u, reason in why.items())
        )
    masked = {
        s: Task(
            tasks[s].kind,
            tasks[s].arrays,
            {
                **tasks[s].config,
                "secagg": {
                    **server.input_config(s),
                    "weighting": weighting,
                    "prefix_weighting": prefix_weighting or {},
                },
            },
        )
        for s in server.masking
    }
    replies: dict[str, Reply] = {}
    for s, r in ctx.ask(masked).items():
        info = r.metrics.get("secagg") or {}
        weight = float(r.num_samples) if weighting == "samples" else 1.0
        if _accept(ctx, s, "masked input", server.accept_input, s, r.arrays, info.get("dtypes"), weight):
            metrics = {k: v for k, v in r.metrics.items() if k != "secagg"}
            replies[s] = Reply({}, metrics, r.num_samples)
            if info.get("unopened"):
                ctx.log(f"[secagg] site {s} could not open the shares of {info['unopened']}")
    consistency = server.consistency_config()
    for s, r in ask_each("secagg/consistency", consistency["survived"], lambda s: consistency).items():
        _accept(ctx, s, "attestation", server.accept_attestation, s, r.metrics.get("secagg"))
    reveal = server.reveal_config()
    reveals = ask_each("secagg/reveal", list(reveal["attestations"]), lambda s: reveal)
    try:
        total, weight, summed = server.unmask({s: r.metrics.get("secagg") for s, r in reveals.items()}, log=ctx.log)
    except SumRejected as e:
        ctx.log(
            f"[secagg] {e}. Which site's input it was cannot be told from the sum. If this repeats, a site or its "
            "transport is resending old messages: check the sites' logs and connections, and remove a site that "
            "replays on purpose from the federation"
        )
        assert server.layout is not None
        return SecureSum(
            {s: replies[s] for s in e.sites},
            {},
            0.0,
            dict(zip(server.layout.names, server.layout.dtypes)),
            rejected=str(e),
            exchange=exchange,
        )
    assert server.layout is not None
    return SecureSum(
        {s: replies[s] for s in summed},
        {k: v.to(ctx.device) for k, v in total.items()},
        weight,
        dict(zip(server.layout.names, server.layout.dtypes)),
        exchange=exchange,
    )


def _accept(ctx: ServerContext, site: str, what: str, accept: Callable[..., None], *args: Any) -> bool:
    """``accept(*args)``; False (logged: the site is left out of the rest of the exchange) on a PayloadError."""
    try:
        accept(*args)
    except PayloadError as e:
        ctx.log(f"[secagg] site {site} left out of the exchange: its {what} was rejected: {e}")
        return False
    return True
