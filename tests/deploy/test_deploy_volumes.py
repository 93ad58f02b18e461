"""A volume run deployed: the plan made over the wire from the sites' fingerprints is `fedseg plan`'s, and
FedAvg on it ends with the simulation's weights and Dice bitwise.

The sites are :class:`SiteRuntime` objects with the default loader (their own datalists, the plan's grid,
the cache) behind the in-process byte channel; the NVIDIA FLARE carrier is tested on the same server and
site halves in ``tests/deploy/test_deploy_nvflare.py``.
"""

from __future__ import annotations

import json

import pytest

from fedseg.data.spec import load_federation
from fedseg.data.volumes.budget import device_budget
from fedseg.data.volumes.load import (
    ensure_plan,
    load_volume_site,
    pad_to_common_shape,
    plan_federation,
    plan_path,
)
from fedseg.data.volumes.plan import save_plan
from fedseg.deployment.params import deploy_params
from fedseg.deployment.server import load_deploy_config, prepare_run, serve
from fedseg.deployment.site import SiteConfig, SiteRuntime
from fedseg.deployment.transport import LoopbackChannel, RemoteTransport
from fedseg.deployment.volumes import plan_and_shape, site_cache_setting, site_operation
from fedseg.execution.federation import load_federation_data, plan_volume_run
from fedseg.foundation.errors import PayloadError
from fedseg.simulation.runner import run
from fedseg.site.batches import SiteData
from tests.runs.test_patches2d import patches2d_federation
from tests.runs.test_volumes_run import write_federation
from tests.support.helpers import assert_same_arrays, server_state

# deployed in the clear (a deployment's default is secure aggregation) to equal the simulation bitwise
RUN = [
    "rounds=2",
    "train.local_steps=1",
    "train.batch_size=2",
    "model.num_res_units=0",
    "eval.every=1",
    "privacy.secure_aggregation=false",
    "checkpoint_keep=final",  # the simulated run's last server state is compared with the deployed one's
]


def _budget():
    """The budget the sites report and a simulation plans for: this machine's device at the run's batch
    (a CPU's throughput fixed by the suite's ``FEDSEG_CPU_GFLOPS``)."""
    return device_budget("auto", batch=2)


def _runtimes(spec, tmp_path):
    fed = load_federation(spec)
    return {
        s.name: SiteRuntime(SiteConfig(s.name, str(s.datalist), str(tmp_path / "sites" / s.name))) for s in fed.sites
    }


def _planned(tmp_path, call=None):
    """A prepared deploy run on a tiny two-site volume federation (no plan beside the spec), planned over the
    in-process channel: ``(spec, plan, header, logs)``."""
    spec = write_federation(tmp_path / "data", n=(2, 1, 1))
    cfg = load_deploy_config(spec, RUN)
    out = tmp_path / "dep"
    desc = prepare_run(cfg, out)
    logs: list[str] = []
    transport = RemoteTransport(
        desc["sites"], call or LoopbackChannel(_runtimes(spec, tmp_path)), deploy_params(cfg), log=logs.append
    )
    _, header, plan = plan_and_shape(out, desc, cfg, transport, 60.0, logs.append)
    return spec, plan, header, logs


def test_deployed_fingerprint_gives_the_plan_of_fedseg_plan_and_the_simulations_shape(tmp_path):
    """The sites' fingerprint and histogram replies, combined by the server in federation order, are the
    numbers `fedseg plan` combines in one process: the same plan, field for field; the volume shape the
    sites agree is the one the simulation pads every site to."""
    spec, plan, header, _ = _planned(tmp_path)
    assert plan.to_json() == plan_federation(load_federation(spec), log=lambda m: None, budget=_budget()).to_json()
    assert plan.intensity["channels"][0]["mode"] == "ct" and plan.sites == ["lps", "ras"]
    fed = load_federation(spec)  # the simulation's padding of every split of every site to one shape
    data = {s.name: SiteData(*load_volume_site(fed, s, plan, "auto", log=lambda m: None)) for s in fed.sites}
    assert header["volume_shape"] == list(pad_to_common_shape(data)["lps"].train.images.shape[2:])
    assert header["plan"] == plan.to_json()


