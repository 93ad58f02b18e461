"""Signed secure-aggregation keys (fedseg.privacy.identity): a correctly signed exchange sums as an unsigned
one, and keys that do not match their site's certificate (replaced on the way, signed with another site's key,
a certificate of another CA or naming another site, unsigned, replayed from another exchange) are refused: that
site is left out before anyone masks and the others' sum comes out bitwise."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from fedseg.foundation.errors import ConfigError, PayloadError
from fedseg.privacy import secagg
from fedseg.privacy.identity import Identity, load_identity, statement
from fedseg.privacy.protocol import ServerParty, SiteParty, survivors_statement

pytest.importorskip("cryptography")
pytest.importorskip("Crypto")

from tests.support.pki import CA, forged
from tests.unit.privacy.test_secagg import BITS, _arrays, _encoded_sum

SITES = [f"site{k}" for k in range(4)]


@pytest.fixture(scope="module")
def ca():
    return CA()


@pytest.fixture(scope="module")
def identities(ca):
    return {u: ca.identity(u) for u in SITES}


def _signed_exchange(identities, exchange="e1", relay=None, log=None):
    """The four steps in process with each site's identity; ``relay(site, request)`` may alter the step-2 key
    list the server sends ``site`` (a server or path that substitutes keys).  Returns (sum, weight, summed,
    server, parties)."""
    inputs = {u: _arrays(k) for k, u in enumerate(identities)}
    weights = {u: float(2 + k) for k, u in enumerate(identities)}
    server = ServerParty(exchange, BITS)
    parties = {u: SiteParty(u, exchange, identities[u]) for u in identities}
    for u in identities:
        server.accept_keys(u, parties[u].advertise())
    request = server.share_request()
    for u in identities:
        req = json.loads(json.dumps(request))  # what crosses the wire
        if relay is not None:
            relay(u, req)
        server.accept_shares(u, parties[u].share(req["order"], req["keys"]))
    for u in server.masking:
        cfg = server.input_config(u)
        arrays, dtypes, bad = parties[u].mask(inputs[u], weights[u], cfg["order"], cfg["shares"], BITS)
        assert bad == []
        server.accept_input(u, arrays, dtypes, weights[u])
    cfg = server.consistency_config()
    for u in cfg["survived"]:
        server.accept_attestation(u, parties[u].attest(cfg["dropped"], cfg["survived"]))
    cfg = server.reveal_config()
    reveals = {u: parties[u].reveal(cfg["dropped"], cfg["survived"], cfg["attestations"]) for u in cfg["attestations"]}
    total, weight, summed = server.unmask(reveals, log=log or (lambda m: None))
    return total, weight, summed, server, parties, inputs, weights


def test_signed_exchange_sums_bitwise_as_before(identities):
    """Signing adds a certificate and a signature to step 1 and a check to step 2; the masks, and so the sum,
    are the unsigned protocol's: the decoded sum equals the sum of the plain encodings bitwise."""
    total, weight, summed, server, parties, inputs, weights = _signed_exchange(identities)
    assert summed == SITES and server.left_out == {} and weight == sum(weights.values())
    assert all(set(server.signed[u]) == {"certificate", "signature"} for u in SITES)
    assert all(p.refused == {} for p in parties.values())
    want = _encoded_sum(inputs, weights, SITES)
    assert all(torch.equal(total[k], want[k]) for k in want)


def _replace_s_key(site, req):
    """The server (or the path) gives site0 its own mask key in place of site2's."""
    if site == "site0":
        req["keys"]["site2"]["s"] = secagg.keypair().public.hex()


def _replay_keys(identities):
    """site2's complete signed step-1 message of another exchange, relayed to site0 in this one."""
    old = SiteParty("site2", "e0", identities["site2"]).advertise()

    def relay(site, req):
        if site == "site0":
            req["keys"]["site2"] = old

    return relay


