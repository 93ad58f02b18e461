"""Differential privacy attacked by the server, with only what the server holds: the run config it ships (its
seed included), the site indices it assigns, the task fields it sends and the sites' replies.

Each attack succeeded against fedseg when DP noise was drawn from generators seeded by (run seed, site index,
role, step), batches were seeded permutations, ε was counted in the site's checkpointed state and training
losses were sent; each must fail now (the site's noise and batches come from its OS-keyed CSPRNG, its ε from
an append-only ledger it enforces)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fedseg.algorithms import get_algorithm
from fedseg.foundation.config import PrivacyConfig
from fedseg.foundation.errors import PayloadError
from fedseg.foundation.messages import Task
from fedseg.foundation.seeding import generator
from fedseg.privacy import accountant
from fedseg.privacy.dp import clip_per_sample, per_sample_gradients
from fedseg.site.runtime import Site
from fedseg.site.workload import segmentation_workload
from tests.support.helpers import TINY_MODEL, tiny_config, tiny_sites

pytest.importorskip("opacus")

SIGMA, CLIP = 1.0, 1.0


@pytest.fixture(scope="module")
def wl():
    return segmentation_workload(2, 1, ["fg"], TINY_MODEL)


def _privacy(**kw) -> PrivacyConfig:
    fields = {f.name for f in dataclasses.fields(PrivacyConfig)}
    kw = {k: v for k, v in kw.items() if k in fields}  # (dp_randomness: runs against older fedseg too)
    return PrivacyConfig(**{"dp": "sample", "noise_multiplier": SIGMA, "clip": CLIP, **kw})


def _site(wl, method: str = "fga", index: int = 0, **privacy) -> Site:
    cfg = dataclasses.replace(tiny_config(method, rounds=2), privacy=_privacy(**privacy))
    data = tiny_sites(2)
    name = list(data)[index]
    return Site(name, index, data[name], wl, cfg, get_algorithm(cfg))


def _init(wl) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {f"global/{k}": v for k, v in wl.build_model().state_dict().items()}


def _fga_task(wl, step: int = 0) -> Task:
    return Task("fga_step", _init(wl) if step == 0 else {}, {"round": 1, "step": step})


class _Truth:
    """What only the site knows: the clipped sum Σ_i clip(g_i) of each privatized batch and its mean loss,
    recorded around :func:`fedseg.privacy.dp.privatized_gradient` (the attacks never read it)."""

    def __init__(self, monkeypatch):
        import fedseg.site.dpsgd as site_dp

        self.sums: list[dict[str, torch.Tensor]] = []
        self.losses: list[float] = []
        original = site_dp.privatized_gradient

        def record(model, loss, x, target, clip, *args, **kwargs):
            grads, losses = per_sample_gradients(model, loss, x, target, kwargs.get("params"))
            self.sums.append(clip_per_sample(grads, clip)[0])
            self.losses.append(float(losses.mean()))
            return original(model, loss, x, target, clip, *args, **kwargs)

        monkeypatch.setattr(site_dp, "privatized_gradient", record)


def _grads(reply) -> dict[str, torch.Tensor]:
    return {k[len("grad/") :]: v.double() for k, v in reply.arrays.items() if k.startswith("grad/")}


def _norm(d: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(v.double().pow(2).sum()) for v in d.values()))


def _regenerated_noise(cfg, index: int, names, shapes, how: str) -> torch.Tensor:
    """The server's regeneration of a site's first DP-SGD noise vector from the seed it shipped: the seeded
    generator of (seed, site index, "dp", role, 0) fedseg used to draw it from, or the test mode's key."""
    total = sum(math.prod(shapes[n]) for n in names)
    if how == "generator":
        return torch.randn(total, generator=generator(cfg.seed, index, "dp", "global", 0), dtype=torch.float64) * (
            SIGMA * CLIP
        )
    from fedseg.privacy.randomness import Randomness

    return Randomness("seeded", cfg.seed, index).normal(total, SIGMA * CLIP, "noise", "global", 0)


