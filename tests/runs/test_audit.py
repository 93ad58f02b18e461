"""The leakage audit: the attack works where it provably should, the server's observations are what the
sites send, the protections transform them as stated, and ``fedseg audit`` writes its table and page."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from fedseg.apps.audit import (
    PROTECTIONS,
    AttackConfig,
    AuditOptions,
    Part,
    fc_inversion,
    invert,
    known_seed_message,
    match_scores,
    ncc,
    private_messages,
    psnr,
    reidentification,
    run_audit,
    secure_sum,
    sent_by_sites,
    server_isolated,
    total_variation,
    unrolled_update,
    verdict,
)
from fedseg.apps.audit.inversion import gradient_cost
from fedseg.cli import main
from fedseg.foundation.errors import ConfigError
from fedseg.site.workload import segmentation_workload
from tests.support.helpers import TINY_MODEL, tiny_config, tiny_sites

pytest.importorskip("skimage")


def _smooth_image(seed: int, shape=(1, 3, 8, 8)) -> torch.Tensor:
    x = torch.rand(shape, generator=torch.Generator().manual_seed(seed))
    return F.avg_pool2d(F.pad(x, (1, 1, 1, 1), mode="replicate"), 3, 1)


def _fc_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 32), nn.ReLU(), nn.Linear(32, 4))


def _gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    names = [n for n, _ in model.named_parameters()]
    gs = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
    return dict(zip(names, gs))


def test_a_fully_connected_first_layer_gives_the_image_exactly():
    """For y = W x + b: ∂L/∂W = (∂L/∂y) xᵀ and ∂L/∂b = ∂L/∂y, so x = (∂L/∂W)_i / (∂L/∂b)_i for any row i with
    ∂L/∂b_i ≠ 0 (Phong et al. 2017; Geiping et al. 2020, Prop. 1): one sample's gradient is its image."""
    model, x, y = _fc_net(), _smooth_image(0), torch.tensor([2])
    g = _gradient(model, x, y)
    rec = fc_inversion(g["1.weight"], g["1.bias"]).reshape(x.shape)
    assert torch.allclose(rec, x, atol=1e-5)
    assert psnr(rec[0], x[0]) > 80


def test_the_attack_recovers_one_image_through_a_fully_connected_first_layer():
    """Cosine gradient matching reaches the image (far above an unrelated image's PSNR): the first layer's
    gradient is ∝ x, so the cosine is 1 only at the image (up to the rows' common scale, fixed by the rest)."""
    model, x, y = _fc_net(), _smooth_image(0), torch.tensor([2])
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    inv = invert(
        model,
        weights,
        _gradient(model, x, y),
        [Part(tuple(x.shape), y, F.cross_entropy)],
        AttackConfig(iterations=150, restarts=1, tv=1e-3),
        torch.Generator().manual_seed(1),
    )
    got = match_scores(inv.images[0], x)
    unrelated = match_scores(_smooth_image(5), x)
    assert got["psnr_mean"] > 30, got
    assert unrelated["psnr_mean"] < 20
    assert inv.cost < 1e-3


def test_the_attack_is_seeded():
    model, x, y = _fc_net(), _smooth_image(0), torch.tensor([1])
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = (model, weights, _gradient(model, x, y), [Part(tuple(x.shape), y, F.cross_entropy)])
    cfg = AttackConfig(iterations=5, restarts=2)
    a = invert(*args, cfg, torch.Generator().manual_seed(3))
    b = invert(*args, cfg, torch.Generator().manual_seed(3))
    c = invert(*args, cfg, torch.Generator().manual_seed(4))
    assert torch.equal(a.images[0], b.images[0]) and a.costs == b.costs
    assert not torch.equal(a.images[0], c.images[0])


def test_matching_assigns_each_reconstruction_its_own_image():
    truth = torch.cat([_smooth_image(i) for i in range(3)])
    recon = truth[[2, 0]] + 0.01  # two of them, out of order
    s = match_scores(recon, truth)
    assert sorted(map(tuple, s["pairs"])) == [(0, 2), (1, 0)]
    assert min(s["psnr"]) > 35 and s["ssim_mean"] > 0.9


