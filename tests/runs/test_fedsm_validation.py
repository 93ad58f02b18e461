"""FedSM's validation in one pass over each site's cases: each model runs once per case, and the sums the sites
return give the candidates the validation the engine's separate evaluation gives them."""

from __future__ import annotations

import dataclasses

import pytest

from fedseg.algorithms.fedsm import route_task
from fedseg.foundation.config import RunConfig
from fedseg.simulation.runner import build_engine
from tests.support.helpers import tiny_config

GRID = [0.0, 0.4, 0.6, 1.0]


def _with(cfg: RunConfig, **fedsm) -> RunConfig:
    return dataclasses.replace(cfg, params={"fedsm": fedsm})


def _finished(tmp_path, sites, workload, stop_after: int | None = None):
    cfg = _with(tiny_config("fedsm", rounds=2), gamma="auto-per-model", gamma_grid=GRID)
    engine = build_engine(cfg, workload, sites, out=tmp_path, progress=False, log=lambda m: None)
    engine.run(stop_after=stop_after)
    return engine


def test_each_model_runs_once_a_case_and_the_sums_are_the_separate_evaluations(tmp_path, sites, workload):
    """At a site of the federation, γ-gated routing sends a case to the global model or to its top class's
    personalized model (Alg. 2), and the candidates are the composite, the global model and the site's own
    personalized model.  One pass needs the global and the own model on every case and another personalized
    model only on the cases whose top class it is: Σ_s 2 n_s + (n_s − n_s,own top) forwards, against
    2 n_s (γ search) + n_s (composite) + 2 n_s (global, personalized) evaluated apart.  The sums it returns must
    be the engine's own evaluation of the same candidates (per-case scores summed as the engine sums them), to
    rounding: a model's output on a case does not depend on which other cases share its batch."""
    # Prepare: a run whose selector routes cases to more than one model
    engine = _finished(tmp_path, sites, workload)
    algo, ctx = engine.algorithm, engine.ctx
    calls = []
    model_predict = workload.predict

    def counting(model, x):
        calls.append(x.shape[0])
        return model_predict(model, x)

    workload.predict = counting  # (the sites share the workload object)
    # Execute
    try:
        cands = algo.candidates(engine.state, ctx)
    finally:
        workload.predict = model_predict
    # Assert: the forwards of one pass
    comp = cands[0]
    replies = route_task(ctx.transport, comp, list(sites), "validation", GRID, per_model=False)
    own_top = {s: replies[s]["n_by_top"][i] for i, s in enumerate(sites)}
    n = {s: replies[s]["n"] for s in sites}
    assert sum(calls) == sum(2 * n[s] + n[s] - own_top[s] for s in sites)
    assert any(own_top[s] < n[s] for s in sites) or sum(calls) == 2 * sum(n.values())
    assert [c.name for c in cands] == ["fedsm", "global", *(f"personal/{s}" for s in sites)]
    assert all(c.scored is not None for c in cands)
    # Assert: the same validation as the engine's evaluation of each candidate on its own
    plain = [dataclasses.replace(c, scored=None) for c in cands]
    scores = engine.evaluate(plain, "validation", lambda c: c.val_sites or ctx.sites)
    for c in cands:
        assert set(c.scored) == set(scores[c.name])
        for s, cases in scores[c.name].items():
            k, total = c.scored[s]
            assert k == len(cases)
            assert total == pytest.approx(sum(sum(x) / len(x) for x in cases), abs=1e-9)
    assert comp.config["gamma_per_model"] is not None  # the composite is scored at the thresholds chosen


def test_the_best_candidates_share_one_snapshot_of_each_tensor(tmp_path, sites, workload):
    """The composite holds the global and personalized models' tensors; when it and they improve in the same round
    the engine keeps one copy of each tensor for all of them, never the server state's own tensors (which the next
    round replaces)."""
    # Execute: one validated round, where every candidate improves (from nothing); stopped before the final assembly
    engine = _finished(tmp_path, sites, workload, stop_after=1)
    # Assert
    best = {name: b.candidate.arrays for name, b in engine.best.items()}
    assert {b.round for b in engine.best.values()} == {1}
    glob = {k: v for k, v in best["fedsm"].items() if k.startswith("global/")}
    assert glob and all(best["global"][k.removeprefix("global/")] is v for k, v in glob.items())
    for s in sites:
        mine = {k: v for k, v in best["fedsm"].items() if k.startswith(f"personal/{s}/")}
        assert all(best[f"personal/{s}"][k.removeprefix(f"personal/{s}/")] is v for k, v in mine.items())
    state_ids = {id(v) for v in engine.state.values()}
    assert not any(id(v) in state_ids for arrays in best.values() for v in arrays.values())
