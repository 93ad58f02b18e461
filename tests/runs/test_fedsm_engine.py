"""FedSM end to end on tiny federations: fedsm, fedsm-extra, fedsm-ensemble, γ = auto,
resume, traffic, bad inputs; and the Table 5 / Table 7 runners on a tiny synthetic spec."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from fedseg.algorithms import get_algorithm
from fedseg.algorithms.softpull import LambdaBelowOneOverKWarning
from fedseg.foundation.config import ModelConfig, RunConfig, TrainConfig
from fedseg.foundation.errors import ConfigError
from fedseg.simulation.runner import simulate
from tests.support.helpers import tiny_config, tiny_sites


def _with(cfg: RunConfig, **fedsm) -> RunConfig:
    return dataclasses.replace(cfg, params={"fedsm": fedsm})


def _strip_times(obj):
    if isinstance(obj, dict):
        return {k: _strip_times(v) for k, v in obj.items() if k not in ("time_s", "wall_time_s")}
    if isinstance(obj, list):
        return [_strip_times(v) for v in obj]
    return obj


@pytest.mark.parametrize(
    "method,phases",
    [
        ("fedsm", ["joint", "joint", "joint"]),
        ("fedsm-extra", ["models", "models", "selector"]),
        ("fedsm-ensemble", ["models", "models", "selector"]),
    ],
)
def test_each_variant_runs_end_to_end_and_reports_the_composite(tmp_path, sites, workload, method, phases):
    # Execute
    res = simulate(tiny_config(method, rounds=3), workload, sites, out=tmp_path, progress=False)
    # Assert: the method's row is the composite; global and every personalized model are tracked too
    names = {r["name"] for r in res["rows"]}
    assert names == {"fedsm", "global", *(f"personal/{s}" for s in sites)}
    fedsm_row = next(r for r in res["rows"] if r["name"] == "fedsm")
    assert res["per_site_dice"] == fedsm_row["per_site_dice"]
    assert 0.0 <= res["client_avg_dice"] <= 1.0
    assert [e["phase"] for e in res["history"]] == phases
    # the selector is trained when it should be, and its routing accuracy is recorded
    for e in res["history"]:
        assert ("selector_loss" in e) == (e["phase"] != "models")
        assert ("routing_acc" in e) == (e["phase"] != "models")
        if "routing_acc" in e:
            assert set(e["routing_acc"]) == set(sites)
    # personalized models differ per site after SoftPull with λ = 0.7 < 1
    server = load_file(str(tmp_path / "checkpoints/server.safetensors"))
    k = next(
        k for k in server if k.startswith("personal/site1/") and server[k].is_floating_point() and server[k].numel() > 1
    )
    assert not torch.equal(server[k], server[k.replace("site1", "site2")])
    # selector classes: K (Eq. 2) or K + 1 with the global model (Eq. 1 / ensemble)
    head = [v for k, v in server.items() if k.startswith("selector/classifier") and k.endswith("weight")][-1]
    assert head.shape[0] == (3 if method == "fedsm" else 4)


def test_fedsm_with_lambda_one_over_k_makes_personalized_models_equal(sites, workload, tmp_path):
    """λ = 1/K: SoftPull is the uniform mean, so all personalized models are identical after a round."""
    simulate(_with(tiny_config("fedsm", rounds=1), lam=1 / 3), workload, sites, out=tmp_path, progress=False)
    server = load_file(str(tmp_path / "checkpoints/server.safetensors"))
    for k, v in server.items():
        if k.startswith("personal/site1/") and v.is_floating_point():
            torch.testing.assert_close(v, server[k.replace("site1", "site3")])


def test_gamma_auto_picks_a_grid_value_from_federated_validation(tmp_path, sites, workload):
    cfg = _with(tiny_config("fedsm", rounds=2), gamma="auto", gamma_grid=[0.0, 0.5, 1.0])
    res = simulate(cfg, workload, sites, out=tmp_path, progress=False)
    best = json.loads((tmp_path / "checkpoints/best.json").read_text())
    assert best["fedsm"]["config"]["gamma"] in (0.0, 0.5, 1.0)
    # the γ search is evaluation traffic, not training traffic
    assert all(e["eval_bytes"][s]["sent"] > 0 for e in res["history"] for s in sites)


def test_gamma_auto_per_model_routes_with_one_threshold_per_personalized_model(tmp_path, sites, workload):
    """``fedsm.gamma = "auto-per-model"``: the best composite carries one grid threshold per personalized
    model (and the one common γ, reported), and the test routing report's per-site Dice at those
    thresholds is the composite's test Dice in the results (the predictor routes with them too)."""
    from fedseg.apps.studies.fedsm import run_fedsm

    grid = [0.0, 0.5, 1.0]
    cfg = _with(tiny_config("fedsm", rounds=2), gamma="auto-per-model", gamma_grid=grid)
    res = run_fedsm(cfg, workload, sites, out=tmp_path)
    config = json.loads((tmp_path / "checkpoints/best.json").read_text())["fedsm"]["config"]
    per = config["gamma_per_model"]
    assert len(per) == len(sites) and set(per) <= set(grid) and config["gamma"] in grid
    rep = res["fedsm"]
    assert rep["gamma_per_model"] == per
    dice = (
        dict(zip(res["sites"], res["per_site_dice"]))
        if isinstance(res["per_site_dice"], list)
        else res["per_site_dice"]
    )
    for s in sites:
        assert rep["per_site"][s]["dice"] == pytest.approx(dice[s], abs=1e-6)
    with pytest.raises(ConfigError, match="auto-per-model"):
        get_algorithm(_with(tiny_config("fedsm", rounds=2), gamma="per-site"))


