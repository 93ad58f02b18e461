"""Secure aggregation against an active server that varies what it ASKS: one model to the target and another to
the others in one exchange, or the same ask again in a second run without the target.

Each test acts as the server with only what it holds (the tasks it sends, the replies and the protocol messages,
through ``site.handle(Task)`` or a deployed site's byte operations) and tries to recover one site's update.
Against the sites of the release before this check (no task digest in the attestation; a secure-aggregation
record per run id; no site salt) each attack recovers the target's update exactly (``_attack_*`` returns the
recovered and the true arrays); now the sites refuse, or the recovery is wrong.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from fedseg.deployment.policy import SitePolicy
from fedseg.deployment.site import SALT_NAME, SiteConfig, SiteRuntime
from fedseg.deployment.wire import decode_reply, encode_task
from fedseg.foundation.config import PrivacyConfig, dump_toml
from fedseg.foundation.errors import PayloadError
from fedseg.foundation.messages import Task
from fedseg.privacy.protocol import ServerParty, task_digest
from tests.deploy.test_deploy import HEADER, _workload
from tests.deploy.test_secagg_active import BITS, RND, _ask, _federation, _truth
from tests.support.helpers import tiny_config, tiny_sites

pytest.importorskip("cryptography")
pytest.importorskip("Crypto")


def _exchange(ask, names, exchange, arrays_for, config=None):
    """One exchange driven by the server's own code (:class:`ServerParty`), every protocol check honest, but the
    task of site ``s`` carries ``arrays_for(s)``; ``ask(site, kind, config, arrays)`` answers one task.  Returns
    the decoded weighted sum and each summed site's public weight."""
    server = ServerParty(exchange, BITS)
    for s in names:
        server.accept_keys(s, ask(s, "secagg/keys", {"exchange": exchange}, {}).metrics["secagg"])
    req = server.share_request()
    for s in names:
        server.accept_shares(s, ask(s, "secagg/shares", req, {}).metrics["secagg"])
    weights = {}
    for s in server.masking:
        secure = {**server.input_config(s), "weighting": "samples"}
        r = ask(s, "train", {**(config or {}), "secagg": secure}, arrays_for(s))
        server.accept_input(s, r.arrays, r.metrics["secagg"]["dtypes"], float(r.num_samples))
        weights[s] = float(r.num_samples)
    c = server.consistency_config()
    for s in c["survived"]:
        server.accept_attestation(s, ask(s, "secagg/consistency", c, {}).metrics["secagg"])
    cfg = server.reveal_config()
    reveals = {s: ask(s, "secagg/reveal", cfg, {}).metrics["secagg"] for s in cfg["attestations"]}
    return server.unmask(reveals, log=lambda m: None)[0], weights


# ------------------------------------------------------------------ one model per exchange
def _attack_two_models(k: int = 3):
    """Real weights to the target, all-zero weights to the others, in one exchange (keys, shares, lists and
    attestations all honest).  From all-zero weights a ReLU network's activations are zero, so the others'
    updates are (but for a few biases) the zeros the server sent: the sum over n_target is the target's update."""
    sites, state = _federation(k)
    target = "site1"
    zeros = {n: torch.zeros_like(v) for n, v in state.items()}

    def ask(s, kind, config, arrays):
        return _ask(sites, s, kind, config, arrays)

    total, _ = _exchange(ask, list(sites), "e-two", lambda s: state if s == target else zeros)
    _, truth, n = _truth(k, target, state)
    return {name: v / n for name, v in total.items()}, truth


def test_a_site_reveals_only_when_every_survivor_answered_the_same_task():
    """Attack 4.  Derivation: y_target = n_t·x_t + masks, y_v = n_v·x_v + masks with x_v ≈ 0 (from zero weights);
    once the masks are removed the sum is n_t·x_t + Σ n_v·x_v ≈ n_t·x_t.  Against the earlier sites this recovers
    nearly every value of the target's update exactly (3,088 of 3,089 at K = 3).  Now each site attests the digest
    of the task it answered (its arrays and config) with the survivor set, and reveals only when every survivor
    attested its own digest: the target's differs from the others', so no site reveals and the sum stays masked."""
    with pytest.raises(PayloadError, match="refuses to reveal shares of exchange e-two: 1 survivors attested"):
        _attack_two_models(3)


def test_the_task_digest_covers_arrays_and_config_but_not_the_exchange_fields():
    """The digest changes with any array's bytes, name, dtype or shape and with any config value but the
    ``secagg`` fields (which differ per site by design); a site's own name in an array path reads ``<self>``
    (FedSM's first round sends each site ``personal/<site>/…``), so the same model gives the same digest."""
    a = {"global/w": torch.ones(2, 3), "global/n": torch.tensor(1)}
    base = task_digest(a, {"round": 1, "secagg": {"order": ["s1", "s2"]}})
    assert base == task_digest(dict(reversed(list(a.items()))), {"round": 1, "secagg": {"order": ["s2"]}})
    for other, config in (
        ({**a, "global/w": torch.ones(2, 3) * 1.0000001}, {"round": 1}),
        ({**a, "global/w": torch.ones(3, 2)}, {"round": 1}),
        ({**a, "global/w": torch.ones(2, 3, dtype=torch.float64)}, {"round": 1}),
        ({"global/v": a["global/w"], "global/n": a["global/n"]}, {"round": 1}),
        (a, {"round": 2}),
        (a, {"round": 1, "mu": 0.0}),
    ):
        assert task_digest(other, config) != base
    mine = {"personal/site1/w": torch.ones(2)}
    theirs = {"personal/site2/w": torch.ones(2)}
    assert task_digest(mine, {}, "site1") == task_digest(theirs, {}, "site2") != task_digest(mine, {}, "site2")