def test_malformed_fingerprint_over_the_wire_is_rejected_and_the_plan_uses_the_other_site(tmp_path):
    spec = write_federation(tmp_path / "data", n=(2, 1, 1))
    channel = LoopbackChannel(_runtimes(spec, tmp_path))
    hostile = json.dumps({"site": "lps", "fingerprint": {"version": 1, "cases": [], "foreground": {"count": -1}}})

    def call(site, op, payload, timeout):
        return hostile.encode() if (site, op) == ("lps", "fingerprint") else channel(site, op, payload, timeout)

    _, plan, _, logs = _planned(tmp_path, call)
    assert plan.sites == ["ras"] and "lps" in plan.rejected
    assert any("fingerprint of site lps rejected" in m for m in logs)


@pytest.mark.parametrize("reads", ["auto", "cache"])
def test_deployed_volume_run_plans_like_fedseg_plan_and_equals_simulation(tmp_path, reads, caplog):
    """No plan beside the spec: the server asks the sites for fingerprints and histograms, makes the plan
    (the same numbers `fedseg plan` combines, in the same order, so the same plan to the last bit), agrees
    one volume shape, and the run is the simulation's (same grid, same padding, same seeds), also when the
    sites read their volumes from their caches as used (``volume_reads = "cache"``) and the simulation
    holds them in memory."""
    # Prepare
    spec = write_federation(tmp_path / "data", n=(2, 1, 1))
    cfg = load_deploy_config(spec, [*RUN, "deploy.round_deadline_s=120", f"volume_reads={reads}"])
    prepare_run(cfg, tmp_path / "dep")
    logs: list[str] = []
    # Execute
    with caplog.at_level("INFO", logger="fedseg.deployment.site"):
        dep = serve(tmp_path / "dep", LoopbackChannel(_runtimes(spec, tmp_path)), log=logs.append)
    expected = plan_federation(load_federation(spec), log=lambda m: None, budget=_budget())
    sim = run(spec, out=tmp_path / "sim", overrides=[*RUN, "volume_cache=off"], progress=False, log=lambda m: None)
    # Assert
    sites_said = [r.getMessage() for r in caplog.records if r.name == "fedseg.deployment.site"]
    assert (reads == "cache") == any("read from the cache as used" in m for m in sites_said)
    deployed_plan = json.loads((tmp_path / "dep" / "plan.json").read_text())
    assert deployed_plan == expected.to_json() == sim["plan"] == dep["plan"]
    assert any("plan made from the fingerprints" in m for m in logs)
    desc = json.loads((tmp_path / "dep" / "deploy.json").read_text())
    assert desc["plan"] == deployed_plan and len(desc["volume_shape"]) == 3
    assert_same_arrays(server_state(tmp_path / "dep"), server_state(tmp_path / "sim"))
    assert dep["per_site_dice"] == sim["per_site_dice"] and dep["num_cases"] == sim["num_cases"]
    assert dep["deploy"]["dropouts"] == []


def test_planning_operations_refuse_a_malformed_request(tmp_path):
    spec = write_federation(tmp_path / "data", n=(2, 1, 1))
    site = load_federation(spec).site("ras")
    header = {"mode": "3d", "spatial_dims": 3, "in_channels": 1, "labels": {"mass": [1]}, "image_size": None}
    bad = [{"channel": 0, "lo": 1.0, "hi": float("nan"), "bins": 8}]
    with pytest.raises(PayloadError, match="histogram requests"):
        site_operation("ras", site.datalist, "histogram", {"data": header, "requests": bad, "weighting": "case"}, print)
    past = [{"channel": 1, "lo": 0.0, "hi": 1.0, "bins": 8}]
    with pytest.raises(PayloadError, match="past in_channels"):
        site_operation(
            "ras", site.datalist, "histogram", {"data": header, "requests": past, "weighting": "case"}, print
        )
    with pytest.raises(PayloadError, match="no volume data header"):
        site_operation("ras", site.datalist, "fingerprint", {"data": {**header, "mode": "2d"}}, print)
    logs: list[str] = []  # the server does not choose where a site writes
    assert site_cache_setting("/etc", "ras", logs.append) == "auto" and "names a folder" in logs[0]
    assert site_cache_setting("off", "ras", logs.append) == "off"
    fp = site_operation("ras", site.datalist, "fingerprint", {"data": header}, print)["fingerprint"]
    assert len(fp["cases"]) == 2 and fp["channels"][0]["foreground"]["count"] > 0  # aggregate numbers only