def _site2_as(ca, identities, how):
    """The identities with site2's replaced by a faulty one."""
    out = dict(identities)
    if how == "other_key":  # site2 signs with site1's private key and presents its own certificate
        out["site2"] = dataclasses.replace(identities["site2"], private_key=identities["site1"].private_key)
    elif how == "other_ca":  # a kit of another federation: its own root CA, which the others do not trust
        out["site2"] = CA("another-root").identity("site2")
    elif how == "other_cn":  # a certificate of this CA that names site1
        cert, key = ca.issue("site1")
        out["site2"] = forged("site2", cert, key, ca.pem)
    elif how == "unsigned":
        out["site2"] = None
    return out


@pytest.mark.parametrize("how", ["replaced", "replayed", "other_key", "other_ca", "other_cn", "unsigned"])
def test_keys_that_do_not_match_the_certificate_leave_that_site_out(ca, identities, how):
    """site2's keys fail a peer's check (Bonawitz's signature step): its certificate must chain to the
    federation's root CA and name site2, and its key must verify the signature of (exchange, site2, C, S, hash
    of b) as relayed.  Whoever refuses it makes no share for it and says why; the server leaves site2 out of
    the masking, so no input carries a mask with it, and the sum over site0, site1 and site3 is bitwise the sum
    of their plain encodings (threshold 3 of 4: the round proceeds)."""
    relay = _replace_s_key if how == "replaced" else _replay_keys(identities) if how == "replayed" else None
    ids = identities if relay is not None else _site2_as(ca, identities, how)
    total, _, summed, server, parties, inputs, weights = _signed_exchange(ids, relay=relay)
    others = ["site0", "site1", "site3"]
    assert summed == others and server.masking == others
    assert list(server.left_out) == ["site2"]
    refusers = {"replaced": ["site0"], "replayed": ["site0"]}.get(how, others)
    assert sorted(server.left_out["site2"]) == refusers
    reason = server.left_out["site2"][refusers[0]]
    expect = {
        "replaced": "does not verify",
        "replayed": "does not verify",
        "other_key": "does not verify",
        "other_ca": "not issued by this federation's root CA",
        "other_cn": "names 'site1'",
        "unsigned": "unsigned",
    }[how]
    assert expect in reason and ("deploy provision" in reason or "check the server" in reason), reason
    if how == "other_ca":  # site2 also refuses everyone (their CA is not its); its refusals no longer count
        assert sorted(parties["site2"].refused) == others
    want = _encoded_sum(inputs, weights, others)
    assert all(torch.equal(total[k], want[k]) for k in want)


def test_a_site_does_not_mask_with_a_peer_it_refused(identities):
    """A server that ignores a refusal and asks site0 to mask with site2 anyway is refused by site0."""
    server = ServerParty("e1", BITS)
    parties = {u: SiteParty(u, "e1", identities[u]) for u in SITES}
    for u in SITES:
        server.accept_keys(u, parties[u].advertise())
    req = server.share_request()
    for u in SITES:
        r = json.loads(json.dumps(req))
        _replace_s_key(u, r)
        parties[u].share(r["order"], r["keys"])
    assert list(parties["site0"].refused) == ["site2"]
    with pytest.raises(PayloadError, match=r"whose keys this site refused"):
        parties["site0"].mask(_arrays(0), 1.0, SITES, {}, BITS)


def test_server_checks_refusals_and_share_lists():
    """A step-2 message must name other sites as refused and hold a share for each other site it accepted."""
    server = ServerParty("e", BITS)
    parties = {u: SiteParty(u, "e") for u in SITES[:3]}
    for u, p in parties.items():
        server.accept_keys(u, p.advertise())
    req = server.share_request()
    msg = parties["site0"].share(req["order"], req["keys"])
    with pytest.raises(PayloadError, match="refused peers"):
        server.accept_shares("site0", {**msg, "refused": {"site0": "me"}})
    with pytest.raises(PayloadError, match="one sealed share for each of"):
        server.accept_shares("site0", {**msg, "refused": {"site1": "no"}})  # refused, but a share for it
    shares = {k: v for k, v in msg["shares"].items() if k != "site1"}
    server.accept_shares(
        "site0",
        {"shares": shares, "refused": {"site1": "its certificate is another CA's"}, "commitments": msg["commitments"]},
    )
    assert server.refusals["site0"] == {"site1": "its certificate is another CA's"}