@pytest.mark.parametrize("training", ["fga", "fedavg"])
def test_default_selector_keeps_round_traffic_within_three_times_fedavg(workload, training):
    """Default U-Net and default selector, one local step: per site and round, FedSM carries 2 w_g
    (global + personalized) plus, with the fedavg selector, 3 w_s (selector + its two Adam moments,
    + step) each way, with the fga selector one gradient (w_s) each way (+ the selector once from
    site 1); FedAvg carries w_g."""
    # Prepare: default model (5 levels need 32 px), one local step
    cfg = RunConfig(
        federation="(mem)",
        rounds=2,
        model=ModelConfig(),
        train=TrainConfig(batch_size=2, local_steps=1, local_epochs=None),
    )
    from fedseg.site.workload import segmentation_workload

    wl = segmentation_workload(2, 1, ["fg"], ModelConfig())
    data = tiny_sites(2, n_train=2, size=32)
    # Execute
    fa = simulate(dataclasses.replace(cfg, method="fedavg"), wl, data, progress=False)
    fs = simulate(
        dataclasses.replace(cfg, method="fedsm", params={"fedsm": {"selector_training": training}}),
        wl,
        data,
        progress=False,
    )
    # Assert: round 2 (with the averaged selector moments on the way out too)
    for s in data:
        b_fa, b_fs = fa["history"][1]["bytes"][s], fs["history"][1]["bytes"][s]
        assert b_fs["sent"] <= 3 * b_fa["sent"] and b_fs["received"] <= 3 * b_fa["received"]
        assert b_fs["sent"] > 2 * b_fa["sent"]  # global + personalized + selector


