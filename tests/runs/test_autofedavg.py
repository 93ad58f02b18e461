"""Auto-FedAvg (Xia et al. 2021): the maths on hand-made tensors, then tiny federations end to end."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.func import functional_call

from fedseg.algorithms import get_algorithm
from fedseg.algorithms.autofedavg import AutoFedAvgParams, extra_cost_ratio, init_beta
from fedseg.algorithms.learned_weights import (
    NETWORK,
    aggregate,
    alpha_eval,
    alpha_per_tensor,
    alpha_train,
    dirichlet_mode,
    mix,
    sample_dirichlet,
    tensor_layers,
)
from fedseg.foundation.arrays import dot, weighted_mean
from fedseg.foundation.errors import ConfigError, PayloadError
from fedseg.foundation.messages import Task
from fedseg.simulation.runner import simulate
from fedseg.site.runtime import Site
from tests.support.helpers import assert_same_checkpoints, tiny_config, tiny_sites


def _cfg(rounds: int = 2, method: str = "autofedavg", **params):
    cfg = tiny_config(method, rounds=rounds)
    return dataclasses.replace(cfg, params={"autofedavg": params} if params else {})


def _models(k: int = 3, seed: int = 0, dtype=torch.float64) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "lin.weight": torch.randn(2, 3, generator=g, dtype=dtype),
            "lin.bias": torch.randn(2, generator=g, dtype=dtype),
            "bn.num_batches_tracked": torch.tensor(i),
        }
        for i in range(k)
    ]


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2).double()

    def forward(self, x):
        return self.lin(x)


def _loss_of(weights: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((functional_call(_Tiny(), weights, (x,)) - y) ** 2).mean()


def _xy():
    g = torch.Generator().manual_seed(1)
    return torch.randn(5, 3, generator=g, dtype=torch.float64), torch.randn(5, 2, generator=g, dtype=torch.float64)


# ------------------------------------------------------------------ α from β
@pytest.mark.parametrize("k", [3, 6])
def test_equal_logits_or_concentrations_give_uniform_alpha_exactly(k):
    """softmax(0, …, 0) = 1/K and the Dirichlet mode (6−1)/(6K−K) = 1/K, both exactly in float64."""
    # Prepare
    p_soft = AutoFedAvgParams(param="softmax")
    p_dir = AutoFedAvgParams(param="dirichlet")
    # Execute
    a_soft = alpha_eval(init_beta(p_soft, [5] * k, [NETWORK]), "softmax")[NETWORK]
    a_dir = alpha_eval(init_beta(p_dir, [5] * k, [NETWORK]), "dirichlet")[NETWORK]
    # Assert
    assert a_soft.tolist() == [1.0 / k] * k
    assert a_dir.tolist() == [1.0 / k] * k


def test_uniform_alpha_aggregation_is_bitwise_fedavg_even():
    """aggregate with α_k = 1/K goes through weighted_mean with FedAvg-even's weights: identical bits."""
    # Prepare: float32 models (float64 accumulation inside weighted_mean)
    models = _models(3, dtype=torch.float32)
    alpha = alpha_per_tensor(
        alpha_eval(init_beta(AutoFedAvgParams(), [4, 9, 30], [NETWORK]), "dirichlet"),
        tensor_layers(["lin.weight", "lin.bias"], [NETWORK]),
    )
    # Execute
    ours = aggregate(models, alpha)
    even = weighted_mean(models, [1 / 3] * 3)
    # Assert: bitwise, and the integer buffer comes from the first site untouched
    for k in even:
        assert torch.equal(ours[k], even[k]), k
    assert ours["bn.num_batches_tracked"].item() == 0


def test_log_sample_logits_give_fedavg_weights():
    """β_k = log n_k ⇒ softmax(β)_k = n_k / Σ n (FedAvg's weights), up to float64 rounding."""
    # Prepare
    n = [4, 9, 30]
    beta = init_beta(AutoFedAvgParams(param="softmax", softmax_init="log_samples"), n, [NETWORK])
    # Execute
    alpha = alpha_eval(beta, "softmax")[NETWORK]
    models = _models(3)
    ours = aggregate(models, {"lin.weight": alpha, "lin.bias": alpha})
    fedavg = weighted_mean(models, n)
    # Assert
    torch.testing.assert_close(alpha, torch.tensor([4 / 43, 9 / 43, 30 / 43], dtype=torch.float64), rtol=0, atol=1e-15)
    for k in ("lin.weight", "lin.bias"):
        torch.testing.assert_close(ours[k], fedavg[k], rtol=0, atol=1e-14)