# ------------------------------------------------------------------ no exact replay across runs
NAMES = ["site1", "site2", "site3", "site4"]
TARGET = "site1"


def _runtimes(tmp, policy):
    data = tiny_sites(len(NAMES))

    def loader(name, datalist, header, cfg):
        return data[name], _workload(cfg)

    return {
        n: SiteRuntime(SiteConfig(n, "(in memory)", str(tmp / "sites" / n)), loader=loader, policy=policy)
        for n in NAMES
    }


def _setup(runtimes, run_id, cfg):
    desc = {"run_id": run_id, "sites": NAMES, "data": HEADER, "config_toml": dump_toml(cfg.to_dict())}
    for rt in runtimes.values():
        out = json.loads(rt.call("setup", json.dumps(desc).encode()))
        assert "refused" not in out, out


def _wire_ask(runtimes):
    def ask(s, kind, config, arrays):
        return decode_reply(runtimes[s].call("task", encode_task(Task(kind, arrays, {"round": RND, **config}))))

    return ask


def _attack_second_run(tmp, policy, lr_b=None):
    """Run A: round 1 of a FedAvg run over the four sites, with weights w and seed the server chose.  Run B (another
    run id): the same round, the same w and seed, the same site order, without the target in the exchange.  Without
    DP a site's update is a function of w, the seed and its index: (sum A − sum B) / n_target is the target's."""
    cfg = tiny_config("fedavg", rounds=3)
    cfg = dataclasses.replace(cfg, privacy=PrivacyConfig(secure_aggregation=True))
    runtimes = _runtimes(tmp, policy)
    torch.manual_seed(0)
    state = {f"global/{k}": v.detach().clone() for k, v in _workload(cfg).build_model().state_dict().items()}
    _setup(runtimes, "run-a", cfg)
    first, weights = _exchange(_wire_ask(runtimes), NAMES, "e-a", lambda s: state)
    _setup(
        runtimes,
        "run-b",
        cfg if lr_b is None else dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lr=lr_b)),
    )
    second, _ = _exchange(_wire_ask(runtimes), [s for s in NAMES if s != TARGET], "e-b", lambda s: state)
    n = weights[TARGET]
    recovered = {k: (first[k] - second[k]) / n for k in first}
    _, truth, _ = _truth(len(NAMES), TARGET, state)
    return recovered, truth, state


def _relative_error(recovered, truth, sent) -> float:
    """‖recovered − truth‖ / ‖truth − sent‖ over the floating arrays: the error relative to the target's update."""
    floats = [k for k in truth if truth[k].is_floating_point()]
    diff = sum(float((recovered[k] - truth[k].double()).pow(2).sum()) for k in floats)
    update = sum(float((truth[k].double() - sent[k].double()).pow(2).sum()) for k in floats)
    return (diff / update) ** 0.5


def test_a_site_does_not_mask_the_same_input_again_with_other_sites_in_another_run(tmp_path):
    """Attack 5 against sites whose policy lets the run seed drive their randomness (``reproducible = true``, the
    rehearsals' setting): the earlier sites kept their record per run id, so run B's site2–site4 masked the
    same bits again with other sites and (sum A − sum B)/n recovered the target exactly.  Now a deployed site
    keeps one record for all its runs, indexed by the hash of each input it masked: the same bits go out again
    only with the same sites (or the survivors it attested)."""
    with pytest.raises(PayloadError, match="masked the same input bits before"):
        _attack_second_run(tmp_path, SitePolicy(reproducible=True))


def test_a_salted_site_gives_another_update_in_another_run(tmp_path):
    """Attack 5 against sites with the default policy: each site mixes its own salt (made once from the OS, kept
    in its work folder, hashed with the run id) into its batch order and augmentation, so run B's updates are not
    run A's and (sum A − sum B)/n is the target's update plus the others' run-to-run differences: the relative
    error of the recovery is of the order of the update itself, not the fixed-point floor (~1e-9)."""
    recovered, truth, sent = _attack_second_run(tmp_path, SitePolicy())
    assert _relative_error(recovered, truth, sent) > 0.5
    salts = {(tmp_path / "sites" / n / SALT_NAME).read_text() for n in NAMES}
    assert len(salts) == len(NAMES) and all(len(s.strip()) == 64 for s in salts)


def test_a_reproducible_site_answers_one_ask_once_over_all_its_runs(tmp_path):
    """Attack 5 with a run config a hair away from run A's (learning rate × 1.001): the inputs are not the same bits
    any more, but without a salt each site's update is a near copy of run A's, and (sum A − sum B)/n is close to
    the target's update.  A deployed site without a salt answers one ask (arrays, kind, round, step) with one
    input and one set of sites over all its runs."""
    cfg = tiny_config("fedavg")
    with pytest.raises(PayloadError, match=r"was asked train\|1\|None with the same arrays before"):
        _attack_second_run(tmp_path, SitePolicy(reproducible=True), lr_b=cfg.train.lr * 1.001)
