"""Secure aggregation against an ACTIVE server: each attack acts as the server with only what it holds (the
tasks it sends, the sites' replies and the protocol messages) and tries to recover one site's update exactly.

Every attack here recovers the target's fixed-point input bitwise against a site that does not check what
the server sends (each ``_attack_*`` returns the recovered and the true encoding, equal there); the sites
refuse each one, so here each attack ends in the site's :class:`PayloadError`.

The sites are real :class:`fedseg.site.runtime.Site` objects running FedAvg's site half with
``privacy.secure_aggregation`` on; the server's side is this module, talking to them through
``site.handle(Task)`` only.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from fedseg.algorithms import get_algorithm
from fedseg.foundation.arrays import prefixed
from fedseg.foundation.config import PrivacyConfig
from fedseg.foundation.errors import PayloadError
from fedseg.foundation.messages import Task
from fedseg.privacy import secagg
from fedseg.privacy.protocol import CANARY, MASKED, ServerParty
from fedseg.site.runtime import Site
from fedseg.site.workload import segmentation_workload
from tests.support.helpers import TINY_MODEL, tiny_config, tiny_sites

pytest.importorskip("cryptography")
pytest.importorskip("Crypto")

BITS = 32
RND = 1


def _federation(k: int, secure: bool = True, **train) -> tuple[dict[str, Site], dict[str, torch.Tensor]]:
    """``k`` FedAvg sites (secure aggregation on in their own config) and the global model the server sends."""
    cfg = tiny_config("fedavg", rounds=3, **train)
    cfg = dataclasses.replace(cfg, privacy=PrivacyConfig(secure_aggregation=secure))
    workload = segmentation_workload(2, 1, ["fg"], TINY_MODEL)
    data = tiny_sites(k)
    sites = {s: Site(s, i, d, workload, cfg, get_algorithm(cfg)) for i, (s, d) in enumerate(data.items())}
    torch.manual_seed(0)
    state = prefixed("global", {k: v.detach().clone() for k, v in workload.build_model().state_dict().items()})
    return sites, state


def _truth(k: int, target: str, state, **train) -> tuple[np.ndarray, dict[str, torch.Tensor], int]:
    """The target's plain reply to round RND's task (a twin site, secure aggregation off): its fixed-point
    encoding × n_k as it masks it, the arrays, n_k."""
    sites, _ = _federation(k, secure=False, **train)
    reply = sites[target].handle(Task("train", state, {"round": RND}))
    encoded, _ = secagg.encode(reply.arrays, float(reply.num_samples), BITS, k)
    return encoded, reply.arrays, reply.num_samples


def _ask(sites, s, kind, config, arrays=None):
    return sites[s].handle(Task(kind, arrays or {}, {"round": RND, **config}))


def _keys(sites, names, exchange):
    return {s: _ask(sites, s, "secagg/keys", {"exchange": exchange}).metrics["secagg"] for s in names}


def _shares(sites, names, exchange, keys, order):
    req = {"exchange": exchange, "order": order, "keys": {u: keys[u] for u in order}}
    return {s: _ask(sites, s, "secagg/shares", req).metrics["secagg"] for s in names}


def _mask(sites, s, exchange, order, dealt, state, extra=None):
    sealed = {u: dealt[u]["shares"][s] for u in order if u != s and s in dealt[u]["shares"]}
    secure = {"exchange": exchange, "order": order, "shares": sealed, "fraction_bits": BITS, "weighting": "samples"}
    return _ask(sites, s, "train", {**(extra or {}), "secagg": secure}, state)


def _attest(sites, s, exchange, dropped, survived):
    """A site's attestation of ``survived``, or None where it refuses (or has no consistency round)."""
    try:
        return _ask(sites, s, "secagg/consistency", {"exchange": exchange, "dropped": dropped, "survived": survived})
    except PayloadError:
        return None


def _reveal(sites, s, exchange, dropped, survived, attestations):
    config = {"exchange": exchange, "dropped": dropped, "survived": survived, "attestations": attestations}
    return _ask(sites, s, "secagg/reveal", config).metrics["secagg"]


def _flat(reply) -> np.ndarray:
    """A masked reply as the server flattens it: the arrays in name order, then the check word (uint64)."""
    arrays = dict(reply.arrays)
    check = arrays.pop(CANARY)
    plain = {k[len(MASKED) :]: v for k, v in arrays.items()}
    return np.concatenate([*(plain[k].reshape(-1).numpy() for k in sorted(plain)), check.numpy()]).view(np.uint64)