def test_default_selector_keeps_the_demos_round_traffic_within_three_times_fedavg():
    """The demo's federation (``make demo``: the half-width U-Net 8…128 with one residual unit, 3 image channels,
    2 labels, 6 sites, batch 4 and one local epoch a round: the largest site's 60 cases make T = 15 lockstep
    selector steps) with FedSM's default selector (fga).  Per site and round FedAvg carries w_g each way; FedSM
    the global and personalized models (2 w_g) each way plus T selector gradients up and T averaged gradients
    down, and site 1 the selector's weights once more (the exact bytes: ``test_selector_bytes_per_round`` in
    test_fedsm_selector_fga.py).  The worst site's ratio (site 1)

        (4 w_g + (2T + 1) w_s) / (2 w_g) = 2 + (2T + 1) w_s / (2 w_g)  ≤  3   ⇔   (2T + 1) w_s ≤ 2 w_g

    holds for the default selector's size and fails for the selector of width 0.125 (153,654 parameters for
    3 channels and 6 classes: 31 w_s ≈ 23 w_g)."""
    from fedseg.algorithms.fedsm import FedSMParams
    from fedseg.apps.studies.compare import DEMO_OVERRIDES
    from fedseg.data.synth import split_sizes
    from fedseg.models import Selector
    from fedseg.site.workload import segmentation_workload

    channels = next(o for o in DEMO_OVERRIDES if o.startswith("model.channels="))
    model = ModelConfig(channels=tuple(json.loads(channels.partition("=")[2])), num_res_units=1)
    w_g = sum(p.numel() for p in segmentation_workload(2, 3, ["disc", "cup"], model).build_model().parameters())
    steps = max(math.ceil(n / 4) for n, _, _ in split_sizes("fundus", 0.15))  # the demo's largest site, batch 4
    assert steps == 15

    def ratio(width: float) -> float:
        p = FedSMParams(selector_width=width)
        w_s = sum(x.numel() for x in Selector(2, 3, 6, width=p.selector_width, hidden=p.selector_hidden).parameters())
        return (4 * w_g + (2 * steps + 1) * w_s) / (2 * w_g)

    assert FedSMParams().resolved().selector_training == "fga"
    assert 2 < ratio(FedSMParams().selector_width) <= 3
    assert ratio(0.125) > 10  # the selector of width 0.125: its gradients outweigh the U-Net


def test_one_site_is_rejected_and_lambda_below_one_over_k_runs_with_a_warning(workload):
    """λ = 0.2 < 1/K = 1/3 (K = 3): SoftPull gives the own model 0.2 and each other site's 0.4 —
    allowed (the paper's Table 7 has λ = 0.1 with K = 6) but warned; λ outside [0, 1] is rejected."""
    from fedseg.algorithms.softpull import LambdaBelowOneOverKWarning

    one = dict(list(tiny_sites().items())[:1])
    with pytest.raises(ConfigError, match="at least 2 sites"):
        simulate(tiny_config("fedsm", rounds=1), workload, one, progress=False)
    with pytest.warns(
        LambdaBelowOneOverKWarning,
        match=r"fedsm.lam = 0.2 is below 1/K = 0.3333 .* weighs 0.2 .* every other site's 0.4 — more than its own",
    ):
        res = simulate(_with(tiny_config("fedsm", rounds=1), lam=0.2), workload, tiny_sites(), progress=False)
    assert res["config"]["fedsm"]["lam"] == 0.2
    assert res["config"]["fedsm"]["gamma_margin"] == 0.01  # the resolved default is written down
    with pytest.raises(ConfigError, match=r"fedsm.lam = 1.5 must be in \[0, 1\]"):
        simulate(_with(tiny_config("fedsm", rounds=1), lam=1.5), workload, tiny_sites(), progress=False)


# ------------------------------------------------------- Table 5 / Table 7 runners
@pytest.fixture(scope="module")
def tiny_spec(tmp_path_factory):
    from fedseg.data.synth import synthesize

    return synthesize("prostate", tmp_path_factory.mktemp("fed"), seed=0, scale=0.005, size=16)


TINY_OVERRIDES = [
    "model.channels=[4, 8, 16]",
    "model.strides=[2, 2]",
    "model.num_res_units=1",
    "train.batch_size=4",
    "train.local_steps=1",
    "train.local_epochs=none",
    "checkpoint_every=10",
]


