"""A site's party of a secure-aggregation exchange (:mod:`fedseg.privacy.protocol`): its keys, the shares it
deals and holds, the masking of its input, its attestation of the survivors and what it reveals, with every
check it makes against an active server."""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fedseg.foundation.errors import PayloadError
from fedseg.privacy import secagg
from fedseg.privacy.identity import Identity
from fedseg.privacy.protocol.messages import (
    BUNDLE_BYTES,
    CANARY,
    MASKED,
    SHARE_BYTES,
    from_hex,
    survivors_statement,
)
from fedseg.privacy.secagg import KEY_BYTES


def _ad(exchange: str, sender: str, recipient: str) -> bytes:
    return f"{exchange}|{sender}|{recipient}".encode()


def _mac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


class SiteParty:
    """A site's side of one exchange: its key pairs and self-mask seed, the shares it holds; with an
    ``identity``, it signs its keys and checks its peers' (see :mod:`fedseg.privacy.protocol`).  It masks only with at least
    ``min_sites`` sites (``privacy.secagg_min_sites``) and t = ⌊|U1|/2⌋ + 1 (:func:`fedseg.privacy.secagg.threshold_for`),
    remembers the set it masked with (U2) and reveals only for a survivor set it attested and that at least t
    survivors attested (the consistency round, see :mod:`fedseg.privacy.protocol`)."""

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
            u: {k: from_hex((keys[u] or {}).get(k), KEY_BYTES, f"{k} key of {u}") for k in ("c", "s", "b_digest")}
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
        ``task``: the digest of the task the arrays answer (:func:`fedseg.privacy.protocol.task_digest`), attested in the consistency
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
                if len(bundle) != BUNDLE_BYTES or bundle[0] != me_index:
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
        relayed}) hold a valid attestation of the same survivor set and the same task (:func:`fedseg.privacy.protocol.task_digest`) from
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
            "s": {d: self.held[d][:SHARE_BYTES].hex() for d in dropped if d in self.held},
            "b": {u: (self.held[u][:1] + self.held[u][SHARE_BYTES:]).hex() for u in survived if u in self.held},
        }
