"""Secure aggregation's arithmetic and cryptography: the server learns Σ_k c_k x_k and nothing of one x_k.

The protocol is Bonawitz et al.'s ("Practical Secure Aggregation for Privacy-Preserving Machine
Learning", CCS 2017, Sections 4–5) for an honest-but-curious server, with double masking; the message
exchange that runs it is :mod:`fedseg.privacy.protocol`.  This module holds its pieces, each a pure
function:

* **Fixed point modulo 2^64** (:func:`encode`, :func:`decode`).  A float x becomes the integer
  q = round(c · x · 2^f) (c: the site's public weight, its sample count n_k under FedAvg's weighting;
  f: ``privacy.secagg_fraction_bits``), stored as an unsigned 64-bit integer (two's complement for
  q < 0), and every sum is taken modulo 2^64 (NumPy's ``uint64`` arithmetic wraps by definition).  As
  long as the true sum fits in a signed 64-bit integer, the sum of the encodings read as signed is the
  sum of the q's exactly, so the decoded sum differs from Σ c_k x_k only by the rounding of each
  encoding: at most K · 2^-(f+1) per value for K sites (:func:`quantization_bound`), plus float64's
  relative 2^-53 when the integer sum is read back.  :func:`encode` refuses a value with
  K · max|c x| · 2^f ≥ 2^63 (the sum of K such values could overflow) with one error naming the
  setting to lower.  Integer tensors (a batch-norm step counter) are summed as they are (c = 1, f = 0).
* **Pairwise masks** (:func:`shared_key`, :func:`expand`).  Each site has two X25519 key pairs per
  exchange (``cryptography``): one (``c``) to encrypt the shares it sends through the server, one
  (``s``) for masks.  Sites u and v agree on X25519(s_u, S_v) = X25519(s_v, S_u), derive a 32-byte
  seed with HKDF-SHA256 (its ``info`` names the purpose and the exchange, so a seed never serves two
  exchanges) and expand it with the ChaCha20 stream cipher to one 64-bit word per value.  Site u adds
  the mask for each v after it in the exchange's order and subtracts it for each v before it, so in
  the sum over all sites every mask appears once with + and once with − and cancels exactly.
* **Self masks** (Bonawitz's double masking).  Each site also adds ChaCha20(b_u) for a fresh random
  32-byte seed b_u, so its masked input stays hidden even if its pairwise seeds are ever revealed (a
  site that the server wrongly believes dropped, or whose input arrives after it was declared dropped).
  After the masked inputs are in, the server learns b_u of every site whose input it got and the mask
  private key s_u of every site whose input it did not get, never both for one site.
* **Threshold shares** (:func:`split`, :func:`recover`).  Both secrets (s_u and b_u, 32 bytes each)
  are split with Shamir's scheme (pycryptodome's ``Shamir``, which shares 16-byte secrets: each secret
  is two halves shared with the same indices) among all K sites of the exchange, the owner included,
  with threshold t = ⌊K/2⌋ + 1.  Any t surviving sites can rebuild the secret the server is entitled to;
  fewer cannot, and since an honest site reveals for each peer only one of its two shares, and only for
  the one survivor set that t sites attested (:mod:`fedseg.privacy.protocol`), a server cannot
  collect t shares of both secrets of one site.  A rebuilt secret is checked against what its
  owner published before masking (the public key S_u, the hash of b_u).  The server first checks each share
  against the hash its dealer published (:func:`share_commitment`) and sets aside one that does not
  match; :func:`recover` still tries other subsets of t shares if the matching ones do not rebuild the
  published secret, so a malformed or replayed share is rejected with
  :class:`~fedseg.foundation.errors.PayloadError` and the sum still comes out.
* **Sealed shares** (:func:`seal`, :func:`unseal`).  A share travels through the server encrypted and
  authenticated with ChaCha20-Poly1305 under a key both sites derive from their ``c`` key pairs, with
  the exchange, sender and recipient as associated data: the server cannot read it, and one replayed
  from another exchange or redirected to another site fails to open.
* **The server's unmasking** (:func:`unmask_sum`): Σ of the masked inputs it got, minus their self
  masks, minus the pairwise masks each of them shares with a site that dropped after the masks were
  fixed, decoded: the exact fixed-point sum of the surviving sites.
* **The check word** (:func:`canary`).  Each site appends one 64-bit word to its encoding before masking:
  a public value derived from the exchange and the site (SHA-256).  The unmasked sum's last word must be
  the sum of the summed sites' words.  An input whose masks belong to another exchange (replayed from an
  earlier round or step) or to another list of sites does not cancel against this exchange's masks, so
  its check word comes out as a uniformly random word: wrong with probability 1 − 2^-64.  The word is
  public and its masked value reveals nothing; the real coordinates' encodings and masks are unchanged
  (a ChaCha20 keystream one word longer starts with the same words).  It does not detect a site that
  masks a wrong value correctly for this exchange (poisoning): no check on the sum can.

Keys and seeds come from the operating system's random source (``os.urandom``), not from the run's
seed: a key derived from a seed the server knows would hide nothing.  Runs stay reproducible because
the masks cancel exactly — the unmasked sum, and so every model, does not depend on the keys; only the
masked bytes on the wire differ from run to run.  Functions that make keys take ``private=`` bytes for
tests (e.g. from :func:`fedseg.foundation.seeding.generator`).

Bonawitz's signatures of the keys are :mod:`fedseg.privacy.identity`'s, the consistency check and the
sites' own checks against an active server :mod:`fedseg.privacy.protocol`'s.  Not implemented: SecAgg+'s
sparse neighbour graph (cost O(K²) pairs here, fine for cross-silo federations of a few to a few dozen sites).
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fedseg.foundation.errors import FedsegError, PayloadError

__all__ = [
    "KEY_BYTES",
    "KeyPair",
    "Layout",
    "canary",
    "decode",
    "encode",
    "expand",
    "keypair",
    "layout_of",
    "mask",
    "quantization_bound",
    "recover",
    "seal",
    "seed_digest",
    "share_commitment",
    "shared_key",
    "split",
    "threshold_for",
    "unmask_sum",
    "unseal",
]

KEY_BYTES = 32
"""Length of every secret here: an X25519 private key, a self-mask seed, a derived key."""

_WORD = np.uint64


def _libs():
    try:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import x25519
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
        from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    except ImportError as e:  # pragma: no cover - the privacy extra is installed by make
        raise FedsegError(
            "privacy.secure_aggregation needs the 'cryptography' package: pip install 'fedseg[privacy]'"
        ) from e
    return hashes, x25519, Cipher, algorithms, ChaCha20Poly1305, HKDF


# ------------------------------------------------------------------ fixed point
@dataclass(frozen=True)
class Layout:
    """Names (sorted), shapes and dtypes of the arrays a site masks: the order of the flat vector."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    @property
    def size(self) -> int:
        return sum(int(np.prod(s, dtype=np.int64)) for s in self.shapes)