def test_unseen_site_runner_writes_the_table5_layout(tmp_path, tiny_spec):
    from fedseg.apps.studies.fedsm import unseen

    rows, table = unseen(
        tiny_spec, tmp_path, TINY_OVERRIDES, sites=["site2"], gammas=[0.0, 0.9], rounds=1, log=lambda m: None
    )
    r = rows[0]
    # selection frequencies over GM and the five remaining PMs sum to 1 at γ = 0, with no GM (γ = 0)
    assert set(r["selection_at_0"]) == {"global", *(f"personal/site{i}" for i in (1, 3, 4, 5, 6))}
    assert sum(r["selection_at_0"].values()) == pytest.approx(1.0)
    assert r["selection_at_0"]["global"] == 0.0
    # the grid: the given γ values plus the run's own (γ = auto picks one on validation)
    assert {0.0, 0.9} <= {float(g) for g in r["dice_by_gamma"]}
    assert r["best_dice"] >= r["dice_at_0"] and r["best_gamma"] in {float(g) for g in r["dice_by_gamma"]}
    # what the run chose on its five training sites' validation, and the unseen site's Dice with it: with one
    # γ, the grid's Dice at that γ; with one per personalized model, five thresholds
    assert 0.0 <= r["dice_at_chosen"] <= 1.0
    if r["gamma_per_model"] is None:
        assert r["dice_at_chosen"] == pytest.approx(r["dice_by_gamma"][float(r["gamma"])])
    else:
        assert len(r["gamma_per_model"]) == 5
    header = table.splitlines()[0]
    assert header.startswith("| Unseen site | γ | GM | PM site1 | PM site2 |") and header.endswith(
        "Dice | Best γ, Dice |"
    )
    assert "| site2 | 0 |" in table and "N/A" in table.splitlines()[2]
    assert (tmp_path / "unseen.md").read_text() == table


def test_lambda_sweep_writes_the_table7_layout_and_runs_lambda_below_one_over_k(tmp_path, tiny_spec):
    from fedseg.cli import main

    # Execute through the CLI verb (a thin wrapper over fedsm_experiments.sweep); λ = 0.1 < 1/K warns
    with pytest.warns(LambdaBelowOneOverKWarning, match=r"fedsm.lam = 0.1 is below 1/K"):
        rc = main(
            [
                "fedsm",
                "sweep",
                str(tiny_spec),
                "--lam",
                "0.1,0.7",
                "--gamma",
                "0,0.9",
                "--rounds",
                "1",
                "--out",
                str(tmp_path),
                *[a for o in TINY_OVERRIDES for a in ("--set", o)],
            ]
        )
    assert rc == 0
    table = (tmp_path / "sweep.md").read_text()
    lines = table.splitlines()
    assert lines[0] == "| λ | 0.1 | 0.7 |"
    # λ = 0.1 < 1/K = 1/6 runs (Table 7's first column), with a warning
    assert lines[2].startswith("| Client Avg | 0.") and lines[3].startswith("| Global | 0.")
    assert "rejected" not in table
    rows = json.loads((tmp_path / "sweep.json").read_text())
    assert set(rows[1]["dice_by_gamma"]) >= {"0.0", "0.9"}


def test_a_study_over_seeds_runs_each_seed_in_its_folder_and_tabulates_them(tmp_path, tiny_spec, capsys):
    """``--seeds 0,1``: one sweep per seed in OUT/seed<N> (each run's config holds its seed), then
    OUT/sweep.md over both, which ``fedseg fedsm table`` reproduces from the two folders alone."""
    from fedseg.cli import main

    args = ["--lam", "0.7", "--gamma", "0", "--rounds", "1", "--out", str(tmp_path)]
    args += [a for o in TINY_OVERRIDES for a in ("--set", o)]
    assert main(["fedsm", "sweep", str(tiny_spec), "--seeds", "0,1", *args]) == 0
    for seed in (0, 1):
        res = json.loads((tmp_path / f"seed{seed}" / "lam0.7" / "results.json").read_text())
        assert res["config"]["seed"] == seed
    table = (tmp_path / "sweep.md").read_text()
    assert table.splitlines()[0] == "| λ | 0.7 |" and "over 2 seed(s)" in table
    assert (
        main(["fedsm", "table", str(tmp_path / "seed0"), str(tmp_path / "seed1"), "--md", str(tmp_path / "t.md")]) == 0
    )
    assert (tmp_path / "t.md").read_text() == table
    # one run or one per seed, not both
    assert main(["fedsm", "sweep", str(tiny_spec), "--seed", "0", "--seeds", "0,1", *args]) == 2
    assert "not both" in capsys.readouterr().err


