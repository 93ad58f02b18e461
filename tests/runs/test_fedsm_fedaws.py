"""FedAwS for FedSM's selector (``fedsm.selector_training = "fedaws"``; :mod:`fedseg.algorithms.fedsm.fedaws`).

Hand derivations (the module docstring): with unit class embeddings ŵ_c and d_cc' = ‖ŵ_c − ŵ_c'‖²,

    reg_sp(W) = Σ_c Σ_{c'≠c} max(0, ν − d_cc')²,
    ∂reg/∂ŵ_c = −8 Σ_{c'≠c} max(0, ν − d_cc') (ŵ_c − ŵ_c'),   ∂reg/∂w_c = (I − ŵ_c ŵ_cᵀ)/‖w_c‖ · ∂reg/∂ŵ_c.

Three classes in 2-D, w_1 = (1, 0), w_2 = (0, 1), w_3 = (−1, 0), ν = 3: d_12 = d_23 = 2 (active, ν − d = 1),
d_13 = 4 (inactive).  reg = 2 (1² + 1²) = 4.
∂reg/∂ŵ_1 = −8 (ŵ_1 − ŵ_2) = (−8, 8), projected off ŵ_1 = (1, 0): (0, 8).
∂reg/∂ŵ_2 = −8 ((ŵ_2 − ŵ_1) + (ŵ_2 − ŵ_3)) = (0, −16), projected off ŵ_2 = (0, 1): (0, 0) — pushed equally
from both sides.  ∂reg/∂ŵ_3 = −8 (ŵ_3 − ŵ_2) = (8, 8), projected off (−1, 0): (0, 8).
Doubling w_1's norm halves its gradient: (0, 4).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from safetensors.torch import load_file

from fedseg.algorithms.fedsm import FedSMParams
from fedseg.algorithms.fedsm.fedaws import (
    class_head,
    equal_rows,
    positive_loss,
    selector_positive_loss,
    server_step,
    spreadout,
    spreadout_step,
)
from fedseg.foundation.errors import ConfigError
from fedseg.models import Selector
from fedseg.simulation.runner import simulate
from tests.support.helpers import tiny_config, tiny_sites

W3 = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]], dtype=torch.float64)


def test_spreadout_value_and_gradient_follow_the_hand_derivation():
    w = W3.clone().requires_grad_(True)
    reg = spreadout(w, nu=3.0)
    reg.backward()
    assert float(reg.detach()) == pytest.approx(4.0)
    torch.testing.assert_close(w.grad, torch.tensor([[0.0, 8.0], [0.0, 0.0], [0.0, 8.0]], dtype=torch.float64))
    # through the normalization: twice the norm, half the gradient (same direction, same value)
    w2 = (W3 * torch.tensor([[2.0], [1.0], [1.0]], dtype=torch.float64)).requires_grad_(True)
    reg2 = spreadout(w2, nu=3.0)
    reg2.backward()
    assert float(reg2.detach()) == pytest.approx(4.0)
    torch.testing.assert_close(w2.grad[0], torch.tensor([0.0, 4.0], dtype=torch.float64))


def test_spreadout_step_moves_only_pairs_closer_than_nu():
    # every pair at least 2 apart (d = 2, 4, 2): ν = 1.5 leaves W exactly as it is
    assert torch.equal(spreadout_step(W3, nu=1.5, lr=0.1), W3)
    # w_1, w_2 30° apart (d = 2 − 2 cos 30° ≈ 0.27 < ν = 1), w_3 opposite w_1 (d = 4) and far from w_2 (≈ 3.73)
    a = math.radians(30)
    w = torch.tensor([[1.0, 0.0], [math.cos(a), math.sin(a)], [-1.0, 0.0]], dtype=torch.float64)
    new = spreadout_step(w, nu=1.0, lr=0.01)
    assert torch.equal(new[2], w[2])  # its pairs are farther apart than ν
    assert not torch.equal(new[0], w[0]) and not torch.equal(new[1], w[1])
    u, v = torch.nn.functional.normalize(new[:2], dim=1)
    assert float(((u - v) ** 2).sum()) > 2 - 2 * math.cos(a)  # pushed apart
    assert float(spreadout(new, 1.0)) < float(spreadout(w, 1.0))


def test_positive_loss_has_no_gradient_into_other_classes_embeddings():
    g = torch.Generator().manual_seed(0)
    h = torch.rand(5, 8, generator=g, dtype=torch.float64)
    w = torch.randn(4, 8, generator=g, dtype=torch.float64).requires_grad_(True)
    positive_loss(h, w, own=2, margin=0.9).backward()
    assert w.grad[[0, 1, 3]].abs().max() == 0
    assert w.grad[2].abs().max() > 0
    # value: an image whose embedding points along its class embedding costs nothing, an orthogonal one m²
    e = torch.eye(3, dtype=torch.float64)
    assert float(positive_loss(e[:1], e, own=0, margin=0.9)) == 0.0
    assert float(positive_loss(e[1:2], e, own=0, margin=0.9)) == pytest.approx(0.81)
    # on the selector: the last layer's rows are the embeddings; its bias and other rows get no gradient
    torch.manual_seed(0)
    sel = Selector(2, 1, 3, width=0.0625, hidden=8).double()
    assert class_head(sel, 3) == "classifier.2"
    selector_positive_loss(sel, torch.rand(4, 1, 16, 16, dtype=torch.float64), own=1, margin=0.9).backward()
    head = sel.classifier[2]
    assert head.weight.grad[[0, 2]].abs().max() == 0 and head.weight.grad[1].abs().max() > 0
    assert head.bias.grad is None
    assert sel.features[0].weight.grad.abs().max() > 0  # the image embedding g_θ is trained


def test_server_step_takes_each_class_embedding_from_its_site_then_spreads_and_equalizes():
    head = "classifier.2"
    key, bias, mom = f"selector/{head}.weight", f"selector/{head}.bias", f"selector_optim/{head}.weight/exp_avg"
    avg = {key: torch.zeros(3, 2, dtype=torch.float64), bias: torch.ones(3), mom: torch.zeros(3, 2)}
    own = {}
    for c in range(3):  # site c trained row c (norm c + 1); its moments are 10 + c
        rows = torch.zeros(3, 2, dtype=torch.float64)
        rows[c] = W3[c] * (c + 1)
        own[c] = {key: rows, mom: torch.full((3, 2), 10.0 + c)}
    out = server_step(avg, own, head, nu=1.5, lr=0.1)  # rows 2 or more apart: no spread-out move
    expected = W3 * 2.0  # the rows' directions, at their mean norm (1 + 2 + 3) / 3
    torch.testing.assert_close(out[key], expected)
    assert torch.equal(out[bias], torch.zeros(3))
    torch.testing.assert_close(out[mom], torch.tensor([[10.0, 10.0], [11.0, 11.0], [12.0, 12.0]]))
    # routing by the logits is routing by the cosine: equal row norms
    assert torch.allclose(equal_rows(torch.randn(4, 3)).norm(dim=1).std(), torch.tensor(0.0), atol=1e-6)


def test_fedaws_params_are_checked():
    with pytest.raises(ConfigError, match=r"fedsm.fedaws_nu = 5.0 must be in \(0, 4\]"):
        FedSMParams(selector_training="fedaws", fedaws_nu=5.0).validate()
    with pytest.raises(ConfigError, match=r"fedsm.fedaws_lr = 0.0 must be > 0"):
        FedSMParams(fedaws_lr=0.0).validate()
    with pytest.raises(ConfigError, match=r"fedsm.fedaws_margin = 1.5 must be in \(0, 1\]"):
        FedSMParams(fedaws_margin=1.5).validate()
    assert FedSMParams(selector_training="fedaws").resolved().selector_steps == "all"


def test_fedaws_selector_runs_end_to_end_with_the_traffic_of_fedavg(tmp_path, workload):
    data = tiny_sites(2, n_train=8)
    sel = {"selector_width": 0.0625, "selector_hidden": 8, "selector_lr": 0.01, "selector_steps": "all"}
    runs, servers = {}, {}
    for training in ("fedavg", "fedaws"):
        cfg = tiny_config("fedsm", rounds=2, dtype="float64")
        cfg = dataclasses.replace(cfg, params={"fedsm": {**sel, "selector_training": training}})
        runs[training] = simulate(cfg, workload, data, out=tmp_path / training, progress=False)
        servers[training] = load_file(str(tmp_path / training / "checkpoints/server.safetensors"))
    aws = servers["fedaws"]
    w, b = aws["selector/classifier.2.weight"], aws["selector/classifier.2.bias"]
    torch.testing.assert_close(w.norm(dim=1), w.norm(dim=1).mean().expand(2))  # equal rows
    assert torch.equal(b, torch.zeros_like(b))
    assert not torch.equal(w, servers["fedavg"]["selector/classifier.2.weight"])
    assert all(0.0 <= v <= 1.0 for v in runs["fedaws"]["history"][-1]["routing_acc"].values())
    # the arrays of the averaged selector travel (selector + its Adam moments), less the moments of the
    # head's bias, which the positive-only loss does not train: exp_avg, exp_avg_sq (2 float64) + step (float32)
    bias_moments = 2 * b.numel() * 8 + 4
    for r in range(2):
        avg_b, aws_b = runs["fedavg"]["history"][r]["bytes"], runs["fedaws"]["history"][r]["bytes"]
        for s in data:  # round 1 the server sends no moments yet, the replies carry them
            diff = (avg_b[s]["sent"] - aws_b[s]["sent"], avg_b[s]["received"] - aws_b[s]["received"])
            assert diff == ((0, bias_moments) if r == 0 else (bias_moments, bias_moments)), (r, s)


def test_fedaws_leaves_the_k_plus_1_class_selector_of_fedsm_extra_to_fedavg(tmp_path, workload):
    """FedSM-extra's selector phase has Eq. 1 labels, not one class per site: under ``fedaws`` it trains
    exactly as under ``fedavg`` (same local cross-entropy, same average, no spread-out step)."""
    data = tiny_sites(2, n_train=8)
    sel = {"selector_width": 0.0625, "selector_hidden": 8, "selector_lr": 0.01, "selector_steps": "all"}
    servers = {}
    for training in ("fedavg", "fedaws"):
        cfg = tiny_config("fedsm-extra", rounds=2, dtype="float64")
        fedsm = {**sel, "selector_training": training, "selector_rounds": 1}
        simulate(
            dataclasses.replace(cfg, params={"fedsm": fedsm}), workload, data, out=tmp_path / training, progress=False
        )
        servers[training] = load_file(str(tmp_path / training / "checkpoints/server.safetensors"))
    keys = [k for k in servers["fedavg"] if k.startswith("selector/")]
    assert keys and all(torch.equal(servers["fedaws"][k], servers["fedavg"][k]) for k in keys)
