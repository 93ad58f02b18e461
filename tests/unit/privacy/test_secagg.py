"""Secure aggregation's core (fedseg.privacy): exact cancellation, the quantization bound, dropouts,
rejected shares, and that a masked input hides its plaintext."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedseg.foundation.errors import PayloadError
from fedseg.foundation.seeding import generator
from fedseg.privacy import secagg
from fedseg.privacy.protocol import CANARY, MASKED, ServerParty, SiteParty, SumRejected

pytest.importorskip("cryptography")
pytest.importorskip("Crypto")

BITS = 32


def _arrays(k: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Uneven shapes, negative values, a float64 and an integer tensor."""
    g = generator(seed, k)
    return {
        "b.weight": torch.randn(7, 3, generator=g) * 3,
        "a.bias": -torch.rand(5, generator=g),
        "c.double": torch.randn(2, 2, 2, generator=g, dtype=torch.float64),
        "d.count": torch.tensor(11 + k),
    }


def _consistency(server, parties):
    """The consistency round and step 4's requests: each survivor attests the survivor set (a site that refuses
    is left out), then the attesting survivors reveal; returns their step-4 replies."""
    cfg = server.consistency_config()
    for u in cfg["survived"]:
        try:
            server.accept_attestation(u, parties[u].attest(cfg["dropped"], cfg["survived"]))
        except PayloadError:
            pass
    cfg = server.reveal_config()
    return {u: parties[u].reveal(cfg["dropped"], cfg["survived"], cfg["attestations"]) for u in cfg["attestations"]}


def _exchange(
    inputs, weights, drop_after_shares=(), drop_after_masking=(), tamper=None, log=None, exchange="x1", send=None
):
    """Run the four steps in process; ``tamper(reveals)`` may edit the step-4 replies; ``send(site, masked)``
    may replace the masked arrays a site sends."""
    sites = list(inputs)
    server = ServerParty(exchange, BITS)
    parties = {u: SiteParty(u, exchange) for u in sites}
    for u in sites:
        server.accept_keys(u, parties[u].advertise())
    req = server.share_request()
    for u in sites:
        if u not in drop_after_shares:
            server.accept_shares(u, parties[u].share(req["order"], req["keys"]))
    masked = {}
    for u in server.masking:
        cfg = server.input_config(u)
        arrays, dtypes, bad = parties[u].mask(inputs[u], weights[u], cfg["order"], cfg["shares"], BITS)
        assert bad == []
        masked[u] = arrays
        if send is not None:
            arrays = send(u, arrays)
        if u not in drop_after_masking:
            server.accept_input(u, arrays, dtypes, weights[u])
    reveals = _consistency(server, parties)
    if tamper is not None:
        tamper(reveals, parties)
    total, weight, summed = server.unmask(reveals, log=log or (lambda m: None))
    return total, weight, summed, masked, server


def _encoded_sum(inputs, weights, sites):
    acc = None
    for u in sites:
        e, layout = secagg.encode(inputs[u], weights[u], BITS, len(inputs))
        acc = e if acc is None else acc + e
    return secagg.decode(acc, layout, BITS)


def test_masks_cancel_exactly():
    """Σ masked − self masks = Σ encodings mod 2^64, so the decoded sum equals the decoded sum of the
    unmasked encodings bitwise (pairwise masks enter once with + and once with −)."""
    inputs = {f"site{k}": _arrays(k) for k in range(4)}
    weights = {u: float(3 + i) for i, u in enumerate(inputs)}
    total, weight, summed, _, _ = _exchange(inputs, weights)
    assert summed == list(inputs) and weight == sum(weights.values())
    want = _encoded_sum(inputs, weights, inputs)
    for k in want:
        assert torch.equal(total[k], want[k]), k
    assert total["d.count"].item() == sum(11 + k for k in range(4))  # integers: their exact sum