def test_gamma_choice_scores_two_models_a_case_and_chooses_what_scoring_all_of_them_chooses(tmp_path, sites, workload):
    """γ-gated routing sends a case to the global model or to its top class's personalized model (Alg. 2:
    ``max ŷ > γ`` → PM argmax + 1, else 0), never to another, so the γ search during a run asks the sites for
    ``per_model = False``: two forward passes a case instead of K + 1 (here 2 of 4).  Its selections (Dice
    sums, counts, per-top sums, for every γ of the grid and the per-model thresholds) must be those of the
    full scoring, the diagnosis' per-model Dice is left out (null) and the reply check accepts exactly that."""
    from fedseg.algorithms.fedsm import route_task
    from fedseg.algorithms.fedsm.selection import check_route_metrics
    from fedseg.foundation.errors import PayloadError
    from fedseg.simulation.runner import build_engine

    # Prepare: a finished run whose selector routes cases to more than one model
    grid = [0.0, 0.4, 0.6, 1.0]
    cfg = _with(tiny_config("fedsm", rounds=2), gamma="auto-per-model", gamma_grid=grid)
    engine = build_engine(cfg, workload, sites, out=tmp_path, progress=False, log=lambda m: None)
    engine.run()
    cand = engine.best["fedsm"].candidate
    calls = []
    model_predict = workload.predict

    def counting(model, x):
        calls.append(x.shape[0])
        return model_predict(model, x)

    workload.predict = counting  # (the sites share the workload object)
    # Execute
    try:
        full = route_task(engine.transport, cand, list(sites), "validation", grid)
        n_full, calls[:] = sum(calls), []
        pair = route_task(engine.transport, cand, list(sites), "validation", grid, per_model=False)
        n_pair = sum(calls)
    finally:
        workload.predict = model_predict
    # Assert
    cases = sum(r["n"] for r in full.values())
    assert n_full == (len(sites) + 1) * cases and n_pair == 2 * cases
    for s in sites:
        assert pair[s]["dice_sum_per_model"] is None and full[s]["dice_sum_per_model"] is not None
        assert len(pair[s]["selections"]) == len(grid) + 1  # the grid and the per-model thresholds
        for a, b in zip(pair[s]["selections"], full[s]["selections"], strict=True):
            assert a["gamma"] == b["gamma"] and a["counts"] == b["counts"]
            assert a["dice_sum"] == pytest.approx(b["dice_sum"], abs=1e-9)
            assert a["dice_sum_by_top"] == pytest.approx(b["dice_sum_by_top"], abs=1e-9)
    assert len({tuple(sel["counts"]) for r in full.values() for sel in r["selections"]}) > 1  # γ changes routing
    for s in sites:  # at γ = 0 every case goes to its top class's personalized model
        assert full[s]["n_by_top"] == pair[s]["n_by_top"] == full[s]["selections"][grid.index(0.0)]["counts"][1:]
    config = {**cand.config, "gammas": grid}
    check_route_metrics({**config, "per_model": False}, pair["site1"])
    with pytest.raises(PayloadError, match="must be null"):
        check_route_metrics({**config, "per_model": False}, full["site1"])
    with pytest.raises(PayloadError, match="dice_sum_per_model is not"):
        check_route_metrics(config, pair["site1"])


def test_table7_over_seeds_gives_mean_and_sd_per_lambda_and_gamma():
    """Two seeds, λ 0.1 and 0.7: Client Avg 0.6 and 0.8 → 0.7000 ± 0.1414 (sd with n − 1: √(2·0.1²/1));
    the γ used by each seed's run is listed; the per-γ Dice is averaged the same way."""
    from fedseg.apps.studies.fedsm_seeds import table7_over_seeds

    def row(lam, ca, gd, gamma, d0):
        return {"lam": lam, "client_avg_dice": ca, "global_dice": gd, "gamma": gamma, "dice_by_gamma": {"0.0": d0}}

    seeds = [
        [row(0.1, 0.6, 0.5, 0.0, 0.4), row(0.7, 0.9, 0.9, 0.9, 0.8)],
        [row(0.1, 0.8, 0.5, 1.0, 0.6), row(0.7, 0.9, 0.7, 0.0, 0.8)],
    ]
    lines = table7_over_seeds(seeds).splitlines()
    assert lines[0] == "| λ | 0.1 | 0.7 |"
    assert lines[2] == "| Client Avg | 0.7000 ± 0.1414 | 0.9000 ± 0.0000 |"
    assert lines[3] == "| Global | 0.5000 ± 0.0000 | 0.8000 ± 0.1414 |"
    assert lines[4] == "| γ used (per seed) | 0, 1 | 0.9, 0 |"
    assert "| 0 | 0.5000 ± 0.1414 | 0.8000 ± 0.0000 |" in lines