def test_volume_run_rehearsed_over_nvidia_flare_equals_simulation(tmp_path, flare_cluster):
    """The same over NVIDIA FLARE: a server and two site processes with mutual TLS on 127.0.0.1 (the volume
    sites of the shared cluster, ``rehearse`` submitting one more job to it); the plan is made from the
    fingerprints the sites send through FLARE."""
    from fedseg.deployment.run import rehearse

    spec = flare_cluster.volumes
    assert not plan_path(load_federation(spec)).exists()  # no plan beside the spec: made over the wire
    overrides = [*RUN, "deploy.round_deadline_s=60", "deploy.setup_timeout_s=90"]
    dep = rehearse(spec, 2, tmp_path / "dep", overrides=overrides, timeout=150, cluster=flare_cluster.cluster)
    sim = run(spec, out=tmp_path / "sim", overrides=RUN, progress=False, log=lambda m: None)
    assert dep is not None and dep["plan"] == sim["plan"]
    assert_same_arrays(server_state(tmp_path / "dep"), server_state(tmp_path / "sim"))
    assert dep["per_site_dice"] == sim["per_site_dice"] and dep["deploy"]["dropouts"] == []


def _deploy(spec, tmp_path, overrides, folder="dep"):
    """Prepare and serve a deployed run over the in-process byte channel: ``(results, logs)``."""
    # in the clear, as the simulations these runs are compared with
    cfg = load_deploy_config(spec, ["privacy.secure_aggregation=false", *overrides, "deploy.round_deadline_s=120"])
    prepare_run(cfg, tmp_path / folder)
    logs: list[str] = []
    dep = serve(tmp_path / folder, LoopbackChannel(_runtimes(spec, tmp_path)), log=logs.append)
    return dep, logs


def test_deployed_patches2d_fedavg_equals_simulation(tmp_path):
    """``mode = "patches2d"`` deployed: the same plan over the wire, slices for training and volumes for
    evaluation at every site, one common shape (the slices' in-plane axes and the volumes' three), the
    plan's in-plane patch; FedAvg ends with the simulation's weights and Dice bitwise."""
    spec = patches2d_federation(tmp_path / "data", n=(2, 1, 1))
    run2d = ["rounds=2", "train.local_steps=2", "train.batch_size=4", "model.num_res_units=0", "checkpoint_keep=final"]
    dep, logs = _deploy(spec, tmp_path, run2d)
    sim = run(spec, out=tmp_path / "sim", overrides=[*run2d, "volume_cache=off"], progress=False, log=lambda m: None)
    assert any("2D patches of axial slices" in m for m in logs)
    assert dep["plan"] == sim["plan"]
    assert load_deploy_config(tmp_path / "dep" / "config.toml").model.roi_size == (32, 32)
    assert_same_arrays(server_state(tmp_path / "dep"), server_state(tmp_path / "sim"))
    assert dep["per_site_dice"] == sim["per_site_dice"] and dep["num_cases"] == sim["num_cases"] == {"ras": 1, "lps": 1}