def _secret(reveals, kind, owner, t, fits) -> bytes:
    shares = {}
    for got in reveals.values():
        if owner in got.get(kind, {}):
            raw = bytes.fromhex(got[kind][owner])
            shares[raw[0]] = raw[1:]
    return secagg.recover(shares, t, fits, f"{kind} of {owner}")[0]


def _fits_b(keys, owner, exchange):
    return lambda x: secagg.seed_digest(x, exchange) == bytes.fromhex(keys[owner]["b_digest"])


def _fits_s(keys, owner):
    return lambda x: secagg.keypair(x).public == bytes.fromhex(keys[owner]["s"])


# ------------------------------------------------------------------ the attacks
def _attack_singleton(k: int):
    """Every site keys and deals its shares (U1 = all k sites), but the target is told to mask with itself
    only: y = x + PRG(b).  Each other site masks with [itself, target] (so it opens the target's share) and is
    then told that it and the target survived; each reveals its share of b_target, which t of them rebuild;
    y − PRG(b) is the target's encoding."""
    sites, state = _federation(k)
    names, target, exchange = list(sites), "site1", "e-single"
    keys = _keys(sites, names, exchange)
    dealt = _shares(sites, names, exchange, keys, names)
    y = _flat(_mask(sites, target, exchange, [target], dealt, state))
    reveals = {target: _reveal(sites, target, exchange, [], [target], {})}
    for v in names[1:]:
        _mask(sites, v, exchange, [target, v], dealt, state)
        att = {u: _attest(sites, u, exchange, [], [target, v]) for u in (v,)}
        reveals[v] = _reveal(sites, v, exchange, [], [target, v], att)
    b = _secret(reveals, "b", target, secagg.threshold_for(k), _fits_b(keys, target, exchange))
    x = y - secagg.expand(b, y.size)
    return x[:-1], _truth(k, target, state)[0]


def _attack_survivor_lists(k: int):
    """All k sites mask with all (an honest step 3).  Then each other site w is told that only w and the target
    survived (the rest dropped), and the target that it alone survived: w reveals its shares of b_target and
    of s_v for every v ∉ {w, target}; the target its shares of b_target and of every s_v.  So b_target and
    every other site's mask key s_v are rebuilt (k − 1 ≥ t shares of each), and y_target minus its self mask
    and its pairwise masks (from s_v and S_target) is its encoding."""
    sites, state = _federation(k)
    names, target, exchange = list(sites), "site1", "e-lists"
    keys = _keys(sites, names, exchange)
    dealt = _shares(sites, names, exchange, keys, names)
    ys = {s: _flat(_mask(sites, s, exchange, names, dealt, state)) for s in names}
    others = [v for v in names if v != target]
    lists = {w: ([v for v in others if v != w], [target, w]) for w in others}
    lists[target] = (others, [target])
    atts = {w: _attest(sites, w, exchange, *lists[w]) for w in names}
    reveals = {}
    for w in names:
        dropped, survived = lists[w]
        try:
            reveals[w] = _reveal(sites, w, exchange, dropped, survived, {u: atts[u] for u in survived})
        except PayloadError:
            continue
    t = secagg.threshold_for(k)
    y = ys[target].copy()
    y -= secagg.expand(_secret(reveals, "b", target, t, _fits_b(keys, target, exchange)), y.size)
    me = names.index(target)
    for i, v in enumerate(names):
        if v == target:
            continue
        s_v = _secret(reveals, "s", v, t, _fits_s(keys, v))
        m = secagg.expand(secagg.shared_key(s_v, bytes.fromhex(keys[target]["s"]), "mask", exchange), y.size)
        (np.subtract if i > me else np.add)(y, m, out=y)
    return y[:-1], _truth(k, target, state)[0]


