"""A site's half of secure aggregation (:mod:`fedseg.privacy.protocol`): the built-in task kinds of its
steps 1, 2, the consistency round and step 4, and the masking of a reply whose task asks for it (step 3).

:meth:`fedseg.site.runtime.Site.handle` answers ``secagg/keys``, ``secagg/shares``, ``secagg/consistency``
and ``secagg/reveal`` here whatever the method, and passes every reply whose task carries
``config["secagg"]`` through :func:`mask_reply` before it leaves the site: the reply's arrays are replaced
by their masked fixed-point encodings (``secagg/<name>``, int64), so no transport and no server code ever
holds one site's plain arrays.  The exchange's keys and shares live in ``site.scratch`` (not saved: a site
that restarts mid-exchange has lost its keys and counts as dropped; the others' sum still comes out).

**What the site checks itself** (against a server that sends what it likes): it keys and masks only with at
least ``privacy.secagg_min_sites`` sites and a majority t of those keyed; it attests and reveals only for lists
that split the set it masked with exactly, and reveals only after t survivors attested the same survivor set
(:class:`~fedseg.privacy.protocol.SiteParty`).  Its :class:`Record` (``site.secagg_record``) keeps, per
(task kind, round, step), the set it masked with, the hash of its input and the survivor set it attested: a
second masked reply for the same (kind, round, step) goes out only for the same input bits, masked with the
same set or with the survivor set it attested (a round resumed after a site dropped), and it attests no other
survivor set.  Every honest site attests at most one set per key, and a sum needs t > K/2 attestations, so
all the sums of one key that come out are over one set of sites and the same inputs: two sums whose
difference would be one site's input never both come out.  Across runs (a deployed site keeps one record for
all its runs, ``WORKDIR/secagg_record.jsonl``, its keys naming the run id) the record is indexed by the hash of
each input: the same input bits never go out masked with another set of sites, whatever run asks.  A deployed
site without a salt (its policy's ``reproducible = true``: its batches are a function of the run seed) also
answers one ask — the task's arrays, kind, round and step — with one input and one set over all its runs; a
salted site's next run trains on other batches, so no exact replay exists to refuse.  The record is not part
of the site's saved state (:meth:`~fedseg.site.runtime.Site.state_arrays`): restoring a checkpoint does not
rewind it.

**One task per exchange.**  The site hashes the task it masks a reply to
(:func:`fedseg.privacy.protocol.task_digest`) and attests that digest with the survivor set; it reveals only
when every survivor attested the same digest (:meth:`~fedseg.privacy.protocol.SiteParty.reveal`).  With ``privacy.secure_aggregation`` on in the site's
own config, :meth:`~fedseg.site.runtime.Site.handle` refuses a task whose reply the method sums
(:meth:`fedseg.seams.algorithm.Algorithm.summed`) when it comes without the ``secagg`` field or with a
``steps`` count (the local work comes from the site's config).

A site with an identity (``site.identity``: its certificate and private key, from its FLARE startup kit when
deployed, :mod:`fedseg.privacy.identity`) signs its keys and checks its peers' before it shares with them; a
site without one (the simulation's: every party is in one process there, so signing would prove nothing)
signs and checks nothing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from fedseg.foundation.config import RunConfig
from fedseg.foundation.errors import PayloadError
from fedseg.foundation.messages import Reply, Task
from fedseg.privacy.identity import Identity
from fedseg.privacy.protocol import SiteParty, task_digest


class SecureSite(Protocol):
    """What secure aggregation uses of :class:`fedseg.site.runtime.Site` (named here, not imported: the
    runtime imports this module)."""

    name: str
    cfg: RunConfig
    scratch: dict[str, Any]
    identity: Identity | None
    dp: Any  # fedseg.site.dp.SiteDP: books client-level DP's noise by the survivors when the site reveals


__all__ = ["KINDS", "RECORD_NAME", "Record", "check_summed", "handle", "mask_reply", "record_of", "weights_by_name"]

KINDS = ("secagg/keys", "secagg/shares", "secagg/consistency", "secagg/reveal")
"""The task kinds of secure aggregation's setup, consistency and unmasking steps, answered by every site."""

RECORD_NAME = "secagg_record.jsonl"
"""File name of a deployed site's :class:`Record` in its run folder."""

_SCRATCH = "secagg"