def layout_of(arrays: Mapping[str, torch.Tensor]) -> Layout:
    """The :class:`Layout` of ``arrays``: names sorted, so both ends flatten them in one order."""
    names = tuple(sorted(arrays))
    return Layout(
        names, tuple(tuple(arrays[k].shape) for k in names), tuple(str(arrays[k].dtype).split(".")[-1] for k in names)
    )


def encode(
    arrays: Mapping[str, torch.Tensor],
    weight: float | Callable[[str], float],
    fraction_bits: int,
    num_sites: int,
    what: str = "arrays",
) -> tuple[np.ndarray, Layout]:
    """``arrays`` as one flat ``uint64`` vector of round(weight · x · 2^fraction_bits) modulo 2^64.

    Floating tensors are scaled by ``weight`` (the site's public weight, e.g. n_k; a function of the
    array's name when one exchange sums arrays under different weights, e.g. FedSM's n_k-weighted global
    model beside its unweighted personalized models) and 2^fraction_bits and rounded to the nearest
    integer (error ≤ 1/2 in units of 2^-fraction_bits); integer tensors are taken as they are.  Raises
    :class:`PayloadError` for a non-finite value or one so large that the sum of ``num_sites`` of them
    could leave the signed 64-bit range (num_sites · max|weight · x| · 2^f ≥ 2^63).
    """
    layout = layout_of(arrays)
    out = np.empty(layout.size, dtype=_WORD)
    pos = 0
    limit = 2.0**63 / max(1, num_sites)
    for name in layout.names:
        t = arrays[name].detach().to("cpu")
        n = t.numel()
        if t.is_floating_point():
            weight_of = weight(name) if callable(weight) else weight
            x = t.to(torch.float64).numpy().reshape(-1) * (float(weight_of) * 2.0**fraction_bits)  # 2^f: exact
            top = float(np.abs(x).max()) if n else 0.0
            if not np.isfinite(top):  # a NaN or an infinity anywhere makes the maximum one
                raise PayloadError(
                    f"{what}: '{name}' holds a non-finite value; secure aggregation encodes finite numbers only"
                )
            if top >= limit:
                raise PayloadError(
                    f"{what}: '{name}' reaches |{top / 2.0**fraction_bits / float(weight_of):.4g}| (× weight {weight_of:g}); "
                    f"the sum of {num_sites} such values overflows 64-bit fixed point with "
                    f"privacy.secagg_fraction_bits = {fraction_bits}: lower it (e.g. --set privacy.secagg_fraction_bits=24)"
                )
            q = np.rint(x, out=x).astype(np.int64)
        else:
            q = t.to(torch.int64).numpy().reshape(-1)
            if n and float(np.abs(q).max()) >= limit:
                raise PayloadError(f"{what}: integer tensor '{name}' is too large to sum over {num_sites} sites")
        out[pos : pos + n] = q.view(_WORD)
        pos += n
    return out, layout