def test_dirichlet_mode_formula_and_that_it_maximizes_the_density():
    """β = (2, 3, 5): mode = (1, 2, 4) / (10 − 3) = (1/7, 2/7, 4/7); no nearby simplex point has higher density."""
    # Prepare
    beta = torch.tensor([2.0, 3.0, 5.0], dtype=torch.float64)
    dist = torch.distributions.Dirichlet(beta)
    # Execute
    mode = dirichlet_mode(beta)
    # Assert
    torch.testing.assert_close(mode, torch.tensor([1 / 7, 2 / 7, 4 / 7], dtype=torch.float64), rtol=0, atol=1e-16)
    for d in ([0.01, -0.01, 0.0], [0.0, 0.01, -0.01], [-0.01, 0.0, 0.01]):
        assert dist.log_prob(mode) > dist.log_prob(mode + torch.tensor(d, dtype=torch.float64))
    # layer-wise: one distribution per column
    cols = dirichlet_mode(torch.stack([beta, torch.tensor([6.0, 6.0, 6.0], dtype=torch.float64)], dim=1))
    torch.testing.assert_close(cols[:, 1], torch.full((3,), 1 / 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="concentration > 1"):
        dirichlet_mode(torch.tensor([1.0, 3.0], dtype=torch.float64))


def test_dirichlet_samples_are_seeded_on_the_simplex_and_leave_the_global_rng_alone():
    # Prepare
    beta = torch.full((3, 4), 6.0, dtype=torch.float64)
    before = torch.get_rng_state()
    # Execute
    a, b, c = sample_dirichlet(beta, 7), sample_dirichlet(beta, 7), sample_dirichlet(beta, 8)
    # Assert
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.shape == (3, 4)
    torch.testing.assert_close(a.sum(dim=0), torch.ones(4, dtype=torch.float64))
    assert torch.equal(torch.get_rng_state(), before)


# --------------------------------------------------------------- gradients
def test_alpha_gradient_is_inner_product_of_loss_gradient_and_site_model():
    """With w̄ = Σ α_k w_k, the chain rule gives ∂L/∂α_k = ⟨∇_w L(w̄), w_k⟩ (summed over all tensors)."""
    # Prepare
    models = [{k: v for k, v in m.items() if k.startswith("lin")} for m in _models(3)]
    x, y = _xy()
    alpha = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64, requires_grad=True)
    # Execute: autograd through the mixing
    mixed = mix(models, {"lin.weight": alpha, "lin.bias": alpha})
    _loss_of(mixed, x, y).backward()
    # Execute: ∇L at w̄ separately, then inner products
    w_bar = {k: v.detach().clone().requires_grad_(True) for k, v in mixed.items()}
    _loss_of(w_bar, x, y).backward()
    grad = {k: v.grad for k, v in w_bar.items()}
    expected = torch.stack([dot(grad, m) for m in models])
    # Assert
    torch.testing.assert_close(alpha.grad, expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("param", ["softmax", "dirichlet"])
def test_identical_site_models_give_zero_beta_gradient(param):
    """If every w_k = w then Σ α_k w_k = w for every α on the simplex, so L does not depend on β."""
    # Prepare
    same = [{k: v for k, v in _models(1)[0].items() if k.startswith("lin")}] * 3
    differ = [{k: v for k, v in m.items() if k.startswith("lin")} for m in _models(3)]
    x, y = _xy()

    def beta_grad(models):
        beta = torch.tensor([6.0, 5.0, 7.0], dtype=torch.float64, requires_grad=True)
        alpha = alpha_train({NETWORK: beta}, param, seed=3)[NETWORK]
        _loss_of(mix(models, {"lin.weight": alpha, "lin.bias": alpha}), x, y).backward()
        return beta.grad

    # Execute
    g_same, g_differ = beta_grad(same), beta_grad(differ)
    # Assert: zero up to rounding for identical models; clearly non-zero otherwise
    assert g_same.abs().max() < 1e-12
    assert g_differ.abs().max() > 1e-4


def test_layerwise_with_all_layers_tied_equals_networkwise():
    """β_{k,p} = β_k for all p: same α per tensor, same aggregate, and ∂L/∂β_net = Σ_p ∂L/∂β_{·,p} (chain rule)."""
    # Prepare
    models = [{k: v for k, v in m.items() if k.startswith("lin")} for m in _models(3)]
    x, y = _xy()
    names = ["lin.weight", "lin.bias"]
    b0 = torch.tensor([0.3, -0.2, 0.1], dtype=torch.float64)
    # Execute: aggregation (softmax and Dirichlet mode)
    for param, b in (("softmax", b0), ("dirichlet", b0 + 4.0)):
        net = alpha_per_tensor(alpha_eval({NETWORK: b}, param), tensor_layers(names, [NETWORK]))
        lay = alpha_per_tensor(alpha_eval({n: b.clone() for n in names}, param), tensor_layers(names, names))
        a_net, a_lay = aggregate(models, net), aggregate(models, lay)
        # Assert
        for n in names:
            assert torch.equal(a_net[n], a_lay[n])
    # Execute: gradients (softmax)
    beta_net = b0.clone().requires_grad_(True)
    _loss_of(
        mix(models, alpha_per_tensor(alpha_train({NETWORK: beta_net}, "softmax", 0), tensor_layers(names, [NETWORK]))),
        x,
        y,
    ).backward()
    beta_lay = {n: b0.clone().requires_grad_(True) for n in names}
    _loss_of(
        mix(models, alpha_per_tensor(alpha_train(beta_lay, "softmax", 0), tensor_layers(names, names))), x, y
    ).backward()
    # Assert
    torch.testing.assert_close(
        beta_net.grad, beta_lay["lin.weight"].grad + beta_lay["lin.bias"].grad, rtol=1e-12, atol=1e-15
    )
    assert not torch.allclose(beta_lay["lin.weight"].grad, beta_lay["lin.bias"].grad)


def test_tensor_layers_maps_buffers_to_their_module_or_the_mean():
    """Parameters are their own layer; bn.running_mean follows bn.weight; a parameter-less module's buffer gets the mean α."""
    # Prepare
    params = ["conv.weight", "conv.bias", "bn.weight", "bn.bias"]
    names = [*params, "bn.running_mean", "bn.running_var", "stats.buf"]
    # Execute
    groups = tensor_layers(names, params)
    alpha = {
        "conv.weight": torch.tensor([1.0, 0.0]),
        "conv.bias": torch.tensor([1.0, 0.0]),
        "bn.weight": torch.tensor([0.0, 1.0]),
        "bn.bias": torch.tensor([0.0, 1.0]),
    }
    per = alpha_per_tensor(alpha, groups)
    # Assert
    assert (
        groups["bn.running_mean"] == "bn.weight" and groups["conv.bias"] == "conv.bias" and groups["stats.buf"] is None
    )
    assert per["stats.buf"].tolist() == [0.5, 0.5]
    assert set(tensor_layers(names, [NETWORK]).values()) == {NETWORK}


def test_extra_cost_ratio_formula():
    """(K − 1) / (2 t0): the paper's example K = 3, t0 = 10 gives 10 %."""
    assert extra_cost_ratio(3, 10) == pytest.approx(0.10)
    assert extra_cost_ratio(6, 1) == 2.5
    with pytest.raises(ValueError, match="interval >= 1"):
        extra_cost_ratio(3, 0)


# ------------------------------------------------------------------- params
@pytest.mark.parametrize(
    "params, message",
    [
        ({"param": "gauss"}, "autofedavg.param"),
        ({"granularity": "module"}, "autofedavg.granularity"),
        ({"interval": 0}, "autofedavg.interval"),
        ({"steps": 0}, "autofedavg.steps"),
        ({"lr": -1.0}, "autofedavg.lr"),
        ({"min_concentration": 1.0}, "mode exists"),
        ({"concentration": 0.5}, "autofedavg.concentration"),
        ({"softmax_init": "ones"}, "autofedavg.softmax_init"),
        ({"beta_weighting": "median"}, "autofedavg.beta_weighting"),
        ({"t0": 5}, "unknown key"),
    ],
)
def test_bad_settings_are_rejected_with_the_key_named(params, message):
    with pytest.raises(ConfigError, match=message):
        get_algorithm(_cfg(**params))


def test_site_refuses_a_weight_step_without_peer_models(workload):
    # Prepare
    cfg = _cfg()
    site = Site("site1", 0, tiny_sites()["site1"], workload, cfg, get_algorithm(cfg))
    task = Task(
        "autofedavg-step",
        {f"beta/{NETWORK}": torch.full((3,), 6.0, dtype=torch.float64)},
        {"round": 1, "step": 0, "sites": ["site1", "site2", "site3"]},
    )
    # Execute / Assert
    with pytest.raises(PayloadError, match="must send 'autofedavg-peers' first"):
        site.handle(task)


def test_peer_models_and_beta_optimizer_live_in_site_scratch_for_one_phase(workload):
    """A learning phase's working state is ``site.scratch`` (never saved): the peers' models after
    'autofedavg-peers', the β optimizer after a step, nothing after the phase's last step; the site's
    saved state (``store``, ``optimizers``) never holds any of it."""
    # Prepare
    cfg = _cfg()
    site = Site("site1", 0, tiny_sites()["site1"], workload, cfg, get_algorithm(cfg))
    site.model("global")  # the workload's model, as a site that has trained has it
    own = site.arrays("global")
    names = ["site1", "site2", "site3"]
    peers = {f"{s}/{k}": v.clone() for s in names[1:] for k, v in own.items()}
    beta = {f"beta/{NETWORK}": torch.full((3,), 6.0, dtype=torch.float64)}
    # Execute / Assert
    site.handle(Task("autofedavg-peers", peers, {"round": 1, "sites": names}))
    assert set(site.scratch) == {"autofedavg/peers"} and sorted(site.scratch["autofedavg/peers"]) == names
    site.handle(Task("autofedavg-step", beta, {"round": 1, "step": 0, "sites": names, "last": False}))
    assert set(site.scratch) == {"autofedavg/peers", "autofedavg/beta"}
    reply = site.handle(Task("autofedavg-step", beta, {"round": 1, "step": 1, "sites": names, "last": True}))
    assert site.scratch == {} and set(reply.arrays) == set(beta)
    assert not site.store and "autofedavg/beta" not in site.optimizers


# --------------------------------------------------------------- end to end
def test_first_aggregation_equals_fedavg_even(sites, workload):
    """Round 1 with t0 = 2 aggregates with α(β0) = 1/K: the global model is bitwise FedAvg-even's."""
    # Execute
    auto = simulate(_cfg(1, interval=2), workload, sites, progress=False)
    even = simulate(_cfg(1, method="fedavg-even"), workload, sites, progress=False)
    # Assert: the best global model (round 1 is the only round) is the same
    assert auto["history"][0]["alpha"] == {s: 1 / 3 for s in sites}
    assert auto["per_case_dice"]["global"] == even["per_case_dice"]["global"]


def test_first_aggregation_equals_fedavg_even_bitwise_weights(tmp_path, sites, workload):
    # Execute
    simulate(_cfg(1, interval=2, param="softmax"), workload, sites, out=tmp_path / "a", progress=False)
    simulate(_cfg(1, method="fedavg-even"), workload, sites, out=tmp_path / "e", progress=False)
    a = load_file(str(tmp_path / "a/checkpoints/server.safetensors"))
    e = load_file(str(tmp_path / "e/checkpoints/server.safetensors"))
    # Assert
    assert {k for k in a if k.startswith("global/")} == set(e)
    for k in e:
        assert torch.equal(a[k], e[k]), k


def test_measured_extra_bytes_equal_the_papers_formula(sites, workload):
    """K = 3, t0 = 2, 4 rounds: extra model bytes / FedAvg bytes = (K−1)/(2 t0) = 1/2 exactly; β adds 2·S·K·8K bytes per phase."""
    # Prepare
    k, t0, steps, rounds = 3, 2, 2, 4
    # Execute
    auto = simulate(_cfg(rounds, interval=t0, steps=steps), workload, sites, progress=False)
    base = simulate(_cfg(rounds, method="fedavg-even"), workload, sites, progress=False)

    def total(res):
        return sum(b["sent"] + b["received"] for e in res["history"] for b in e["bytes"].values())

    # Assert
    beta_bytes = (rounds // t0) * 2 * steps * k * (8 * k)
    extra = total(auto) - total(base)
    assert extra - beta_bytes == extra_cost_ratio(k, t0) * total(base)
    assert [e["alpha_learned"] for e in auto["history"]] == [False, True, False, True]
    recorded = [e["extra_bytes"] for e in auto["history"] if e["alpha_learned"]]
    assert sum(r["models"] for r in recorded) + sum(r["beta"] for r in recorded) == extra


@pytest.mark.parametrize("param", ["softmax", "dirichlet"])
@pytest.mark.parametrize("granularity", ["network", "layer"])
def test_end_to_end_variants_learn_weights(sites, workload, param, granularity):
    # Execute
    res = simulate(
        _cfg(2, param=param, granularity=granularity, interval=1, steps=3, lr=0.1), workload, sites, progress=False
    )
    # Assert: α learned every round, on the simplex, moved away from 1/K
    h = res["history"]
    assert [e["alpha_learned"] for e in h] == [True, True]
    for e in h:
        assert sum(e["alpha"].values()) == pytest.approx(1.0, abs=1e-12)
        assert all(v > 0 for v in e["alpha"].values())
        assert len(e["agg_loss"]) == 3
    assert max(abs(v - 1 / 3) for v in h[-1]["alpha"].values()) > 1e-3
    # Table 2 candidates: the global model and the global model selected on each site
    assert [r["name"] for r in res["rows"]] == ["global", *(f"global@{s}" for s in sites)]
    assert 0.0 <= res["client_avg_dice"] <= 1.0


def test_reinit_resets_beta_before_each_phase(sites, workload):
    """With t0 = 1, round 1 is the same either way; round 2 starts from β0 with reinit and from β^1 without."""
    # Execute
    kept = simulate(_cfg(2, interval=1, steps=2, lr=0.5), workload, sites, progress=False)
    reset = simulate(_cfg(2, interval=1, steps=2, lr=0.5, reinit=True), workload, sites, progress=False)
    # Assert
    assert kept["history"][0]["beta"] == reset["history"][0]["beta"]
    assert kept["history"][1]["beta"] != reset["history"][1]["beta"]


def test_autofedavg_is_deterministic_and_resumes_bitwise(tmp_path, sites, workload):
    # Prepare: 4 rounds, t0 = 2, Dirichlet (seeded rsample) layer-wise
    cfg = _cfg(4, interval=2, steps=2, granularity="layer", lr=0.1)
    # Execute
    full = simulate(cfg, workload, sites, out=tmp_path / "full", progress=False)
    assert full["label"] == "Auto-FedAvg-L-Dirichlet" and full["primary"] == "global"  # the algorithm's own label
    assert simulate(cfg, workload, sites, out=tmp_path / "part", progress=False, stop_after=3) is None
    resumed = simulate(cfg, workload, tiny_sites(), out=tmp_path / "part", progress=False, resume=True)
    # Assert
    assert_same_checkpoints(tmp_path / "full", tmp_path / "part")
    assert [e["alpha"] for e in full["history"]] == [e["alpha"] for e in resumed["history"]]
    assert full["per_case_dice"] == resumed["per_case_dice"]
    # the site scratch of the learning phase is gone from the checkpoint
    site_state = json.loads((tmp_path / "full/checkpoints/sites/site1.json").read_text())
    assert "autofedavg/beta" not in site_state["optimizers"]
    assert not any(
        k.startswith("store/") for k in load_file(str(tmp_path / "full/checkpoints/sites/site1.safetensors"))
    )