class Record:
    """What a site masked, per ``"<run>|<task kind>|<round>|<step>"`` (``<run>``: the site's :attr:`epoch`, its
    deployed run id; empty in simulation): ``{"masked": U2 (sorted), "input": SHA-256 of the encoded input (hex),
    "survived": the U3 it attested (sorted) or None}``, and indexed by the input's hash across every run it
    holds (:meth:`with_input`).  In memory, and with ``path`` also in an append-only file of JSON lines
    (``{"key": …, "entry": …}``, the last line of a key holding), each change appended and flushed to disk
    before the reply leaves the site, read back on creation.  A deployed site keeps one file for all its runs."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else None
        self.entries: dict[str, dict[str, Any]] = {}
        self.inputs: dict[str, dict[str, dict[str, Any]]] = {}  # input digest -> {key: entry}
        if self.path is not None and self.path.is_file():
            fix = (
                "restore it from a backup (deleting it lets the server ask this site again for replies it already sent)"
            )
            try:
                lines = self.path.read_text().splitlines()
            except OSError as e:
                raise PayloadError(f"the secure-aggregation record {self.path} is unreadable ({e}); {fix}") from None
            for i, line in enumerate(lines):
                try:
                    item = json.loads(line)
                    key, entry = item["key"], item["entry"]
                except (ValueError, KeyError, TypeError) as e:
                    if i == len(lines) - 1:  # a last line cut short by a crash: that change never left the site
                        break
                    raise PayloadError(
                        f"the secure-aggregation record {self.path} is unreadable at line {i + 1} ({e}); {fix}"
                    ) from None
                if not isinstance(key, str) or not isinstance(entry, dict):
                    raise PayloadError(
                        f"the secure-aggregation record {self.path}: line {i + 1} is not a key and an entry; {fix}"
                    )
                self.entries[key] = entry
                self._index(key, entry)

    def _index(self, key: str, entry: dict[str, Any]) -> None:
        digest = entry.get("input")
        if isinstance(digest, str):
            self.inputs.setdefault(digest, {})[key] = entry

    def get(self, key: str) -> dict[str, Any] | None:
        return self.entries.get(key)

    def with_input(self, digest: str) -> list[dict[str, Any]]:
        """Every entry (of any run) whose masked input had the encoding hash ``digest``."""
        return list(self.inputs.get(digest, {}).values())

    def put(self, key: str, entry: dict[str, Any]) -> None:
        self.entries[key] = entry
        self._index(key, entry)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps({"key": key, "entry": entry}) + "\n")
                f.flush()
                os.fsync(f.fileno())


def record_of(site: SecureSite) -> Record:
    """``site.secagg_record``, an in-memory :class:`Record` made on first use when the site has none."""
    record = getattr(site, "secagg_record", None)
    if record is None:
        record = Record()
        site.secagg_record = record  # type: ignore[attr-defined]
    return record


def _label(task: Task) -> str:
    return f"{task.kind}|{task.config.get('round')}|{task.config.get('step')}"


def _same_answer(entry: dict[str, Any], input_digest: str, masked: list[str]) -> bool:
    """An earlier record lets a site send this masked reply again: the same input, masked with the same sites or
    with the survivors it attested (a repeat of one sum, never the difference of two)."""
    return entry.get("input") == input_digest and masked in (entry.get("masked"), entry.get("survived"))


def _key(site: SecureSite, task: Task) -> str:
    epoch = getattr(site, "epoch", "")
    return f"{epoch}|{_label(task)}" if epoch else _label(task)


def _party(site: SecureSite, config: dict[str, Any]) -> SiteParty:
    party = site.scratch.get(_SCRATCH)
    exchange = config.get("exchange")
    if party is None or party.exchange != exchange:
        raise PayloadError(
            f"site {site.name}: no keys for secure-aggregation exchange {exchange!r} (the site restarted or "
            "missed its setup); it is left out of this exchange"
        )
    return party


def check_summed(site: SecureSite, task: Task) -> None:
    """A task whose reply the server sums (``privacy.secure_aggregation`` on in the site's config) is refused
    when it comes without secure aggregation (the site never sends such a reply unmasked) or sets its own
    ``steps`` (the site's local work comes from its own config)."""
    if "secagg" not in task.config:
        raise PayloadError(
            f"site {site.name}: privacy.secure_aggregation is on in this site's config and the server sums "
            f"the reply to {task.kind!r}; this task comes without secure aggregation, so the site refuses it "
            "(it never sends such a reply unmasked)"
        )
    if task.config.get("steps") is not None:
        raise PayloadError(
            f"site {site.name}: a {task.kind!r} task that the server sums securely sets steps = "
            f"{task.config['steps']!r}; the site's local work comes from its own config "
            "(train.local_steps / train.local_epochs), not from the task"
        )


def handle(site: SecureSite, task: Task) -> Reply:
    """Steps 1, 2, the consistency round and step 4: advertise fresh keys, send sealed shares, attest the
    survivor set (once per (kind, round, step), :class:`Record`), reveal the shares the server may have; after
    a reveal, ``site.dp.on_reveal(exchange, masked, survived)`` when the site's DP has that hook."""
    if task.kind == "secagg/keys":
        exchange = task.config.get("exchange")
        if not isinstance(exchange, str) or not exchange:
            raise PayloadError(f"site {site.name}: a secure-aggregation exchange needs an id")
        party = SiteParty(site.name, exchange, site.identity, site.cfg.privacy.secagg_min_sites)
        site.scratch[_SCRATCH] = party
        return Reply(metrics={"secagg": party.advertise()})
    party = _party(site, task.config)
    if task.kind == "secagg/shares":
        return Reply(metrics={"secagg": party.share(task.config.get("order", []), task.config.get("keys", {}))})
    dropped, survived = task.config.get("dropped", []), task.config.get("survived", [])
    if task.kind == "secagg/consistency":
        key = party.record_key
        if key is None:
            raise PayloadError(f"site {site.name}: exchange {party.exchange} has no masked input of this site")
        record = record_of(site)
        entry = record.get(key) or {}
        if not isinstance(survived, list) or not all(isinstance(u, str) for u in survived):
            raise PayloadError(
                f"site {site.name}: the survivor list of exchange {party.exchange} is not a list of names"
            )
        asked = record.get(party.asked_key) if party.asked_key is not None else None
        before = entry.get("survived")
        if before is None and asked is not None:
            before = asked.get("survived")
        if before is not None and before != sorted(survived):
            raise PayloadError(
                f"site {site.name}: attested the survivors {before} for {key} already; it does not attest "
                f"{sorted(survived)} (two sums over different sets would give the difference of their inputs)"
            )
        attestation = party.attest(dropped, survived)
        record.put(key, {**entry, "survived": sorted(survived)})
        if party.asked_key is not None:
            record.put(party.asked_key, {**(asked or {}), "survived": sorted(survived)})
        return Reply(metrics={"secagg": attestation})
    if task.kind == "secagg/reveal":
        shares = party.reveal(dropped, survived, task.config.get("attestations"))
        site.scratch.pop(_SCRATCH, None)  # the exchange is over for this site
        hook = getattr(getattr(site, "dp", None), "on_reveal", None)
        if hook is not None:
            hook(party.exchange, list(party.masked_with), list(survived))
        return Reply(metrics={"secagg": shares})
    raise PayloadError(f"site {site.name}: unknown secure-aggregation task {task.kind!r}")


def mask_reply(site: SecureSite, task: Task, reply: Reply) -> Reply:
    """Step 3: the reply with its arrays encoded (× the public weight: its sample count under
    ``weighting = "samples"``, else 1; per name prefix with ``prefix_weighting``, :func:`weights_by_name`), masked and renamed ``secagg/<name>``; ``metrics["secagg"]`` says
    their dtypes and which peers' shares did not open.  ``asked``: the task's digest
    (:func:`fedseg.privacy.protocol.task_digest`, taken before the handler ran; default: now), attested in the
    consistency round so that the site reveals only when every survivor answered the same task."""
    config = task.config["secagg"]
    party = _party(site, config)
    rnd = task.config.get("round")
    if isinstance(rnd, bool) or not isinstance(rnd, int) or not 1 <= rnd <= site.cfg.rounds:
        raise PayloadError(
            f"site {site.name}: a masked reply for round {rnd!r}; this site's run has rounds 1..{site.cfg.rounds} "
            "and sends one masked reply per task kind, round and step"
        )
    bits = site.cfg.privacy.secagg_fraction_bits
    if config.get("fraction_bits") != bits:
        raise PayloadError(
            f"site {site.name}: the server encodes with {config.get('fraction_bits')} fraction bits, this site "
            f"with privacy.secagg_fraction_bits = {bits}; server and sites must run the same config"
        )
    weights = weights_by_name(config, reply.num_samples)
    digest = task_digest(task.arrays, task.config, site.name)
    arrays, dtypes, unopened = party.mask(
        reply.arrays, weights, config.get("order", []), config.get("shares", {}), bits, digest
    )
    key, record = _key(site, task), record_of(site)
    entry = record.get(key)
    masked = sorted(party.masked_with)
    if entry is not None and not _same_answer(entry, party.input_digest, masked):
        raise PayloadError(
            f"site {site.name}: sent its masked reply for {_label(task)} already (masked with {entry.get('masked')}, "
            f"survivors attested {entry.get('survived')}); it sends another only with the same input and the same "
            f"sites or the survivors it attested, not with {masked} or another input (the difference of two sums "
            "over different sets is one site's input)"
        )
    for before in record.with_input(party.input_digest):  # the same bits, in any run this site took part in
        if masked not in (before.get("masked"), before.get("survived")):
            raise PayloadError(
                f"site {site.name}: masked the same input bits before (for another ask, or in another run), with "
                f"{before.get('masked')}; it does not send them again masked with {masked} (the difference of two "
                "sums over different sets is one site's input)"
            )
    if getattr(site, "epoch", "") and getattr(site, "salt", None) is None:
        # a deployed site whose batches the run seed drives (policy reproducible = true): what was asked — the
        # arrays, kind, round and step — gets one input and one set over all its runs, so that another run config
        # (another learning rate, say) cannot make a near copy of its reply masked with other sites
        ask = f"asked|{_label(task)}|{task_digest(task.arrays, {}, site.name)}"
        prior = record.get(ask)
        if prior is not None and not _same_answer(prior, party.input_digest, masked):
            raise PayloadError(
                f"site {site.name}: was asked {_label(task)} with the same arrays before (in this or another run) and "
                f"masked its reply with {prior.get('masked')}; without a site salt it sends another reply to the same "
                f"ask only with the same input and sites, not with {masked} or another input (give this site a salt: "
                "its policy's reproducible = false)"
            )
        if prior is None:
            record.put(ask, {"masked": masked, "input": party.input_digest, "survived": None})
        party.asked_key = ask
    if entry is None:
        record.put(key, {"masked": masked, "input": party.input_digest, "survived": None})
    party.record_key = key
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
