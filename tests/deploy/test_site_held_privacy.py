"""What a deployed site holds against the server of its own federation: the roster of its sites, its identity,
its randomness and its δ.

Each attack acts as the server of a federation provisioned with ``fedseg deploy provision`` (NVIDIA FLARE's
provisioner: a root CA, and kits for the server, three sites and the admin), with only what the server's
operator holds: the server's kit and the admin's kit (their certificates and private keys), the run config it
ships, the tasks it sends and the replies it gets.  The target is a real :class:`SiteRuntime` started from
site1's kit (its certificate, key and roster), driven over its byte operations (``setup``, ``task``) as FLARE
would.  Each attack recovered site1's update, or its gradient under its noise, against the code before the
site held these settings (said per test); each ends in the site's refusal (logged, and in its release log) or in
a wrong recovery now.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fedseg.algorithms import get_algorithm
from fedseg.deployment.policy import SitePolicy
from fedseg.deployment.site import SiteConfig, SiteRuntime
from fedseg.deployment.wire import decode_reply, encode_task
from fedseg.foundation.arrays import prefixed
from fedseg.foundation.config import PrivacyConfig, dump_toml
from fedseg.foundation.errors import PayloadError
from fedseg.foundation.messages import Task
from fedseg.privacy import accountant
from fedseg.privacy.identity import Identity
from fedseg.privacy.protocol import MASKED, ServerParty, SiteParty
from fedseg.site.runtime import Site
from tests.deploy.test_deploy import HEADER, _workload
from tests.support.helpers import tiny_config, tiny_sites

pytest.importorskip("cryptography")
pytest.importorskip("Crypto")
pytest.importorskip("nvflare", reason="the attacks run on kits from NVIDIA FLARE's provisioner")

SITES = ["site1", "site2", "site3"]
HOST = "localhost"  # the server's name in the kits (its certificate's common name)
BITS = 32


@pytest.fixture(scope="module")
def kits(tmp_path_factory):
    """A federation provisioned as `fedseg deploy provision` does it (FLARE's provisioner, RSA-2048 keys)."""
    from fedseg.deployment.run import provision

    try:
        return provision(SITES, f"{HOST}:18002", tmp_path_factory.mktemp("fed") / "kits")
    except Exception as e:  # pragma: no cover - an environment where FLARE cannot provision
        pytest.skip(f"nvflare cannot provision here: {e}")


def _held_identity(kit: Path, name: str, crt: str, key: str) -> Identity:
    """An identity the server's operator makes from a kit it holds (built directly: it runs its own code)."""
    from cryptography.hazmat.primitives import serialization

    start = kit / "startup"
    private = serialization.load_pem_private_key((start / key).read_bytes(), password=None)
    return Identity(name, (start / crt).read_text(), private, (start / "rootCA.pem").read_bytes())


def _minted(kits, name: str) -> Identity:
    """A second certificate for ``name`` minted with the root CA's key (``.provision/``), after provisioning:
    what whoever kept the CA's key can make."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    state = json.loads((kits["server"].parent / ".provision" / "fedseg" / "state" / "cert.json").read_text())
    ca_key = serialization.load_pem_private_key(state["root_pri_key"].encode(), password=None)
    ca_cert = x509.load_pem_x509_certificate(state["root_cert"].encode())
    key = ec.generate_private_key(ec.SECP256R1())  # any key the site can verify (FLARE's are RSA; EC is faster)
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = cert.public_bytes(serialization.Encoding.PEM).decode()
    return Identity(name, pem, key, (kits["site1"] / "startup" / "rootCA.pem").read_bytes())


def _cfg(method="fedavg", **privacy):
    cfg = tiny_config(method, rounds=1)
    return dataclasses.replace(
        cfg,
        privacy=PrivacyConfig(**{"secure_aggregation": True, **privacy}),
        params={**cfg.params, "deploy": {"round_deadline_s": 30.0, "max_update_ratio": 0}},
    )


def _target(tmp: Path, kits, cfg, policy: SitePolicy | None = None, name: str = "site1") -> SiteRuntime:
    """``name``'s runtime as FLARE starts it (its kit's startup folder as its identity, a policy as its kit's
    file gives it), set up for the run ``cfg`` over the federation's three sites."""
    data = tiny_sites(3)
    rt = SiteRuntime(
        SiteConfig(name, "(in memory)", str(tmp / name)),
        loader=lambda n, dl, header, c: (data[n], _workload(c)),
        identity=kits[name] / "startup",
        policy=policy or SitePolicy(),
    )
    desc = {"run_id": "run-1", "sites": SITES, "data": HEADER, "config_toml": dump_toml(cfg.to_dict())}
    reply = json.loads(rt.call("setup", json.dumps(desc).encode()))
    assert "refused" not in reply, reply
    return rt


