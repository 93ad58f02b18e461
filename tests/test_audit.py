"""The leakage audit: the attack works where it provably should, the server's observations are what the
sites send, the protections transform them as stated, and ``fedseg audit`` writes its table and page."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import TINY_MODEL, tiny_config, tiny_sites
from fedseg.apps.audit import (
    AttackConfig,
    AuditOptions,
    Part,
    fc_inversion,
    invert,
    match_scores,
    private_messages,
    psnr,
    run_audit,
    secure_sum,
    sent_by_sites,
    total_variation,
)
from fedseg.apps.audit.inversion import gradient_cost
from fedseg.cli import main
from fedseg.foundation.errors import ConfigError
from fedseg.site.workload import segmentation_workload

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
    trains the same local steps); a small bound clips the update to it; the noise is the sites' seeded one."""
    cfg, workload, data = tiny
    for message in ("fga", "fedavg-1step"):
        plain = sent_by_sites(message, cfg, workload, data)[0].message
        loose = private_messages(message, cfg, workload, data, clip=1e6, sigma=1e-12)[0]
        for n, g in plain.items():
            assert torch.allclose(loose[n], g, atol=1e-5), (message, n)
    tight = private_messages("fedavg-1step", cfg, workload, data, clip=1e-3, sigma=1e-9)[0]
    assert float(sum(v.double().pow(2).sum() for v in tight.values()) ** 0.5) == pytest.approx(1e-3, rel=1e-3)
    noisy = private_messages("fga", cfg, workload, data, clip=1.0, sigma=1.0)
    again = private_messages("fga", cfg, workload, data, clip=1.0, sigma=1.0)
    assert all(torch.equal(noisy[0][n], again[0][n]) for n in noisy[0])
    assert not torch.equal(noisy[0][next(iter(noisy[0]))], noisy[1][next(iter(noisy[1]))])


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
        (m, p) for m in ("fga", "fedavg-local") for p in ("plain", "secagg", "dp", "secagg+dp")
    ]
    plain, secagg = rows[0], rows[1]
    assert plain.reconstructions.shape[0] == 1 and secagg.reconstructions.shape[0] == 3  # one image per site
    local = rows[4]
    assert local.kind == "update" and local.truth.shape[0] >= 1
    json.dumps(doc)


@pytest.mark.slow
def test_cli_audit_end_to_end(tmp_path, capsys):
    spec = tmp_path / "fed"
    assert main(["synth", "--preset", "fundus", "--out", str(spec), "--scale", "0.03", "--size", "16"]) == 0
    out = tmp_path / "audit"
    args = ["audit", str(spec / "federation.toml"), "--method", "all", "--out", str(out)]
    args += ["--iterations", "2", "--restarts", "1", "--set", "model.channels=[4,8]", "--set", "model.strides=[2]"]
    assert main(args) == 0
    doc = json.loads((out / "audit.json").read_text())
    assert {(r["message"], r["protection"]) for r in doc["rows"]} == {
        (m, p)
        for m in ("fga", "fedsm-selector", "fedavg-1step", "fedavg-local")
        for p in ("plain", "secagg", "dp", "secagg+dp")
    }
    page = (out / "audit.html").read_text()
    assert page.count("data:image/png;base64,") == 16
    assert "| fga | plain |" in capsys.readouterr().out


def test_bad_audit_options_are_one_clear_error(tiny):
    cfg, workload, data = tiny
    with pytest.raises(ConfigError, match="choose from plain, secagg, dp, secagg\\+dp"):
        run_audit(cfg, workload, data, AuditOptions(protections=("tls",)), log=lambda _: None)
    with pytest.raises(ConfigError, match="--sites 3 or fewer"):
        run_audit(cfg, workload, data, AuditOptions(sites=5), log=lambda _: None)
    with pytest.raises(ConfigError, match="selector_training=fga"):
        fedavg_selector = dataclasses.replace(cfg, params={"fedsm": {"selector_training": "fedavg"}})
        sent_by_sites("fedsm-selector", fedavg_selector, workload, data)