def decode(total: np.ndarray, layout: Layout, fraction_bits: int) -> dict[str, torch.Tensor]:
    """The modular sum ``total`` read back: float tensors as float64 (Σ weight · x, to the bound of
    :func:`quantization_bound`), integer tensors as int64 (their exact sum)."""
    signed = np.asarray(total, dtype=_WORD).view(np.int64)
    if signed.size != layout.size:
        raise PayloadError(f"a masked sum has {signed.size} values, its layout {layout.size}")
    out: dict[str, torch.Tensor] = {}
    pos = 0
    for name, shape, dtype in zip(layout.names, layout.shapes, layout.dtypes):
        n = int(np.prod(shape, dtype=np.int64))
        part = signed[pos : pos + n]
        if getattr(torch, dtype).is_floating_point:
            out[name] = torch.from_numpy(part.astype(np.float64) * 2.0**-fraction_bits).reshape(shape)
        else:
            out[name] = torch.from_numpy(part.copy()).reshape(shape)
        pos += n
    return out


def quantization_bound(num_sites: int, fraction_bits: int) -> float:
    """Largest |decoded sum − Σ_k c_k x_k| per value from rounding: each of the K encodings is off by at
    most half a unit of 2^-f, so the sum by K · 2^-(f+1) (before float64's relative 2^-53 on reading
    it back).  Divided by Σ c_k it bounds the weighted mean's error."""
    return num_sites * 2.0 ** -(fraction_bits + 1)


# ------------------------------------------------------------------ keys and masks
@dataclass(frozen=True)
class KeyPair:
    """An X25519 key pair as raw 32-byte strings."""

    private: bytes
    public: bytes


def keypair(private: bytes | None = None) -> KeyPair:
    """A fresh X25519 key pair from ``os.urandom`` (or from the 32 bytes ``private``, for tests)."""
    _, x25519, *_ = _libs()
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    key = x25519.X25519PrivateKey.from_private_bytes(os.urandom(KEY_BYTES) if private is None else private)
    return KeyPair(
        key.private_bytes_raw(), key.public_key().public_bytes(encoding=Encoding.Raw, format=PublicFormat.Raw)
    )


def shared_key(private: bytes, peer_public: bytes, purpose: str, exchange: str) -> bytes:
    """HKDF-SHA256(X25519(private, peer_public)) with ``info`` = purpose and exchange: the same 32 bytes at
    both ends of a pair, a different key for each purpose and exchange."""
    hashes, x25519, _, _, _, HKDF = _libs()
    if not isinstance(peer_public, bytes) or len(peer_public) != KEY_BYTES:
        raise PayloadError(f"a public key must be {KEY_BYTES} bytes, got {len(peer_public)}")
    try:
        raw = x25519.X25519PrivateKey.from_private_bytes(private).exchange(
            x25519.X25519PublicKey.from_public_bytes(peer_public)
        )
    except ValueError as e:  # a low-order point gives the all-zero secret, which cryptography refuses
        raise PayloadError(f"public key {peer_public.hex()[:16]}… is not usable for key agreement ({e})") from e
    info = f"fedseg secagg {purpose} {exchange}".encode()
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(raw)