def _state(cfg) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return prefixed("global", {k: v.detach().clone() for k, v in _workload(cfg).build_model().state_dict().items()})


def _truth(cfg, state) -> dict[str, torch.Tensor]:
    """site1's plain update for round 1 (a twin site with its data, secure aggregation off): what the attacks
    try to recover (the test's reference; the server never holds it)."""
    plain = dataclasses.replace(cfg, privacy=PrivacyConfig())
    data = tiny_sites(3)["site1"]
    return (
        Site("site1", 0, data, _workload(plain), plain, get_algorithm(plain))
        .handle(Task("train", state, {"round": 1}))
        .arrays
    )


def _ask(rt: SiteRuntime, kind: str, config: dict, arrays=None):
    return decode_reply(rt.call("task", encode_task(Task(kind, arrays or {}, {"round": 1, **config}))))


def _phantom_exchange(rt: SiteRuntime, phantoms: dict[str, Identity | None], state) -> dict | str:
    """The server runs one exchange of FedAvg's round-1 ``"train"`` task with the target and parties it plays
    itself (``phantoms``: a name and the identity it signs with, or None: unsigned); they mask zeros.  It ignores
    any refusal of the target's and asks it to mask with all of them.  Returns the recovered update (the unmasked
    sum over the target's sample count) or the refusal the target answered with."""
    exchange = f"train-r1-{os.urandom(8).hex()}"
    server = ServerParty(exchange, BITS)
    parties = {n: SiteParty(n, exchange, ident, min_sites=2) for n, ident in phantoms.items()}
    order = [rt.name, *phantoms]
    try:
        server.accept_keys(rt.name, _ask(rt, "secagg/keys", {"exchange": exchange}).metrics["secagg"])
        for n, p in parties.items():
            server.accept_keys(n, p.advertise())
        request = server.share_request()
        dealt = {rt.name: _ask(rt, "secagg/shares", request).metrics["secagg"]}
        dealt.update({n: p.share(request["order"], request["keys"]) for n, p in parties.items()})
        for n in order:
            server.accept_shares(n, dealt[n])
        server.refusals = {n: {} for n in order}  # the server ignores the target's refusals
        secure = {"fraction_bits": BITS, "weighting": "samples", "prefix_weighting": {}}
        reply = _ask(rt, "train", {"secagg": {**server.input_config(rt.name), **secure}}, state)
        dtypes = reply.metrics["secagg"]["dtypes"]
        server.accept_input(rt.name, reply.arrays, dtypes, float(reply.num_samples))
        zeros = {k: torch.zeros(reply.arrays[MASKED + k].shape, dtype=getattr(torch, d)) for k, d in dtypes.items()}
        for n, p in parties.items():
            cfg = server.input_config(n)
            masked, _, _ = p.mask(zeros, 0.0, cfg["order"], cfg["shares"], BITS)
            server.accept_input(n, masked, dtypes, 0.0)
        lists = server.consistency_config()
        server.accept_attestation(rt.name, _ask(rt, "secagg/consistency", lists).metrics["secagg"])
        for n, p in parties.items():
            server.accept_attestation(n, p.attest(lists["dropped"], lists["survived"]))
        reveal = server.reveal_config()
        reveals = {rt.name: _ask(rt, "secagg/reveal", reveal).metrics["secagg"]}
        reveals.update(
            {n: p.reveal(reveal["dropped"], reveal["survived"], reveal["attestations"]) for n, p in parties.items()}
        )
        total, weight, _ = server.unmask(reveals, log=lambda m: None)
    except PayloadError as e:
        return str(e)
    return {k: v / weight for k, v in total.items()}


def _max_error(recovered: dict, truth: dict) -> float:
    return max(float((recovered[k].double() - truth[k].double()).abs().max()) for k in truth)


def _refused_in_release_log(rt: SiteRuntime) -> list[dict]:
    """The release log's lines of the run's task refusals (what left the site instead of a reply)."""
    lines = [json.loads(line) for line in rt.release_log().read_text().splitlines()]
    assert not any(e.get("kind") == "secagg/reveal" and "sha256" in e for e in lines)  # no reveal left the site
    return [e for e in lines if e["op"] == "task" and "error" in e]