def test_left_out_takes_the_most_refused_first():
    """site1 refuses everyone and everyone refuses site1 (another CA): only site1 is left out.  Two sites that
    refuse only each other are both left out."""
    server = ServerParty("e", BITS)
    server.order = ["a", "b", "c", "d"]
    server.sealed = {u: {} for u in server.order}
    server.refusals = {"a": {"b": "x"}, "b": {"a": "x", "c": "x", "d": "x"}, "c": {"b": "x"}, "d": {"b": "x"}}
    assert list(server.left_out) == ["b"] and server.masking == ["a", "c", "d"]
    server.refusals = {"a": {"b": "x"}, "b": {"a": "x"}, "c": {}, "d": {}}
    assert sorted(server.left_out) == ["a", "b"] and server.masking == ["c", "d"]


def test_a_peer_certificate_that_is_not_a_sites_client_certificate_is_refused(ca, identities):
    """Without a roster too, a peer's certificate of the federation's CA that names the peer is refused when it
    is not an end entity's client certificate: a CA certificate, an extended key usage without clientAuth (a
    server's), or FLARE's role attribute (an admin's: FLARE writes the admin's role into unstructuredName); one
    with clientAuth is accepted."""
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    keys = {"c": b"c" * 32, "s": b"s" * 32, "b_digest": b"b" * 32}
    cases = {
        "it is a CA certificate": ca.issue(
            "site2", extensions=[(x509.BasicConstraints(ca=True, path_length=None), True)]
        ),
        "does not allow clientAuth": ca.issue(
            "site2", extensions=[(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)]
        ),
        "role attribute 'project_admin'": ca.issue("site2", role="project_admin"),
        None: ca.issue("site2", extensions=[(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False)]),
    }
    for why, (cert, key) in cases.items():
        peer = forged("site2", cert, key, ca.pem)
        got = identities["site1"].check_peer("site2", "e", keys, peer.sign("e", keys["c"], keys["s"], keys["b_digest"]))
        assert (got is None) if why is None else (why in got), (why, got)


def test_statement_binds_every_field():
    """Each field is length-prefixed: moving bytes between fields changes the statement."""
    base = statement("e", "site1", b"c" * 32, b"s" * 32, b"b" * 32)
    assert base != statement("e", "site1x", b"c" * 31, b"s" * 32, b"b" * 32)
    assert base != statement("e1", "site1", b"c" * 32, b"s" * 32, b"b" * 32)
    assert base != statement("e", "site2", b"c" * 32, b"s" * 32, b"b" * 32)


def test_kit_identity_rsa_as_flare_provisions(tmp_path):
    """A FLARE startup folder (client.crt, client.key, rootCA.pem; RSA-2048 keys, as FLARE's provisioning
    makes) with the federation's roster beside it (local/fedseg_roster.json): the site signs with it, a peer of
    the same CA accepts it; no client.crt: no identity; a kit of another site, a kit without its roster, or a key
    that is not the certificate's, is one ConfigError naming the fix."""
    rsa = CA(kind="rsa")
    kits = rsa.federation(tmp_path / "fed", ["site1", "site2"])
    me = load_identity(kits["site1"], "site1")
    peer = load_identity(kits["site2"], "site2")
    assert isinstance(me, Identity) and isinstance(peer, Identity)
    keys = {"c": b"c" * 32, "s": b"s" * 32, "b_digest": b"b" * 32}
    sent = me.sign("e", keys["c"], keys["s"], keys["b_digest"])
    assert peer.check_peer("site1", "e", keys, sent) is None
    assert "does not verify" in peer.check_peer("site1", "e", {**keys, "s": b"t" * 32}, sent)
    assert load_identity(tmp_path / "none", "site1") is None
    with pytest.raises(ConfigError, match=r"names 'site1', not 'site2'.*deploy provision"):
        load_identity(kits["site1"], "site2")
    with pytest.raises(ConfigError, match=r"holds no roster.*deploy provision.*deploy roster"):
        load_identity(rsa.kit(tmp_path / "bare" / "startup", "site1"), "site1")
    (kits["site1"] / "client.key").write_bytes((kits["site2"] / "client.key").read_bytes())
    with pytest.raises(ConfigError, match="the private key is not the certificate's"):
        load_identity(kits["site1"], "site1")


