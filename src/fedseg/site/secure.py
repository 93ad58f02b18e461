"""A site's half of secure aggregation (:mod:`fedseg.privacy.protocol`): the built-in task kinds of its
steps 1, 2 and 4, and the masking of a reply whose task asks for it (step 3).

:meth:`fedseg.site.runtime.Site.handle` answers ``secagg/keys``, ``secagg/shares`` and ``secagg/reveal``
here whatever the method, and passes every reply whose task carries ``config["secagg"]`` through
:func:`mask_reply` before it leaves the site: the reply's arrays are replaced by their masked fixed-point
encodings (``secagg/<name>``, int64), so no transport and no server code ever holds one site's plain
arrays.  The exchange's keys and shares live in ``site.scratch`` (not saved: a site that restarts
mid-exchange has lost its keys and counts as dropped; the others' sum still comes out).

A site with an identity (``site.identity``: its certificate and private key, from its FLARE startup kit when
deployed, :mod:`fedseg.privacy.identity`) signs its keys and checks its peers' before it shares with them; a
site without one (the simulation's: every party is in one process there, so signing would prove nothing)
signs and checks nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from fedseg.foundation.config import RunConfig
from fedseg.foundation.errors import PayloadError
from fedseg.foundation.messages import Reply, Task
from fedseg.privacy.identity import Identity
from fedseg.privacy.protocol import SiteParty


class Site(Protocol):
    """What secure aggregation uses of :class:`fedseg.site.runtime.Site` (named here, not imported: the
    runtime imports this module)."""

    name: str
    cfg: RunConfig
    scratch: dict[str, Any]
    identity: Identity | None
    dp: Any  # fedseg.site.dp.SiteDP: books client-level DP's noise by the survivors when the site reveals


__all__ = ["KINDS", "handle", "mask_reply", "weights_by_name"]

KINDS = ("secagg/keys", "secagg/shares", "secagg/reveal")
"""The task kinds of secure aggregation's setup and unmasking steps, answered by every site."""

_SCRATCH = "secagg"


def _party(site: Site, config: dict[str, Any]) -> SiteParty:
    party = site.scratch.get(_SCRATCH)
    exchange = config.get("exchange")
    if party is None or party.exchange != exchange:
        raise PayloadError(
            f"site {site.name}: no keys for secure-aggregation exchange {exchange!r} (the site restarted or "
            "missed its setup); it is left out of this exchange"
        )
    return party


def handle(site: Site, task: Task) -> Reply:
    """Steps 1, 2 and 4: advertise fresh keys, send sealed shares, reveal the shares the server may have."""
    if task.kind == "secagg/keys":
        exchange = task.config.get("exchange")
        if not isinstance(exchange, str) or not exchange:
            raise PayloadError(f"site {site.name}: a secure-aggregation exchange needs an id")
        party = SiteParty(site.name, exchange, site.identity)
        site.scratch[_SCRATCH] = party
        return Reply(metrics={"secagg": party.advertise()})
    party = _party(site, task.config)
    if task.kind == "secagg/shares":
        return Reply(metrics={"secagg": party.share(task.config.get("order", []), task.config.get("keys", {}))})
    if task.kind == "secagg/reveal":
        shares = party.reveal(task.config.get("dropped", []), task.config.get("survived", []))
        site.dp.on_reveal(party.exchange, list(party.order), list(task.config.get("survived", [])))  # ε booked first
        site.scratch.pop(_SCRATCH, None)  # the exchange is over for this site
        return Reply(metrics={"secagg": shares})
    raise PayloadError(f"site {site.name}: unknown secure-aggregation task {task.kind!r}")


def mask_reply(site: Site, task: Task, reply: Reply) -> Reply:
    """Step 3: the reply with its arrays encoded (× the public weight: its sample count under
    ``weighting = "samples"``, else 1; per name prefix with ``prefix_weighting``, :func:`weights_by_name`), masked and renamed ``secagg/<name>``; ``metrics["secagg"]`` says
    their dtypes and which peers' shares did not open."""
    config = task.config["secagg"]
    party = _party(site, config)
    bits = site.cfg.privacy.secagg_fraction_bits
    if config.get("fraction_bits") != bits:
        raise PayloadError(
            f"site {site.name}: the server encodes with {config.get('fraction_bits')} fraction bits, this site "
            f"with privacy.secagg_fraction_bits = {bits}; server and sites must run the same config"
        )
    weights = weights_by_name(config, reply.num_samples)
    arrays, dtypes, unopened = party.mask(
        reply.arrays, weights, config.get("order", []), config.get("shares", {}), bits
    )
    metrics = {**reply.metrics, "secagg": {"dtypes": dtypes, "unopened": unopened}}
    return Reply(arrays=arrays, metrics=metrics, num_samples=reply.num_samples)


def weights_by_name(config: dict[str, Any], num_samples: int) -> Callable[[str], float]:
    """The public weight of each array of a masked reply: ``config["prefix_weighting"]`` ({name prefix:
    ``"samples"`` or ``"even"``}, the first prefix that starts the name) or else ``config["weighting"]``;
    ``"samples"`` is the site's sample count, ``"even"`` 1.  One exchange then sums, e.g., FedSM's global
    model weighted by n_k beside the plain sum of its personalized models."""
    by_prefix = config.get("prefix_weighting") or {}
    if not isinstance(by_prefix, dict) or any(w not in ("samples", "even") for w in by_prefix.values()):
        raise PayloadError(f"secure aggregation: prefix_weighting {by_prefix!r} is not {{prefix: 'samples' | 'even'}}")
    default = config.get("weighting")

    def weight(name: str) -> float:
        rule = next((w for p, w in by_prefix.items() if name.startswith(p)), default)
        return float(num_samples) if rule == "samples" else 1.0

    return weight