def _estimates(site: Site, reply) -> list[torch.Tensor]:
    """The server's estimates of the site's clipped gradient sum: reply × B − regenerated noise, for each way
    of regenerating the noise it knows and each batch size it could divide by (the reply's, the config's)."""
    grads = _grads(reply)
    names = list(grads)
    shapes = {n: tuple(g.shape) for n, g in grads.items()}
    flat = torch.cat([grads[n].flatten() for n in names])
    out = []
    for b in sorted({reply.num_samples, site.cfg.train.batch_size}):
        for how in ("generator", "randomness"):
            try:
                out.append(flat * b - _regenerated_noise(site.cfg, site.index, names, shapes, how))
            except ImportError:  # older fedseg: no test mode to regenerate
                continue
    return out


def _relative_errors(site: Site, reply, truth: dict[str, torch.Tensor]) -> list[float]:
    names = list(_grads(reply))
    true = torch.cat([truth[n].double().flatten() for n in names])
    return [float((est - true).norm() / true.norm()) for est in _estimates(site, reply)]


# --------------------------------------------------------------------------- (a) noise regenerated from the seed
def test_regenerating_the_noise_from_the_seed_recovers_nothing(wl, monkeypatch):
    """(a) The server regenerates a site's DP-SGD noise from the run seed and the site index it holds and
    subtracts it from the reply.  Against seed-derived noise this recovered the clipped gradient sum to
    relative error ~1e-6 although the noise was far larger than the signal; with the site's OS-keyed noise the
    best of the server's regenerations is off by more than the signal itself (relative error > 1).  The test
    mode (``dp_randomness = "seeded"``), whose results say ε = ∞ against the server, is still open to it."""
    truth = _Truth(monkeypatch)
    site = _site(wl)
    reply = site.handle(_fga_task(wl))
    errors = _relative_errors(site, reply, truth.sums[0])
    noise_to_signal = math.sqrt(sum(v.numel() for v in truth.sums[0].values())) * SIGMA * CLIP / _norm(truth.sums[0])
    assert noise_to_signal > 10  # the noise dwarfs the signal: only a regenerated noise could recover it
    assert min(errors) > 1.0, errors
    seeded = _site(wl, dp_randomness="seeded")
    truth.sums.clear()
    reply = seeded.handle(_fga_task(wl))
    assert min(_relative_errors(seeded, reply, truth.sums[0])) < 1e-4


# ---------------------------------------------------------------------- (b) the same seed, different noise
def test_two_runs_with_the_same_seed_draw_different_noise_and_batches(wl):
    """(b) Two sites with the same config, seed and index answer the same task with different noise and
    different batches (their replies differ by about the noise: √2 σC/B per coordinate), so a run cannot be
    replayed by the server to predict either; in the test mode they answer bitwise the same."""
    a, b = _site(wl), _site(wl)
    ra, rb = _grads(a.handle(_fga_task(wl))), _grads(b.handle(_fga_task(wl)))
    diff = torch.cat([(ra[n] - rb[n]).flatten() for n in ra])
    expected = math.sqrt(2) * SIGMA * CLIP / a.cfg.train.batch_size
    assert float(diff.std()) == pytest.approx(expected, rel=0.2)
    batches = [[sa.dp.batch(2, "train", "train", j, 100, 50).tolist() for j in range(3)] for sa in (a, b)]
    assert batches[0] != batches[1]
    sa, sb = _site(wl, dp_randomness="seeded"), _site(wl, dp_randomness="seeded")
    ra, rb = _grads(sa.handle(_fga_task(wl))), _grads(sb.handle(_fga_task(wl)))
    assert all(torch.equal(ra[n], rb[n]) for n in ra)


