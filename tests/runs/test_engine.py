"""Engine properties: determinism, FedAvg(K=1) = local, evaluation layout, the checkpoint commit, damaged
checkpoints (resume = uninterrupted run for every method: ``tests/runs/test_resume.py``)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from fedseg.foundation.errors import PayloadError
from fedseg.simulation.runner import simulate
from tests.support.helpers import (
    assert_same_arrays,
    assert_same_checkpoints,
    server_state,
    strip_times,
    tiny_config,
    tiny_sites,
)


def test_same_seed_gives_bitwise_identical_runs(tmp_path, sites, workload):
    # Execute: the same config twice, and once with another seed
    cfg = tiny_config("fedavg", rounds=2)
    r1 = simulate(cfg, workload, sites, out=tmp_path / "a", progress=False)
    r2 = simulate(cfg, workload, sites, out=tmp_path / "b", progress=False)
    simulate(
        tiny_config("fedavg", rounds=2).__class__(**{**cfg.__dict__, "seed": 1}),
        workload,
        sites,
        out=tmp_path / "c",
        progress=False,
    )
    # Assert: weights and results identical except timings; another seed differs
    assert_same_checkpoints(tmp_path / "a", tmp_path / "b")
    assert strip_times(r1) == strip_times(r2)
    assert strip_times(json.loads((tmp_path / "a/results.json").read_text())) == strip_times(
        json.loads((tmp_path / "b/results.json").read_text())
    )
    a, c = server_state(tmp_path / "a"), server_state(tmp_path / "c")
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_fedavg_with_one_site_equals_local_training(tmp_path, workload):
    one = dict(list(tiny_sites().items())[:1])
    fa = simulate(tiny_config("fedavg", rounds=3), workload, one, out=tmp_path / "fa", progress=False)
    lo = simulate(tiny_config("local", rounds=3), workload, one, out=tmp_path / "lo", progress=False)
    w_fa, w_lo = server_state(tmp_path / "fa"), server_state(tmp_path / "lo")
    assert_same_arrays(
        {k.removeprefix("global/"): v for k, v in w_fa.items()},
        {k.removeprefix("local/site1/"): v for k, v in w_lo.items()},
    )
    assert fa["per_site_dice"] == lo["per_site_dice"]


def test_local_reports_model_by_site_matrix(sites, workload):
    res = simulate(tiny_config("local", rounds=2), workload, sites, progress=False)
    assert [r["home_site"] for r in res["rows"]] == list(sites)
    for r in res["rows"]:
        assert set(r["per_site_dice"]) == set(sites)
    # the method's row is each site's own model on its own test set (the matrix diagonal)
    for r in res["rows"]:
        assert res["per_site_dice"][r["home_site"]] == r["per_site_dice"][r["home_site"]]


def test_history_records_losses_validation_and_bytes(sites, workload):
    res = simulate(tiny_config("fedavg", rounds=2), workload, sites, progress=False)
    h = res["history"]
    assert [e["round"] for e in h] == [1, 2]
    nparams = sum(v.numel() * v.element_size() for v in workload.build_model().state_dict().values())
    for e in h:
        assert set(e["train_loss"]) == set(sites)
        assert set(e["val_dice"]["global"]) == set(sites)
        assert all(b == {"sent": nparams, "received": nparams} for b in e["bytes"].values())
    assert 0.0 <= res["client_avg_dice"] <= 1.0 and 0.0 <= res["global_dice"] <= 1.0


def test_keeping_vs_resetting_optimizer_state_differs(sites, workload):
    kept = simulate(tiny_config("fedavg", rounds=2), workload, sites, progress=False)
    reset = simulate(tiny_config("fedavg", rounds=2, reset_optimizer=True), workload, sites, progress=False)
    assert kept["history"][1]["train_loss"] != reset["history"][1]["train_loss"]
    # round 1 is identical: the optimizers start fresh either way
    assert kept["history"][0]["train_loss"] == reset["history"][0]["train_loss"]


def test_site_rejects_model_of_another_shape(sites, workload):
    from fedseg.algorithms import get_algorithm
    from fedseg.foundation.messages import Task
    from fedseg.site.runtime import Site

    cfg = tiny_config()
    site = Site("site1", 0, sites["site1"], workload, cfg, get_algorithm(cfg))
    bad = {f"global/{k}": torch.zeros(1) for k in workload.build_model().state_dict()}
    with pytest.raises(PayloadError, match="same model configuration"):
        site.handle(Task("train", bad, {"round": 1}))
    with pytest.raises(PayloadError, match="not handled by method"):
        site.handle(Task("nonsense"))


def test_checkpoint_commit_rolls_forward_after_its_record_and_back_before_it(tmp_path):
    """A save interrupted before its commit record leaves the previous checkpoint in force (staged files are
    dropped); one interrupted after the record is finished on the next load (staged files moved into place)."""
    from fedseg.seams.checkpoint import commit_checkpoint

    # Prepare: round 1 committed; round 2 staged without a record
    d = tmp_path / "checkpoints"
    (d / "sites.next").mkdir(parents=True)
    (d / "server.safetensors").write_text("r1")
    (d / "progress.json").write_text(json.dumps({"round": 1}))
    (d / "server.safetensors.next").write_text("r2")
    (d / "sites.next" / "site1.json").write_text("r2")
    # Execute / Assert: rolled back
    commit_checkpoint(d)
    assert (
        (d / "server.safetensors").read_text() == "r1"
        and not (d / "server.safetensors.next").exists()
        and not (d / "sites.next").exists()
    )
    # Prepare: round 2 staged with its record, and half moved already (a crash during the commit)
    (d / "sites.next").mkdir()
    (d / "sites.next" / "site1.json").write_text("r2")
    (d / "server.safetensors").write_text("r2")
    (d / "best.json.next").write_text("r2")
    (d / "progress.json.next").write_text(json.dumps({"round": 2, "staged": ["server.safetensors", "best.json"]}))
    # Execute / Assert: rolled forward
    commit_checkpoint(d)
    assert json.loads((d / "progress.json").read_text())["round"] == 2
    assert (d / "best.json").read_text() == "r2" and (d / "sites" / "site1.json").read_text() == "r2"
    assert not list(d.glob("*.next")) and not (d / "sites.next").exists()


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda w: {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in w.items()},
            "non-finite values in",
        ),
        (
            lambda w: {
                k: (torch.zeros(3, 3) if k == min(n for n in w if n.startswith("model/")) else v) for k, v in w.items()
            },
            "does not fit this run's site",
        ),
    ],
    ids=["nan", "wrong-shape"],
)
def test_resume_refuses_a_damaged_site_state_naming_the_file(tmp_path, sites, workload, damage, message):
    """A site's saved state (models + optimizer moments) is checked on --resume like the server's:
    finite, and fitting the site's models; the error names the file instead of a traceback deep in torch."""
    from safetensors.torch import save_file

    from fedseg.foundation.errors import ConfigError

    # Prepare: a run stopped after round 1, then one site's state damaged
    cfg = tiny_config("fedavg", rounds=2)
    assert simulate(cfg, workload, sites, out=tmp_path, progress=False, stop_after=1) is None
    site = next(iter(sites))
    path = tmp_path / "checkpoints" / "sites" / f"{site}.safetensors"
    save_file({k: v.contiguous() for k, v in damage(load_file(str(path))).items()}, str(path))
    # Execute / Assert
    with pytest.raises(ConfigError, match=f"{path.name}.*{message}|{message}.*{path.name}"):
        simulate(cfg, workload, tiny_sites(), out=tmp_path, progress=False, resume=True)
