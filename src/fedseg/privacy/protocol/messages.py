"""What the two parties of a secure-aggregation exchange (:mod:`fedseg.privacy.protocol`) agree on: the
names of the masked arrays, the sizes of a share and of a sealed bundle, the statement a site attests
and the digests of a task and of a model, and the error of a sum that must not be used."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fedseg.foundation.errors import PayloadError
from fedseg.privacy.secagg import KEY_BYTES

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


SHARE_BYTES = 1 + KEY_BYTES
"""Bytes of one share: the holder's index, then the share."""
BUNDLE_BYTES = 1 + 2 * KEY_BYTES
"""Bytes of the bundle a site seals for one peer: the peer's index, its share of s_u and of b_u."""
SEALED_BYTES = 12 + BUNDLE_BYTES + 16
"""Bytes of a sealed bundle: nonce, bundle, tag."""


def from_hex(value: Any, length: int, what: str) -> bytes:
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