def test_quantization_error_within_stated_bound():
    """Each encoding rounds to the nearest 2^-f, so |decoded − Σ c_k x_k| ≤ K·2^-(f+1) (+ float64 reading)."""
    inputs = {f"site{k}": _arrays(k, seed=5) for k in range(3)}
    weights = {u: float(10 * (i + 1)) for i, u in enumerate(inputs)}
    total, _, _, _, _ = _exchange(inputs, weights)
    bound = secagg.quantization_bound(3, BITS)
    for k in ("a.bias", "b.weight", "c.double"):
        exact = sum(weights[u] * inputs[u][k].double() for u in inputs)
        err = (total[k] - exact).abs().max().item()
        assert err <= bound + exact.abs().max().item() * 2.0**-52, (k, err, bound)
    # the bound is tight enough to matter: with few fraction bits the error is visible and still bounded
    coarse = secagg.encode({"x": torch.tensor([0.3, -0.7])}, 1.0, 4, 1)[0]
    back = secagg.decode(coarse, secagg.layout_of({"x": torch.tensor([0.0, 0.0])}), 4)["x"]
    assert 0 < (back - torch.tensor([0.3, -0.7], dtype=torch.float64)).abs().max() <= secagg.quantization_bound(1, 4)


def test_dropped_site_masks_removed_and_survivor_sum_exact():
    """A site that dropped after the masks were fixed: the survivors rebuild its mask key, the server
    removes its pairwise masks, and the sum over the survivors equals their unmasked encodings bitwise.
    A site that dropped before sending its shares is simply not part of the masking."""
    inputs = {f"site{k}": _arrays(k, seed=2) for k in range(5)}
    weights = {u: 1.0 + i for i, u in enumerate(inputs)}
    total, weight, summed, _, server = _exchange(
        inputs, weights, drop_after_shares=("site4",), drop_after_masking=("site1",)
    )
    assert summed == ["site0", "site2", "site3"]
    assert server.masking == ["site0", "site1", "site2", "site3"]
    assert weight == weights["site0"] + weights["site2"] + weights["site3"]
    want = _encoded_sum(inputs, weights, summed)
    for k in want:
        assert torch.equal(total[k], want[k]), k


def test_too_many_dropouts_refused():
    """With 3 sites the threshold is 2: one survivor cannot rebuild anything, and one input is no sum."""
    inputs = {f"site{k}": _arrays(k) for k in range(3)}
    with pytest.raises(PayloadError, match="at least 2 masked inputs"):
        _exchange(inputs, dict.fromkeys(inputs, 1.0), drop_after_masking=("site0", "site1"))


def test_malformed_shares_rejected_with_payload_error():
    """Wrong length and wrong holder index are rejected share by share (PayloadError)."""
    inputs = {f"site{k}": _arrays(k) for k in range(3)}
    _, _, _, _, server = _exchange(inputs, dict.fromkeys(inputs, 1.0))
    with pytest.raises(PayloadError, match="bytes, expected 33"):
        server.check_share("site1", "site0", "ab" * 20)
    with pytest.raises(PayloadError, match="index 3, the site's is 2"):
        server.check_share("site1", "site0", "03" + "00" * 32)
    with pytest.raises(PayloadError, match="hex"):
        server.check_share("site1", "site0", "zz" * 33)


def test_replayed_and_bad_shares_set_aside_and_sum_still_exact():
    """A share replayed from another exchange has the right length and index but does not rebuild the key
    the owner published for this one: it is rejected (logged), the other shares rebuild the key, and the
    sum is exact.  With too few good shares left the sum is refused with PayloadError."""
    inputs = {f"site{k}": _arrays(k, seed=3) for k in range(5)}
    weights = dict.fromkeys(inputs, 2.0)
    old = {}  # an earlier exchange's reveals, to replay from

    def keep_old(reveals, parties):
        old.update(reveals)

    _exchange(inputs, weights, drop_after_masking=("site4",), tamper=keep_old)

    def replay(reveals, parties):
        reveals["site2"]["s"]["site4"] = old["site2"]["s"]["site4"]
        reveals["site3"]["b"]["site0"] = "ff" * 33  # wrong index too

    logged = []
    total, _, summed, _, _ = _exchange(inputs, weights, drop_after_masking=("site4",), tamper=replay, log=logged.append)
    assert any("from site site2 is not the one site site4 committed to" in m for m in logged), logged
    assert any("index 255" in m for m in logged), logged
    want = _encoded_sum(inputs, weights, summed)
    assert all(torch.equal(total[k], want[k]) for k in want)

    def ruin(reveals, parties):  # site4 dropped; 4 survivors hold its shares, t = 3: leave 2 good ones
        reveals["site0"]["s"]["site4"] = old["site0"]["s"]["site4"]
        reveals["site1"]["s"]["site4"] = old["site1"]["s"]["site4"]

    with pytest.raises(PayloadError, match="2 well-formed shares, 3 needed"):
        _exchange(inputs, weights, drop_after_masking=("site4",), tamper=ruin)


