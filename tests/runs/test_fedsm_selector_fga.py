"""FedSM's selector trained by federated gradient averaging (``fedsm.selector_training = "fga"``).

Hand derivation (Remedios et al. 2020, Section 2.2, applied to the selector alone): at
lockstep step t every site k computes the gradient of its mean cross-entropy on its
batch B_k(t) (labels: the site's position k, Eq. 2; or Eq. 1's oracle labels in
FedSM-extra's selector phase); the server's sample-weighted mean
Σ_k |B_k| / Σ_j |B_j| · ∇ (1/|B_k|) Σ_{i∈B_k} ℓ_i = ∇ (1/|∪B_k|) Σ_{i∈∪B_k} ℓ_i is the
gradient of the pooled batch, and every site applies it with an Adam whose state it
built from the same gradients.  So after R rounds of T steps the selector equals one
selector trained centrally with one Adam on the concatenated batches (site order) for
R·T steps — up to float64 rounding of the split sum (≤ 1e-9 relative) — and all sites
hold bitwise identical selectors and Adam moments.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from fedseg.algorithms import get_algorithm
from fedseg.algorithms.fedsm import selector_role
from fedseg.algorithms.fedsm.selector import augment_for_selector, flip_batch
from fedseg.algorithms.softpull import experts_loss, image_losses, oracle_labels
from fedseg.foundation.seeding import derive_seed, generator
from fedseg.models import Selector
from fedseg.simulation.runner import simulate
from fedseg.site.runtime import Site
from tests.support.helpers import tiny_config, tiny_sites

# the selector as drawn (no flips): these tests follow the batches image by image
SEL = {"selector_width": 0.0625, "selector_hidden": 8, "selector_lr": 0.01, "selector_augment": "none"}


def _cfg(method: str, rounds: int, **fedsm):
    cfg = tiny_config(method, rounds=rounds, dtype="float64")
    return dataclasses.replace(cfg, params={"fedsm": {**SEL, **fedsm}})


def _central_selector(
    cfg,
    workload,
    data,
    classes: int,
    rounds: range,
    steps: int,
    frozen=None,
    objective: str = "oracle",
    flip: bool = False,
) -> dict[str, torch.Tensor]:
    """One selector (the engine's seeded init), one Adam, each step on the concatenation of the sites' batches:
    Eq. 2's site labels, or with ``frozen`` models Eq. 1's labels (``objective = "oracle"``) or the
    mixture-of-experts objective of their per-image losses (``"experts"``, τ = the run's ``ensemble_tau``)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(cfg.seed, "init", selector_role(classes)))
        sel = Selector(2, 1, classes, width=SEL["selector_width"], hidden=SEL["selector_hidden"])
    sel = sel.to(torch.float64)
    opt = torch.optim.Adam(sel.parameters(), lr=SEL["selector_lr"], betas=tuple(cfg.train.betas))
    algo = get_algorithm(cfg)
    sites = [Site(s, i, d, workload, cfg, algo) for i, (s, d) in enumerate(data.items())]
    for rnd in rounds:
        per_site = [list(s.batches(rnd, "train", steps=steps)) for s in sites]
        for t in range(steps):
            xs, labels = [], []
            for k, batches in enumerate(per_site):
                x, y = batches[t]
                if flip:  # fedsm.selector_augment = "flip": the site's seeded flips of its batch, masks alike
                    x, y = flip_batch(x, generator(cfg.seed, k, rnd, "selector-flip", t), y)
                xs.append(x)
                if frozen is None:
                    labels.append(torch.full((x.shape[0],), k, dtype=torch.long))
                else:
                    with torch.no_grad():
                        outputs = [m(x) for m in frozen]
                        labels.append(
                            oracle_labels(outputs, y, workload.loss)
                            if objective == "oracle"
                            else image_losses(outputs, y, workload.loss)
                        )
            opt.zero_grad(set_to_none=True)
            logits = sel(torch.cat(xs))
            if frozen is not None and objective == "experts":
                experts_loss(logits, torch.cat(labels), algo.params.ensemble_tau).backward()
            else:
                F.cross_entropy(logits, torch.cat(labels)).backward()
            opt.step()
    return {k: v.detach().clone() for k, v in sel.state_dict().items()}


def _rel_diff(a, b) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a) / max(float(b[k].abs().max()) for k in a)


def _server_selector(out) -> dict[str, torch.Tensor]:
    return {
        k.removeprefix("selector/"): v
        for k, v in load_file(str(out / "checkpoints/server.safetensors")).items()
        if k.startswith("selector/")
    }


def _sites_in_sync(out, sites, role):
    states = {s: load_file(str(out / f"checkpoints/sites/{s}.safetensors")) for s in sites}
    ref = states[sites[0]]
    keys = [k for k in ref if k.startswith((f"model/{role}/", f"optim/{role}/"))]
    assert any(k.endswith("exp_avg_sq") for k in keys)
    for s in sites[1:]:
        for k in keys:
            assert torch.equal(states[s][k], ref[k]), (s, k)
    return ref


def test_fga_selector_equals_a_centrally_trained_selector_in_float64(tmp_path, workload):
    """3 sites of 6, 8 and 10 training cases, batch 4 (1 local epoch): T = max(2, 2, 3) = 3
    lockstep selector steps per round; 3 rounds = 9 Adam steps of the pooled batch (12 cases,
    labels 0, 1, 2 by site; sites 1 and 2 cycle into their next seeded permutation)."""
    # Prepare
    data = tiny_sites()
    cfg = _cfg("fedsm", rounds=3)
    # Execute
    res = simulate(cfg, workload, data, out=tmp_path, progress=False)
    # Assert
    assert [e["selector_steps"] for e in res["history"]] == [3, 3, 3]
    assert all(e["selector_in_sync"] for e in res["history"])
    central = _central_selector(cfg, workload, data, 3, range(1, 4), steps=3)
    assert _rel_diff(_server_selector(tmp_path), central) <= 1e-9
    ref = _sites_in_sync(tmp_path, list(data), "selector@3")
    step = [v for k, v in ref.items() if k.startswith("optim/selector@3/") and k.endswith("/step")]
    assert {float(v) for v in step} == {9.0}
    # the routing accuracy of the selector each site holds is reported every round
    assert set(res["history"][0]["routing_acc"]) == set(data)
    # negative control: the averaged selector (local steps, then the mean) is not that selector
    simulate(
        _cfg("fedsm", rounds=3, selector_training="fedavg", selector_steps="all"),
        workload,
        data,
        out=tmp_path / "avg",
        progress=False,
    )
    assert _rel_diff(_server_selector(tmp_path / "avg"), central) > 1e-3


def test_flip_batch_flips_each_image_by_its_own_seeded_draws_and_keeps_its_values():
    """Two axes, 4 images: image i is flipped along H when the first 4 draws of the generator say
    r_H[i] < 1/2 and along W when the next 4 say r_W[i] < 1/2 (redrawn here from the same seed); a
    flip only moves pixels, so each image keeps the multiset of its values."""
    x = torch.rand(4, 2, 3, 5, generator=torch.Generator().manual_seed(1))
    out = flip_batch(x, torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(7)
    r_h, r_w = torch.rand(4, generator=g), torch.rand(4, generator=g)

    def by_hand(t: torch.Tensor, i: int) -> torch.Tensor:  # item i of t flipped as the draws say
        t = t[i].flip(1) if r_h[i] < 0.5 else t[i]
        return t.flip(2) if r_w[i] < 0.5 else t

    for i in range(4):
        assert torch.equal(out[i], by_hand(x, i))
        assert torch.equal(out[i].flatten().sort().values, x[i].flatten().sort().values)
    assert not torch.equal(out, x)  # this seed flips at least one image
    # with masks: each mask is flipped as its image (the same draws), the images as without
    y = torch.rand(4, 3, 3, 5, generator=torch.Generator().manual_seed(2))
    out2, ym = flip_batch(x, torch.Generator().manual_seed(7), y)
    assert torch.equal(out2, out)
    assert all(torch.equal(ym[i], by_hand(y, i)) for i in range(4))
    # a class label per image (no spatial axes) is returned as it is
    labels = torch.arange(4)
    assert flip_batch(x, torch.Generator().manual_seed(7), labels)[1] is labels


def test_fga_selector_with_flips_equals_a_central_selector_on_the_same_flipped_batches(tmp_path, workload):
    """fedsm.selector_augment = "flip": each site flips its lockstep batch with its seeded draws
    (run seed, site, round, step), so the selector is still the central selector of the pooled batch —
    of the flipped batches (float64, 3 rounds × 3 steps, as the test above); without flips it is not."""
    data = tiny_sites()
    cfg = _cfg("fedsm", rounds=3, selector_augment="flip")
    simulate(cfg, workload, data, out=tmp_path, progress=False)
    flipped = _central_selector(cfg, workload, data, 3, range(1, 4), steps=3, flip=True)
    assert _rel_diff(_server_selector(tmp_path), flipped) <= 1e-9
    assert _rel_diff(_server_selector(tmp_path), _central_selector(cfg, workload, data, 3, range(1, 4), steps=3)) > 1e-3
    # the averaged selector's local steps flip their batches too
    avg = _cfg("fedsm", rounds=1, selector_training="fedavg")
    simulate(avg, workload, data, out=tmp_path / "avg", progress=False)
    simulate(
        dataclasses.replace(avg, params={"fedsm": {**avg.params["fedsm"], "selector_augment": "flip"}}),
        workload,
        data,
        out=tmp_path / "avgf",
        progress=False,
    )
    assert _rel_diff(_server_selector(tmp_path / "avgf"), _server_selector(tmp_path / "avg")) > 1e-6
    # "none" (the default) leaves a batch as drawn
    site = Site("a", 0, data["site1"], workload, _cfg("fedsm", rounds=1), get_algorithm(_cfg("fedsm", rounds=1)))
    x, y = torch.rand(2, 1, 4, 4), torch.rand(2, 2, 4, 4)
    assert all(a is b for a, b in zip(augment_for_selector(site, x, y, 1, 0), (x, y)))


@pytest.mark.parametrize("objective,flip", [("oracle", False), ("experts", False), ("oracle", True)])
def test_fga_selector_of_fedsm_extra_equals_central_training_on_eq1_labels(tmp_path, workload, objective, flip):
    """FedSM-extra, 3 rounds = 2 model rounds + 1 selector round: the K + 1-class selector's
    single FGA round equals central training on the pooled batches with Eq. 1's labels
    (``extra_objective = "oracle"``, the paper's) or the mixture-of-experts objective of the
    per-image losses (``"experts"``, the default) computed from the frozen global and
    personalized models (those the server holds after the model rounds; they do not change
    in the selector phase).  Both are means over the images, so the pooled batch's mean
    gradient is the mean of the sites' (equal batches).  With ``selector_augment = "flip"`` each
    image is flipped together with its mask, so Eq. 1's label is that of the flipped pair."""
    # Prepare
    data = tiny_sites()
    aug = {"selector_augment": "flip"} if flip else {}
    cfg = _cfg("fedsm-extra", rounds=3, selector_rounds=1, extra_objective=objective, **aug)
    # Execute
    res = simulate(cfg, workload, data, out=tmp_path, progress=False)
    # Assert
    assert res["history"][-1]["phase"] == "selector" and res["history"][-1]["selector_in_sync"]
    server = load_file(str(tmp_path / "checkpoints/server.safetensors"))
    frozen = []
    for name in ["global", *(f"personal/{s}" for s in data)]:
        m = workload.build_model().to(torch.float64)
        m.load_state_dict({k.removeprefix(name + "/"): v for k, v in server.items() if k.startswith(name + "/")})
        frozen.append(m.eval())
    central = _central_selector(
        cfg, workload, data, 4, range(3, 4), steps=3, frozen=frozen, objective=objective, flip=flip
    )
    assert res["config"]["fedsm"]["extra_objective"] == objective
    assert _rel_diff(_server_selector(tmp_path), central) <= 1e-9
    other = _central_selector(
        cfg,
        workload,
        data,
        4,
        range(3, 4),
        steps=3,
        frozen=frozen,
        objective={"oracle": "experts"}.get(objective, "oracle"),
        flip=flip,
    )
    assert _rel_diff(_server_selector(tmp_path), other) > 1e-6  # the objective is the one trained on
    _sites_in_sync(tmp_path, list(data), "selector@4")
    # routing accuracy of a K + 1-class selector is agreement with Eq. 1's labels, in [0, 1]
    assert all(0.0 <= v <= 1.0 for v in res["history"][-1]["routing_acc"].values())


@pytest.mark.parametrize("training", ["fga", "fedavg"])
def test_selector_bytes_per_round(workload, training):
    """Sites of 8 and 10 cases, batch 4: T = max(2, 3) = 3 selector steps.  Per site in round 2,
    fga: the models' train task (2 w_g down, 2 w_g up) plus T selector gradients up (steps
    0…T−1) and T averaged gradients down (steps 1…T−1 and the final apply); site 1 also returns
    the selector's weights once.  fedavg: 2 w_g + 3 w_s each way (selector, two Adam moments)
    plus one float32 step counter (Adam's) per selector parameter tensor."""
    data = tiny_sites(2, n_train=8)
    res = simulate(
        _cfg("fedsm", rounds=2, selector_training=training, selector_steps="all"), workload, data, progress=False
    )
    b = res["history"][1]["bytes"]
    w_g = sum(v.numel() * v.element_size() for v in workload.build_model().to(torch.float64).state_dict().values())
    sel = Selector(2, 1, 2, width=SEL["selector_width"], hidden=SEL["selector_hidden"]).to(torch.float64)
    w_s = sum(p.numel() * p.element_size() for p in sel.parameters())
    if training == "fga":
        assert b["site2"] == {"sent": 2 * w_g + 3 * w_s, "received": 2 * w_g + 3 * w_s}
        assert b["site1"] == {"sent": 2 * w_g + 3 * w_s, "received": 2 * w_g + 4 * w_s}
    else:
        n = sum(1 for _ in sel.parameters())
        assert b["site2"]["sent"] == b["site2"]["received"] == 2 * w_g + 3 * w_s + n * 4


# ---------------------------------------------------------------- FedRS (restricted softmax)
def test_fedrs_restricted_softmax_gradient_follows_the_hand_derivation():
    """FedRS (Li & Zhan 2021): at a site that holds only class o (Eq. 2: its own position), the
    logits z_j of the other classes are scaled by α: z'_o = z_o, z'_j = α z_j.  The cross-entropy
    L = −z'_o + log Σ_k exp(z'_k) has, with p' = softmax(z'),

        ∂L/∂z_o = p'_o − 1,        ∂L/∂z_j = α p'_j   (j ≠ o, chain rule through z'_j = α z_j).

    α = 0: p'_o = e^{z_o} / (e^{z_o} + K − 1) and the gradient w.r.t. every other class's logit is
    zero — a site's local steps no longer push the other sites' classes down.  α = 1: plain
    softmax, ∂L/∂z_j = p_j."""
    from fedseg.algorithms.fedsm.selector import restricted_logits

    z = torch.tensor([[0.3, -1.2, 2.0, 0.5]], dtype=torch.float64)
    o = 2
    for alpha in (0.0, 0.5, 1.0):
        zz = z.clone().requires_grad_(True)
        F.cross_entropy(restricted_logits(zz, [o], alpha), torch.tensor([o])).backward()
        zp = torch.where(torch.arange(4) == o, z, alpha * z)
        p = torch.softmax(zp, dim=1)
        expected = alpha * p
        expected[0, o] = p[0, o] - 1
        torch.testing.assert_close(zz.grad, expected)
        if alpha == 0.0:
            assert zz.grad[0, [0, 1, 3]].abs().max() == 0
            torch.testing.assert_close(zz.grad[0, o], torch.exp(z[0, o]) / (torch.exp(z[0, o]) + 3) - 1)


def test_fedrs_selector_with_alpha_one_is_the_averaged_selector_and_differs_below(tmp_path, workload):
    """α = 1 leaves the softmax unrestricted, so ``fedrs`` is ``fedavg`` (same local steps, same
    averaging) bitwise; α = 0.5 changes the local loss and so the selector."""
    data = tiny_sites(2, n_train=8)
    runs = {}
    for name, training, alpha in (("avg", "fedavg", 0.5), ("rs1", "fedrs", 1.0), ("rs05", "fedrs", 0.5)):
        cfg = _cfg("fedsm", rounds=2, selector_training=training, selector_steps="all", fedrs_alpha=alpha)
        simulate(cfg, workload, data, out=tmp_path / name, progress=False)
        runs[name] = _server_selector(tmp_path / name)
    for k in runs["avg"]:
        assert torch.equal(runs["rs1"][k], runs["avg"][k]), k
    assert _rel_diff(runs["rs05"], runs["avg"]) > 1e-3


def test_fedrs_alpha_is_checked():
    from fedseg.algorithms.fedsm import FedSMParams
    from fedseg.foundation.errors import ConfigError

    with pytest.raises(ConfigError, match=r"fedsm.fedrs_alpha = 1.5 must be in \[0, 1\]"):
        FedSMParams(selector_training="fedrs", fedrs_alpha=1.5).validate()