def _honest(sites, names, exchange, state, extra=None):
    """One exchange run by the server's own code (:class:`ServerParty`) over ``names``: the decoded sum."""
    server = ServerParty(exchange, BITS)
    for s in names:
        server.accept_keys(s, _ask(sites, s, "secagg/keys", {"exchange": exchange}).metrics["secagg"])
    req = server.share_request()
    for s in names:
        server.accept_shares(s, _ask(sites, s, "secagg/shares", req).metrics["secagg"])
    for s in server.masking:
        secure = {**server.input_config(s), "weighting": "samples"}
        r = _ask(sites, s, "train", {**(extra or {}).get(s, {}), "secagg": secure}, state)
        server.accept_input(s, r.arrays, r.metrics["secagg"]["dtypes"], float(r.num_samples))
    if hasattr(server, "consistency_config"):
        c = server.consistency_config()
        for s in c["survived"]:
            server.accept_attestation(s, _ask(sites, s, "secagg/consistency", c).metrics["secagg"])
    cfg = server.reveal_config()
    holders = cfg.get("attestations", cfg["survived"])
    reveals = {s: _ask(sites, s, "secagg/reveal", cfg).metrics["secagg"] for s in holders}
    return server.unmask(reveals, log=lambda m: None)[0]


def _decoded(encoded: np.ndarray, arrays) -> dict[str, torch.Tensor]:
    return secagg.decode(encoded, secagg.layout_of(arrays), BITS)


def _attack_twice(k: int):
    """Round RND's task asked twice (the same (kind, round, step)): once with all k sites, once with all but the
    target.  With train.reset_optimizer (or for a gradient, as FGA's steps) the sites' work is the same both
    times, so the difference of the two sums is the target's."""
    sites, state = _federation(k, reset_optimizer=True)
    names, target = list(sites), "site1"
    first = _honest(sites, names, "e-once", state)
    second = _honest(sites, [s for s in names if s != target], "e-twice", state)
    encoded, arrays, _ = _truth(k, target, state, reset_optimizer=True)
    return {n: first[n] - second[n] for n in first}, _decoded(encoded, arrays)


def _attack_steps_zero(k: int):
    """The other sites are told ``steps = 0``: they send the model they were sent, which the server knows, × their
    public n_k; the sum minus those is the target's."""
    sites, state = _federation(k)
    names, target = list(sites), "site1"
    extra = {s: {"steps": 0} for s in names if s != target}
    total = _honest(sites, names, "e-steps", state, extra)
    sent = {n[len("global/") :]: v for n, v in state.items()}
    for s in names[1:]:
        known = _decoded(secagg.encode(prefixed("global", sent), float(sites[s].num_train), BITS, k)[0], state)
        total = {n: total[n] - known[n] for n in total}
    encoded, arrays, _ = _truth(k, target, state)
    return total, _decoded(encoded, arrays)


def _attack_strip(k: int):
    """The target's task without the ``secagg`` field: its plain reply."""
    sites, state = _federation(k)
    reply = _ask(sites, "site1", "train", {}, state)
    encoded, _, n = _truth(k, "site1", state)
    return secagg.encode(reply.arrays, float(n), BITS, k)[0], encoded


# ------------------------------------------------------------------ the tests
@pytest.mark.parametrize("k", [2, 3, 5])
def test_a_site_does_not_mask_with_a_short_list(k):
    """The singleton list: the target masks with itself only, so the shares of its self-mask seed are all that
    hide its input (recovered exactly by a site that masks with any list naming it).  A site masks with at least
    privacy.secagg_min_sites = 3 sites and t of those keyed: it refuses (at K = 2 already the key list)."""
    with pytest.raises(PayloadError, match="at least"):
        _attack_singleton(k)


@pytest.mark.parametrize("k", [3, 5, 10])
def test_a_site_reveals_only_for_a_survivor_set_t_survivors_attested(k):
    """A different survivor list per site (each w: {w, target}): against a site that reveals for whatever lists
    it is sent, the server rebuilds b_target and every other s_v and so the target's input exactly.  A site
    attests one survivor set and reveals only with t matching attestations: at most one of the lists gathers
    t of them (any two sets of t > K/2 survivors overlap), so the server cannot rebuild both secrets of any site
    and recovering fails."""
    with pytest.raises(PayloadError, match="shares"):
        _attack_survivor_lists(k)


def test_a_site_does_not_answer_the_same_round_twice_with_other_sites():
    """Asking round RND's task twice, the second time without the target: the difference of the two sums is the
    target's update.  The others refuse a second masked reply for the same (kind, round, step) with another set
    of sites (their record)."""
    with pytest.raises(PayloadError, match="sent its masked reply for train\\|1\\|None already"):
        _attack_twice(4)