# ------------------------------------------------------------------------------ (c) restore does not rewind ε
def test_restore_neither_rewinds_epsilon_nor_reuses_noise(wl, tmp_path):
    """(c) The server checkpoints a site, asks for a privatized gradient, restores the checkpoint and asks the
    same again.  With ε and the noise keys in the checkpointed state this rewound ε to 0 and returned the
    identical reply (the difference of the replies noise-free).  Now ε after the restore is the ε before it,
    the second answer is booked on top (two releases on the same batch: one mechanism at σ/√2), the replies
    differ by about the noise, and a restarted site reading its ledger file has the same ε."""
    from fedseg.seams.checkpoint import restore_site, save_site

    site = _site(wl)
    if hasattr(site.dp, "ledger"):  # (the attack also runs against a fedseg without one)
        site.dp.ledger.attach(tmp_path / "ledger.jsonl")
    save_site(site, tmp_path / "r0")
    first = _grads(site.handle(_fga_task(wl)))
    spent = site.dp.epsilon()
    assert spent > 0
    restore_site(site, tmp_path / "r0")
    assert site.dp.epsilon() == spent
    second = _grads(site.handle(_fga_task(wl)))
    q = site.dp.sample_rate
    assert site.dp.epsilon() == pytest.approx(accountant.epsilon([(SIGMA / math.sqrt(2), q, 1)], 1e-5), rel=1e-12)
    diff = torch.cat([(first[n] - second[n]).flatten() for n in first])
    assert float(diff.std()) == pytest.approx(math.sqrt(2) * SIGMA * CLIP / site.cfg.train.batch_size, rel=0.2)
    restarted = _site(wl)
    restarted.dp.ledger.attach(tmp_path / "ledger.jsonl")
    assert restarted.dp.epsilon() == site.dp.epsilon()


# ------------------------------------------------------------------------- (d) the site enforces its budget
def test_the_site_refuses_a_step_past_its_budget_whatever_the_server_says(wl):
    """(d) privacy.epsilon fits one privatized step but not two; the server says budget_action = "warn" (train
    on) and asks for a second step: the site refuses it with an error naming privacy.epsilon and books nothing."""
    q = 4 / 6
    one = accountant.epsilon([(SIGMA, q, 1)], 1e-5)
    site = _site(wl, epsilon=one * 1.01, budget_action="warn")
    site.handle(_fga_task(wl))
    spent = site.dp.epsilon()
    with pytest.raises(PayloadError, match="privacy.epsilon"):
        site.handle(_fga_task(wl, step=1))
    assert site.dp.epsilon() == spent <= one * 1.01


# ------------------------------------------------- (e), (f) FedSM booked per batch; ε from the server's view
def test_fedsm_booking_and_reported_epsilon_equal_an_accountant_of_what_the_server_knows(wl):
    """(e) FedSM trains its global and personalized models and (joint phase) its selector on the same batches
    of a round: ε reported per site equals Opacus' RDP accountant stepped once per batch at σ/√m (m = the
    models trained on it: 2, plus 1 for each of the round's selector steps), and exceeds the ε of booking the
    2·S + L model steps as independent subsampled steps.  (f) Everything the accountant here uses is what the
    server knows: σ, δ and B from the config it ships, n_k from the sites' replies, the steps from its protocol."""
    from opacus.accountants import RDPAccountant

    from fedseg.simulation.runner import simulate

    sites = tiny_sites(2)
    cfg = dataclasses.replace(tiny_config("fedsm", rounds=1), privacy=_privacy(budget_action="warn"))
    res = simulate(cfg, wl, sites, progress=False, log=lambda m: None)
    selector_steps = res["history"][0]["selector_steps"]
    for name, data in sites.items():
        n = len(data.train)
        q = cfg.train.batch_size / n
        per_round = math.ceil(n / cfg.train.batch_size)
        acc = RDPAccountant()
        for j in range(max(per_round, selector_steps)):
            m = (2 if j < per_round else 0) + (1 if j < selector_steps else 0)
            acc.step(noise_multiplier=SIGMA / math.sqrt(m), sample_rate=q)
        reported = res["privacy"]["sites"][name]["epsilon"]
        assert reported == pytest.approx(acc.get_epsilon(cfg.privacy.delta), rel=1e-9)
        independent = accountant.epsilon([(SIGMA, q, 2 * per_round + selector_steps)], cfg.privacy.delta)
        assert reported > independent