# ------------------------------------------------------------------ attack 1: phantom parties, the roster
def test_provisioning_pins_the_sites_in_every_kit_and_prints_them(kits, capsys):
    """Every site kit holds the same roster: each site's name and the SHA-256 of its certificate's DER bytes
    (computed here independently from the kit's client.crt), and the server's and the admin's certificates as
    non-sites; ``fedseg deploy roster KIT`` prints it, one participant a line, for comparison out of band."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    from fedseg.cli import main
    from fedseg.privacy.identity import fingerprint

    rosters = [json.loads((kits[s] / "local" / "fedseg_roster.json").read_text()) for s in SITES]
    assert rosters[0] == rosters[1] == rosters[2]
    roster = rosters[0]
    for s in SITES:
        cert = x509.load_pem_x509_certificate((kits[s] / "startup" / "client.crt").read_bytes())
        assert roster["sites"][s] == cert.fingerprint(hashes.SHA256()).hex(":").upper()
    assert roster["server"] == {HOST: fingerprint((kits["server"] / "startup" / "server.crt").read_bytes())}
    assert list(roster["admins"]) == ["admin@fedseg.org"]
    assert main(["deploy", "roster", str(kits["site2"])]) == 0
    out = capsys.readouterr().out
    assert all(f"site      {s}  {roster['sites'][s]}" in out for s in SITES)
    assert f"server    {HOST}  {roster['server'][HOST]}" in out and "site site2, its certificate is the roster's" in out


@pytest.mark.parametrize("who", ["server-and-admin", "minted"])
def test_the_server_cannot_stand_in_for_sites_with_certificates_it_holds(tmp_path, kits, who, caplog):
    """Attack 1.  The server runs an exchange with site1 and two parties of its own, signing their keys with
    certificates of the federation's root CA that its operator holds: the server's and the admin's
    (``server-and-admin``: U1 = [site1, localhost, admin@fedseg.org], names the certificates carry), or second
    certificates for site2 and site3 minted with the CA's key after provisioning (``minted``).  Before the roster,
    site1 accepted both (each chains to the root CA and its common name is the claimed name), dealt its shares
    (t = 2 of 3: the two sealed to the server's parties suffice), masked, attested and revealed, and the server
    removed every mask: site1's model after the round to a largest error of 1.9e-11 in both variants (the
    fixed-point floor, 2⁻³³ per encoded value; run against the code before this check).  Now site1 refuses: a
    name outside its roster refuses the whole exchange; a certificate that is not the one the roster pins for
    that name leaves the party out, and site1 refuses to mask with it.  No reveal leaves site1."""
    cfg = _cfg()
    rt = _target(tmp_path, kits, cfg)
    if who == "server-and-admin":
        phantoms = {
            HOST: _held_identity(kits["server"], HOST, "server.crt", "server.key"),
            "admin@fedseg.org": _held_identity(kits["admin"], "admin@fedseg.org", "client.crt", "client.key"),
        }
    else:
        phantoms = {"site2": _minted(kits, "site2"), "site3": _minted(kits, "site3")}
    with caplog.at_level(logging.INFO):
        got = _phantom_exchange(rt, phantoms, _state(cfg))
    assert isinstance(got, str), (
        f"the server recovered site1's update to {_max_error(got, _truth(cfg, _state(cfg))):.3g}"
    )
    if who == "server-and-admin":
        assert "names ['localhost', 'admin@fedseg.org'], not sites of this site's roster" in got
    else:
        assert "whose keys this site refused" in got
    refused = _refused_in_release_log(rt)
    assert refused and refused[-1]["error"].startswith("PayloadError: site site1")
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(m.startswith("site site1 refuses a 'secagg/shares' task") or "a 'train' task" in m for m in warned), (
        warned
    )
    assert isinstance(rt.site.identity, Identity) and rt.site.identity.roster is not None


def test_a_peer_certificate_is_checked_against_the_roster_and_its_role(kits):
    """Why each certificate the server's operator holds is refused as a site's, as site1's identity checks a
    peer (step 2 and the consistency round): the server's certificate is the roster's server entry; the admin's
    carries FLARE's role attribute; a minted certificate for site2 is not the one the roster pins; the real
    site2's is accepted."""
    from fedseg.privacy.identity import load_identity

    me = load_identity(kits["site1"] / "startup", "site1")
    server = (kits["server"] / "startup" / "server.crt").read_text()
    admin = (kits["admin"] / "startup" / "client.crt").read_text()
    assert "is the server's ('localhost')" in me._chain_and_name(server, HOST)
    assert "role attribute 'project_admin'" in me._chain_and_name(admin, "admin@fedseg.org")
    assert "not the one this site's roster pins" in me._chain_and_name(_minted(kits, "site2").certificate, "site2")
    assert not isinstance(me._chain_and_name((kits["site2"] / "startup" / "client.crt").read_text(), "site2"), str)