def test_a_summed_reply_is_never_sent_unmasked():
    """A training task without the secagg field gets the site's plain update against a site that follows the task;
    a site whose own config has secure aggregation on refuses it."""
    with pytest.raises(PayloadError, match="comes without secure aggregation"):
        _attack_strip(3)


def test_local_work_comes_from_the_site_not_the_task():
    """steps = 0 to the other sites makes the sum one site's model plus what the server sent; a site refuses a
    summed task that sets its steps."""
    with pytest.raises(PayloadError, match="sets steps = 0"):
        _attack_steps_zero(3)


def test_the_same_task_again_with_the_same_sites_and_input_is_answered():
    """A repeat that reveals nothing new (the same sites, the same input bits: a round resumed from the sites'
    checkpoints) is answered, and its sum is the first one's bitwise.  Restoring a checkpoint does not rewind the
    record: asked once more after a restore, without one site, the others refuse."""
    sites, state = _federation(4, reset_optimizer=True)
    names = list(sites)
    saved = {s: sites[s].state_arrays() for s in names}
    first = _honest(sites, names, "e-a", state)
    for s in names:
        sites[s].load_state_arrays(*saved[s])
    again = _honest(sites, names, "e-b", state)
    assert all(torch.equal(first[n], again[n]) for n in first)
    for s in names:
        sites[s].load_state_arrays(*saved[s])
    with pytest.raises(PayloadError, match="already"):
        _honest(sites, names[1:], "e-c", state)


def test_a_deployed_sites_record_survives_restore_and_restart(tmp_path):
    """A deployed site keeps one record for all its runs in WORKDIR/secagg_record.jsonl (keys name the run id),
    outside its checkpoints: after a restore (the server's ``restore`` operation) and after a restart of the site
    process it still knows what it masked and attested, so neither rewinds its one-reply-per-(kind, round, step)
    rule."""
    import json
    from unittest.mock import ANY

    from fedseg.deployment.server import serve
    from fedseg.deployment.transport import LoopbackChannel
    from fedseg.site.secure import RECORD_NAME
    from tests.deploy.test_deploy import _prepare, _runtimes
    from tests.deploy.test_secagg_deploy import _cfg

    cfg, data = _cfg(rounds=1), tiny_sites(3)
    _prepare(tmp_path / "dep", cfg, list(data))
    runtimes = _runtimes(tmp_path, data)
    setups = {}

    def channel(site, op, payload, timeout):
        if op == "setup":
            setups[site] = payload
        return LoopbackChannel(runtimes)(site, op, payload, timeout)

    serve(tmp_path / "dep", channel, log=lambda m: None)
    key, names = "run-1|train|1|None", list(data)
    runtimes["site1"].call("restore", json.dumps({"round": 0}).encode())
    assert runtimes["site1"].site.secagg_record.get(key)["masked"] == names
    lines = [json.loads(line) for line in (tmp_path / "sites" / "site1" / RECORD_NAME).read_text().splitlines()]
    assert [e for e in lines if e["key"] == key][-1] == {
        "key": key,
        "entry": {"masked": names, "input": ANY, "survived": names},
    }
    restarted = _runtimes(tmp_path, data)["site1"]  # a new process on the same work folder
    restarted.call("setup", setups["site1"])
    assert restarted.site.secagg_record.get(key) == runtimes["site1"].site.secagg_record.get(key)


def test_the_record_is_written_through_and_read_back(tmp_path):
    """A record with a path appends every change at once and a new record on that path reads it back (the last
    change of a key holds); a last line cut short by a crash is ignored (that change never left the site), a
    damaged line before it is one error naming the file and why not to delete it."""
    from fedseg.site.secure import Record

    path = tmp_path / "run" / "secagg_record.jsonl"
    record = Record(path)
    record.put("train|1|None", {"masked": ["a", "b", "c"], "input": "ab", "survived": None})
    record.put("train|1|None", {"masked": ["a", "b", "c"], "input": "ab", "survived": ["a", "b"]})
    record.put("train|2|None", {"masked": ["a", "b", "c"], "input": "cd", "survived": None})
    assert Record(path).entries == record.entries
    assert Record(path).get("train|1|None")["survived"] == ["a", "b"]
    with open(path, "a") as f:
        f.write('{"key": "train|3|None", "ent')
    assert Record(path).entries == record.entries
    path.write_text("{not json\n" + path.read_text())
    with pytest.raises(PayloadError, match="secagg_record.jsonl is unreadable at line 1.*deleting it lets the server"):
        Record(path)


