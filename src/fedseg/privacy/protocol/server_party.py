"""The server's party of a secure-aggregation exchange (:mod:`fedseg.privacy.protocol`): it relays the keys,
routes the sealed shares, checks every reply and unmasks the sum of the sites whose masked input arrived,
checking its check word."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from fedseg.foundation.errors import PayloadError
from fedseg.privacy import secagg
from fedseg.privacy.protocol.messages import (
    CANARY,
    MASKED,
    SEALED_BYTES,
    SHARE_BYTES,
    SumRejected,
    from_hex,
)
from fedseg.privacy.secagg import KEY_BYTES

_MAX_CERT = 16384  # characters of a PEM certificate relayed in step 1
_MAX_REASON = 1000  # characters of a refusal's reason relayed in step 2


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
        self.keys[site] = {k: from_hex(message.get(k), KEY_BYTES, f"{what}: {k}") for k in ("c", "s", "b_digest")}
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
            from_hex(shares[v], SEALED_BYTES, f"share of site {site} for {v}")
        commitments = message.get("commitments")
        if not isinstance(commitments, dict) or any(
            not isinstance(commitments.get(k), list) or len(commitments[k]) != len(self.order) for k in ("s", "b")
        ):
            raise PayloadError(f"{what}: expected 'commitments' with {len(self.order)} hashes under 's' and 'b'")
        self.commitments[site] = {
            k: [from_hex(h, KEY_BYTES, f"{what}: commitment {k}[{i}]") for i, h in enumerate(commitments[k])]
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
        raw = from_hex(value, SHARE_BYTES, f"share of {owner}'s secret from site {holder}")
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
