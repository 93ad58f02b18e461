"""The benchmarks' operator counter (benchmarks/_operators.py) attributes every dispatched operator of a round
to the model role and the phase that caused it, without changing what the run computes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from fedseg.simulation.runner import build_engine
from tests.support.helpers import tiny_config

_spec = importlib.util.spec_from_file_location(
    "_operators", Path(__file__).resolve().parents[2] / "benchmarks" / "_operators.py"
)
assert _spec is not None and _spec.loader is not None
_operators = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_operators)
OperatorCounter, role_of = _operators.OperatorCounter, _operators.role_of


def _counted(method: str, sites, workload):
    cfg = tiny_config(method, rounds=1)
    engine = build_engine(cfg, workload, sites, progress=False, log=lambda m: None)
    counter = OperatorCounter()
    with counter.attach(engine):
        results = engine.run()
    return counter, results


def test_roles_and_phases_of_fedsm_and_fedavg_rounds(sites, workload):
    """FedSM's round dispatches operators for its global and personalized models and its selector in training,
    and for routing in validation; FedAvg's only for its global model.  Views are apart; the counted run gives
    the numbers of the run without the counter, bit for bit."""
    assert role_of("fedsm-eval/p3") == "personalized" and role_of("frozen/global") == "global"
    assert role_of("eval") is None and role_of("fedsm-eval/selector7") == "selector"
    counter, counted = _counted("fedsm", sites, workload)
    per = counter.per_round()
    for role in ("global", "personalized", "selector", "server"):
        assert per[role]["training"] > 0, role
    assert per["routing"]["validation"] > 0 and per["routing"]["training"] == 0
    assert per["selector"]["validation"] == 0  # a selector validated routes
    assert sum(counter.per_round(views=True)[r]["training"] for r in per) > 0
    assert counter.round == 1 and counter.phase == "other"
    plain = build_engine(tiny_config("fedsm", rounds=1), workload, sites, progress=False, log=lambda m: None).run()
    assert plain is not None and counted is not None
    assert plain["per_case_dice"] == counted["per_case_dice"]
    fedavg, _ = _counted("fedavg", sites, workload)
    per = fedavg.per_round()
    assert per["global"]["training"] > 0 and per["global"]["validation"] > 0
    assert all(per[r]["training"] == per[r]["validation"] == 0 for r in ("personalized", "selector", "routing"))
    assert torch.nn.modules.module._global_forward_pre_hooks == {}  # the hook went with the counter