# -------------------------------------------------------------------------------- (g) no loss in DP replies
def test_no_training_loss_leaves_a_dp_site(wl, monkeypatch):
    """(g) The training loss of a batch is a membership signal no noise covers: under DP no reply carries it
    (FGA's gradient step, FedAvg's round, FedSM's round), and no number in the metrics equals the loss the
    site computed; without DP the loss is sent as before."""
    truth = _Truth(monkeypatch)
    for method, task in (
        ("fga", _fga_task(wl)),
        ("fedavg", Task("train", _init(wl), {"round": 1})),
    ):
        truth.losses.clear()
        reply = _site(wl, method).handle(task)
        assert truth.losses
        assert all(v is None for k, v in reply.metrics.items() if k.endswith("loss")), reply.metrics
        numbers = [v for v in reply.metrics.values() if isinstance(v, float)]
        assert not any(abs(v - loss) < 1e-6 for v in numbers for loss in truth.losses)
    plain = _site(wl, "fedavg", dp="off").handle(Task("train", _init(wl), {"round": 1}))
    assert isinstance(plain.metrics["loss"], float)


def test_fedsm_replies_carry_no_loss(wl):
    from fedseg.simulation.runner import simulate

    cfg = dataclasses.replace(tiny_config("fedsm", rounds=1), privacy=_privacy(budget_action="warn"))
    res = simulate(cfg, wl, tiny_sites(2), progress=False, log=lambda m: None)
    entry = res["history"][0]
    for key in ("train_loss", "personal_loss", "selector_loss"):
        assert all(v is None for v in (entry.get(key) or {}).values()), (key, entry.get(key))


# ------------------------------------------------------------------ client level: K, dropouts, worst case
class _Party:
    """A site's keyed secure-aggregation exchange as :mod:`fedseg.site.secure` keeps it (the participant list
    the site was keyed with in ``secagg/shares``)."""

    def __init__(self, exchange: str, order: list[str]):
        self.exchange, self.order = exchange, order


def _client_site(wl, **privacy) -> Site:
    cfg = dataclasses.replace(
        tiny_config("fedavg-even", rounds=2),
        privacy=PrivacyConfig(dp="client", clip=CLIP, secure_aggregation=True, **privacy),
    )
    data = tiny_sites(1)
    return Site("site1", 0, data["site1"], wl, cfg, get_algorithm(cfg))


def test_client_level_k_comes_from_the_keyed_exchange_and_dropouts_are_charged(wl):
    """Client-level DP: K is the size of the participant list the site was keyed with, not the task's claim
    (a claimed K = 1 000 changes nothing); before masking the update is booked at the worst case of t = ⌊K/2⌋+1
    survivors (noise multiplier σ√(t/K)), when it reveals at σ√(|U|/K) for the |U| survivors; a task without
    secure aggregation is refused (privacy.secure_aggregation); a budget the worst case does not fit refuses
    the update before it is masked."""
    site = _client_site(wl, noise_multiplier=SIGMA)
    start = {k[len("global/") :]: v for k, v in _init(wl).items()}
    site.load("global", start)
    order = [f"site{i}" for i in range(1, 11)]
    site.scratch["secagg"] = _Party("x1", order)
    task = Task("train", {}, {"round": 1, "num_sites": 1000, "secagg": {"exchange": "x1"}})
    out = site.dp.client_update("global", start, task)
    delta = {k: out[k] - start[k] for k in start if start[k].is_floating_point()}
    assert _norm(delta) == pytest.approx(
        math.sqrt(sum(v.numel() for v in delta.values())) * SIGMA / math.sqrt(10), rel=0.2
    )
    t = 6  # threshold_for(10)
    assert site.dp.epsilon() == pytest.approx(accountant.epsilon([(SIGMA * math.sqrt(t / 10), 1.0, 1)], 1e-5))
    site.dp.on_reveal("x1", order, order[:8])  # two dropped after masking
    assert site.dp.epsilon() == pytest.approx(accountant.epsilon([(SIGMA * math.sqrt(8 / 10), 1.0, 1)], 1e-5))
    with pytest.raises(PayloadError, match="privacy.secure_aggregation"):
        site.dp.client_update("global", start, Task("train", {}, {"round": 2}))
    full = accountant.epsilon([(SIGMA, 1.0, 1)], 1e-5)
    tight = _client_site(wl, noise_multiplier=SIGMA, epsilon=full * 1.01)
    tight.load("global", start)
    tight.scratch["secagg"] = _Party("x1", order)
    with pytest.raises(PayloadError, match="privacy.epsilon"):
        tight.dp.client_update("global", start, task)
    assert tight.dp.ledger.entries == []