def test_deployed_plan_follows_the_spec_intensity_as_fedseg_plan(tmp_path):
    """``data.intensity = "window"`` travels in the data header: the plan made over the wire is the plan
    `fedseg plan` makes on that spec; over a plan file beside the spec, the window replaces its scheme at
    ``prepare_run`` exactly as a simulation's ``ensure_plan`` does."""
    spec = patches2d_federation(tmp_path / "data", 'intensity = "window"\nwindow = [-100, 100]\n', n=(2, 1, 1))
    fed = load_federation(spec)
    cfg = load_deploy_config(spec, RUN)
    desc = prepare_run(cfg, tmp_path / "dep")
    assert desc["data"]["intensity"] == "window" and desc["data"]["window"] == [-100.0, 100.0]
    transport = RemoteTransport(desc["sites"], LoopbackChannel(_runtimes(spec, tmp_path)), deploy_params(cfg))
    _, header, plan = plan_and_shape(tmp_path / "dep", desc, cfg, transport, 60.0, lambda m: None)
    assert plan.intensity == {"channels": [{"name": "0", "mode": "window", "window": [-100.0, 100.0]}]}
    assert plan.to_json() == plan_federation(fed, log=lambda m: None, budget=_budget()).to_json()
    # over a plan file made with the plan's own scheme ("ct"), the spec's window wins in both
    save_plan(
        plan_federation(load_federation(write_federation(tmp_path / "ct", n=(2, 1, 1))), log=print), plan_path(fed)
    )
    windowed = prepare_run(cfg, tmp_path / "dep2")["plan"]
    assert windowed == ensure_plan(fed, log=lambda m: None).to_json()
    (channel,) = windowed["intensity"]["channels"]
    assert channel["mode"] == "window" and "mean" not in channel
    bad = {**header, "intensity": "hu"}
    with pytest.raises(PayloadError, match="intensity 'hu'"):
        site_operation("ras", fed.site("ras").datalist, "fingerprint", {"data": bad}, print)


VALIDATE_OFTEN = ["train.local_steps=1", "train.batch_size=2", "model.num_res_units=0", "model.roi_size=[8, 8, 8]"]
VALIDATE_OFTEN += ["model.channels=[4, 8]", "model.strides=[2]", "checkpoint_keep=final"]


def test_deployed_server_derives_the_simulations_validation_interval(tmp_path):
    """The sites report their training and validation case counts with the volume shape; the server derives
    ``eval.every`` from them and the agreed shape as a simulation does from its loaded splits: 50 sliding
    windows of 8³ per validation volume against 2 training patches a round gives k = ⌈50·0.8 / (3·2·0.2)⌉ =
    34, capped at rounds / 4 = 10."""
    spec = write_federation(tmp_path / "data", n=(2, 1, 1))
    cfg = load_deploy_config(spec, ["rounds=40", *VALIDATE_OFTEN])
    desc = prepare_run(cfg, tmp_path / "dep")
    transport = RemoteTransport(desc["sites"], LoopbackChannel(_runtimes(spec, tmp_path)), deploy_params(cfg))
    logs: list[str] = []
    planned, _, _ = plan_and_shape(tmp_path / "dep", desc, cfg, transport, 60.0, logs.append)
    fed, data = load_federation_data(spec, log=lambda m: None, volume_cache="off")
    simulated, _ = plan_volume_run(cfg, fed, data, log=lambda m: None)
    assert planned.eval.every == simulated.eval.every == 10
    assert planned == simulated
    assert any("eval.every = 10" in m for m in logs)
    assert json.loads((tmp_path / "dep" / "deploy.json").read_text())["site_cases"] == {"ras": [2, 1], "lps": [2, 1]}
    assert load_deploy_config(tmp_path / "dep" / "config.toml").eval.every == 10


def test_deployed_volume_run_validating_every_k_rounds_equals_simulation(tmp_path):
    """Eight rounds whose derived interval is 2 (rounds / 4): deployed and simulated validate in the same
    rounds and end with the same weights and Dice."""
    spec = write_federation(tmp_path / "data", n=(2, 1, 1))
    dep, _ = _deploy(spec, tmp_path, ["rounds=8", *VALIDATE_OFTEN])
    sim = run(spec, out=tmp_path / "sim", overrides=["rounds=8", *VALIDATE_OFTEN], progress=False, log=lambda m: None)
    assert load_deploy_config(tmp_path / "dep" / "config.toml").eval.every == 2
    validated = [h["round"] for h in dep["history"] if "val_dice" in h]
    assert validated == [h["round"] for h in sim["history"] if "val_dice" in h] == [2, 4, 6, 8]
    assert_same_arrays(server_state(tmp_path / "dep"), server_state(tmp_path / "sim"))
    assert dep["per_site_dice"] == sim["per_site_dice"]