def test_total_variation_of_a_constant_image_is_zero():
    assert float(total_variation(torch.full((1, 1, 4, 4), 0.3))) == 0.0
    assert float(total_variation(torch.eye(4)[None, None])) > 0


def test_secure_sum_is_the_weighted_sum():
    a = {"w": torch.tensor([3.0, 4.0])}
    b = {"w": torch.tensor([1.0, 0.0])}
    assert torch.equal(secure_sum([a, b], [0.5, 0.5])["w"], torch.tensor([2.0, 2.0]))
    with pytest.raises(ValueError, match="one weight per message"):
        secure_sum([a, b], [1.0])


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_config("fga")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=2))
    return cfg, segmentation_workload(2, 1, ["fg"], TINY_MODEL), tiny_sites(n_train=4, size=16)


@pytest.mark.parametrize("message", ["fga", "fedsm-selector"])
def test_the_attackers_model_of_a_gradient_message_is_exact(tiny, message):
    """The recorded batch, target, loss and weights are those the site computed its message from: the
    gradient the attacker's model gives at the true images equals the message (cosine distance 0), so
    the attack's optimum is the true batch."""
    cfg, workload, data = tiny
    sent = sent_by_sites(message, cfg, workload, data)
    assert [s.site for s in sent] == list(data)
    s = sent[0]
    assert s.batch.shape == (2, 1, 16, 16) and s.kind == "gradient"
    model = s.model.train()
    params = {n: s.weights[n].clone().requires_grad_(True) for n, _ in model.named_parameters()}
    value = s.loss(torch.func.functional_call(model, params, (s.batch,)), s.target)
    names = list(s.message)
    grads = torch.autograd.grad(value, [params[n] for n in names])
    for n, g in zip(names, grads):
        assert torch.allclose(g, s.message[n], atol=1e-6), n
    assert float(gradient_cost(list(grads), [s.message[n] for n in names])) < 1e-6


def test_dp_messages_are_the_sites_own_and_seeded(tiny):
    """``privacy.dp`` at the sites: with a bound no gradient or update reaches and negligible noise, DP-SGD's
    gradient is the plain gradient and client-level DP's update the plain update (FedAvg with even weights
    trains the same local steps); a small bound clips the update to it; the noise is the sites' own: the same
    in the seeded test mode, fresh from the OS by default."""
    cfg, workload, data = tiny
    for message in ("fga", "fedavg-1step"):
        plain = sent_by_sites(message, cfg, workload, data)[0].message
        loose = private_messages(message, cfg, workload, data, clip=1e6, sigma=1e-12)[0]
        for n, g in plain.items():
            assert torch.allclose(loose[n], g, atol=1e-5), (message, n)
    tight = private_messages("fedavg-1step", cfg, workload, data, clip=1e-3, sigma=1e-9)[0]
    assert float(sum(v.double().pow(2).sum() for v in tight.values()) ** 0.5) == pytest.approx(1e-3, rel=1e-3)
    seeded = _seeded(cfg)
    noisy = private_messages("fga", seeded, workload, data, clip=1.0, sigma=1.0)
    again = private_messages("fga", seeded, workload, data, clip=1.0, sigma=1.0)
    first = next(iter(noisy[0]))
    assert all(torch.equal(noisy[0][n], again[0][n]) for n in noisy[0])
    assert not torch.equal(noisy[0][first], noisy[1][first])
    fresh = private_messages("fga", cfg, workload, data, clip=1.0, sigma=1.0)
    assert not torch.equal(fresh[0][first], noisy[0][first])


