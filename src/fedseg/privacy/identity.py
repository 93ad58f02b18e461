"""Site identities for secure aggregation: each site signs its public keys of an exchange with the private key
of its certificate, and every site checks its peers' certificates and signatures before it shares with them
(the signature step of Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving Machine
Learning", CCS 2017, Fig. 4, round 1).

A site's identity is what its NVIDIA FLARE startup kit holds (``startup/client.crt``, ``startup/client.key``,
``startup/rootCA.pem``, written by ``fedseg deploy provision``): an X.509 certificate whose common name is the
site's name, issued by the federation's root CA, and its private key.  FLARE's provisioning makes RSA-2048
keys; EC (ECDSA with SHA-256), Ed25519 and Ed448 keys work as well.

What a site signs is :func:`statement`: a fixed label, the exchange id, the site's name, its two X25519 public
keys C_u and S_u and the SHA-256 hash of its self-mask seed b_u.  A peer's keys are accepted (:meth:`Identity.
check_peer`) only if its certificate chains to the same root CA (``cryptography``'s X.509 path verifier, as
FLARE checks its own certificates), is valid now, names the peer as its common name, and its public key
verifies the signature over the statement of this exchange.  So no server and nobody on the path can
substitute a site's keys (it would have to sign for that site), replay a site's keys from another exchange
(the exchange id is signed), or present one site's keys as another's (the name is signed and must be the
certificate's).

**The roster.**  The same root CA certifies the server and the admin (FLARE provisions them together), so
"chains to the root CA" does not make a certificate a site's.  A deployed site therefore holds a
:class:`Roster`, written into its kit at provisioning (``local/fedseg_roster.json``): the federation's site
names and the SHA-256 fingerprint of each site's certificate (of its DER bytes, as ``openssl x509
-fingerprint -sha256`` prints it), and the fingerprints of the server's and the admins' certificates.  With a
roster, a peer is accepted only if its name is a site of the roster and its certificate is the very one the
roster pins for that name (so neither the server's nor an admin's certificate, nor a certificate minted later
with the CA's key, passes); and a certificate that is not an end entity's client certificate (a CA, an
extended key usage without clientAuth, FLARE's admin role attribute) is refused with or without a roster.
Sites compare their rosters out of band (``fedseg deploy roster KIT``): the fingerprint check every PKI
relies on.

Everything here is the ``cryptography`` package, imported when used (the ``privacy`` extra).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedseg.foundation.errors import ConfigError, FedsegError

__all__ = [
    "KIT_FILES",
    "ROSTER_NAME",
    "Identity",
    "Roster",
    "fingerprint",
    "load_identity",
    "read_roster",
    "roster_path",
    "statement",
]

KIT_FILES = ("client.crt", "client.key", "rootCA.pem")
"""A site's certificate, its private key and the federation's root CA, as a FLARE startup kit names them."""

ROSTER_NAME = "fedseg_roster.json"
"""A site kit's roster (:class:`Roster`), in the kit's ``local/`` folder beside its site config."""

_LABEL = b"fedseg secagg keys v1"

_FIX_ROSTER = (
    "provision the federation again (`fedseg deploy provision` writes every site kit's local/fedseg_roster.json) "
    "and compare the rosters of all sites out of band (`fedseg deploy roster KIT`)"
)

_FIX_KIT = "provision every site from the same federation (`fedseg deploy provision`) and start each with its own kit"


def _x509():
    try:
        from cryptography import x509
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, padding, rsa
        from cryptography.x509 import verification
        from cryptography.x509.oid import NameOID
    except ImportError as e:  # pragma: no cover - the privacy extra is installed by make
        raise FedsegError(
            "signed secure-aggregation keys need the 'cryptography' package: pip install 'fedseg[privacy]'"
        ) from e
    return x509, InvalidSignature, hashes, serialization, ec, ed448, ed25519, padding, rsa, verification, NameOID


def statement(exchange: str, site: str, c: bytes, s: bytes, b_digest: bytes) -> bytes:
    """The bytes a site signs in step 1: a label, then exchange, site name, C_u, S_u and the hash of b_u, each
    prefixed by its length (so no two different tuples give the same bytes)."""
    out = bytearray(_LABEL)
    for part in (exchange.encode(), site.encode(), c, s, b_digest):
        out += struct.pack(">I", len(part)) + part
    return bytes(out)


def _sign(key: Any, data: bytes) -> bytes:
    _, _, hashes, _, ec, ed448, ed25519, padding, rsa, _, _ = _x509()
    if isinstance(key, rsa.RSAPrivateKey):
        pss = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.DIGEST_LENGTH)
        return key.sign(data, pss, hashes.SHA256())
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return key.sign(data, ec.ECDSA(hashes.SHA256()))
    if isinstance(key, (ed25519.Ed25519PrivateKey, ed448.Ed448PrivateKey)):
        return key.sign(data)
    raise ConfigError(f"a {type(key).__name__} cannot sign secure-aggregation keys; use an RSA, EC or Ed25519 key")


def _verify(public: Any, signature: bytes, data: bytes) -> bool:
    _, InvalidSignature, hashes, _, ec, ed448, ed25519, padding, rsa, _, _ = _x509()
    try:
        if isinstance(public, rsa.RSAPublicKey):
            pss = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.DIGEST_LENGTH)
            public.verify(signature, data, pss, hashes.SHA256())
        elif isinstance(public, ec.EllipticCurvePublicKey):
            public.verify(signature, data, ec.ECDSA(hashes.SHA256()))
        elif isinstance(public, (ed25519.Ed25519PublicKey, ed448.Ed448PublicKey)):
            public.verify(signature, data)
        else:
            return False
    except (InvalidSignature, ValueError):
        return False
    return True


def _common_name(cert: Any) -> str | None:
    NameOID = _x509()[-1]
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if len(names) == 1 else None


def fingerprint(certificate: Any) -> str:
    """The SHA-256 fingerprint of a certificate (a ``cryptography`` certificate, or PEM as str or bytes): the
    hash of its DER bytes as colon-separated upper-case hex, as ``openssl x509 -noout -fingerprint -sha256``
    prints it."""
    x509, _, _, serialization, *_ = _x509()
    if isinstance(certificate, str):
        certificate = certificate.encode()
    if isinstance(certificate, bytes):
        certificate = x509.load_pem_x509_certificate(certificate)
    digest = hashlib.sha256(certificate.public_bytes(serialization.Encoding.DER)).hexdigest().upper()
    return ":".join(digest[i : i + 2] for i in range(0, len(digest), 2))


def _not_a_site_certificate(cert: Any) -> str | None:
    """Why ``cert`` is not an end entity's client certificate (None: it may be a site's): a CA certificate, an
    extended key usage without clientAuth (a server's), or FLARE's role attribute (an admin's: FLARE's
    provisioning writes an admin's role into the subject's unstructuredName, and nothing into a site's)."""
    x509, *_, NameOID = _x509()
    from cryptography.x509.oid import ExtendedKeyUsageOID

    try:
        if cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca:
            return "it is a CA certificate"
    except x509.ExtensionNotFound:
        pass
    try:
        usages = list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    except x509.ExtensionNotFound:
        usages = None
    if usages is not None and ExtendedKeyUsageOID.CLIENT_AUTH not in usages:
        return (
            f"its extended key usage ({', '.join(getattr(u, '_name', u.dotted_string) for u in usages)}) does not "
            "allow clientAuth: it is a server's certificate"
        )
    roles = cert.subject.get_attributes_for_oid(NameOID.UNSTRUCTURED_NAME)
    if roles:
        return f"it carries FLARE's role attribute {roles[0].value!r}: it is an admin's certificate, not a site's"
    return None


@dataclass(frozen=True)
class Roster:
    """The federation as provisioned, held by each site (:data:`ROSTER_NAME` in its kit's ``local/``): each
    site's name and its certificate's :func:`fingerprint`, the fingerprints of the server's and the admins'
    certificates (never a site's) and of the root CA.  A site with a roster takes part only in exchanges among
    its sites, and accepts a peer's keys only under the certificate the roster pins for that name."""

    sites: dict[str, str]
    server: dict[str, str] = field(default_factory=dict)
    admins: dict[str, str] = field(default_factory=dict)
    root_ca: str = ""
    federation: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "federation": self.federation,
            "root_ca": self.root_ca,
            "sites": dict(self.sites),
            "server": dict(self.server),
            "admins": dict(self.admins),
        }

    @classmethod
    def from_json(cls, raw: Any, where: str = "roster") -> Roster:
        """A roster from its JSON object; :class:`ConfigError` naming ``where`` and the fix when malformed."""

        def names(key: str, required: bool = False) -> dict[str, str]:
            v = raw.get(key, None if required else {})
            if not isinstance(v, dict) or not all(isinstance(a, str) and isinstance(b, str) for a, b in v.items()):
                raise ConfigError(f"{where}: '{key}' is not an object of names and fingerprints; {_FIX_ROSTER}")
            return dict(v)

        if not isinstance(raw, dict):
            raise ConfigError(f"{where} is not a JSON object; {_FIX_ROSTER}")
        sites = names("sites", required=True)
        if not sites:
            raise ConfigError(f"{where} names no site; {_FIX_ROSTER}")
        return cls(sites, names("server"), names("admins"), str(raw.get("root_ca", "")), str(raw.get("federation", "")))

    def outside(self, names: Any) -> list[str]:
        """The names of ``names`` that are not sites of this roster."""
        return [u for u in names if u not in self.sites]

    def refusal(self, name: str, cert: Any) -> str | None:
        """Why ``cert``, presented as site ``name``'s, is not that site's (None: it is the one the roster pins)."""
        fp = fingerprint(cert)
        for role, entries in (("the server's", self.server), ("an admin's", self.admins)):
            owner = next((who for who, f in entries.items() if f == fp), None)
            if owner is not None:
                return (
                    f"the certificate presented as site {name}'s is {role} ({owner!r}), not a site's: the server's "
                    "operator holds it, so it proves no site"
                )
        if name not in self.sites:
            return f"{name!r} is not a site of this site's roster {sorted(self.sites)}"
        if self.sites[name] != fp:
            return (
                f"the certificate presented as site {name}'s (SHA-256 {fp}) is not the one this site's roster pins for "
                f"it ({self.sites[name]}): a certificate issued after provisioning (with the root CA's key), or another "
                "federation's"
            )
        return None

    def lines(self) -> list[str]:
        """The roster as text, one participant a line (``role  name  fingerprint``), for comparison out of band."""
        out = [f"federation {self.federation or '?'}", f"root CA   {self.root_ca}"]
        out += [f"site      {n}  {f}" for n, f in sorted(self.sites.items())]
        out += [f"server    {n}  {f}" for n, f in sorted(self.server.items())]
        out += [f"admin     {n}  {f}" for n, f in sorted(self.admins.items())]
        return out


def read_roster(path: str | Path) -> Roster:
    """The roster in ``path`` (JSON, :meth:`Roster.from_json`); :class:`ConfigError` naming the fix."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: this kit holds no roster of the federation's sites; {_FIX_ROSTER}")
    try:
        raw = json.loads(path.read_text())
    except ValueError as e:
        raise ConfigError(f"roster {path} is not valid JSON ({e}); {_FIX_ROSTER}") from None
    return Roster.from_json(raw, f"roster {path}")


@dataclass
class Identity:
    """A site's certificate (PEM), its private key (a ``cryptography`` key object) and the federation's root
    CA certificates (PEM): what it signs with and what it checks its peers against.  Build one with
    :func:`load_identity` (a FLARE kit's files) or :meth:`from_pem`."""

    name: str
    certificate: str
    private_key: Any
    roots: bytes
    roster: Roster | None = None
    """The federation's sites as provisioned (a deployed site's kit always holds one); None: any certificate of
    the root CA that names the peer and is a client certificate is accepted (tests, other channels)."""
    _chained: dict[str, Any] = field(default_factory=dict, repr=False)  # peer certificate PEM -> loaded, chain ok

    @classmethod
    def from_pem(
        cls,
        name: str,
        certificate: bytes,
        private_key: bytes,
        roots: bytes,
        where: str = "",
        roster: Roster | None = None,
    ) -> Identity:
        """An identity from PEM bytes, checked: the certificate names ``name``, chains to ``roots``, holds the
        private key's public half and, with a ``roster``, is the one the roster pins for ``name``.
        :class:`ConfigError` (naming ``where`` and the fix) otherwise."""
        x509, _, _, serialization, *_ = _x509()
        where = where or f"site {name}'s identity"
        try:
            key = serialization.load_pem_private_key(private_key, password=None)
            cert = x509.load_pem_x509_certificate(certificate)
            x509.load_pem_x509_certificates(roots)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{where}: cannot read the certificate, key or root CA ({e}); {_FIX_KIT}") from e
        public = serialization.PublicFormat.SubjectPublicKeyInfo
        pem = serialization.Encoding.PEM
        if key.public_key().public_bytes(pem, public) != cert.public_key().public_bytes(pem, public):
            raise ConfigError(f"{where}: the private key is not the certificate's; {_FIX_KIT}")
        out = cls(name, certificate.decode(), key, roots, roster)
        why = out._chain_and_name(out.certificate, name)
        if isinstance(why, str):
            raise ConfigError(f"{where}: {why}; {_FIX_ROSTER if roster is not None else _FIX_KIT}")
        return out

    def sign(self, exchange: str, c: bytes, s: bytes, b_digest: bytes) -> dict[str, str]:
        """Step 1's identity fields: this site's certificate (PEM) and its signature (hex) of :func:`statement`."""
        return {
            "certificate": self.certificate,
            "signature": _sign(self.private_key, statement(exchange, self.name, c, s, b_digest)).hex(),
        }

    def sign_bytes(self, data: bytes) -> str:
        """This site's signature (hex) of ``data`` with its certificate's key (the consistency round's survivor
        statement, :mod:`fedseg.privacy.protocol`)."""
        return _sign(self.private_key, data).hex()

    def verify_peer(self, peer: str, certificate: Any, signature: Any, data: bytes) -> bool:
        """True if ``certificate`` (PEM) chains to the root CA, names ``peer`` and its key verifies ``signature``
        (hex) over ``data``."""
        if not isinstance(certificate, str) or not isinstance(signature, str):
            return False
        cert = self._chain_and_name(certificate, peer)
        if isinstance(cert, str):
            return False
        try:
            raw = bytes.fromhex(signature)
        except ValueError:
            return False
        return _verify(cert.public_key(), raw, data)

    def check_peer(self, peer: str, exchange: str, keys: dict[str, bytes], sent: Mapping[str, Any]) -> str | None:
        """None if ``peer``'s step-1 message ``sent`` (its ``certificate`` and ``signature``) proves that ``keys``
        (its C_u, S_u and hash of b_u, as relayed) are its own for ``exchange``; else the reason and the fix."""
        cert_pem, sig_hex = sent.get("certificate"), sent.get("signature")
        if not isinstance(cert_pem, str) or not isinstance(sig_hex, str):
            return (
                f"site {peer} sent its keys unsigned (no certificate or signature): it runs without an identity; "
                f"{_FIX_KIT}"
            )
        cert = self._chain_and_name(cert_pem, peer)
        if isinstance(cert, str):
            return f"{cert}; {_FIX_KIT}"
        try:
            signature = bytes.fromhex(sig_hex)
        except ValueError:
            signature = b""
        data = statement(exchange, peer, keys["c"], keys["s"], keys["b_digest"])
        if not _verify(cert.public_key(), signature, data):
            return (
                f"the signature of site {peer}'s keys for exchange {exchange} does not verify with its certificate: "
                "the keys were replaced on the way (by the server or on the path) or signed with another key. "
                f"If this repeats, check the server and the network path to site {peer}, and that site {peer} "
                "runs from its own kit"
            )
        return None

    def _chain_and_name(self, cert_pem: str, name: str) -> Any:
        """The loaded certificate if it chains to the root CA now and its common name is ``name``; else why not."""
        now = datetime.datetime.now(datetime.UTC)
        if cert_pem in self._chained:  # its chain was checked before; its validity period is checked each time
            cert = self._chained[cert_pem]
            if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
                return f"the certificate of site {name} is not valid now (valid {cert.not_valid_before_utc:%Y-%m-%d} to {cert.not_valid_after_utc:%Y-%m-%d})"
        else:
            x509, *_, verification, _ = _x509()
            try:
                cert = x509.load_pem_x509_certificate(cert_pem.encode())
            except ValueError as e:
                return f"the certificate of site {name} cannot be read ({e})"
            try:
                verifier = (
                    verification.PolicyBuilder()
                    .store(verification.Store(x509.load_pem_x509_certificates(self.roots)))
                    .time(now)
                    .extension_policies(
                        ca_policy=verification.ExtensionPolicy.webpki_defaults_ca(),
                        ee_policy=verification.ExtensionPolicy.permit_all(),
                    )
                    .build_client_verifier()
                )
                verifier.verify(cert, [])
            except (verification.VerificationError, ValueError) as e:
                return (
                    f"the certificate of site {name} (issued by {cert.issuer.rfc4514_string()!r}) is not issued by "
                    f"this federation's root CA or not valid now ({e})"
                )
            self._chained[cert_pem] = cert
        cn = _common_name(cert)
        if cn != name:
            return f"the certificate site {name} presented names {cn!r}, not {name!r} (another site's certificate)"
        why = _not_a_site_certificate(cert)
        if why is None and self.roster is not None:
            why = self.roster.refusal(name, cert)
        elif why is not None:
            why = f"the certificate presented as site {name}'s is not a site's: {why}"
        return why if why is not None else cert


def roster_path(folder: str | Path) -> Path:
    """Where a kit whose ``startup/`` folder is ``folder`` keeps its roster: ``<kit>/local/fedseg_roster.json``."""
    return Path(folder).parent / "local" / ROSTER_NAME


def load_identity(folder: str | Path, name: str) -> Identity | None:
    """The identity in a FLARE startup kit's ``startup/`` folder (:data:`KIT_FILES`) with the kit's roster
    (:func:`roster_path`), or None if it holds no ``client.crt`` (no kit: a simulation, or a deployment over
    another channel).  :class:`ConfigError` when the kit is incomplete, unreadable, another site's, holds no
    roster or its certificate is not the one its roster pins for ``name``."""
    folder = Path(folder)
    cert, key, roots = (folder / f for f in KIT_FILES)
    if not cert.is_file():
        return None
    missing = [p.name for p in (key, roots) if not p.is_file()]
    if missing:
        raise ConfigError(f"site {name}: the startup kit {folder} has client.crt but no {missing}; {_FIX_KIT}")
    roster = read_roster(roster_path(folder))
    return Identity.from_pem(
        name, cert.read_bytes(), key.read_bytes(), roots.read_bytes(), f"site {name}'s kit {folder}", roster
    )