def expand(seed: bytes, count: int) -> np.ndarray:
    """``count`` pseudo-random 64-bit words: the ChaCha20 keystream of ``seed`` (nonce 0; each seed serves
    one exchange and one purpose, so no key and nonce pair is used twice)."""
    _, _, Cipher, algorithms, _, _ = _libs()
    enc = Cipher(algorithms.ChaCha20(seed, b"\0" * 16), mode=None).encryptor()
    return np.frombuffer(enc.update(bytes(8 * count)), dtype=_WORD)


def canary(exchange: str, site: str) -> np.uint64:
    """The check word ``site`` appends to its encoding in ``exchange``: the first 8 bytes of
    SHA-256("fedseg secagg canary", exchange, site), public to every party.  The unmasked sum's check word
    is the sum of the summed sites' words modulo 2^64 only if every input was masked for this exchange."""
    digest = hashlib.sha256(b"fedseg secagg canary " + exchange.encode() + b" " + site.encode()).digest()
    return np.frombuffer(digest[:8], dtype=_WORD)[0]


def seed_digest(seed: bytes, exchange: str) -> bytes:
    """SHA-256 of a self-mask seed and the exchange: what its owner publishes so a rebuilt seed can be checked."""
    return hashlib.sha256(b"fedseg secagg self-mask " + exchange.encode() + b" " + seed).digest()


def share_commitment(exchange: str, owner: str, kind: str, index: int, share: bytes) -> bytes:
    """SHA-256 of one Shamir share (``kind`` "s" or "b" of ``owner``'s secrets, holder ``index``) bound to the
    exchange: what the owner publishes for each share it deals (step 2), so that the server checks each revealed
    share on its own, O(K) hashes, instead of trying subsets of t shares.  A share is 32 bytes that hold two
    uniformly distributed field elements, so its hash hides it (inverting it is a 2^128 search)."""
    head = f"fedseg secagg share {exchange} {owner} {kind} {index} ".encode()
    return hashlib.sha256(head + share).digest()


def mask(
    encoded: np.ndarray,
    me: str,
    order: Sequence[str],
    private: bytes,
    publics: Mapping[str, bytes],
    self_seed: bytes,
    exchange: str,
) -> np.ndarray:
    """y = x + PRG(b) + Σ_{v after me} PRG(s_{me,v}) − Σ_{v before me} PRG(s_{me,v})  (mod 2^64).

    ``order``: every site of the exchange whose shares went out (the same list at every site and the
    server); ``publics``: their mask public keys; ``private``: this site's mask private key."""
    y = encoded + expand(self_seed, encoded.size)
    mine = order.index(me)
    for i, v in enumerate(order):
        if v == me:
            continue
        m = expand(shared_key(private, publics[v], "mask", exchange), encoded.size)
        (np.add if i > mine else np.subtract)(y, m, out=y)
    return y


def unmask_sum(
    masked: Mapping[str, np.ndarray],
    order: Sequence[str],
    publics: Mapping[str, bytes],
    self_seeds: Mapping[str, bytes],
    dropped_privates: Mapping[str, bytes],
    exchange: str,
) -> np.ndarray:
    """The fixed-point sum Σ_{u ∈ masked} x_u (mod 2^64) from the masked inputs of the surviving sites.

    Parameters
    ----------
    masked
        ``{site: y_u}`` of the sites whose masked input arrived (U3).
    order
        Every site that masked with the others (U2), in the exchange's order.
    publics
        Mask public keys of the sites of ``order``.
    self_seeds
        The rebuilt self-mask seed b_u of every site of ``masked``.
    dropped_privates
        The rebuilt mask private key s_d of every site of ``order`` not in ``masked``.
    exchange
        The exchange's id (it enters every derived key).
    """
    missing = [u for u in masked if u not in self_seeds] + [
        d for d in order if d not in masked and d not in dropped_privates
    ]
    if missing:
        raise PayloadError(f"cannot unmask the sum: no rebuilt secret for sites {missing}")
    total = np.zeros(next(iter(masked.values())).size, dtype=_WORD)
    for u, y in masked.items():
        np.add(total, y, out=total)
        np.subtract(total, expand(self_seeds[u], y.size), out=total)
    for d, private in dropped_privates.items():
        di = order.index(d)
        for u in masked:
            m = expand(shared_key(private, publics[u], "mask", exchange), total.size)
            # u added +m when d came after it and −m when before: take that back
            (np.subtract if di > order.index(u) else np.add)(total, m, out=total)
    return total