def test_a_fedavg_sgd_step_is_the_fga_gradient_scaled(tiny):
    """FedAvg's first local step draws the same seeded batch as FGA's step 0, so with plain SGD its update
    w_before − w_after is exactly lr × the FGA gradient: "update as gradient" is exact for one SGD step."""
    cfg, workload, data = tiny
    sgd = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, optimizer="sgd", momentum=0.0, lr=0.1))
    grad = sent_by_sites("fga", sgd, workload, data)[0]
    upd = sent_by_sites("fedavg-1step", sgd, workload, data)[0]
    assert torch.equal(grad.batch, upd.batch) and upd.steps == 1
    for name, g in grad.message.items():
        assert torch.allclose(upd.message[name], 0.1 * g, atol=1e-6), name


def test_the_selector_message_is_computed_with_the_sites_own_label(tiny):
    cfg, workload, data = tiny
    sent = sent_by_sites("fedsm-selector", cfg, workload, data)
    assert [int(s.target[0]) for s in sent] == [0, 1, 2]  # Eq. 2: the site's own index
    assert all(s.kind == "gradient" and s.message for s in sent)


def test_run_audit_rows(tiny):
    cfg, workload, data = tiny
    opts = AuditOptions(messages=("fga", "fedavg-local"), attack=AttackConfig(iterations=3, restarts=1))
    doc, rows = run_audit(cfg, workload, data, opts, log=lambda _: None)
    assert [(r["message"], r["protection"]) for r in doc["rows"]] == [
        (m, p) for m in ("fga", "fedavg-local") for p in PROTECTIONS
    ]
    plain, secagg = rows[0], rows[1]
    assert plain.reconstructions.shape[0] == 1 and secagg.reconstructions.shape[0] == 3  # one image per site
    local = rows[len(PROTECTIONS)]
    # unrolled: one dummy batch per local step (an epoch of 4 cases at --images 1)
    assert local.kind == "update" and local.reconstructions.shape[0] == 4 and local.truth.shape[0] == 4
    for r in doc["rows"]:
        assert r["verdict"] in ("leaks", "no leak shown", "not attacked")
        assert r["mean_image_psnr_mean"] is not None and 0 < r["reid_chance"] < 1
    assert doc["budget"]["reference_iterations"] == 24_000 and doc["budget"]["iterations"] == 3
    json.dumps(doc)


def test_cli_audit_end_to_end(tmp_path, capsys):
    spec = tmp_path / "fed"
    assert main(["synth", "--preset", "fundus", "--out", str(spec), "--scale", "0.03", "--size", "16"]) == 0
    out = tmp_path / "audit"
    args = ["audit", str(spec / "federation.toml"), "--method", "all", "--out", str(out)]
    args += ["--iterations", "2", "--restarts", "1", "--set", "model.channels=[4,8]", "--set", "model.strides=[2]"]
    assert main(args) == 0
    doc = json.loads((out / "audit.json").read_text())
    assert {(r["message"], r["protection"]) for r in doc["rows"]} == {
        (m, p) for m in ("fga", "fedsm-selector", "fedavg-1step", "fedavg-local") for p in PROTECTIONS
    }
    page = (out / "audit.html").read_text()
    assert page.count("data:image/png;base64,") == 4 * len(PROTECTIONS)
    printed = capsys.readouterr().out
    assert "| fga | plain |" in printed and "of the reference attack's 24,000" in printed


def test_bad_audit_options_are_one_clear_error(tiny):
    cfg, workload, data = tiny
    with pytest.raises(ConfigError, match="choose from plain, secagg, dp, secagg\\+dp"):
        run_audit(cfg, workload, data, AuditOptions(protections=("tls",)), log=lambda _: None)
    with pytest.raises(ConfigError, match="--sites 3 or fewer"):
        run_audit(cfg, workload, data, AuditOptions(sites=5), log=lambda _: None)
    with pytest.raises(ConfigError, match="selector_training=fga"):
        fedavg_selector = dataclasses.replace(cfg, params={"fedsm": {"selector_training": "fedavg"}})
        sent_by_sites("fedsm-selector", fedavg_selector, workload, data)


# ------------------------------------------------------------------ baselines, re-identification, verdict