# ------------------------------------------------------------------ deployed (the byte channel a deployment uses)


def _kit_runtimes(tmp, data, kits):
    """Site runtimes as deployed, each with ``kits[name]`` (a startup folder, or None) as its identity."""
    from fedseg.deployment.site import SiteConfig, SiteRuntime
    from tests.deploy.test_deploy import _workload

    def loader(name, datalist, header, cfg):
        return data[name], _workload(cfg)

    from tests.deploy.test_deploy import REHEARSAL

    return {
        n: SiteRuntime(
            SiteConfig(n, "(in memory)", str(tmp / "sites" / n)), loader=loader, identity=kits.get(n), policy=REHEARSAL
        )
        for n in data
    }


def test_deployed_signed_secure_fedavg_equals_simulation_bitwise(tmp_path, ca):
    """Deployed FedAvg with secure aggregation, every site signing with its kit (client.crt, client.key,
    rootCA.pem): each exchange's keys are signed and checked, and the run ends with the simulation's
    (unsigned) weights bitwise: the signatures change no mask and no sum."""
    from fedseg.deployment.server import serve
    from fedseg.deployment.transport import LoopbackChannel
    from fedseg.simulation.runner import simulate
    from tests.deploy.test_deploy import _prepare, _workload
    from tests.deploy.test_secagg_deploy import _cfg
    from tests.support.helpers import assert_same_arrays, server_state, tiny_sites

    cfg, data = _cfg(), tiny_sites(3)
    kits = ca.federation(tmp_path / "kits", list(data))
    runtimes = _kit_runtimes(tmp_path, data, kits)
    _prepare(tmp_path / "dep", cfg, list(data))
    logs: list[str] = []
    dep = serve(tmp_path / "dep", LoopbackChannel(runtimes), log=logs.append)
    assert all(isinstance(rt.site.identity, Identity) for rt in runtimes.values())
    assert not any("left out" in m for m in logs), logs
    sim = simulate(cfg, _workload(cfg), tiny_sites(3), out=tmp_path / "sim", progress=False, log=lambda m: None)
    assert_same_arrays(server_state(tmp_path / "dep"), server_state(tmp_path / "sim"))
    assert dep["per_site_dice"] == sim["per_site_dice"] and dep["deploy"]["dropouts"] == []


class _SubstitutingChannel:
    """The byte channel, but the key list that goes to site1 in step 2 carries another mask key for site3 (a
    server, or anyone on the path, that substitutes a site's keys)."""

    def __init__(self, channel):
        self.channel = channel

    def __call__(self, site, op, payload, timeout):
        from fedseg.deployment.wire import decode_task, encode_task

        if op == "task" and site == "site1":
            task = decode_task(payload)
            if task.kind == "secagg/shares":
                task.config["keys"]["site3"]["s"] = secagg.keypair().public.hex()
                payload = encode_task(task)
        return self.channel(site, op, payload, timeout)