def test_site_refuses_a_second_or_overlapping_reveal():
    """An honest site never gives out both shares of a peer: a request naming one site as dropped and
    survived, lists that do not split the set it masked with, a survivor set it did not attest, or a second
    request in the same exchange, is refused."""
    inputs = {f"site{k}": _arrays(k) for k in range(3)}
    s = {u: SiteParty(u, "e") for u in inputs}
    server = ServerParty("e", BITS)
    for u in s:
        server.accept_keys(u, s[u].advertise())
    req = server.share_request()
    for u in s:
        server.accept_shares(u, s[u].share(req["order"], req["keys"]))
    for u in s:
        cfg = server.input_config(u)
        s[u].mask(inputs[u], 1.0, cfg["order"], cfg["shares"], BITS)
    with pytest.raises(PayloadError, match="refuses"):
        s["site0"].attest(["site1"], ["site0", "site1"])
    with pytest.raises(PayloadError, match="refuses"):
        s["site0"].attest([], ["site0", "site2"])  # site1 is in neither list
    att = {u: s[u].attest(["site1"], ["site0", "site2"]) for u in ("site0", "site2")}
    with pytest.raises(PayloadError, match="it attested"):
        s["site0"].reveal([], ["site0", "site1", "site2"], att)
    s["site0"].reveal(["site1"], ["site0", "site2"], att)
    with pytest.raises(PayloadError, match="already"):
        s["site0"].reveal(["site1"], ["site0", "site2"], att)


def test_tampered_sealed_share_does_not_open():
    """A sealed share redirected to another site (or altered) fails its tag; the receiver does not hold it."""
    inputs = {f"site{k}": _arrays(k) for k in range(3)}
    s = {u: SiteParty(u, "e") for u in inputs}
    server = ServerParty("e", BITS)
    for u in s:
        server.accept_keys(u, s[u].advertise())
    req = server.share_request()
    for u in s:
        server.accept_shares(u, s[u].share(req["order"], req["keys"]))
    cfg = server.input_config("site0")
    cfg["shares"]["site1"] = server.sealed["site2"]["site0"]  # site2's share, claimed to be from site1
    _, _, bad = s["site0"].mask(inputs["site0"], 1.0, cfg["order"], cfg["shares"], BITS)
    assert bad == ["site1"]


def test_masked_input_looks_uniform_and_uncorrelated():
    """A masked input is x + uniform noise mod 2^64, so it is itself uniform: its 64-bit words' bits are
    1 about half the time and its correlation with the plaintext is near 0 (|r| < 4/√n, whereas the
    unmasked encoding correlates perfectly).  Two sites masking the same plaintext send unrelated words."""
    n = 4096
    x = torch.linspace(-1, 1, n)
    inputs = {u: {"w": x.clone()} for u in ("a", "b", "c")}
    _, _, _, masked, _ = _exchange(inputs, dict.fromkeys(inputs, 1.0))
    y = masked["a"][MASKED + "w"].numpy()
    enc = secagg.encode({"w": x}, 1.0, BITS, 3)[0].view(np.int64)
    assert np.corrcoef(enc.astype(np.float64), x.double().numpy())[0, 1] > 0.999
    r = np.corrcoef(y.astype(np.float64), x.double().numpy())[0, 1]
    assert abs(r) < 4 / np.sqrt(n), r
    bits = np.unpackbits(y.view(np.uint8))
    assert abs(bits.mean() - 0.5) < 0.01
    assert not np.array_equal(y, masked["b"][MASKED + "w"].numpy())
    rb = np.corrcoef(y.astype(np.float64), masked["b"][MASKED + "w"].numpy().astype(np.float64))[0, 1]
    assert abs(rb) < 4 / np.sqrt(n)