def test_table5_over_seeds_averages_the_selection_frequencies_and_the_dice():
    """Site1 held out in two seeds: PM site2 chosen for 1.0 and 0.5 of its images → 0.75; PM site3 0 and
    0.5 → 0.25; Dice 0.2 and 0.4 → 0.3000 ± 0.1414; the best γ of each seed listed."""
    from fedseg.apps.studies.fedsm_seeds import table5_over_seeds

    def row(sel2, sel3, dice, best_g, best):
        sel = {"global": 0.0, "personal/site2": sel2, "personal/site3": sel3}
        return {"site": "site1", "selection_at_0": sel, "dice_at_0": dice, "best_gamma": best_g, "best_dice": best}

    lines = table5_over_seeds([[row(1.0, 0.0, 0.2, 0.0, 0.2)], [row(0.5, 0.5, 0.4, 0.9, 0.6)]]).splitlines()
    assert (
        lines[0]
        == "| Unseen site | γ | GM | PM site1 | PM site2 | PM site3 | Dice | Best γ (per seed) | Best γ's Dice |"
    )
    assert lines[2] == "| site1 | 0 | 0.00 | N/A | 0.75 | 0.25 | 0.3000 ± 0.1414 | 0, 0.9 | 0.4000 ± 0.2828 |"


def test_tabulate_names_a_folder_that_holds_no_study_and_refuses_mixed_studies(tmp_path):
    from fedseg.apps.studies.fedsm_seeds import tabulate

    (tmp_path / "a").mkdir()
    with pytest.raises(ConfigError, match=r"a: expected the output folder of one FedSM study .* found neither"):
        tabulate([tmp_path / "a"])
    (tmp_path / "a" / "sweep.json").write_text("[]")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "unseen.json").write_text("[]")
    with pytest.raises(ConfigError, match=r"different studies \(\['sweep', 'unseen'\]\)"):
        tabulate([tmp_path / "a", tmp_path / "b"])


def test_selector_steps_limits_the_selector_work_per_round(tmp_path, sites, workload):
    """local_steps = 3, selector_steps = 1: the models take 3 Adam steps, the selector 1,
    so the averaged selector step count is exactly 1 and a site's personal-model count 3."""
    cfg = _with(
        tiny_config("fedsm", rounds=1, local_steps=3, local_epochs=None), selector_steps=1, selector_training="fedavg"
    )
    simulate(cfg, workload, sites, out=tmp_path, progress=False)
    server = load_file(str(tmp_path / "checkpoints/server.safetensors"))
    steps = {float(v) for k, v in server.items() if k.startswith("selector_optim/") and k.endswith("/step")}
    assert steps == {1.0}
    site = load_file(str(tmp_path / "checkpoints/sites/site1.safetensors"))
    assert float(site["optim/personal/0/step"]) == 3.0


# ------------------------------------------------------------- best models
def test_keep_best_selector_keeps_the_selector_with_the_best_mean_routing_accuracy():
    """Round r reports the accuracies of the selector held at its start (after round r − 1):
    means 0.5 (r0), 0.75 (r1), 0.6 (r2) → the kept selector is r1's, score 0.75, round 1;
    a None/NaN site is left out of the mean."""
    from fedseg.algorithms.fedsm import keep_best_selector

    state: dict[str, torch.Tensor] = {}
    for rnd, (sel, accs) in enumerate(
        [(0.0, {"a": 0.5, "b": 0.5}), (1.0, {"a": 1.0, "b": 0.5, "c": None}), (2.0, {"a": 0.6, "b": float("nan")})],
        start=1,
    ):
        keep_best_selector(state, {"selector/w": torch.tensor([sel])}, accs, rnd - 1)
    assert state["best_selector/w"].item() == 1.0
    assert state["best_selector_score"].item() == pytest.approx(0.75)
    assert int(state["best_selector_round"]) == 1


