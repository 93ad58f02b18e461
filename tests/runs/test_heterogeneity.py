"""The synthetic fundus preset is heterogeneous enough that local models generalize poorly (FedSM Table 3)."""

from __future__ import annotations

from fedseg.data.synth import synthesize
from fedseg.execution.federation import load_federation_data
from fedseg.foundation.config import ModelConfig, RunConfig, TrainConfig
from fedseg.simulation.runner import simulate
from fedseg.site.workload import segmentation_workload


def test_site1_local_model_scores_lower_on_other_sites(tmp_path):
    # Prepare: a small fundus federation (32x32), three of its sites
    spec = synthesize("fundus", tmp_path / "fundus", seed=0, scale=0.3, size=32)
    fed, data = load_federation_data(spec)
    data = {s: data[s] for s in ("site1", "site3", "site4")}
    model = ModelConfig(channels=(8, 16, 32, 64), strides=(2, 2, 2), num_res_units=1)
    cfg = RunConfig(
        federation=str(spec),
        method="local",
        rounds=4,
        model=model,
        train=TrainConfig(batch_size=8, local_epochs=None, local_steps=40, lr=3e-3),
    )
    workload = segmentation_workload(2, fed.in_channels, fed.labels, model, cfg.train)
    # Execute: local training, every local model tested on every site
    res = simulate(cfg, workload, data, progress=False)
    # Assert: site1's model is clearly better on site1's test set than on the other sites'
    row = next(r for r in res["rows"] if r["home_site"] == "site1")
    own = row["per_site_dice"]["site1"]
    assert own > 0.5, own
    for other in ("site3", "site4"):
        assert row["per_site_dice"][other] < own - 0.15, (other, row["per_site_dice"])