# ------------------------------------------------------------------------------ a deployed site's ledger
def test_a_deployed_sites_restore_does_not_rewind_its_ledger(wl, tmp_path):
    """Acting as the server over a deployed site's operations (setup, task, checkpoint, restore): ε after a
    ``restore`` of the round-0 checkpoint is the ε before it; the ledger is a JSON-lines file in the site's
    workdir outside the round checkpoints, and a restarted site (a new runtime set up for the same run)
    reads it back."""
    import json

    from fedseg.deployment.site import SiteConfig, SiteRuntime
    from fedseg.deployment.wire import decode_reply, encode_task
    from fedseg.foundation.config import dump_toml

    cfg = dataclasses.replace(tiny_config("fga", rounds=2), privacy=_privacy())
    data = tiny_sites(2)

    def runtime() -> SiteRuntime:
        rt = SiteRuntime(
            SiteConfig("site1", "(in memory)", str(tmp_path / "work")), loader=lambda *a: (data["site1"], wl)
        )
        desc = {"run_id": "r1", "sites": list(data), "data": {}, "config_toml": dump_toml(cfg.to_dict())}
        rt.call("setup", json.dumps(desc).encode())
        return rt

    def epsilon(rt: SiteRuntime) -> float:
        return decode_reply(rt.call("task", encode_task(Task("privacy", {}, {})))).metrics["epsilon"]

    rt = runtime()
    rt.call("checkpoint", b'{"round": 0}')
    rt.call("task", encode_task(_fga_task(wl)))
    spent = epsilon(rt)
    assert spent > 0
    rt.call("restore", b'{"round": 0}')
    assert epsilon(rt) == spent
    ledger = tmp_path / "work" / "privacy-ledger.jsonl"
    lines = [json.loads(line) for line in ledger.read_text().splitlines()]
    assert [e["kind"] for e in lines] == ["sample"] and lines[0]["run"] == "r1"
    assert not list((tmp_path / "work" / "r1").glob("round-*/**/privacy-ledger.jsonl"))
    assert epsilon(runtime()) == spent


def test_a_dropout_after_masking_is_charged_to_the_survivors(wl):
    """Client-level DP under secure aggregation with K = 5 sites, one of whose masked updates is lost after
    masking (the server drops it): the unmasked sum holds the noise of the 4 survivors only, and each survivor
    books σ√(4/5) when it reveals (the site's hook in ``secagg/reveal``); the dropped site keeps the worst case
    it booked before masking, σ√(t/K) with t = 3."""
    from fedseg.algorithms.secure import secure_ask
    from fedseg.simulation.runner import build_engine

    cfg = dataclasses.replace(
        tiny_config("fedavg-even", rounds=1),
        privacy=PrivacyConfig(dp="client", noise_multiplier=SIGMA, clip=CLIP, secure_aggregation=True),
    )
    engine = build_engine(cfg, wl, tiny_sites(5), progress=False, log=lambda m: None)
    ctx = engine.ctx
    ask = ctx.ask

    def lossy(tasks, optional=False):
        replies = ask(tasks, optional)
        if any(t.kind == "train" for t in tasks.values()):
            replies.pop("site5", None)  # lost after it was masked
        return replies

    ctx.ask = lossy
    state = _init(wl)
    result = secure_ask(ctx, {s: Task("train", state, {"round": 1}) for s in ctx.sites}, "even")
    assert sorted(result.replies) == [f"site{i}" for i in range(1, 5)]
    for name in ctx.sites:
        dp = engine.transport.site(name).dp
        survivors = 4 if name != "site5" else 3  # site5: the worst case it booked, t = 3
        assert dp.epsilon() == pytest.approx(accountant.epsilon([(SIGMA * math.sqrt(survivors / 5), 1.0, 1)], 1e-5))