@pytest.mark.parametrize("method", ["fedsm", "fedsm-extra"])
def test_composite_is_assembled_from_the_best_parts(tmp_path, sites, workload, method):
    """The tested composite holds the best-validation global model and each site's best-validation
    personalized model (fedsm-extra: the best of its model phase, the only rounds they are validated)
    and a selector that is the final one or the best kept one; the rounds are recorded."""
    # Prepare
    cfg = _with(tiny_config(method, rounds=4), selector_width=0.0625, selector_hidden=8, selector_rounds=2)
    # Execute
    res = simulate(cfg, workload, sites, out=tmp_path, progress=False)
    # Assert
    best = load_file(str(tmp_path / "checkpoints/best.safetensors"))
    meta = json.loads((tmp_path / "checkpoints/best.json").read_text())
    server = load_file(str(tmp_path / "checkpoints/server.safetensors"))
    assembled = meta["fedsm"]["config"]["assembled"]
    for name in ["global", *(f"personal/{s}" for s in sites)]:
        part = {k: v for k, v in best.items() if k.startswith(name + "/")}
        assert part and all(torch.equal(best["fedsm/" + k], v) for k, v in part.items()), name
        assert assembled[name] == meta[name]["round"]
        if method == "fedsm-extra":
            assert meta[name]["round"] <= 2  # model phase
    sel = {k.removeprefix("fedsm/selector/"): v for k, v in best.items() if k.startswith("fedsm/selector/")}
    final = {k.removeprefix("selector/"): v for k, v in server.items() if k.startswith("selector/")}
    kept = {k.removeprefix("best_selector/"): v for k, v in server.items() if k.startswith("best_selector/")}
    assert all(torch.equal(sel[k], final[k]) for k in final) or all(torch.equal(sel[k], kept[k]) for k in kept)
    assert 0.0 <= assembled["selector_val_routing_acc"] <= 1.0
    # the method's row is that composite, tested
    assert res["per_site_dice"] == next(r for r in res["rows"] if r["name"] == "fedsm")["per_site_dice"]


# ------------------------------------------------------- settings written down
@pytest.mark.parametrize(
    "profile,expect",
    [
        (
            None,
            {
                "profile": "default",
                "gamma": "auto-per-model",
                "selector_training": "fga",
                "selector_steps": "all",
                "selector_weighting": "even",
                "selector_augment": "flip",
            },
        ),
        (
            "reference",
            {
                "profile": "reference",
                "gamma": 0.9,
                "selector_training": "fedavg",
                "selector_steps": "all",
                "selector_weighting": "samples",
                "selector_augment": "none",
            },
        ),
    ],
)
def test_resolved_fedsm_settings_are_written_and_reload_to_the_same_run(tmp_path, sites, workload, profile, expect):
    """With no [fedsm] settings (or only the profile) config.toml and results.json["config"] hold the
    resolved section (γ, λ, the selector's training…); config.toml loads back to the same settings."""
    from fedseg.algorithms import get_algorithm, known_sections
    from fedseg.foundation.config import load_run_config

    cfg = tiny_config("fedsm", rounds=1)
    if profile is not None:
        cfg = _with(cfg, profile=profile)
    res = simulate(cfg, workload, sites, out=tmp_path, progress=False)
    section = res["config"]["fedsm"]
    assert {k: section[k] for k in expect} == expect and section["lam"] == 0.7
    text = (tmp_path / "config.toml").read_text()
    assert "[fedsm]" in text and "lam = 0.7" in text
    back = load_run_config(tmp_path / "config.toml", known_sections=known_sections())
    assert get_algorithm(back).params == get_algorithm(cfg).params