def test_encode_refuses_overflow_and_non_finite():
    """K · max|c x| · 2^f must stay below 2^63; the error names the setting to lower."""
    with pytest.raises(PayloadError, match="secagg_fraction_bits"):
        secagg.encode({"w": torch.tensor([3.0e9])}, 1.0, 32, 2)
    secagg.encode({"w": torch.tensor([3.0e9])}, 1.0, 24, 2)
    with pytest.raises(PayloadError, match="non-finite"):
        secagg.encode({"w": torch.tensor([float("nan")])}, 1.0, 32, 2)


def test_keys_from_given_bytes_and_agreement_symmetric():
    """X25519 from given private bytes (a seeded generator's, for reproducible tests) agrees both ways;
    the derived keys differ by purpose and exchange."""
    g = np.random.default_rng(0)
    a = secagg.keypair(g.bytes(32))
    b = secagg.keypair(g.bytes(32))
    assert a == secagg.keypair(a.private)
    ab = secagg.shared_key(a.private, b.public, "mask", "e1")
    assert ab == secagg.shared_key(b.private, a.public, "mask", "e1")
    assert ab != secagg.shared_key(a.private, b.public, "mask", "e2")
    assert ab != secagg.shared_key(a.private, b.public, "share", "e1")
    with pytest.raises(PayloadError):
        secagg.shared_key(a.private, b"\0" * 32, "mask", "e1")  # a low-order point


def test_replayed_masked_input_fails_the_check_word():
    """A masked input replayed from an earlier exchange carries that exchange's masks, which do not cancel
    against this one's: the unmasked check word is then (known words) + (uniform 64-bit noise) and matches
    the sum of the summed sites' public words with probability 2^-64, so the sum is rejected
    (:class:`SumRejected` naming the exchange) instead of returned as noise.  With the honest input the
    same exchange's real coordinates are the plain fixed-point sum bitwise: the check word is one more
    coordinate and leaves the others' encodings and masks as they were."""
    inputs = {f"site{k}": _arrays(k, seed=7) for k in range(3)}
    weights = {u: 2.0 + i for i, u in enumerate(inputs)}
    _, _, _, old, _ = _exchange(inputs, weights, exchange="round1")
    assert all(CANARY in m and m[CANARY].dtype == torch.int64 and m[CANARY].shape == (1,) for m in old.values())

    def replay(u, arrays):
        return old[u] if u == "site1" else arrays

    with pytest.raises(SumRejected, match="exchange round2: .* fails its check word") as e:
        _exchange(inputs, weights, exchange="round2", send=replay)
    assert e.value.exchange == "round2" and e.value.sites == list(inputs)
    total, _, summed, _, _ = _exchange(inputs, weights, exchange="round2")
    want = _encoded_sum(inputs, weights, summed)
    assert sorted(total) == sorted(want) and all(torch.equal(total[k], want[k]) for k in want)
    # the same input under a later exchange id is not enough to pass either: the words are per exchange
    assert secagg.canary("round1", "site1") != secagg.canary("round2", "site1")
    assert secagg.canary("round2", "site0") != secagg.canary("round2", "site1")


def test_input_masked_with_another_site_list_is_never_unmasked():
    """A site told a different list of sites (U2) masks with other pairs (its pairwise masks would not cancel):
    it cannot attest the survivor set, so no survivor reveals and the sum is never unmasked.  An input without
    its check word is malformed and leaves its site out."""
    inputs = {f"site{k}": _arrays(k) for k in range(3)}
    server = ServerParty("e", BITS)
    parties = {u: SiteParty(u, "e", min_sites=2) for u in inputs}  # site0 masks with 2 of the 3
    for u in inputs:
        server.accept_keys(u, parties[u].advertise())
    req = server.share_request()
    for u in inputs:
        server.accept_shares(u, parties[u].share(req["order"], req["keys"]))
    for u in inputs:
        cfg = server.input_config(u)
        order = ["site0", "site1"] if u == "site0" else cfg["order"]
        arrays, dtypes, _ = parties[u].mask(inputs[u], 1.0, order, cfg["shares"], BITS)
        if u == "site2":
            with pytest.raises(PayloadError, match="no masked check word"):
                server.accept_input(u, {k: v for k, v in arrays.items() if k != CANARY}, dtypes, 1.0)
        server.accept_input(u, arrays, dtypes, 1.0)
    # site0 masked with 2 sites, not the survivors' 3: it does not attest, and a site reveals only with every
    # survivor's attestation, so the server's reveal request and a request sent anyway both fail
    with pytest.raises(PayloadError, match=r"no attestation from \['site0'\]"):
        _consistency(server, parties)
    cfg = {**server.consistency_config(), "attestations": dict(server.attestations)}
    for u in ("site1", "site2"):
        with pytest.raises(PayloadError, match="2 survivors attested .* all 3 needed; not \\['site0'\\]"):
            parties[u].reveal(cfg["dropped"], cfg["survived"], cfg["attestations"])