@pytest.mark.parametrize("least", [3, 2])
def test_a_run_with_fewer_sites_than_the_minimum_stops_at_once(least):
    """Two sites under secure aggregation: with the default privacy.secagg_min_sites = 3 every site would refuse
    every exchange, so the run stops before training with the setting named; with 2 it runs."""
    from fedseg.execution.engine import Engine
    from fedseg.foundation.errors import ConfigError
    from fedseg.simulation.inprocess import InProcessTransport

    cfg = tiny_config("fedavg", rounds=1)
    cfg = dataclasses.replace(cfg, privacy=PrivacyConfig(secure_aggregation=True, secagg_min_sites=least))
    workload = segmentation_workload(2, 1, ["fg"], TINY_MODEL)
    algorithm = get_algorithm(cfg)
    data = tiny_sites(2)
    sites = {s: Site(s, i, d, workload, cfg, algorithm) for i, (s, d) in enumerate(data.items())}
    transport = InProcessTransport(list(sites.values()))
    if least == 3:
        with pytest.raises(ConfigError, match="privacy.secagg_min_sites = 3"):
            Engine(cfg, algorithm, transport, workload, progress=False, log=lambda m: None)
    else:
        Engine(cfg, algorithm, transport, workload, progress=False, log=lambda m: None)


def test_a_reveal_tells_the_sites_dp_what_it_masked_with_and_who_survived():
    """After a reveal the site calls ``site.dp.on_reveal(exchange, masked, survived)`` when its DP has that hook
    (its privacy ledger books the sum over the survivors), with the set it masked with and the survivor set."""
    sites, state = _federation(4)
    calls = []

    class Ledger:
        def on_reveal(self, exchange, masked, survived):
            calls.append((exchange, sorted(masked), sorted(survived)))

    sites["site2"].dp = Ledger()
    _honest(sites, list(sites), "e-hook", state)
    assert calls == [("e-hook", sorted(sites), sorted(sites))]


def test_a_round_cut_short_is_answered_again_by_its_survivors_only():
    """A round whose exchange lost site4 after masking (survivors site1–site3 attested and revealed) is resumed
    from the sites' checkpoints with the survivors: they answer again (the same inputs, masked with the set they
    attested), and the sum is the first one bitwise.  Asked once more with site1 left out as well, the others
    refuse: that would be a second sum over another set."""
    sites, state = _federation(4, reset_optimizer=True)
    names = list(sites)
    saved = {s: sites[s].state_arrays() for s in names}
    first = _honest_dropping(sites, names, "e-a", state, drop="site4")
    for s in names:
        sites[s].load_state_arrays(*saved[s])
    again = _honest(sites, names[:3], "e-b", state)
    assert all(torch.equal(first[n], again[n]) for n in first)
    for s in names:
        sites[s].load_state_arrays(*saved[s])
    with pytest.raises(PayloadError, match="already"):
        _honest(sites, [*names[1:3], "site4"], "e-c", state)


def _honest_dropping(sites, names, exchange, state, drop):
    """:func:`_honest` where ``drop``'s masked input is lost on the way: the others' sum."""
    server = ServerParty(exchange, BITS)
    for s in names:
        server.accept_keys(s, _ask(sites, s, "secagg/keys", {"exchange": exchange}).metrics["secagg"])
    req = server.share_request()
    for s in names:
        server.accept_shares(s, _ask(sites, s, "secagg/shares", req).metrics["secagg"])
    for s in server.masking:
        r = _ask(sites, s, "train", {"secagg": {**server.input_config(s), "weighting": "samples"}}, state)
        if s != drop:
            server.accept_input(s, r.arrays, r.metrics["secagg"]["dtypes"], float(r.num_samples))
    c = server.consistency_config()
    for s in c["survived"]:
        server.accept_attestation(s, _ask(sites, s, "secagg/consistency", c).metrics["secagg"])
    cfg = server.reveal_config()
    reveals = {s: _ask(sites, s, "secagg/reveal", cfg).metrics["secagg"] for s in cfg["attestations"]}
    return server.unmask(reveals, log=lambda m: None)[0]