def _site_images(n: int = 8, seed: int = 0, size: int = 16) -> torch.Tensor:
    """A site whose images share their structure (a bright disc, as fundus images share the optic disc and
    the field of view) and differ in smooth detail of amplitude ~0.15."""
    yy, xx = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    disc = (((yy - size / 2) ** 2 + (xx - size / 2) ** 2) < (size / 3) ** 2).float()
    template = 0.25 + 0.5 * F.avg_pool2d(disc[None, None], 3, 1, 1)
    g = torch.Generator().manual_seed(seed)
    detail = F.avg_pool2d(torch.rand(n, 1, size, size, generator=g) - 0.5, 5, 1, 2) * 1.5
    return (template + detail).clamp(0, 1)


def test_the_mean_image_beats_unrelated_images_without_any_message_and_is_no_leak():
    """The site's mean image, computed from no message at all, scores above an unrelated image of the same
    site in PSNR for every attacked image — so "PSNR above unrelated images" cannot mean a leak — and the verdict
    does not call it one (it must beat the mean image itself and re-identify the image above chance)."""
    images = _site_images()
    mean = images.mean(dim=0, keepdim=True)
    for k in range(images.shape[0]):
        truth = images[k : k + 1]
        unrelated = images[(k + 1) % images.shape[0]][None]
        got = match_scores(mean, truth)["psnr_mean"]
        assert got > match_scores(unrelated, truth)["psnr_mean"] + 1.0
        pool = torch.cat([truth, images[torch.arange(images.shape[0]) != k]])
        reid = reidentification(mean, pool, [0])
        assert reid["chance"] == pytest.approx(1 / images.shape[0])
        assert verdict(got, got, reid["rate"], reid["chance"]) == "no leak shown"


def test_a_structured_image_with_the_wrong_contrast_is_re_identified_at_a_low_psnr():
    """A reconstruction with the attacked image's structure but another brightness and contrast (0.1 + 0.2 x)
    scores a PSNR as low as noise, yet its nearest neighbour under normalized cross-correlation (invariant to
    x → a + b x, b > 0) is the attacked image: re-identification sees what PSNR misses."""
    images = _site_images()
    x = images[3:4]
    wrong = 0.1 + 0.2 * x
    noise = torch.rand(x.shape, generator=torch.Generator().manual_seed(9))
    assert psnr(wrong[0], x[0]) < 12 and psnr(wrong[0], x[0]) < psnr(images.mean(0), x[0])
    assert abs(psnr(wrong[0], x[0]) - psnr(noise[0], x[0])) < 5
    pool = torch.cat([x, images[torch.arange(8) != 3]])
    reid = reidentification(wrong, pool, [0])
    assert reid["hits"] == [True] and reid["ncc_nearest"][0] == pytest.approx(1.0, abs=1e-9)
    assert reid["rate"] > reid["chance"]
    assert float(ncc(noise, x)[0, 0]) < 0.5
    assert reidentification(noise, pool, [0])["ncc_true_best"][0] < 0.5


def test_the_verdict_needs_both_the_mean_image_beaten_and_re_identification_above_chance():
    assert verdict(25.0, 22.0, 1.0, 0.1) == "leaks"
    assert verdict(21.8, 22.0, 1.0, 0.1) == "no leak shown"  # re-identifies, but no closer than the mean image
    assert verdict(30.0, 22.0, 0.1, 0.1) == "no leak shown"  # at chance: a typical image, not this one
    assert verdict(30.0, 22.0, 0.0, 0.1) == "no leak shown"


def test_the_fc_trap_reconstruction_is_a_leak_by_the_verdict():
    """A fully connected first layer gives the image exactly (``fc_inversion``): the reconstruction beats the
    site's mean image and re-identifies the attacked image among the site's images — a leak."""
    site = torch.cat([_smooth_image(i) for i in range(6)])
    model, x, y = _fc_net(), site[2:3], torch.tensor([1])
    g = _gradient(model, x, y)
    rec = fc_inversion(g["1.weight"], g["1.bias"]).reshape(x.shape).clamp(0, 1)
    mean = site.mean(dim=0, keepdim=True)
    pool = torch.cat([x, site[torch.arange(6) != 2]])
    reid = reidentification(rec, pool, [0])
    got, base = match_scores(rec, x)["psnr_mean"], match_scores(mean, x)["psnr_mean"]
    assert got > base and reid["rate"] == 1.0
    assert verdict(got, base, reid["rate"], reid["chance"]) == "leaks"