def test_client_level_noise_is_not_regenerated_from_the_seed(wl):
    """(a) at client level: the server regenerates a site's noise share N(0, σ²C²/K) from the seeded generator
    of (seed, site index, "dp-client", role, 0) that fedseg drew it from, with K = the sites it masked with,
    and subtracts it from the site's update; the OS-keyed share leaves an error larger than the update."""
    site = _client_site(wl, noise_multiplier=SIGMA)
    start = {k[len("global/") :]: v for k, v in _init(wl).items()}
    model = site.load("global", start)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3)
    trained = site.arrays("global")
    order = [f"site{i}" for i in range(1, 6)]
    site.scratch["secagg"] = _Party("x1", order)
    out = site.dp.client_update("global", start, Task("train", {}, {"round": 1, "secagg": {"exchange": "x1"}}))
    names = [k for k in out if out[k].is_floating_point()]
    truth = torch.cat([(trained[k] - start[k]).double().flatten() for k in names])
    assert float(truth.norm()) < CLIP  # not clipped: the update itself is what the noise hides
    sent = torch.cat([(out[k] - start[k]).double().flatten() for k in names])
    g = generator(site.cfg.seed, site.index, "dp-client", "global", 0)
    regenerated = torch.randn(sent.numel(), generator=g, dtype=torch.float64) * SIGMA * CLIP / math.sqrt(5)
    assert float((sent - regenerated - truth).norm() / truth.norm()) > 1.0


def test_the_policys_epsilon_ceiling_holds_over_every_run_of_the_site(wl, tmp_path):
    """Acting as the server over a deployed site's operations: one run after another (new run ids), each within
    its own ``privacy.epsilon`` = the policy's ``max_epsilon`` = E, each taking two privatized steps.  Against a
    site whose ceiling held per run id, every run was taken and the ledger's entries composed to ε(6 steps) > E
    after three runs (without bound as runs go on).  Derivation of the bound: the runs release on the same data,
    so their RDP adds up as steps do; E is ε(3 steps) at q = 4/6, σ = 1, so a fourth step passes it.  Now the
    site composes every run in its ledger before each step: the run whose next round would pass E is refused at
    setup, or its step is refused, and the ledger's ε (all runs, by Opacus' RDP accountant) never passes E."""
    import json

    from fedseg.deployment.policy import SitePolicy
    from fedseg.deployment.site import SiteConfig, SiteRuntime
    from fedseg.deployment.wire import decode_reply, encode_task
    from fedseg.foundation.config import dump_toml

    q, delta = 4 / 6, 1e-5
    ceiling = accountant.epsilon([(SIGMA, q, 3)], delta)
    cfg = dataclasses.replace(tiny_config("fga", rounds=1), privacy=_privacy(epsilon=ceiling, delta=delta))
    data = tiny_sites(3)  # the policy's default min_sites: a run of fewer is refused before any ε is spent
    rt = SiteRuntime(
        SiteConfig("site1", "(in memory)", str(tmp_path / "work")),
        loader=lambda *a: (data["site1"], wl),
        policy=SitePolicy(secure_aggregation=False, max_epsilon=ceiling),
    )
    refused = []
    for run in ("r1", "r2", "r3"):
        desc = {"run_id": run, "sites": list(data), "data": {}, "config_toml": dump_toml(cfg.to_dict())}
        setup = json.loads(rt.call("setup", json.dumps(desc).encode()))
        if "refused" in setup:
            refused.append((run, setup["refused"]))
            continue
        for step in (0, 1):
            try:
                rt.call("task", encode_task(_fga_task(wl, step)))
            except PayloadError as e:
                refused.append((run, str(e)))
                break
        report = decode_reply(rt.call("task", encode_task(Task("privacy", {}, {})))).metrics
        assert report.get("epsilon_lifetime", report["epsilon"]) <= ceiling
    lines = [json.loads(line) for line in (tmp_path / "work" / "privacy-ledger.jsonl").read_text().splitlines()]
    steps = sum(1 for e in lines if e["kind"] == "sample")
    assert accountant.epsilon([(SIGMA, q, steps)], delta) <= ceiling
    assert refused and "lifetime" in refused[0][1] and "max_epsilon" in refused[0][1], refused