# ------------------------------------------------------------------ attack 2: signing switched off by the run
def test_the_run_config_cannot_switch_signing_off(tmp_path, kits):
    """Attack 2.  The server ships ``privacy.secagg_identity = "off"`` and plays site2 and site3 itself with keys
    of its own, unsigned.  Before, site1 then loaded no identity, checked nothing, and the server — holding both
    peers' keys — passed the consistency round (it computes the pairwise MACs) and recovered site1's model after
    the round to a largest error of 1.9e-11 (run against the code before).  Now site1 signs and checks whatever the run says: the unsigned peers' keys are
    refused and it will not mask with them."""
    cfg = _cfg(secagg_identity="off")
    rt = _target(tmp_path, kits, cfg)
    got = _phantom_exchange(rt, {"site2": None, "site3": None}, _state(cfg))
    assert isinstance(got, str), (
        f"the server recovered site1's update to {_max_error(got, _truth(cfg, _state(cfg))):.3g}"
    )
    assert "whose keys this site refused" in got
    assert isinstance(rt.site.identity, Identity) and rt.enforced["signed_keys"] is True


# ------------------------------------------------------------------ attack 3: seeded DP noise shipped by the run
@pytest.mark.parametrize("reproducible", [False, True])
def test_the_run_config_cannot_make_dp_noise_regenerable(tmp_path, kits, monkeypatch, reproducible):
    """Attack 3.  The server ships ``privacy.dp_randomness = "seeded"`` to a site whose policy takes DP-SGD runs
    without secure aggregation, asks one FGA step and subtracts the noise it regenerates from the seed it shipped
    and the index it assigned (tests/deploy/test_dp_attacks.py's regeneration, with the server's config).  Before, the
    site drew seeded noise and the server recovered its clipped gradient sum to a relative error of 2.7e-6
    under noise far above the signal (run against the code before).  Now the site draws from its OS (its policy is not ``reproducible``): the
    best regeneration is off by more than the signal, and the site's own ``privacy`` report says what it drew.
    With ``reproducible`` (rehearsals only) the seeded mode is the site's choice and the server regenerates it."""
    from tests.deploy.test_dp_attacks import CLIP, SIGMA, _fga_task, _relative_errors, _Truth

    truth = _Truth(monkeypatch)
    cfg = _cfg("fga", secure_aggregation=False, dp="sample", noise_multiplier=SIGMA, clip=CLIP, dp_randomness="seeded")
    policy = SitePolicy(secure_aggregation=False, dp="sample", reproducible=reproducible)
    rt = _target(tmp_path, kits, cfg, policy)
    wl = _workload(cfg)
    reply = decode_reply(rt.call("task", encode_task(_fga_task(wl))))
    order = [f"grad/{k}" for k, _ in wl.build_model().named_parameters()]  # the wire sorts names; the model's order
    reply = dataclasses.replace(reply, arrays={k: reply.arrays[k] for k in order if k in reply.arrays})
    server_view = SimpleNamespace(cfg=cfg, index=SITES.index("site1"))  # what the server shipped and assigned
    best = min(_relative_errors(server_view, reply, truth.sums[0]))
    report = decode_reply(rt.call("task", encode_task(Task("privacy", {}, {})))).metrics
    if reproducible:
        assert best < 1e-4 and report["dp_randomness"] == "seeded"
    else:
        assert best > 1.0, best
        assert report["dp_randomness"] == "os" and report["epsilon_against_server"] == "epsilon"
        assert report["enforced"]["dp_randomness"] == "os" and report["enforced"]["reproducible"] is False


