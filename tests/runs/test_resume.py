"""A resumed run equals the uninterrupted run, bitwise, for every method of the registry.

Each method runs 2 rounds on 2 tiny sites twice: straight through, and stopped after round 1
(checkpointed, as a crash after that round would leave it) then resumed by fresh sites built
from the same data.  Every bit of state a method keeps — the server state (global model,
control variates, Auto-FedAvg's α, FedSM's personalized models and selector), every site's
state (models, optimizer moments, ``store``), the best models and the history — is in the
checkpoint, and every random draw is keyed by (seed, site, round, stream), so the two runs
end in identical checkpoints and results.  FedSM-extra crosses its phase boundary here
(rounds = 2: round 1 trains the models, round 2 the selector).

Method-specific resume cases that test something more live beside their method: Auto-FedAvg
resumed inside a t0 interval, CWT with a transferred optimizer, FedSM with Ditto's
personalization, the vectorized executor, fp16 scalers, the background writer, deployment.
"""

from __future__ import annotations

import json

import pytest

from fedseg.algorithms import REGISTRY
from fedseg.simulation.runner import simulate
from tests.support.helpers import assert_same_checkpoints, every_method_config, strip_times, tiny_sites

# the uninterrupted runs are shared with the deployed ones (tests/deploy/test_deploy.py): one worker runs both
pytestmark = pytest.mark.xdist_group("every-method")


@pytest.mark.parametrize("method", sorted(REGISTRY))
def test_resume_equals_uninterrupted(tmp_path, workload, simulated, method):
    # Prepare: 2 rounds straight; 1 round, "crash" (checkpointed), then resume with fresh sites
    cfg = every_method_config(method)
    full, full_out = simulated(cfg)
    part = simulate(
        cfg, workload, tiny_sites(2), out=tmp_path / "part", progress=False, stop_after=1, log=lambda m: None
    )
    assert part is None
    assert json.loads((tmp_path / "part/checkpoints/progress.json").read_text())["round"] == 1
    # Execute
    resumed = simulate(
        cfg, workload, tiny_sites(2), out=tmp_path / "part", progress=False, resume=True, log=lambda m: None
    )
    # Assert: the same checkpoint bit for bit, and the same results
    assert_same_checkpoints(full_out, tmp_path / "part")
    assert strip_times(full) == strip_times(resumed)
