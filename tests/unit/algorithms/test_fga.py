"""FGA (Remedios et al. 2020, Alg. 1) and FWA: pure maths, exactness against centralized training, warnings.

The exactness tests run in float64 on a model without batch norm and a mean-reduced
loss: then the gradient of the pooled batch's mean loss is Σ_k (b_k / Σ b_j) g_k,
and FGA's Adam sees exactly centralized training's gradients.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import TensorDataset

from fedseg.algorithms import get_algorithm
from fedseg.algorithms.gradients import (
    FGAEquivalenceWarning,
    apply_gradient,
    average_gradients,
    equivalence_problems,
    federation_steps,
    state_digest,
)
from fedseg.foundation.config import EvalConfig, RunConfig, TrainConfig
from fedseg.foundation.errors import ConfigError, PayloadError
from fedseg.foundation.messages import Task
from fedseg.foundation.seeding import derive_seed
from fedseg.simulation.runner import simulate
from fedseg.site.batches import SiteData
from fedseg.site.runtime import Site
from fedseg.site.workload import Workload, accuracy_metric, segmentation_workload
from tests.support.helpers import TINY_MODEL, tiny_sites

# ----------------------------------------------------------------------- helpers


def mlp_workload(batch_norm: bool = False, loss: nn.Module | None = None) -> Workload:
    """A 3-class MLP on 1×4×4 inputs (optionally with batch norm, which breaks FGA's equivalence)."""

    def build() -> nn.Module:
        layers: list[nn.Module] = [nn.Flatten(), nn.Linear(16, 8)]
        if batch_norm:
            layers.append(nn.BatchNorm1d(8))
        layers += [nn.Tanh(), nn.Linear(8, 3)]
        return nn.Sequential(*layers)

    return Workload(
        build_model=build, loss=loss or nn.CrossEntropyLoss(), metric=accuracy_metric, metric_names=("accuracy",)
    )


def class_sites(sizes: list[int], seed: int = 0) -> dict[str, SiteData]:
    """Sites of 1×4×4 inputs; site k's labels follow a site-specific rule (heterogeneous)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, n in enumerate(sizes):

        def split(m: int) -> TensorDataset:
            x = torch.randn(m, 1, 4, 4, generator=g)
            y = ((x[:, 0, 0, :].sum(1) + k) > 0).long()  # noqa: B023 + (x[:, 0, 1, 0] > 0.5).long()
            return TensorDataset(x, y)

        out[f"site{k + 1}"] = SiteData(split(n), split(3), split(3))
    return out


def config(
    method: str = "fga",
    rounds: int = 10,
    batch_size: int = 4,
    params: dict | None = None,
    dtype: str = "float64",
    **train,
) -> RunConfig:
    t = TrainConfig(batch_size=batch_size, dtype=dtype, lr=train.pop("lr", 1e-2), **train)
    return RunConfig(
        federation="(in memory)",
        method=method,
        rounds=rounds,
        train=t,
        eval=EvalConfig(every=1000),
        params=params or {},
        checkpoint_keep="all",  # the tests read the sites' states of finished runs
    )


def init_model(cfg: RunConfig, workload: Workload) -> nn.Module:
    """The engine's seeded initial model (Engine.init_arrays: seed ← derive_seed(seed, 'init', 'global'))."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(cfg.seed, "init", "global"))
        model = workload.build_model()
    return model.to(torch.float64 if cfg.train.dtype == "float64" else torch.float32)


def site_batches(
    cfg: RunConfig, workload: Workload, data: dict[str, SiteData], rnd: int, steps: int
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """batches[t][k]: site k's batch at lockstep step t of round ``rnd`` (seeded stream 'train', cycling permutations)."""
    algo = get_algorithm(cfg)
    per_site = [
        list(Site(s, i, d, workload, cfg, algo).batches(rnd, "train", steps=steps))
        for i, (s, d) in enumerate(data.items())
    ]
    return [list(step) for step in zip(*per_site)]


def adam(cfg: RunConfig, model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=cfg.train.lr, betas=tuple(cfg.train.betas))


def centralized_reference(
    cfg: RunConfig, workload: Workload, data: dict[str, SiteData], steps: int
) -> dict[str, torch.Tensor]:
    """One model, one Adam, each step on the concatenation of the sites' batches (site order)."""
    model = init_model(cfg, workload)
    opt = adam(cfg, model)
    model.train()
    for rnd in range(1, cfg.rounds + 1):
        for batch in site_batches(cfg, workload, data, rnd, steps):
            x = torch.cat([b[0] for b in batch])
            y = torch.cat([b[1] for b in batch])
            opt.zero_grad(set_to_none=True)
            workload.loss(model(x), y).backward()
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def split_batch_reference(
    cfg: RunConfig, workload: Workload, data: dict[str, SiteData], steps: int, weighting: str = "samples"
) -> dict[str, torch.Tensor]:
    """One process, FGA's arithmetic: per-site gradients, :func:`average_gradients`, :func:`apply_gradient`."""
    model = init_model(cfg, workload)
    opt = adam(cfg, model)
    model.train()
    for rnd in range(1, cfg.rounds + 1):
        for batch in site_batches(cfg, workload, data, rnd, steps):
            grads = []
            for x, y in batch:
                model.zero_grad(set_to_none=True)
                workload.loss(model(x), y).backward()
                grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
            apply_gradient(model, opt, average_gradients(grads, [len(b[0]) for b in batch], weighting))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def server_weights(out) -> dict[str, torch.Tensor]:
    return {k.removeprefix("global/"): v for k, v in load_file(str(out / "checkpoints/server.safetensors")).items()}


def rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max |a − b| / max |b| over all floating tensors."""
    assert a.keys() == b.keys()
    num = max(float((a[k].double() - b[k].double()).abs().max()) for k in a if b[k].is_floating_point())
    den = max(float(b[k].double().abs().max()) for k in a if b[k].is_floating_point())
    return num / den


# ------------------------------------------------------------------- pure maths


def test_average_gradients_weights_by_batch_size():
    """g1 = [1, 2] (b=1), g2 = [4, 8] (b=3): samples → (1·g1 + 3·g2)/4 = [3.25, 6.5]; even → (g1 + g2)/2 = [2.5, 5]."""
    # Prepare
    g1 = {"w": torch.tensor([1.0, 2.0], dtype=torch.float64), "b": torch.tensor([4.0], dtype=torch.float64)}
    g2 = {"w": torch.tensor([4.0, 8.0], dtype=torch.float64)}  # no gradient for "b" at site 2 → zeros
    # Execute
    samples = average_gradients([g1, g2], [1, 3])
    even = average_gradients([g1, g2], [1, 3], "even")
    # Assert
    assert torch.equal(samples["w"], torch.tensor([3.25, 6.5], dtype=torch.float64))
    assert torch.equal(samples["b"], torch.tensor([1.0], dtype=torch.float64))  # 1/4 · 4 + 3/4 · 0
    assert torch.equal(even["w"], torch.tensor([2.5, 5.0], dtype=torch.float64))
    assert torch.equal(even["b"], torch.tensor([2.0], dtype=torch.float64))


def test_average_gradients_equals_pooled_gradient():
    """Mean squared error over a pooled batch of 5 = sample-weighted mean of the mean losses on a 2 + 3 split."""
    # Prepare
    torch.manual_seed(0)
    lin = nn.Linear(3, 1).double()
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 1, dtype=torch.float64)

    def grad(xb, yb):
        lin.zero_grad()
        nn.functional.mse_loss(lin(xb), yb).backward()
        return {n: p.grad.clone() for n, p in lin.named_parameters()}

    # Execute
    pooled = grad(x, y)
    avg = average_gradients([grad(x[:2], y[:2]), grad(x[2:], y[2:])], [2, 3])
    # Assert
    for k in pooled:
        torch.testing.assert_close(avg[k], pooled[k], rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize(
    "args, message",
    [
        (([], []), "no gradients"),
        (([{"w": torch.zeros(1)}], [1, 2]), "one batch size per gradient"),
        (([{"w": torch.zeros(1)}], [0]), "batch sizes must be >= 1"),
        (([{"w": torch.zeros(1)}], [1], "median"), "unknown weighting"),
    ],
)
def test_average_gradients_rejects_bad_input(args, message):
    with pytest.raises(ValueError, match=message):
        average_gradients(*args)


def test_federation_steps_max_and_min():
    # Execute / Assert: sites with 3, 1, 2 batches per epoch
    assert federation_steps([3, 1, 2], "max") == 3
    assert federation_steps([3, 1, 2], "min") == 1
    with pytest.raises(ValueError, match="use 'max' or 'min'"):
        federation_steps([3], "mean")


def test_apply_gradient_sets_grads_and_steps():
    """SGD(lr=0.5) on w = [1, 1] with g = [2, 4]: w − 0.5 g = [0, −1]; a parameter without a gradient is untouched."""
    # Prepare
    model = nn.Linear(2, 1, bias=True)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 1.0]]))
        model.bias.fill_(3.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    # Execute
    apply_gradient(model, opt, {"weight": torch.tensor([[2.0, 4.0]], dtype=torch.float64)})
    # Assert
    assert torch.equal(model.weight.detach(), torch.tensor([[0.0, -1.0]]))
    assert float(model.bias.detach()) == 3.0
    with pytest.raises(PayloadError, match="does not have"):
        apply_gradient(model, opt, {"nope": torch.zeros(1)})
    with pytest.raises(PayloadError, match="has shape"):
        apply_gradient(model, opt, {"weight": torch.zeros(3)})


def test_equivalence_problems_finds_batch_norm_and_batch_reduced_losses():
    from monai.losses import DiceCELoss, DiceLoss

    # Prepare
    bn = mlp_workload(batch_norm=True).build_model()
    # Execute / Assert: clean model and per-sample losses pass
    assert equivalence_problems(mlp_workload().build_model(), nn.CrossEntropyLoss()) == []
    assert equivalence_problems(mlp_workload().build_model(), DiceLoss(sigmoid=True)) == []
    # batch norm in training mode is a problem; in eval mode (frozen statistics) it is not
    assert any("batch-norm" in p for p in equivalence_problems(bn.train(), nn.CrossEntropyLoss()))
    assert equivalence_problems(bn.eval(), nn.CrossEntropyLoss()) == []
    # losses reducing over the batch, directly or inside a compound loss
    for loss in (
        DiceLoss(sigmoid=True, batch=True),
        DiceCELoss(sigmoid=True, batch=True),
        nn.CrossEntropyLoss(reduction="sum"),
    ):
        problems = equivalence_problems(mlp_workload().build_model(), loss)
        assert len(problems) == 1 and "reduces over the batch" in problems[0], loss


def test_state_digest_sees_weights_and_moments():
    # Prepare
    model = nn.Linear(2, 1)
    opt = torch.optim.Adam(model.parameters())
    d0 = state_digest(model, opt)
    # Execute: one step changes weights and moments
    apply_gradient(model, opt, {"weight": torch.ones(1, 2), "bias": torch.ones(1)})
    # Assert
    assert state_digest(model, opt) != d0
    assert state_digest(model, opt) == state_digest(model, opt)


@pytest.mark.parametrize(
    "key, value, message",
    [("weighting", "median", "fga.weighting"), ("steps", "mean", "fga.steps"), ("lr", 1.0, r"\[fga\] has unknown key")],
)
def test_fga_params_are_validated(key, value, message):
    with pytest.raises(ConfigError, match=message):
        get_algorithm(config(params={"fga": {key: value}}))


# --------------------------------------------------------------- exactness


def test_fga_equals_centralized_training_in_float64(tmp_path):
    """3 sites of 8, 12 and 4 samples, batch 4: T = max(2, 3, 1) = 3 lockstep steps per round, site 3 cycles its data.

    7 rounds = 21 Adam steps.  Centralized training on the concatenation of the
    sites' batches (pooled batch of 12) gives the same weights up to float64
    rounding (≤ 1e-9 relative); the split-batch reference (same arithmetic in one
    process) gives them bitwise; every site holds bitwise identical weights and Adam moments.
    """
    # Prepare
    data = class_sites([8, 12, 4])
    wl = mlp_workload()
    cfg = config(rounds=7)
    # Execute
    res = simulate(cfg, wl, data, out=tmp_path, progress=False)
    fga = server_weights(tmp_path)
    # Assert: 3 steps per round, sites in sync
    assert [h["steps"] for h in res["history"]] == [3] * 7
    assert all(h["in_sync"] for h in res["history"])
    central = centralized_reference(cfg, wl, data, steps=3)
    assert rel_diff(fga, central) <= 1e-9
    split = split_batch_reference(cfg, wl, data, steps=3)
    for k in split:
        assert torch.equal(fga[k], split[k]), k
    states = {s: load_file(str(tmp_path / f"checkpoints/sites/{s}.safetensors")) for s in data}
    ref = states["site1"]
    shared = [k for k in ref if k.startswith(("model/global/", "optim/global/"))]
    assert any(k.endswith("exp_avg_sq") for k in shared)
    for s in ("site2", "site3"):
        for k in shared:
            assert torch.equal(states[s][k], ref[k]), (s, k)
    assert float(ref["optim/global/0/step"]) == 21.0


def test_unequal_batches_need_sample_weighting(tmp_path):
    """Site 1: 4 samples, site 2: 2 samples, batch 4 → one step per round with batches of 4 and 2.

    Pooled mean loss = (4·L1 + 2·L2)/6, so the sample-weighted mean (p = 2/3, 1/3)
    matches centralized training; the uniform mean (1/2, 1/2) weights site 2's
    samples twice as much and does not (negative test).
    """
    # Prepare
    data = class_sites([4, 2], seed=3)
    wl = mlp_workload()
    cfg_w = config(rounds=20)
    cfg_e = config(rounds=20, params={"fga": {"weighting": "even"}})
    # Execute
    simulate(cfg_w, wl, data, out=tmp_path / "w", progress=False)
    simulate(cfg_e, wl, data, out=tmp_path / "e", progress=False)
    central = centralized_reference(cfg_w, wl, data, steps=1)
    # Assert
    assert rel_diff(server_weights(tmp_path / "w"), central) <= 1e-9
    assert rel_diff(server_weights(tmp_path / "e"), central) > 1e-3
    even_ref = split_batch_reference(cfg_e, wl, data, steps=1, weighting="even")
    assert all(torch.equal(server_weights(tmp_path / "e")[k], even_ref[k]) for k in even_ref)


def test_fga_with_instance_norm_unet_and_dice_matches_centralized(tmp_path):
    """The segmentation setting: tiny instance-norm U-Net, per-sample Dice loss; 2 sites × 4 cases, batch 2 → 2 steps × 10 rounds.

    Conv biases before instance norm have true gradient 0 and Adam rescales their rounding
    noise, so the weights differ by more than float64 rounding: hence the 1e-9 tolerance.
    """
    # Prepare
    data = {k: SiteData(v.train, v.val, v.test) for k, v in tiny_sites(2, n_train=4, size=8).items()}
    data["site2"] = SiteData(
        torch.utils.data.Subset(data["site2"].train, range(4)), data["site2"].val, data["site2"].test
    )
    wl = segmentation_workload(2, 1, ["fg"], TINY_MODEL)
    cfg = RunConfig(
        federation="(in memory)",
        method="fga",
        rounds=10,
        model=TINY_MODEL,
        train=TrainConfig(batch_size=2, dtype="float64"),
        eval=EvalConfig(every=1000),
        checkpoint_keep="all",  # the server's final state is read below
    )
    # Execute
    simulate(cfg, wl, data, out=tmp_path, progress=False)
    # Assert
    central = centralized_reference(cfg, wl, data, steps=2)
    assert rel_diff(server_weights(tmp_path), central) <= 1e-9


def test_fga_bytes_per_round_are_one_gradient_each_way_per_step(tmp_path):
    """P float64 parameters (16·8 + 8 + 8·3 + 3 = 163 → 1304 bytes); 2 sites of 8, batch 4 → T = 2 steps.

    Per site and round: T averaged gradients down (steps 1..T−1 and the final apply),
    T gradients up; site 1 also returns the weights (P) at the round's end, and
    round 1 sends the initial weights down.
    """
    # Prepare
    data = class_sites([8, 8])
    p_bytes = (16 * 8 + 8 + 8 * 3 + 3) * 8
    # Execute
    res = simulate(config(rounds=2), mlp_workload(), data, progress=False)
    r1, r2 = (h["bytes"] for h in res["history"])
    # Assert
    assert r2 == {
        "site1": {"sent": 2 * p_bytes, "received": 3 * p_bytes},
        "site2": {"sent": 2 * p_bytes, "received": 2 * p_bytes},
    }
    assert r1["site1"]["sent"] == r1["site2"]["sent"] == 3 * p_bytes


# -------------------------------------------------------------------- warnings


def test_fga_warns_on_batch_norm_and_the_equivalence_breaks(tmp_path):
    """Batch norm normalizes each site's batch of 4 with its own statistics, not the pooled batch's of 8."""
    # Prepare
    data = class_sites([8, 8])
    wl = mlp_workload(batch_norm=True)
    cfg = config(rounds=5)
    # Execute
    with pytest.warns(FGAEquivalenceWarning, match="batch-norm layers in training mode"):
        simulate(cfg, wl, data, out=tmp_path, progress=False)
    # Assert: the warning is warranted
    assert rel_diff(server_weights(tmp_path), centralized_reference(cfg, wl, data, steps=2)) > 1e-4


def test_fga_warns_on_batch_reduced_dice_loss():
    from monai.losses import DiceLoss

    # Prepare
    wl = segmentation_workload(2, 1, ["fg"], TINY_MODEL)
    wl.loss = DiceLoss(sigmoid=True, batch=True)
    cfg = RunConfig(federation="(in memory)", method="fga", rounds=1, model=TINY_MODEL, train=TrainConfig(batch_size=2))
    # Execute / Assert
    with pytest.warns(FGAEquivalenceWarning, match=r"reduces over the batch.*DiceLoss\(batch=False\)"):
        simulate(cfg, wl, tiny_sites(2, n_train=2, size=8), progress=False)


def test_fga_site_state_is_the_sites_scratch_and_a_restarted_site_reads_the_same_batch():
    """The batch cursor and the equivalence check live in ``site.scratch`` (per site, not saved): a site
    built afresh mid-round (a restart) computes at step 1 the gradient of the same batch, at the same
    weights, as the site that kept its cursor from step 0."""
    # Prepare
    cfg, wl, data = config(rounds=1), mlp_workload(), class_sites([8, 8])
    algo = get_algorithm(cfg)
    init = {f"global/{k}": v for k, v in init_model(cfg, wl).state_dict().items()}
    kept = Site("site1", 0, data["site1"], wl, cfg, algo)
    # Execute
    kept.handle(Task("fga_step", init, {"round": 1, "step": 0}))
    assert set(kept.scratch) == {"fga/cursor", "fga/checked"} and kept.scratch["fga/checked"] == {"global"}
    a = kept.handle(Task("fga_step", {}, {"round": 1, "step": 1}))  # no averaged gradient: the weights stay
    fresh = Site("site1", 0, data["site1"], wl, cfg, algo)
    b = fresh.handle(Task("fga_step", init, {"round": 1, "step": 1}))
    # Assert
    assert a.arrays.keys() == b.arrays.keys() and all(torch.equal(a.arrays[k], b.arrays[k]) for k in a.arrays)
    assert a.num_samples == b.num_samples == 4


def test_fga_does_not_warn_for_a_clean_model():
    with warnings.catch_warnings():
        warnings.simplefilter("error", FGAEquivalenceWarning)
        simulate(config(rounds=1), mlp_workload(), class_sites([4, 4]), progress=False)


# ------------------------------------------------------------------------- FWA


@pytest.mark.parametrize("reset, expected_step", [(False, 6.0), (True, 2.0)])
def test_fwa_keeps_or_resets_adam_moments(tmp_path, reset, expected_step):
    """8 samples, batch 4 → 2 steps per round; after 3 rounds Adam's step count is 6 (kept) or 2 (reset each round)."""
    # Execute
    simulate(
        config("fwa", rounds=3, params={"fwa": {"reset_optimizer": reset}}),
        mlp_workload(),
        class_sites([8, 8]),
        out=tmp_path,
        progress=False,
    )
    # Assert
    for s in ("site1", "site2"):
        assert (
            float(load_file(str(tmp_path / f"checkpoints/sites/{s}.safetensors"))["optim/global/0/step"])
            == expected_step
        )


def test_fwa_with_kept_moments_is_fedavg(tmp_path):
    # Execute
    data = class_sites([8, 6])
    simulate(config("fwa", rounds=2), mlp_workload(), data, out=tmp_path / "fwa", progress=False)
    papers = {"fedavg": {"weighting": "samples", "normalize": "none"}}  # FedAvg as FWA's paper states it
    simulate(config("fedavg", rounds=2, params=papers), mlp_workload(), data, out=tmp_path / "fedavg", progress=False)
    # Assert
    a, b = server_weights(tmp_path / "fwa"), server_weights(tmp_path / "fedavg")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_fwa_params_are_validated():
    with pytest.raises(ConfigError, match="fwa.weighting"):
        get_algorithm(config("fwa", params={"fwa": {"weighting": "median"}}))