@pytest.mark.parametrize("how", ["replaced", "other_ca"])
def test_deployed_refused_keys_leave_the_site_out_and_the_round_proceeds(tmp_path, ca, how):
    """Deployed, site3's keys are refused: replaced on the way to site1 (site1 refuses them), or signed under a
    certificate of another federation's CA (everyone refuses them, and site3 refuses everyone).  The server logs
    who refused site3 and why, leaves it out of the exchange before anyone masks, and the round's model is
    bitwise the one of a deployment where site3 was gone from the start of the exchange.  Two sites are left
    without site3, so the sites accept masking with two (privacy.secagg_min_sites = 2)."""
    from fedseg.deployment.server import serve
    from fedseg.deployment.transport import LoopbackChannel
    from fedseg.deployment.wire import decode_reply
    from tests.deploy.test_deploy import _prepare
    from tests.deploy.test_secagg_deploy import _cfg
    from tests.support.helpers import assert_same_arrays, server_state, tiny_sites

    cfg, names = _cfg(rounds=1, min_sites=2), ["site1", "site2", "site3"]
    kits = ca.federation(tmp_path / "kits", names)
    if how == "other_ca":  # a kit of another federation of the same names: its own root CA and roster
        kits["site3"] = CA("another-root").federation(tmp_path / "other", names)["site3"]

    def gone_at_keys(op, blob):
        if "c" in (decode_reply(blob).metrics.get("secagg") or {}):
            raise ConnectionError("site3 down")
        return blob

    _prepare(tmp_path / "early", cfg, names)
    faults = {"site3": gone_at_keys}
    serve(tmp_path / "early", LoopbackChannel(_kit_runtimes(tmp_path / "early", tiny_sites(3), kits), faults))
    _prepare(tmp_path / "refused", cfg, names)
    channel = LoopbackChannel(_kit_runtimes(tmp_path / "refused", tiny_sites(3), kits))
    logs: list[str] = []
    dep = serve(tmp_path / "refused", _SubstitutingChannel(channel) if how == "replaced" else channel, log=logs.append)
    left = [m for m in logs if "site site3 left out of exchange train-r1-" in m]
    assert len(left) == 1, logs
    assert ("site site1 refused its keys" in left[0]) and (("site site2 refused" in left[0]) == (how == "other_ca"))
    assert ("does not verify" if how == "replaced" else "not issued by this federation's root CA") in left[0]
    assert set(dep["history"][0]["train_loss"]) == {"site1", "site2"}
    assert_same_arrays(server_state(tmp_path / "refused"), server_state(tmp_path / "early"))


@pytest.mark.parametrize("setting", ["auto", "off"])
def test_site_with_a_kit_signs_whatever_the_run_says(tmp_path, ca, setting):
    """A deployed site set up for a run with secure aggregation reads its kit's identity (with its roster) under
    ``privacy.secagg_identity = "auto"`` and under ``"off"`` alike: the run config is the server's, the identity
    the site's; without secure aggregation it reads nothing."""
    from fedseg.foundation.config import PrivacyConfig, dump_toml
    from tests.deploy.test_deploy import HEADER
    from tests.deploy.test_secagg_deploy import _cfg
    from tests.support.helpers import tiny_sites

    data = tiny_sites(2)
    kits = ca.federation(tmp_path / "kits", list(data))
    for secure in (True, False):
        cfg = _cfg()
        cfg = dataclasses.replace(cfg, privacy=PrivacyConfig(secure_aggregation=secure, secagg_identity=setting))
        rt = _kit_runtimes(tmp_path / str(secure), data, kits)["site1"]
        desc = {"run_id": "r", "sites": list(data), "data": HEADER, "config_toml": dump_toml(cfg.to_dict())}
        rt.call("setup", json.dumps(desc).encode())
        assert isinstance(rt.site.identity, Identity) == secure
        assert rt.site.cfg.privacy.secagg_identity == "auto"
        assert rt.enforced["signed_keys"] == (True if secure else None)


def test_signed_attestations_count_only_from_their_signer(identities):
    """With identities a survivor attests U3 with its certificate's signature.  A signature of another survivor
    set, or site2's signature presented as site1's, does not count: with t = 3 of 4 sites and one of the two
    other attestations not valid, site0 refuses to reveal."""
    server = ServerParty("e1", BITS)
    parties = {u: SiteParty(u, "e1", identities[u]) for u in SITES}
    for u in SITES:
        server.accept_keys(u, parties[u].advertise())
    req = server.share_request()
    for u in SITES:
        server.accept_shares(u, parties[u].share(req["order"], req["keys"]))
    for u in SITES:
        cfg = server.input_config(u)
        parties[u].mask(_arrays(0), 1.0, cfg["order"], cfg["shares"], BITS)
    dropped, survived = ["site3"], ["site0", "site1", "site2"]
    att = {u: parties[u].attest(dropped, survived) for u in survived}
    other_set = {"signature": identities["site1"].sign_bytes(survivors_statement("e1", "site1", SITES))}
    for bad in (other_set, att["site2"]):
        with pytest.raises(PayloadError, match="2 survivors attested"):
            parties["site0"].reveal(dropped, survived, {**att, "site1": bad})
    assert sorted(parties["site0"].reveal(dropped, survived, att)["b"]) == survived