def test_reidentification_names_a_bad_index():
    with pytest.raises(ValueError, match="among the pool's 2 images"):
        reidentification(torch.rand(1, 1, 4, 4), torch.rand(2, 1, 4, 4), [2])


# ------------------------------------------------------------------ local steps unrolled


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_the_unrolled_update_is_the_sites_multi_step_update(tiny, optimizer):
    """The attacker's forward model of a FedAvg update: the site's optimizer unrolled over its local steps
    (Adam: m ← β₁m + (1−β₁)g, v ← β₂v + (1−β₂)g², w ← w − lr/(1−β₁ᵗ) · m/(√v/√(1−β₂ᵗ) + ε); SGD with momentum),
    at the true batches, reproduces the update w_0 − w_T the site's own training loop sent — so the attack's
    optimum is the true data.  Treating it as one gradient of the first batch does not."""
    cfg, workload, data = tiny
    train = dataclasses.replace(cfg.train, optimizer=optimizer, lr=0.05 if optimizer == "sgd" else 1e-2)
    s = sent_by_sites("fedavg-local", dataclasses.replace(cfg, train=train), workload, data)[0]
    assert s.steps == 2 and s.optimizer is not None and s.optimizer.kind == optimizer
    steps = [Part(tuple(x.shape), y, s.loss) for x, y in s.batches]
    upd = unrolled_update(s.model.train(), s.weights, [x for x, _ in s.batches], steps, s.optimizer)
    names = list(s.message)
    for n in names:
        scale = float(s.message[n].abs().max())
        assert torch.allclose(upd[n], s.message[n], rtol=1e-4, atol=1e-5 * scale + 1e-9), n
    assert float(gradient_cost([upd[n].detach() for n in names], [s.message[n] for n in names])) < 1e-6
    # differentiable with respect to the batches (what the attack needs)
    xs = [x.clone().requires_grad_(True) for x, _ in s.batches]
    out = unrolled_update(s.model, s.weights, xs, steps, s.optimizer)
    (gx,) = torch.autograd.grad(sum(v.sum() for v in out.values()), xs[:1])
    assert torch.isfinite(gx).all() and float(gx.abs().sum()) > 0
    # one gradient of the first batch is a worse model of the same update
    params = {n: s.weights[n].clone().requires_grad_(True) for n in names}
    value = s.loss(torch.func.functional_call(s.model, params, (s.batches[0][0],)), s.batches[0][1])
    one = torch.autograd.grad(value, [params[n] for n in names])
    assert float(gradient_cost(list(one), [s.message[n] for n in names])) > 1e-3


# ------------------------------------------------------------------ a known seed, an active server


def _seeded(cfg):
    """DP noise from the run seed (the test mode where the privacy settings have one)."""
    if hasattr(cfg.privacy, "dp_randomness"):
        return dataclasses.replace(cfg, privacy=dataclasses.replace(cfg.privacy, dp_randomness="seeded"))
    return cfg


@pytest.mark.parametrize("message", ["fga", "fedavg-1step"])
def test_dp_noise_regenerated_from_the_seed_is_subtracted_and_reported(tiny, message):
    """With noise drawn from (run seed, site, "dp", role, step), an attacker who knows the seed subtracts it:
    the DP message less the regenerated noise is the clipped message, although the noise is far larger."""
    cfg, workload, data = tiny
    cfg = _seeded(cfg)
    sent = sent_by_sites(message, cfg, workload, data)[0]
    known = known_seed_message(
        message,
        cfg,
        workload,
        data,
        1.0,
        1.0,
        sent,
    )
    assert known.noise > 10 * known.signal
    assert known.matched and known.residual < 1e-4 * known.signal, known.note()
    assert "matched" in known.note() and "NOT" not in known.note()


