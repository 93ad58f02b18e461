"""A small certificate authority for tests: a root CA and site certificates laid out as a FLARE startup kit
(client.crt, client.key, rootCA.pem) and the federation's roster, made with ``cryptography``."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from fedseg.privacy.identity import ROSTER_NAME, Identity, Roster, fingerprint

_PEM = serialization.Encoding.PEM


def _key(kind: str):
    return (
        rsa.generate_private_key(public_exponent=65537, key_size=2048)
        if kind == "rsa"
        else ec.generate_private_key(ec.SECP256R1())
    )


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn), x509.NameAttribute(NameOID.ORGANIZATION_NAME, "t")])


class CA:
    """A root CA (``kind``: "ec" P-256, fast, or "rsa" 2048, as FLARE provisions) that issues site certificates."""

    def __init__(self, name: str = "fedseg-test-root", kind: str = "ec"):
        self.kind, self.key = kind, _key(kind)
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(_name(name))
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        self.pem = self.cert.public_bytes(_PEM)

    def issue(self, cn: str, key=None, extensions=(), role: str | None = None) -> tuple[bytes, bytes]:
        """(certificate PEM, private key PEM) of a site certificate whose common name is ``cn``; ``extensions``:
        more (extension, critical) pairs; ``role``: FLARE's role attribute (unstructuredName), as on an admin's."""
        key = key or _key(self.kind)
        now = datetime.datetime.now(datetime.UTC)
        subject = _name(cn)
        if role is not None:
            subject = x509.Name([*subject, x509.NameAttribute(NameOID.UNSTRUCTURED_NAME, role)])
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(cn)]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False)
        )
        for ext, critical in extensions:
            builder = builder.add_extension(ext, critical=critical)
        cert = builder.sign(self.key, hashes.SHA256())
        pem_key = key.private_bytes(_PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        return cert.public_bytes(_PEM), pem_key

    def identity(self, name: str) -> Identity:
        cert, key = self.issue(name)
        return Identity.from_pem(name, cert, key, self.pem)

    def kit(self, folder: Path, name: str) -> Path:
        """A FLARE-like ``startup/`` folder for ``name`` (without a roster: see :meth:`federation`)."""
        folder.mkdir(parents=True, exist_ok=True)
        cert, key = self.issue(name)
        (folder / "client.crt").write_bytes(cert)
        (folder / "client.key").write_bytes(key)
        (folder / "rootCA.pem").write_bytes(self.pem)
        return folder

    def federation(self, root: Path, names: list[str]) -> dict[str, Path]:
        """A kit per site under ``root/<name>/`` as ``fedseg deploy provision`` lays it out: ``startup/`` and the
        federation's roster in ``local/fedseg_roster.json``; returns ``{name: startup folder}``."""
        startups = {n: self.kit(root / n / "startup", n) for n in names}
        roster = Roster(
            sites={n: fingerprint((f / "client.crt").read_bytes()) for n, f in startups.items()},
            root_ca=fingerprint(self.pem),
            federation="test",
        )
        for n in names:
            (root / n / "local").mkdir(parents=True, exist_ok=True)
            (root / n / "local" / ROSTER_NAME).write_text(json.dumps(roster.to_json()))
        return startups


def forged(name: str, cert: bytes, key: bytes, roots: bytes) -> Identity:
    """An identity built without :meth:`Identity.from_pem`'s checks: what a misconfigured or hostile site signs
    with (a certificate of another CA or naming another site, a key that is not its certificate's)."""
    return Identity(name, cert.decode(), serialization.load_pem_private_key(key, password=None), roots)
