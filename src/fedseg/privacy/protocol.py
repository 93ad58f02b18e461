"""Secure aggregation as messages: what a site and the server each do at each step of one exchange.

One exchange sums one array dictionary over the sites (Bonawitz et al. 2017, Fig. 4, the consistency
check included; the arithmetic and its guarantees are :mod:`fedseg.privacy.secagg`'s, the signatures
:mod:`fedseg.privacy.identity`'s).  Every message is JSON (keys and shares as hex strings) or the masked
arrays, so any transport carries it:

====  =======================================  =============================================
step  server → site                             site → server
====  =======================================  =============================================
1     ``keys``: the exchange id                 its public keys C_u, S_u and the hash of b_u (signed)
2     ``shares``: everyone's public keys (U1)  its shares of s_u and b_u, sealed per peer; the peers
                                               whose keys it refused; the hash of every share
3     the task + the shares sealed for it (U2) the task's arrays, encoded and masked
4a    ``consistency``: who dropped, who        its attestation of U3
      survived (U3)
4b    ``reveal``: the same lists and the       shares of s_d (dropped) and of b_u (survived)
      survivors' attestations
====  =======================================  =============================================

**What a site checks** (against an active server, Bonawitz et al. Section 6 and Flower's SecAgg+ client):
U1 and U2 hold at least ``min_sites`` sites (``privacy.secagg_min_sites``) and U2 at least t = ⌊|U1|/2⌋ + 1;
it masks once per exchange and remembers U2; the lists of 4a and 4b must split U2 exactly with itself and at
least t sites among the survivors; it attests one U3 per exchange, and reveals only for the U3 it attested
and only after every survivor attested that same U3 (t of them at least).  Two different survivor sets
would each need t > |U1|/2 attestations, so some honest site would have attested both: at most one survivor
set per exchange gets any shares, and the server never gets both secrets of one site.

**One task per exchange.**  What a site attests binds the task it masked its reply to as well
(:func:`task_digest`: SHA-256 of the task's arrays — names, dtypes, shapes, bytes — and its config less the
``secagg`` fields), and a site reveals only when every survivor's attestation names the same digest as its
own.  A server that sends the target real weights and the others all-zero weights (their updates are then
known, and the sum minus them is the target's update) gets no share: the target's digest differs from the
others', so no site sees every survivor attest its own task.  What remains: a server that sends ONE crafted
model to every site learns only the sum of the replies to it, as for an honest model — bounded by DP
(``privacy.dp``), not by secure aggregation.

The attestation is the site's certificate's signature of :func:`survivors_statement` when it has an
identity; without one, an
HMAC-SHA256 of it for each other survivor under the key the pair derives from its ``c`` keys (X25519 + HKDF,
purpose "consistency"), which a server that relayed the ``c`` keys unchanged cannot compute (one that replaced
them holds every pair's key: only signed keys stop it).

**Share commitments.**  In step 2 each site sends the hash of every share it dealt
(:func:`fedseg.privacy.secagg.share_commitment`); the server checks each revealed share against its
owner's commitment and rebuilds each secret from the shares that match: a bad share costs one hash, not a
search over subsets of t shares.

:class:`SiteParty` is a site's side (kept between the steps of one exchange), :class:`ServerParty`
the server's: it routes the sealed shares, checks every reply (a malformed one raises
:class:`~fedseg.foundation.errors.PayloadError`, which the caller logs, leaving that site out) and
returns the unmasked sum of the sites whose masked input arrived, after checking its check word
(:func:`fedseg.privacy.secagg.canary`): a sum that holds an input masked for another exchange (replayed)
or another list of sites raises :class:`SumRejected`.

**Signed keys.**  A site with an :class:`~fedseg.privacy.identity.Identity` (its certificate and private key)
signs its step-1 keys and checks every peer's in step 2 (:meth:`~fedseg.privacy.identity.Identity.check_peer`).
It makes no share for a peer whose check fails and reports it with the reason; the server leaves that peer out
of the masking (:attr:`ServerParty.left_out`), so the others' sum comes out without it, and a site refuses to
mask with a peer it refused.  A site without an identity signs nothing and checks nothing.

**The roster.**  A deployed site's identity carries the federation's roster
(:class:`~fedseg.privacy.identity.Roster`): an exchange whose key list (U1), masking list (U2) or survivor
lists (U3) name a party that is not one of its sites is refused whole (no share dealt, nothing masked or
revealed), and a peer's certificate must be the one the roster pins for its name.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fedseg.foundation.errors import PayloadError
from fedseg.privacy import secagg
from fedseg.privacy.identity import Identity
from fedseg.privacy.secagg import KEY_BYTES

__all__ = [
    "CANARY",
    "MASKED",
    "ServerParty",
    "SiteParty",
    "SumRejected",
    "model_digest",
    "survivors_statement",
    "task_digest",
]

MASKED = "secagg/"
"""Prefix of the masked arrays in a reply (distinct from the plain names, whose dtype they do not have)."""

CANARY = MASKED + ".canary"
"""The masked check word of a reply: one int64 (no array of a model has a name that starts with a dot)."""


class SumRejected(PayloadError):
    """The unmasked sum's check word is wrong: some masked input was not masked for this exchange (replayed
    from another exchange or masked with another list of sites), so the sum is noise and must not be used.
    ``exchange`` and ``sites`` (the sites summed) say which exchange failed."""

    def __init__(self, message: str, exchange: str, sites: Sequence[str]):
        super().__init__(message)
        self.exchange, self.sites = exchange, list(sites)


_SHARE = 1 + KEY_BYTES
_BUNDLE = 1 + 2 * KEY_BYTES
_SEALED = 12 + _BUNDLE + 16
_MAX_CERT = 16384  # characters of a PEM certificate relayed in step 1
_MAX_REASON = 1000  # characters of a refusal's reason relayed in step 2


def _hex(value: Any, length: int, what: str) -> bytes:
    """Bytes from a hex string of exactly ``length`` bytes, or :class:`PayloadError` naming ``what``."""
    if not isinstance(value, str):
        raise PayloadError(f"{what}: expected a hex string, got {type(value).__name__}")
    try:
        raw = bytes.fromhex(value)
    except ValueError as e:
        raise PayloadError(f"{what}: not a hex string") from e
    if len(raw) != length:
        raise PayloadError(f"{what}: {len(raw)} bytes, expected {length}")
    return raw


def _ad(exchange: str, sender: str, recipient: str) -> bytes:
    return f"{exchange}|{sender}|{recipient}".encode()


_SURVIVORS = b"fedseg secagg survivors v1"


def survivors_statement(exchange: str, signer: str, survived: Sequence[str], task: str = "") -> bytes:
    """What a site attests in the consistency round: a label, the exchange, the attesting site, the hash of the
    task it masked its reply to (:func:`task_digest`) and the survivor set U3 (sorted), each prefixed by its
    length (no two different tuples give the same bytes)."""
    out = bytearray(_SURVIVORS)
    for part in (exchange, signer, task, *sorted(survived)):
        raw = part.encode()
        out += struct.pack(">I", len(raw)) + raw
    return bytes(out)


_TASK = b"fedseg secagg task v1"


def task_digest(arrays: Mapping[str, torch.Tensor], config: Mapping[str, Any], me: str = "") -> str:
    """SHA-256 (hex) of what a task asks: its arrays in name order (each name, dtype, shape and bytes, each
    prefixed by its length) and its config less the secure-aggregation fields (``secagg``: the exchange's
    own lists and shares, which differ per site), as canonical JSON.  A path component of an array name equal
    to ``me`` (the recipient: FedSM's first round sends each site ``personal/<site>/…``) reads ``<self>``, so
    the same model sent to every site has the same digest at every site."""
    h = hashlib.sha256(_TASK)

    def part(raw: bytes) -> None:
        h.update(struct.pack(">Q", len(raw)) + raw)

    for name in sorted(arrays):
        v = arrays[name].detach().cpu().contiguous()
        canonical = "/".join("<self>" if me and c == me else c for c in name.split("/"))
        part(canonical.encode())
        part(str(v.dtype).encode())
        part(repr(tuple(v.shape)).encode())
        part(v.reshape(-1).view(torch.uint8).numpy().tobytes() if v.numel() else b"")
    rest = {k: v for k, v in config.items() if k != "secagg"}
    part(json.dumps(rest, sort_keys=True, default=repr).encode())
    return h.hexdigest()


def model_digest(arrays: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 (hex) of one model's arrays (:func:`task_digest` with no config): what a deployed site's
    policy names in ``allowed_models`` and what it compares an evaluation candidate with."""
    return task_digest(arrays, {})


def _mac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


class SiteParty:
    """A site's side of one exchange: its key pairs and self-mask seed, the shares it holds; with an
    ``identity``, it signs its keys and checks its peers' (see the module).  It masks only with at least
    ``min_sites`` sites (``privacy.secagg_min_sites``) and t = ⌊|U1|/2⌋ + 1 (:func:`fedseg.privacy.secagg.threshold_for`),
    remembers the set it masked with (U2) and reveals only for a survivor set it attested and that at least t
    survivors attested (the consistency round, see the module)."""

    def __init__(self, me: str, exchange: str, identity: Identity | None = None, min_sites: int = 3):
        self.me, self.exchange, self.identity = me, exchange, identity
        self.min_sites = max(2, int(min_sites))
        self.certs: dict[str, Any] = {}  # peer -> its certificate (PEM) as relayed in step 1, with an identity
        self.masked_with: list[str] = []  # U2, once this site masked
        self.input_digest = ""  # SHA-256 of the encoded input it masked (hex)
        self.task = ""  # the digest of the task whose reply it masked (task_digest), attested with U3
        self.attested: list[str] | None = None  # U3 (sorted), once this site attested it
        self.record_key: str | None = None  # what the site files its masked input under (fedseg.site.secure.Record)
        self.asked_key: str | None = None  # and, at a deployed site without a salt, what was asked
        self.c = secagg.keypair()
        self.s = secagg.keypair()
        self.b = os.urandom(KEY_BYTES)
        self.order: list[str] = []  # U1, as the server sent it in step 2
        self.keys: dict[str, dict[str, bytes]] = {}
        self.held: dict[str, bytes] = {}  # owner -> index byte + share of s + share of b
        self.refused: dict[str, str] = {}  # peer -> why its keys were refused (step 2)
        self.revealed = False

    def advertise(self) -> dict[str, str]:
        """Step 1: the public keys and the self-mask seed's hash; with an identity also this site's certificate
        and its signature of them (:meth:`fedseg.privacy.identity.Identity.sign`)."""
        digest = secagg.seed_digest(self.b, self.exchange)
        out = {"c": self.c.public.hex(), "s": self.s.public.hex(), "b_digest": digest.hex()}
        if self.identity is not None:
            out.update(self.identity.sign(self.exchange, self.c.public, self.s.public, digest))
        return out

    def share(self, order: Sequence[str], keys: Mapping[str, Mapping[str, str]]) -> dict[str, dict[str, Any]]:
        """Step 2: remember U1's keys (refused when U1 has fewer than ``min_sites`` sites); with an identity, check
        each peer's certificate and signature; split s and b among U1 (own share kept); return ``{"shares": {peer:
        hex}, "refused": {peer: reason}, "commitments": {"s": [hex], "b": [hex]}}``: each accepted peer's share
        sealed for it, the peers whose keys this site refused (no share made) and the hash of every share it dealt
        in U1's order (:func:`fedseg.privacy.secagg.share_commitment`)."""
        order = list(order)
        if self.me not in order or len(set(order)) != len(order) or set(keys) != set(order):
            raise PayloadError(f"site {self.me}: the key list of exchange {self.exchange} does not name each site once")
        if self.order:
            raise PayloadError(f"site {self.me}: exchange {self.exchange} was keyed already; it deals its shares once")
        self._check_roster(order, "key list (U1)")
        if len(order) < self.min_sites:
            raise PayloadError(
                f"site {self.me}: exchange {self.exchange} lists {len(order)} sites {order}; this site masks only with "
                f"at least privacy.secagg_min_sites = {self.min_sites} (with fewer the others' inputs, known to or "
                "forged by the server, can be subtracted from the sum): run the exchange with more sites"
            )
        self.order = order
        self.keys = {
            u: {k: _hex((keys[u] or {}).get(k), KEY_BYTES, f"{k} key of {u}") for k in ("c", "s", "b_digest")}
            for u in order
        }
        mine = self.keys[self.me]
        if mine["c"] != self.c.public or mine["s"] != self.s.public:
            raise PayloadError(f"site {self.me}: the server relayed other public keys than this site's own")
        if self.identity is not None:
            self.certs = {u: (keys[u] or {}).get("certificate") for u in order}
            for u in order:
                why = None if u == self.me else self.identity.check_peer(u, self.exchange, self.keys[u], keys[u])
                if why is not None:
                    self.refused[u] = why
        t = secagg.threshold_for(len(order))
        s_shares = secagg.split(self.s.private, t, len(order))
        b_shares = secagg.split(self.b, t, len(order))
        out = {}
        commitments: dict[str, list[str]] = {"s": [], "b": []}
        for i in range(len(order)):
            commitments["s"].append(secagg.share_commitment(self.exchange, self.me, "s", i + 1, s_shares[i]).hex())
            commitments["b"].append(secagg.share_commitment(self.exchange, self.me, "b", i + 1, b_shares[i]).hex())
        for i, v in enumerate(order):
            bundle = bytes([i + 1]) + s_shares[i] + b_shares[i]
            if v == self.me:
                self.held[self.me] = bundle
                continue
            if v in self.refused:
                continue
            key = secagg.shared_key(self.c.private, self.keys[v]["c"], "share", self.exchange)
            out[v] = secagg.seal(key, bundle, _ad(self.exchange, self.me, v)).hex()
        return {"shares": out, "refused": dict(self.refused), "commitments": commitments}

    def mask(
        self,
        arrays: Mapping[str, torch.Tensor],
        weight: float | Callable[[str], float],
        order: Sequence[str],
        shares: Mapping[str, str],
        fraction_bits: int,
        task: str = "",
    ) -> tuple[dict[str, torch.Tensor], dict[str, str], list[str]]:
        """Step 3: open the shares sealed for this site, then encode ``weight`` · arrays (a function of the
        array's name: per-name weights, :func:`fedseg.privacy.secagg.encode`) and mask them with every site
        of ``order`` (U2), with this site's check word appended (:func:`fedseg.privacy.secagg.canary`).
        ``task``: the digest of the task the arrays answer (:func:`task_digest`), attested in the consistency
        round: the site reveals only if every survivor masked a reply to the same task.
        Returns the masked arrays (``secagg/<name>``, int64, and the masked check word :data:`CANARY`), their
        dtypes and the senders whose share did not open (they are not held; the sum still works if
        enough others are)."""
        order = list(order)
        if not self.order or self.me not in order or not set(order) <= set(self.order) or len(set(order)) != len(order):
            raise PayloadError(f"site {self.me}: exchange {self.exchange} asks to mask with sites it did not key")
        if self.masked_with:
            raise PayloadError(
                f"site {self.me}: exchange {self.exchange} was masked already; a site masks once per exchange"
            )
        t = secagg.threshold_for(len(self.order))
        if len(order) < max(self.min_sites, t):
            raise PayloadError(
                f"site {self.me}: exchange {self.exchange} asks to mask with {len(order)} sites {order}; this site masks "
                f"with at least {max(self.min_sites, t)} (privacy.secagg_min_sites = {self.min_sites} and the threshold "
                f"t = {t} of the {len(self.order)} sites keyed)"
            )
        self._check_roster(order, "masking list (U2)")
        refused = sorted(set(order) & set(self.refused))
        if refused:
            raise PayloadError(
                f"site {self.me}: exchange {self.exchange} asks to mask with {refused}, whose keys this site refused "
                "in step 2; it does not mask with keys it could not check"
            )
        me_index = self.order.index(self.me) + 1
        bad = []
        for sender in order:
            if sender == self.me:
                continue
            try:
                key = secagg.shared_key(self.c.private, self.keys[sender]["c"], "share", self.exchange)
                blob = bytes.fromhex(shares[sender]) if isinstance(shares.get(sender), str) else b""
                bundle = secagg.unseal(key, blob, _ad(self.exchange, sender, self.me), f"share from {sender}")
                if len(bundle) != _BUNDLE or bundle[0] != me_index:
                    raise PayloadError(f"share from {sender}: wrong length or index")
                self.held[sender] = bundle
            except (PayloadError, ValueError):
                bad.append(sender)
        encoded, layout = secagg.encode(arrays, weight, fraction_bits, len(order), f"site {self.me}")
        self.masked_with = order
        self.task = str(task)
        self.input_digest = hashlib.sha256(
            "|".join(f"{n}:{s}:{d}" for n, s, d in zip(layout.names, layout.shapes, layout.dtypes)).encode()
            + encoded.tobytes()
        ).hexdigest()
        encoded = np.append(encoded, secagg.canary(self.exchange, self.me))
        publics = {u: self.keys[u]["s"] for u in order}
        y = secagg.mask(encoded, self.me, order, self.s.private, publics, self.b, self.exchange).view(np.int64)
        out, pos = {}, 0
        for name, shape in zip(layout.names, layout.shapes):
            n = int(np.prod(shape, dtype=np.int64))
            out[MASKED + name] = torch.from_numpy(y[pos : pos + n].copy()).reshape(shape)
            pos += n
        out[CANARY] = torch.from_numpy(y[pos:].copy())
        return out, dict(zip(layout.names, layout.dtypes)), bad

    def _check_roster(self, names: Sequence[str], what: str) -> None:
        """With a roster (:attr:`fedseg.privacy.identity.Identity.roster`): :class:`PayloadError` when ``names``
        holds a party that is not one of the roster's sites (the server's own name, an admin's, an invented one):
        the site deals no share, masks nothing and reveals nothing in such an exchange."""
        roster = self.identity.roster if self.identity is not None else None
        outside = roster.outside(names) if roster is not None else []
        if roster is not None and outside:
            raise PayloadError(
                f"site {self.me}: the {what} of exchange {self.exchange} names {outside}, not sites of this site's "
                f"roster {sorted(roster.sites)} (its kit's local/fedseg_roster.json); it takes no part in an exchange "
                "with parties outside the federation (the server's or an admin's name stands for keys the server's "
                "operator holds). If the federation changed, provision it again and compare the new rosters"
            )

    def _check_lists(self, dropped: Sequence[str], survived: Sequence[str], what: str) -> tuple[list[str], list[str]]:
        """The lists of the consistency round and of step 4, checked: they split U2 exactly (each site once), name
        this site among the survivors and hold at least t survivors, all of them sites of its roster (with one);
        :class:`PayloadError` otherwise."""
        dropped, survived = list(dropped), list(survived)
        self._check_roster([*dropped, *survived], "survivor lists (U3)")
        t = secagg.threshold_for(len(self.order)) if self.order else 0
        if (
            not self.masked_with
            or len(set(dropped)) != len(dropped)
            or len(set(survived)) != len(survived)
            or set(dropped) & set(survived)
            or set(dropped) | set(survived) != set(self.masked_with)
            or self.me not in survived
            or len(survived) < t
        ):
            raise PayloadError(
                f"site {self.me}: refuses to {what} for exchange {self.exchange} with dropped {dropped} and survived "
                f"{survived}: they must split the {len(self.masked_with)} sites it masked with {self.masked_with} "
                f"exactly, name this site among at least t = {t} survivors"
            )
        return dropped, survived

    def attest(self, dropped: Sequence[str], survived: Sequence[str]) -> dict[str, Any]:
        """The consistency round (after step 3): attest the survivor set U3 if the lists split U2 exactly and
        U3 holds at least t sites.  With an identity: ``{"signature": hex}``, its certificate's signature of
        :func:`survivors_statement`; without: ``{"macs": {peer: hex}}``, HMAC-SHA256 of the statement under the
        key this site shares with each other survivor (X25519 of their ``c`` keys + HKDF, purpose
        "consistency").  A site attests one survivor set per exchange."""
        dropped, survived = self._check_lists(dropped, survived, "attest the survivors")
        if self.attested is not None and self.attested != sorted(survived):
            raise PayloadError(
                f"site {self.me}: attested the survivors {self.attested} of exchange {self.exchange} already; it "
                f"does not attest another set {sorted(survived)}"
            )
        self.attested = sorted(survived)
        data = survivors_statement(self.exchange, self.me, survived, self.task)
        if self.identity is not None:
            return {"signature": self.identity.sign_bytes(data)}
        return {"macs": {v: _mac(self._pair_key(v), data).hex() for v in survived if v != self.me}}

    def _pair_key(self, peer: str) -> bytes:
        return secagg.shared_key(self.c.private, self.keys[peer]["c"], "consistency", self.exchange)

    def _attested_by(self, peer: str, attestation: Any, survived: Sequence[str]) -> bool:
        """Whether ``attestation`` (as relayed) is ``peer``'s valid attestation of ``survived``."""
        if not isinstance(attestation, dict):
            return False
        data = survivors_statement(self.exchange, peer, survived, self.task)
        if self.identity is not None:
            return self.identity.verify_peer(peer, self.certs.get(peer), attestation.get("signature"), data)
        macs = attestation.get("macs")
        tag = macs.get(self.me) if isinstance(macs, dict) else None
        if not isinstance(tag, str):
            return False
        try:
            raw = bytes.fromhex(tag)
        except ValueError:
            return False
        return hmac.compare_digest(raw, _mac(self._pair_key(peer), data))

    def reveal(
        self, dropped: Sequence[str], survived: Sequence[str], attestations: Mapping[str, Any] | None = None
    ) -> dict[str, dict[str, str]]:
        """Step 4: shares of s_d for each dropped site and of b_u for each surviving one (this site among
        them), ``{"s": {d: hex}, "b": {u: hex}}``.  Refused unless the lists split U2 exactly with at least t
        survivors, this site attested that survivor set and ``attestations`` ({survivor: its attestation, as
        relayed}) hold a valid attestation of the same survivor set and the same task (:func:`task_digest`) from
        EVERY survivor: a server that sent one survivor other arrays or another config than the rest (real
        weights to the target, all-zero weights to the others) gets no share of anyone's secrets, so it never
        unmasks a sum of replies to different tasks.  Refused as well when this exchange was revealed before:
        an honest site never gives out both shares of one peer."""
        if self.revealed:
            raise PayloadError(f"site {self.me}: revealed its shares of exchange {self.exchange} already")
        dropped, survived = self._check_lists(dropped, survived, "reveal shares")
        if self.attested != sorted(survived):
            raise PayloadError(
                f"site {self.me}: refuses to reveal shares of exchange {self.exchange} for survivors {sorted(survived)}: "
                f"it attested {self.attested} in the consistency round"
            )
        attestations = attestations if isinstance(attestations, Mapping) else {}
        missing = sorted(
            u
            for u in survived
            if u != self.me and not (u in attestations and self._attested_by(u, attestations[u], survived))
        )
        if missing:
            raise PayloadError(
                f"site {self.me}: refuses to reveal shares of exchange {self.exchange}: "
                f"{len(survived) - len(missing)} survivors attested the survivor set {sorted(survived)} and this "
                f"site's task validly, all {len(survived)} needed; not {missing} (the server sent them other "
                "survivor lists or another task — other arrays or config — than this site's, or altered their "
                "attestations)"
            )
        self.revealed = True
        return {
            "s": {d: self.held[d][:_SHARE].hex() for d in dropped if d in self.held},
            "b": {u: (self.held[u][:1] + self.held[u][_SHARE:]).hex() for u in survived if u in self.held},
        }


class ServerParty:
    """The server's side of one exchange over ``sites`` (in the exchange's order)."""

    def __init__(self, exchange: str, fraction_bits: int):
        self.exchange, self.fraction_bits = exchange, fraction_bits
        self.keys: dict[str, dict[str, bytes]] = {}
        self.signed: dict[str, dict[str, str]] = {}  # site -> its certificate and signature, relayed as sent
        self.order: list[str] = []  # U1
        self.sealed: dict[str, dict[str, str]] = {}  # sender -> {recipient: hex}
        self.refusals: dict[str, dict[str, str]] = {}  # sender -> {peer whose keys it refused: reason}
        self.commitments: dict[str, dict[str, list[bytes]]] = {}  # dealer -> {"s"|"b": hash per holder index}
        self.inputs: dict[str, np.ndarray] = {}
        self.weights: dict[str, float] = {}
        self.layout: secagg.Layout | None = None
        self.attestations: dict[str, Any] = {}  # survivor -> its attestation of the survivor set, relayed as sent

    # step 1
    def accept_keys(self, site: str, message: Any) -> None:
        """A site's step-1 message; :class:`PayloadError` if malformed."""
        what = f"keys of site {site}"
        if not isinstance(message, dict):
            raise PayloadError(f"{what}: expected an object")
        self.keys[site] = {k: _hex(message.get(k), KEY_BYTES, f"{what}: {k}") for k in ("c", "s", "b_digest")}
        signed = {k: message[k] for k in ("certificate", "signature") if k in message}
        if any(not isinstance(v, str) or len(v) > _MAX_CERT for v in signed.values()):
            raise PayloadError(
                f"{what}: its certificate or signature is not a string of at most {_MAX_CERT} characters"
            )
        self.signed[site] = signed
        self.order.append(site)

    def share_request(self) -> dict[str, Any]:
        """Step 2's task config: U1 and its keys."""
        if len(self.order) < 2:
            raise PayloadError(
                f"secure aggregation needs at least 2 sites; {len(self.order)} answered (one site's sum is its input)"
            )
        return {
            "exchange": self.exchange,
            "order": list(self.order),
            "keys": {u: {**{k: v.hex() for k, v in self.keys[u].items()}, **self.signed[u]} for u in self.order},
        }

    # step 2
    def accept_shares(self, site: str, message: Any) -> None:
        """A site's step-2 message: ``{"shares": {peer: sealed hex}, "refused": {peer: reason}, "commitments": {"s":
        [hex], "b": [hex]}}``, one sealed share (of the sealed length) for each other site of U1 that it did not
        refuse and one hash of each share it dealt (U1's order)."""
        what = f"shares of site {site}"
        if not isinstance(message, dict) or not isinstance(message.get("shares"), dict):
            raise PayloadError(f"{what}: expected an object with 'shares'")
        refused = message.get("refused") or {}
        peers = [u for u in self.order if u != site]
        if not isinstance(refused, dict) or not set(refused) <= set(peers):
            raise PayloadError(f"{what}: its refused peers {sorted(refused)[:5]} are not other sites of {peers}")
        shares = message["shares"]
        accepted = [u for u in peers if u not in refused]
        if sorted(shares) != sorted(accepted):
            raise PayloadError(f"{what}: expected one sealed share for each of {accepted}")
        for v in accepted:
            _hex(shares[v], _SEALED, f"share of site {site} for {v}")
        commitments = message.get("commitments")
        if not isinstance(commitments, dict) or any(
            not isinstance(commitments.get(k), list) or len(commitments[k]) != len(self.order) for k in ("s", "b")
        ):
            raise PayloadError(f"{what}: expected 'commitments' with {len(self.order)} hashes under 's' and 'b'")
        self.commitments[site] = {
            k: [_hex(h, KEY_BYTES, f"{what}: commitment {k}[{i}]") for i, h in enumerate(commitments[k])]
            for k in ("s", "b")
        }
        self.sealed[site] = dict(shares)
        self.refusals[site] = {u: str(why)[:_MAX_REASON] for u, why in refused.items()}

    @property
    def left_out(self) -> dict[str, dict[str, str]]:
        """The sites left out of the masking because other sites refused their keys, ``{site: {refuser: reason}}``.

        Among the sites that sent shares, the ones refused by the most others are left out, then their own
        refusals no longer count, until no remaining site refuses another.  A site whose keys were replaced on
        the way to some sites, or whose certificate is another CA's or names another site, is refused by those
        sites and left out; a site that refuses everyone (its own root CA is not the federation's) is refused
        by all the others and left out first."""
        active = [u for u in self.order if u in self.sealed]
        out: dict[str, dict[str, str]] = {}
        while True:
            against = {v: {u: self.refusals[u][v] for u in active if v in self.refusals.get(u, {})} for v in active}
            top = max((len(r) for r in against.values()), default=0)
            if top == 0:
                return out
            for v, r in against.items():
                if len(r) == top:
                    out[v] = r
            active = [u for u in active if u not in out]

    @property
    def masking(self) -> list[str]:
        """U2: the sites of U1 whose shares went out and whose keys no other site refused (:attr:`left_out`), in
        order; they mask with each other."""
        out = self.left_out
        return [u for u in self.order if u in self.sealed and u not in out]

    def input_config(self, site: str) -> dict[str, Any]:
        """Step 3: what the masking task for ``site`` carries."""
        order = self.masking
        if len(order) < 2:
            raise PayloadError(f"secure aggregation needs at least 2 sites; {len(order)} sent their shares")
        return {
            "exchange": self.exchange,
            "order": order,
            "shares": {u: self.sealed[u][site] for u in order if u != site},
            "fraction_bits": self.fraction_bits,
        }

    # step 3
    def accept_input(self, site: str, arrays: Mapping[str, torch.Tensor], dtypes: Any, weight: float) -> None:
        """A site's masked arrays (all ``secagg/…`` int64, the layout of the first input, and the masked check
        word :data:`CANARY`) and public weight."""
        what = f"masked input of site {site}"
        if site not in self.masking:
            raise PayloadError(f"{what}: the site was not part of the masking")
        arrays = dict(arrays)
        check = arrays.pop(CANARY, None)
        if not isinstance(check, torch.Tensor) or check.dtype != torch.int64 or tuple(check.shape) != (1,):
            raise PayloadError(f"{what}: no masked check word '{CANARY}' (one int64); the site runs another protocol")
        if not isinstance(dtypes, dict) or sorted(dtypes) != sorted(k[len(MASKED) :] for k in arrays):
            raise PayloadError(f"{what}: its dtype list does not name its arrays")
        bad = [k for k, v in arrays.items() if not k.startswith(MASKED) or v.dtype != torch.int64]
        if bad:
            raise PayloadError(f"{what}: {bad[:3]} are not masked int64 arrays")
        plain = {k[len(MASKED) :]: v for k, v in arrays.items()}
        layout = secagg.layout_of(plain)
        layout = secagg.Layout(layout.names, layout.shapes, tuple(str(dtypes[k]) for k in layout.names))
        if not all(isinstance(getattr(torch, d, None), torch.dtype) for d in layout.dtypes):
            raise PayloadError(f"{what}: unknown dtypes {sorted(set(layout.dtypes))}")
        if self.layout is None:
            self.layout = layout
        elif layout != self.layout:
            raise PayloadError(f"{what}: names, shapes or dtypes differ from the other sites'")
        if not (weight >= 0 and weight < float("inf")):
            raise PayloadError(f"{what}: weight {weight}")
        parts = [plain[k].detach().cpu().reshape(-1).numpy() for k in layout.names]
        self.inputs[site] = np.concatenate([*parts, check.detach().cpu().numpy()]).view(np.uint64)
        self.weights[site] = float(weight)

    def consistency_config(self) -> dict[str, Any]:
        """The consistency round's task config: who dropped after masking and who survived (U3), the same for
        every survivor."""
        survived = [u for u in self.masking if u in self.inputs]
        if len(survived) < 2:
            raise PayloadError(f"secure aggregation needs at least 2 masked inputs; {len(survived)} arrived")
        return {
            "exchange": self.exchange,
            "dropped": [u for u in self.masking if u not in self.inputs],
            "survived": survived,
        }

    def accept_attestation(self, site: str, message: Any) -> None:
        """A survivor's attestation of U3 (``{"signature": hex}`` or ``{"macs": {peer: hex}}``, checked by the
        sites, not here: the server holds no key that verifies a MAC); :class:`PayloadError` if malformed."""
        what = f"attestation of site {site}"
        if site not in self.consistency_config()["survived"]:
            raise PayloadError(f"{what}: the site is not a survivor")
        ok = isinstance(message, dict) and (
            (isinstance(message.get("signature"), str) and len(message["signature"]) <= _MAX_CERT)
            or (
                isinstance(message.get("macs"), dict)
                and all(isinstance(v, str) and len(v) == 64 for v in message["macs"].values())
                and set(message["macs"]) <= set(self.order)
            )
        )
        if not ok:
            raise PayloadError(f"{what}: expected {{'signature': hex}} or {{'macs': {{peer: hex}}}}")
        self.attestations[site] = message

    def reveal_config(self) -> dict[str, Any]:
        """Step 4's task config: who dropped after masking, who survived and the survivors' attestations; sent to
        the survivors (every survivor must have attested, or :class:`PayloadError`: a site reveals only with
        every survivor's attestation of the same survivor set and task)."""
        cfg = self.consistency_config()
        attested = {u: self.attestations[u] for u in cfg["survived"] if u in self.attestations}
        if len(attested) < len(cfg["survived"]):
            missing = [u for u in cfg["survived"] if u not in attested]
            raise PayloadError(
                f"exchange {self.exchange}: {len(attested)} of the {len(cfg['survived'])} survivors attested the "
                f"survivor set; no attestation from {missing}, and every survivor's is needed"
            )
        return {**cfg, "attestations": attested}

    # step 4
    def check_share(self, holder: str, owner: str, value: Any) -> tuple[int, bytes]:
        """One revealed share: 33 bytes whose first is the holder's index in U1; :class:`PayloadError` otherwise."""
        raw = _hex(value, _SHARE, f"share of {owner}'s secret from site {holder}")
        want = self.order.index(holder) + 1
        if raw[0] != want:
            raise PayloadError(f"share of {owner}'s secret from site {holder}: index {raw[0]}, the site's is {want}")
        return raw[0], raw[1:]

    def unmask(self, reveals: Mapping[str, Any], log=print) -> tuple[dict[str, torch.Tensor], float, list[str]]:
        """Rebuild b_u of the survivors and s_d of the dropped from the step-4 replies ``{holder: message}``,
        remove their masks, check the sum's check word and decode: ``(Σ_u weight_u · arrays_u (float64; integer
        tensors summed), Σ_u weight_u, the sites summed)``.  A malformed share, or one whose hash is not the one
        its owner committed to in step 2, is logged and set aside (one hash per share: O(K), no search over
        subsets of t shares); a wrong check word raises :class:`SumRejected` (the sum must not be used)."""
        cfg = self.consistency_config()
        dropped, survived = cfg["dropped"], cfg["survived"]
        t = secagg.threshold_for(len(self.order))
        holders = {self.order.index(u) + 1: u for u in self.order}
        collected: dict[tuple[str, str], dict[int, bytes]] = {}
        for holder, message in reveals.items():
            if holder not in survived or not isinstance(message, dict):
                log(f"[secagg] reveal of site {holder} ignored: not a surviving site's object")
                continue
            for kind, owners in (("s", dropped), ("b", survived)):
                got = message.get(kind)
                for owner in owners:
                    if not isinstance(got, dict) or owner not in got:
                        continue
                    try:
                        i, share = self.check_share(holder, owner, got[owner])
                    except PayloadError as e:
                        log(f"[secagg] rejected: {e}")
                        continue
                    committed = self.commitments.get(owner, {}).get(kind)
                    if (
                        committed is not None
                        and secagg.share_commitment(self.exchange, owner, kind, i, share) != committed[i - 1]
                    ):
                        log(
                            f"[secagg] rejected: the share of site {owner}'s {'mask key' if kind == 's' else 'self-mask seed'} "
                            f"from site {holder} is not the one site {owner} committed to"
                        )
                        continue
                    collected.setdefault((kind, owner), {})[i] = share
        secrets: dict[tuple[str, str], bytes] = {}
        for kind, owners in (("s", dropped), ("b", survived)):
            for owner in owners:
                if kind == "s":

                    def fits(x: bytes, owner=owner) -> bool:
                        return secagg.keypair(x).public == self.keys[owner]["s"]
                else:

                    def fits(x: bytes, owner=owner) -> bool:
                        return secagg.seed_digest(x, self.exchange) == self.keys[owner]["b_digest"]

                what = f"the {'mask key' if kind == 's' else 'self-mask seed'} of site {owner}"
                secret, bad = secagg.recover(collected.get((kind, owner), {}), t, fits, what)
                for i in sorted(bad):
                    log(f"[secagg] rejected: the share of {what} from site {holders[i]} does not fit the published one")
                secrets[(kind, owner)] = secret
        total = secagg.unmask_sum(
            {u: self.inputs[u] for u in survived},
            self.masking,
            {u: self.keys[u]["s"] for u in self.masking},
            {u: secrets[("b", u)] for u in survived},
            {d: secrets[("s", d)] for d in dropped},
            self.exchange,
        )
        if int(total[-1]) != sum(int(secagg.canary(self.exchange, u)) for u in survived) % 2**64:
            raise SumRejected(
                f"exchange {self.exchange}: the unmasked sum of sites {survived} fails its check word, so at least "
                "one of their masked inputs was not masked for this exchange (replayed from an earlier exchange, "
                "or masked with another list of sites); the sum is noise and is not used",
                self.exchange,
                survived,
            )
        assert self.layout is not None
        return (
            secagg.decode(total[:-1], self.layout, self.fraction_bits),
            sum(self.weights[u] for u in survived),
            survived,
        )