def test_noise_the_seed_does_not_give_is_reported_as_not_matched(tiny):
    """Sites whose DP noise does not come from the run seed (the default: every draw keyed by fresh OS
    bytes) leave the regenerated noise useless, and the row says so: the residual is the size of the noise,
    not of the signal."""
    cfg, workload, data = tiny
    sent = sent_by_sites("fga", cfg, workload, data)[0]
    known = known_seed_message("fga", cfg, workload, data, 1.0, 1.0, sent)
    assert not known.matched and known.residual > known.signal
    assert "did NOT match" in known.note()


@pytest.mark.parametrize("message", ["fga", "fedavg-1step"])
def test_the_malicious_server_row_reports_what_the_sites_let_it_recover(tiny, message):
    """An active server runs secure aggregation with the sites' own code but chooses whom it asks (the same
    step twice, one site fewer) or what steps it sends (0 to the others).  The row reports either the
    attacked site's message, recovered exactly, or the sites' refusal."""
    cfg, workload, data = tiny
    sent = sent_by_sites(message, cfg, workload, data)[0]
    got = server_isolated(message, cfg, workload, data, sent)
    if got.message is None:
        assert "refused" in got.how or "left the site out" in got.how
    else:
        assert got.error is not None and got.error < 1e-5 and "message recovered" in got.how, got.how
        for n, v in sent.message.items():
            assert torch.allclose(got.message[n], v, atol=1e-5), n


def test_a_site_that_refuses_stops_the_malicious_server(tiny, monkeypatch):
    from fedseg.foundation.errors import PayloadError
    from fedseg.site.runtime import Site

    cfg, workload, data = tiny
    sent = sent_by_sites("fga", cfg, workload, data)[0]
    handle = Site.handle

    def refusing(self, task):
        if "secagg" in task.config and self.name == "site1":
            raise PayloadError("site1: refuses to mask for this participant list")
        return handle(self, task)

    monkeypatch.setattr(Site, "handle", refusing)
    got = server_isolated("fga", cfg, workload, data, sent)
    assert got.message is None and "refuses to mask" in got.how
    assert "needs 3 or more sites" in server_isolated("fga", cfg, workload, dict(list(data.items())[:2]), sent).how


def test_the_default_attack_budget_follows_the_device():
    """Without ``--iterations`` the attack runs 4,000 iterations on a GPU (closer to the reference attack's
    24,000) and 200 on the CPU."""
    from fedseg.apps.audit.command import default_iterations

    assert default_iterations(torch.device("cuda", 0)) == 4_000
    assert default_iterations(torch.device("cpu")) == 200


def test_the_re_identification_pool_leaves_out_flipped_copies_of_the_attacked_images():
    """The selector sees its batch flipped: the site's unflipped copy of an attacked image is the same image,
    not a rival for its reconstruction; other images stay."""
    from fedseg.apps.audit.run import _pool
    from fedseg.site.batches import SiteData

    images = _site_images(5)
    seen = images[1:2].flip(3)
    site = SiteData(TensorDataset(images, images), TensorDataset(images[:0], images[:0]), None)
    pool = _pool(seen, [site])
    assert pool.shape[0] == 5 and torch.equal(pool[0], seen[0])
    assert not any(torch.equal(p, images[1]) for p in pool)


def test_a_row_with_nothing_to_attack_says_so(tiny):
    """With two sites the active server cannot ask one site fewer (secure aggregation needs two): the row is
    "not attacked", scored as the mean image, with the reason in its notes."""
    cfg, workload, data = tiny
    opts = AuditOptions(
        messages=("fga",), protections=("malicious-server",), sites=2, attack=AttackConfig(iterations=1, restarts=1)
    )
    doc, rows = run_audit(cfg, workload, data, opts, log=lambda _: None)
    assert rows[0].verdict == "not attacked" and "needs 3 or more sites" in rows[0].notes[0]
    assert doc["rows"][0]["psnr_mean"] == pytest.approx(doc["rows"][0]["mean_image_psnr_mean"])