def test_study_tables_show_the_thresholds_each_run_chose_and_the_unseen_sites_dice_with_them():
    """With ``fedsm.gamma = "auto-per-model"`` a run's γ is one threshold per personalized model: the λ
    table lists them per seed, and the unseen-site table adds the thresholds chosen on the training sites'
    validation with the unseen site's Dice at them (0.5 and 0.7 → 0.6000 ± 0.1414)."""
    from fedseg.apps.studies.fedsm_seeds import table5_over_seeds, table7_over_seeds

    def lam_row(per):
        return {"lam": 0.7, "client_avg_dice": 0.8, "global_dice": 0.8, "gamma": 0.0, "gamma_per_model": per}

    lines = table7_over_seeds([[lam_row([0, 1, 0.95])], [lam_row(None)]]).splitlines()
    assert lines[4] == "| γ used (per seed) | (0, 1, 0.95), 0 |"

    def row(per, d):
        sel = {"global": 0.0, "personal/site2": 1.0}
        return {
            "site": "site1",
            "selection_at_0": sel,
            "dice_at_0": 0.2,
            "best_gamma": 1.0,
            "best_dice": 0.6,
            "gamma": 0.0,
            "gamma_per_model": per,
            "dice_at_chosen": d,
        }

    lines = table5_over_seeds([[row([0, 1], 0.5)], [row([1, 0.9], 0.7)]]).splitlines()
    assert lines[0].endswith("| γ chosen on validation (per seed) | Its Dice |")
    assert lines[2].endswith("| (0, 1); (1, 0.9) | 0.6000 ± 0.1414 |")


# ------------------------------------------------ the global model by gradient averaging
def test_global_model_by_gradient_averaging_is_fgas_and_the_personalized_models_are_softpulls(
    tmp_path, sites, workload
):
    """``fedsm.global_training = "fga"``: the global model takes one lockstep exchange per local step, on the
    round's seeded batches from the same initial weights, each site applying the sample-weighted mean gradient
    with its own Adam — exactly the FGA method's computation (Remedios et al.: centralized training on the pooled
    batches), so after 3 rounds FedSM's global model equals FGA's bitwise.  SoftPull's personalized models
    (Eq. 11) read only w_{p,k} and site k's batches, never the global model, so they equal those of a run whose
    global model is averaged (``"fedavg"``) bitwise; the global models of the two runs differ."""
    runs = {}
    for name, cfg in (
        ("fga", tiny_config("fga", rounds=3)),
        ("by_fga", _with(tiny_config("fedsm", rounds=3), global_training="fga", selector_width=0.0625)),
        ("by_avg", _with(tiny_config("fedsm", rounds=3), selector_width=0.0625)),
    ):
        res = simulate(cfg, workload, sites, out=tmp_path / name, progress=False)
        runs[name] = (res, load_file(str(tmp_path / name / "checkpoints/server.safetensors")))
    fga, by_fga, by_avg = (runs[n][1] for n in ("fga", "by_fga", "by_avg"))
    glob = [k for k in fga if k.startswith("global/")]
    personal = [k for k in by_avg if k.startswith("personal/")]
    assert glob and personal
    assert all(torch.equal(fga[k], by_fga[k]) for k in glob)
    assert not all(torch.equal(by_avg[k], by_fga[k]) for k in glob)
    assert all(torch.equal(by_avg[k], by_fga[k]) for k in personal)
    # the round's losses are the global model's, as FGA's; the settings are written down
    res = runs["by_fga"][0]
    assert [e["train_loss"] for e in res["history"]] == [e["train_loss"] for e in runs["fga"][0]["history"]]
    assert all(e["global_steps"] == 3 and e["global_in_sync"] for e in res["history"])  # epoch mode: 10 cases / 4
    assert res["config"]["fedsm"]["global_training"] == "fga"
    assert runs["by_avg"][0]["config"]["fedsm"]["global_training"] == "fedavg"


@pytest.mark.parametrize(
    "settings,match",
    [
        ({"personalization": "ditto"}, "works with fedsm.personalization = 'softpull' only"),
        ({"aggregation": "median"}, "fedsm.aggregation = 'median' combines the sites' global models"),
    ],
)
def test_global_model_by_gradient_averaging_refuses_settings_it_cannot_honour(workload, settings, match):
    cfg = _with(tiny_config("fedsm", rounds=1), global_training="fga", **settings)
    with pytest.raises(ConfigError, match=match):
        simulate(cfg, workload, tiny_sites(), progress=False)
    with pytest.raises(ConfigError, match="fga"):  # fp16 loss scaling cannot average raw gradients
        simulate(
            _with(tiny_config("fedsm", rounds=1, precision="fp16"), global_training="fga", selector_training="fedavg"),
            workload,
            tiny_sites(),
            progress=False,
        )