def test_the_server_stops_before_a_round_past_a_sites_lifetime_ceiling():
    """The engine reads each site's report: a site whose next round would pass its policy's ceiling over all its
    runs (``epsilon_lifetime_next`` > ``epsilon_ceiling``) stops training before that round, whatever
    ``budget_action`` says (the site would refuse the round's steps); a site within it, or without a ceiling,
    does not."""
    import types

    from fedseg.execution.engine import Engine

    logs: list[str] = []
    for action in ("stop", "warn"):
        cfg = dataclasses.replace(tiny_config(), privacy=_privacy(epsilon=100.0, budget_action=action))
        engine = types.SimpleNamespace(cfg=cfg, log=logs.append)
        within = {"epsilon_next": 1.0, "epsilon_lifetime_next": 2.5, "epsilon_ceiling": 3.0}
        past = {"epsilon_next": 1.0, "epsilon_lifetime_next": 3.5, "epsilon_ceiling": 3.0}
        no_ceiling = {"epsilon_next": 1.0, "epsilon_lifetime_next": 30.0, "epsilon_ceiling": None}
        assert not Engine.over_budget(engine, {"site1": within, "site2": no_ceiling}, 2)
        assert Engine.over_budget(engine, {"site1": within, "site2": past}, 2)
    assert "site site2 to ε = 3.5 over all its runs > its policy's max_epsilon = 3" in logs[-1]


def test_a_lockstep_rounds_overshoot_is_forecast_against_the_lifetime_ceiling(wl):
    """The engine stops before a round that would pass a site's lifetime ceiling by the site's
    ``epsilon_lifetime_next``.  A lockstep round (FGA) takes the largest site's step count: here 3 steps a round
    at a site that planned 2 (6 cases, B = 4).  Derivation: after two rounds of 3 steps at q = 4/6, σ = 1 the next
    round takes the ledger to ε(9 steps), the planned round only to ε(8 steps).  Before, the lifetime forecast
    counted the planned round (ε(8 steps)) while the run's own forecast repeated the last round: a server
    trusting it started a round the site then refused a step of.  Now both repeat the last round."""
    site = _site(wl, epsilon=100.0)
    site.dp.lifetime_ceiling = 100.0
    assert site.dp.plan() == (2, 1) and site.dp.sample_rate == pytest.approx(4 / 6)
    for rnd in (1, 2):
        for step in range(3):
            site.handle(_fga_task(wl, step) if rnd == 1 else Task("fga_step", {}, {"round": 2, "step": step}))
        report = site.handle(Task("privacy", {}, {})).metrics
    q, delta = site.dp.sample_rate, site.cfg.privacy.delta
    assert accountant.epsilon([(SIGMA, q, 9)], delta) > accountant.epsilon([(SIGMA, q, 8)], delta)
    assert report["epsilon_next"] == pytest.approx(accountant.epsilon([(SIGMA, q, 9)], delta))
    assert report["epsilon_lifetime_next"] == pytest.approx(accountant.epsilon([(SIGMA, q, 9)], delta))


def test_augmentation_and_selector_flips_under_dp_are_not_the_run_seeds(wl):
    """Acting as the server: it ships the run seed and assigns the site index, so a stream seeded by them alone is
    one it regenerates — under DP, which augmentation (crop, flip) a training case got, and FedSM's selector
    flips.  Against a site that seeded them by (seed, site, round, purpose) the server's regeneration was the
    site's draw; now a DP site keys them by its DP randomness (fresh OS bytes per draw): two sites with the same
    seed and index draw differently, and neither draws the server's.  The seeded test mode stays reproducible,
    and without DP the run seed drives them as before (a simulation's bitwise reproducibility)."""

    def draw(site, *purpose) -> torch.Tensor:
        return torch.rand(16, generator=site.streams.generator(1, *purpose))

    for purpose in (("train", "transform"), ("selector-flip", 0)):
        public = torch.rand(16, generator=generator(0, 0, 1, *purpose))  # what the server regenerates
        a, b = draw(_site(wl, "fedavg"), *purpose), draw(_site(wl, "fedavg"), *purpose)
        assert not torch.equal(a, b) and not torch.equal(a, public) and not torch.equal(b, public)
        seeded = [draw(_site(wl, "fedavg", dp_randomness="seeded"), *purpose) for _ in range(2)]
        assert torch.equal(seeded[0], seeded[1])
        plain = dataclasses.replace(tiny_config("fedavg", rounds=2), privacy=PrivacyConfig())
        data = tiny_sites(2)["site1"]
        site = Site("site1", 0, data, wl, plain, get_algorithm(plain))
        assert torch.equal(draw(site, *purpose), public)