# ------------------------------------------------------------------ attack 7: δ chosen by the server
def test_the_server_cannot_choose_delta(tmp_path, kits):
    """Attack 7.  A site's policy caps ε at 1; the server ships ε = 1 at δ = 0.5.  Before, the site accepted and
    derived its noise for ε = 1 at δ = 0.5 (run against the code before: set up, no refusal).  What that is worth,
    by the site's own accountant: for one step at q = 1 the σ that gives ε = 1 at δ = 0.5 gives ε = 7.1 at
    δ = 1e-5.  Now the site's δ ceiling, min(1e-5, 1/(10·n_k)) by default, refuses the run at setup, naming
    privacy.delta; the same run at δ = 1e-5 is taken with a σ whose round fits ε = 1 there (its round is 2 steps
    at q = 4/6 on site1's 6 cases: σ = 5 spends ε = 0.82 at δ = 1e-5, σ = 4 spends 1.07 and is refused at setup by
    the policy's lifetime ceiling: not one round of it fits)."""
    sigma = accountant.noise_multiplier(1.0, 0.5, 1.0, 1)
    assert accountant.epsilon([(sigma, 1.0, 1)], 0.5) <= 1.0 < 5.0 < accountant.epsilon([(sigma, 1.0, 1)], 1e-5)
    ceiling = SitePolicy(secure_aggregation=False, dp="sample", max_epsilon=1.0)
    loose = _cfg("fedavg", secure_aggregation=False, dp="sample", epsilon=1.0, delta=0.5)
    data = tiny_sites(3)
    rt = SiteRuntime(
        SiteConfig("site1", "(in memory)", str(tmp_path / "strict")),
        loader=lambda n, dl, header, c: (data[n], _workload(c)),
        identity=kits["site1"] / "startup",
        policy=ceiling,
    )
    desc = {"run_id": "run-1", "sites": SITES, "data": HEADER, "config_toml": dump_toml(loose.to_dict())}
    reply = json.loads(rt.call("setup", json.dumps(desc).encode()))
    assert "privacy.delta = 0.5 is above min(1e-5, 1/(10·n_k)) of this site = 1e-05" in reply["refused"]
    with pytest.raises(PayloadError, match="refuses run run-1 by its policy"):
        rt.call("task", encode_task(Task("train", {}, {"round": 1})))
    at = dataclasses.replace(loose.privacy, delta=1e-5)
    assert accountant.epsilon([(4.0, 4 / 6, 2)], 1e-5) > 1.0 > accountant.epsilon([(5.0, 4 / 6, 2)], 1e-5)
    short = dataclasses.replace(loose, privacy=dataclasses.replace(at, noise_multiplier=4.0))
    desc = {**desc, "config_toml": dump_toml(short.to_dict())}
    reply = json.loads(rt.call("setup", json.dumps({**desc, "run_id": "run-2"}).encode()))
    assert "one more round of this run would take it to 1.066 > the policy's lifetime ceiling" in reply["refused"]
    strict = dataclasses.replace(loose, privacy=dataclasses.replace(at, noise_multiplier=5.0))
    site = _target(tmp_path / "ok", kits, strict, ceiling).site
    assert site is not None and site.dp.lifetime_epsilon(extra_rounds=1) <= 1.0


def test_a_run_naming_a_party_outside_the_roster_is_refused_at_setup(tmp_path, kits):
    """The run's site list must be sites of the roster: a server that lists its own name among the sites (to
    meet the policy's ``min_sites`` with a party it plays) is refused at setup with the names and the fix."""
    data = tiny_sites(3)
    rt = SiteRuntime(
        SiteConfig("site1", "(in memory)", str(tmp_path / "s")),
        loader=lambda n, dl, header, c: (data[n], _workload(c)),
        identity=kits["site1"] / "startup",
        policy=SitePolicy(),
    )
    desc = {
        "run_id": "r",
        "sites": ["site1", "site2", HOST],
        "data": HEADER,
        "config_toml": dump_toml(_cfg().to_dict()),
    }
    reply = json.loads(rt.call("setup", json.dumps(desc).encode()))
    assert "the run's sites ['localhost'] are not sites of this site's roster" in reply["refused"]
    assert "provision it again" in reply["refused"] and rt.site is None


def test_a_kit_without_its_roster_refuses_runs_and_is_stopped_before_it_starts(tmp_path, kits):
    """A site kit provisioned before rosters (no local/fedseg_roster.json): `fedseg deploy site` stops with the
    fix, and a site runtime started from it refuses a secure-aggregation run at setup with the same fix instead
    of taking part unchecked."""
    import shutil

    from fedseg.deployment.run import configure_site
    from fedseg.foundation.errors import ConfigError

    old = tmp_path / "site1"
    shutil.copytree(kits["site1"], old)
    (old / "local" / "fedseg_roster.json").unlink()
    datalist = tmp_path / "dl.json"
    datalist.write_text("{}")
    with pytest.raises(ConfigError, match=r"holds no roster.*fedseg deploy provision"):
        configure_site(old, datalist, tmp_path / "work")
    data = tiny_sites(3)
    rt = SiteRuntime(
        SiteConfig("site1", "(in memory)", str(tmp_path / "s")),
        loader=lambda n, dl, header, c: (data[n], _workload(c)),
        identity=old / "startup",
        policy=SitePolicy(),
    )
    desc = {"run_id": "r", "sites": SITES, "data": HEADER, "config_toml": dump_toml(_cfg().to_dict())}
    reply = json.loads(rt.call("setup", json.dumps(desc).encode()))
    assert "holds no roster" in reply["refused"] and "fedseg deploy provision" in reply["refused"]