def _keyed(k: int, exchange: str = "e", min_sites: int = 3):
    """k parties through step 2 with the server's own lists; returns (server, parties, inputs)."""
    inputs = {f"site{i}": _arrays(i) for i in range(k)}
    server = ServerParty(exchange, BITS)
    parties = {u: SiteParty(u, exchange, min_sites=min_sites) for u in inputs}
    for u in inputs:
        server.accept_keys(u, parties[u].advertise())
    req = server.share_request()
    for u in inputs:
        server.accept_shares(u, parties[u].share(req["order"], req["keys"]))
    return server, parties, inputs


def _masked(k: int, exchange: str = "e", min_sites: int = 3):
    """k parties through step 3 with the server's own lists; returns (server, parties)."""
    server, parties, inputs = _keyed(k, exchange, min_sites)
    for u in inputs:
        cfg = server.input_config(u)
        arrays, dtypes, _ = parties[u].mask(inputs[u], 1.0, cfg["order"], cfg["shares"], BITS)
        server.accept_input(u, arrays, dtypes, 1.0)
    return server, parties


def test_attestations_that_are_not_the_peers_do_not_count():
    """Without identities a survivor's attestation is an HMAC per peer under the key the pair derives from its c
    keys.  The server holds no such key: a MAC it alters, site0's own MAC for site1 reflected back as site1's
    (the statement names the attesting site), or site1's MAC from a parallel exchange under the same id (other
    keys) does not count, and with fewer than t valid attestations (t = 3 of 4 sites: site0's own, site2's and
    the forged one) site0 refuses to reveal."""
    _, p = _masked(4)
    dropped, survived = ["site3"], ["site0", "site1", "site2"]
    att = {u: p[u].attest(dropped, survived) for u in survived}
    _, other = _masked(4)
    forged = (
        {"macs": {**att["site1"]["macs"], "site0": "00" * 32}},
        {"macs": {"site0": att["site0"]["macs"]["site1"]}},
        other["site1"].attest(dropped, survived),
    )
    for bad in forged:
        with pytest.raises(PayloadError, match="2 survivors attested the survivor set"):
            p["site0"].reveal(dropped, survived, {**att, "site1": bad})
    shares = p["site0"].reveal(dropped, survived, att)
    assert sorted(shares["s"]) == ["site3"] and sorted(shares["b"]) == survived


def test_a_site_refuses_fewer_than_min_sites_or_t():
    """U1 shorter than privacy.secagg_min_sites is refused in step 2; U2 shorter than t of U1 in step 3; lists
    with fewer than t survivors in the consistency round."""
    server = ServerParty("e", BITS)
    parties = {u: SiteParty(u, "e", min_sites=3) for u in ("a", "b")}
    for u in parties:
        server.accept_keys(u, parties[u].advertise())
    req = server.share_request()
    with pytest.raises(PayloadError, match="secagg_min_sites = 3"):
        parties["a"].share(req["order"], req["keys"])
    server, p, inputs = _keyed(5, min_sites=2)  # t = 3 of 5
    cfg = server.input_config("site0")
    with pytest.raises(PayloadError, match="masks with at least 3"):
        p["site0"].mask(inputs["site0"], 1.0, ["site0", "site1"], cfg["shares"], BITS)
    _, p = _masked(5, min_sites=2)
    with pytest.raises(PayloadError, match="at least t = 3"):
        p["site0"].attest(["site2", "site3", "site4"], ["site0", "site1"])