# ------------------------------------------------------------------ shares
def threshold_for(num_sites: int) -> int:
    """Bonawitz's t = ⌊K/2⌋ + 1 (a majority): fewer sites cannot rebuild a secret, and a server cannot
    collect t shares of both of one site's secrets from honest sites (each reveals one kind per peer)."""
    return num_sites // 2 + 1


def split(secret: bytes, threshold: int, count: int) -> list[bytes]:
    """Shamir shares of a 32-byte secret for holders 1..count: share i (index i + 1) is 32 bytes, the
    shares of the secret's two 16-byte halves (pycryptodome shares 16-byte secrets)."""
    from Crypto.Protocol.SecretSharing import Shamir

    if len(secret) != KEY_BYTES:
        raise ValueError(f"a shared secret is {KEY_BYTES} bytes, got {len(secret)}")
    if not 2 <= threshold <= count <= 255:
        raise ValueError(f"Shamir sharing needs 2 <= threshold <= holders <= 255, got {threshold} of {count}")
    lo = Shamir.split(threshold, count, secret[:16])
    hi = Shamir.split(threshold, count, secret[16:])
    return [a + b for (_, a), (_, b) in zip(lo, hi)]


def _combine(shares: Mapping[int, bytes]) -> bytes:
    from Crypto.Protocol.SecretSharing import Shamir

    items = sorted(shares.items())
    return Shamir.combine([(i, s[:16]) for i, s in items]) + Shamir.combine([(i, s[16:]) for i, s in items])


def recover(
    shares: Mapping[int, bytes], threshold: int, fits: Callable[[bytes], bool], what: str
) -> tuple[bytes, set[int]]:
    """Rebuild a secret from the shares ``{holder index: 32 bytes}`` and check it with ``fits`` (it matches
    what the owner published).  Shares of the wrong length are set aside; when the first ``threshold``
    shares do not give a fitting secret, every other subset is tried, so bad shares from a minority do not
    stop the sum.  Returns the secret and the indices of shares that were not used in a fitting subset
    and do not fit it (the ones to reject); raises :class:`PayloadError` when no subset fits."""
    good = {i: s for i, s in shares.items() if isinstance(s, bytes) and len(s) == KEY_BYTES}
    if len(good) < threshold:
        raise PayloadError(
            f"{what}: {len(good)} well-formed shares, {threshold} needed to rebuild it (too many sites dropped)"
        )
    for subset in itertools.combinations(sorted(good), threshold):
        secret = _combine({i: good[i] for i in subset})
        if fits(secret):
            # a share outside the subset is bad if the secret rebuilt with it in place of a member differs
            bad = {i for i in shares if i not in good}
            for i in good:
                if i not in subset and _combine({i: good[i], **{j: good[j] for j in subset[1:]}}) != secret:
                    bad.add(i)
            return secret, bad
    raise PayloadError(f"{what}: no {threshold} of the {len(good)} shares rebuild the published secret")


def seal(key: bytes, plaintext: bytes, associated: bytes) -> bytes:
    """ChaCha20-Poly1305 encryption of ``plaintext`` bound to ``associated``: 12-byte nonce + ciphertext + tag."""
    *_, ChaCha20Poly1305, _ = _libs()
    nonce = os.urandom(12)
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, associated)


def unseal(key: bytes, blob: bytes, associated: bytes, what: str) -> bytes:
    """Open :func:`seal`'s ``blob``; :class:`PayloadError` when it was altered, replayed from another exchange
    or meant for another pair of sites (the tag does not verify)."""
    from cryptography.exceptions import InvalidTag

    *_, ChaCha20Poly1305, _ = _libs()
    if len(blob) < 12 + 16:
        raise PayloadError(f"{what}: a sealed share of {len(blob)} bytes is too short")
    try:
        return ChaCha20Poly1305(key).decrypt(blob[:12], blob[12:], associated)
    except InvalidTag as e:
        raise PayloadError(
            f"{what}: the sealed share does not open (altered, replayed from another exchange or meant for another site)"
        ) from e
