"""A volume plan made for the device at hand: a CPU's time per step, a GPU's memory, recorded and reused."""

from __future__ import annotations

import json
import math

import pytest

from fedseg.cli import main
from fedseg.data.spec import load_federation
from fedseg.data.volumes.budget import (
    CPU_LADDER,
    DeviceBudget,
    device_budget,
    network_step_flops,
    step_flops,
    unet_step_flops,
    weakest,
)
from fedseg.data.volumes.load import ensure_plan, plan_federation, plan_for_run, plan_path
from fedseg.data.volumes.plan import GPU_MEMORY_GIB, device_network_plan, network_plan, round_cost
from fedseg.foundation.config import RunConfig, TrainConfig
from fedseg.foundation.errors import ConfigError
from fedseg.site import calls
from tests.runs.test_volumes_run import write_federation

# nnU-Net's 30-CT example (tests/runs/test_networks.py): 512 × 512 × 150 at 0.8 × 0.8 × 2.5 mm
CT_SHAPE, CT_SPACING = [512.0, 512.0, 150.0], [0.8, 0.8, 2.5]


def test_step_flops_counts_the_convolutions_by_hand():
    """Two levels, channels 2 → 4, 1 image channel, 1 label, a 4 × 4 × 4 patch pooled once to 2 × 2 × 2,
    kernels 3 × 3 × 3 (27 voxels): encoder 64·27·(1·2 + 2·2) + 8·27·(2·4 + 4·4) = 10368 + 5184; the decoder level
    0: transposed 64·4·2 = 512 and convolutions 64·27·(2·2·2 + 2·2) = 20736; output 64·2·1 = 128; 36928
    multiply-adds a patch, × 2 (flop) × 3 (forward + backward) × batch 2 = 443136."""
    assert step_flops([4, 4, 4], [[2, 2, 2]], [2, 4], None, 1, 1, 2) == 443136


def test_unet_step_flops_counts_monais_unet_by_hand():
    """MONAI's U-Net 2 → 4, one stride 2, 2 residual units, on 4 × 4 × 4 (level 1: 2 × 2 × 2 = 8 voxels): the
    down layer 27·8·(2·1·2 + 1·2·2) = 1728 (two convolutions and the strided residual one); the up layer's
    transposed convolution from the 2 + 4 concatenated channels to the 1 label 27·8·6·1 = 1296 and its
    convolution 27·64·1·1 = 1728; the bottom 8·(27·(2·4 + 4·4) + 2·4) = 5248; 10000 multiply-adds a patch,
    × 2 × 3 × batch 2 = 120000 — the U-Net convolves its first level at half resolution, so far less than
    DynUNet's 443136 on the same levels."""
    assert unet_step_flops([4, 4, 4], [[2, 2, 2]], [2, 4], 1, 1, 2) == 120000
    assert network_step_flops("unet", [4, 4, 4], [[2, 2, 2]], [2, 4], None, 1, 1, 2) == 120000


def test_a_cpu_budget_plans_a_smaller_network_than_the_8_gib_gpu_plan():
    """A CPU of 20 GFLOP/s with a target of 0.5 s a step of 2 patches: the chosen rung's estimate is within the
    target and the next rung's is not; patch and features are far below nnU-Net's 8 GiB plan (56 × 192 × 192,
    32 → 320)."""
    gpu = network_plan(CT_SHAPE, CT_SPACING, gpu_memory=GPU_MEMORY_GIB)
    budget = DeviceBudget("cpu", step_seconds=0.5, gflops=20.0, batch=2)
    cpu, record = device_network_plan(CT_SHAPE, CT_SPACING, budget)
    assert math.prod(cpu["patch"]) < math.prod(gpu["patch"]) / 10 and cpu["channels"][0] < gpu["channels"][0]
    flops = unet_step_flops(cpu["patch"], cpu["strides"], cpu["channels"], 1, 1, 2)
    assert record["estimate_s"] == pytest.approx(flops / 20e9, abs=1e-3) and record["estimate_s"] <= 0.5
    assert record["device"] == "cpu" and record["gflops"] == 20.0 and cpu["batch_size"] == 2
    assert record["network"] == "unet"  # sized for the network "auto" builds on a CPU
    rung = record["rung"]
    assert 0 <= rung < len(CPU_LADDER) - 1
    nxt, base = CPU_LADDER[rung + 1]
    bigger = network_plan(CT_SHAPE, CT_SPACING, base=base, patch_voxels=nxt)
    assert unet_step_flops(bigger["patch"], bigger["strides"], bigger["channels"], 1, 1, 2) / 20e9 > 0.5
    # sized for DynUNet's step (more work a voxel) the plan is no larger
    slim, rec = device_network_plan(CT_SHAPE, CT_SPACING, budget, network="dynunet")
    assert math.prod(slim["patch"]) <= math.prod(cpu["patch"])
    assert rec["rung"] <= rung and rec["network"] == "dynunet"
    # a faster CPU affords at least as large a plan; a GPU budget is nnU-Net's plan for its memory
    faster, rec = device_network_plan(CT_SHAPE, CT_SPACING, DeviceBudget("cpu", step_seconds=0.5, gflops=200.0))
    assert rec["rung"] >= rung and math.prod(faster["patch"]) >= math.prod(cpu["patch"])
    assert device_network_plan(CT_SHAPE, CT_SPACING, DeviceBudget("cuda", gpu_memory=8.0))[0] == gpu


def test_the_plan_records_its_cpu_budget_and_a_second_run_reuses_it(tmp_path, monkeypatch):
    """The first run's probe (here the throughput set by FEDSEG_CPU_GFLOPS) picks the rung and the plan file
    records it; a later run on a machine twice as fast reads the file and trains the same plan."""
    spec = write_federation(tmp_path)
    fed = load_federation(spec)
    monkeypatch.setenv("FEDSEG_CPU_GFLOPS", "0.5")
    logs: list[str] = []
    first = ensure_plan(fed, log=logs.append, device="cpu", batch=2)
    saved = json.loads(plan_path(fed).read_text())
    assert saved["budget"]["device"] == "cpu" and saved["budget"]["gflops"] == 0.5 and saved["gpu_memory"] is None
    assert saved["network"] == "unet" and any("made for this CPU" in m and "--gpu-memory 8" in m for m in logs)
    monkeypatch.setenv("FEDSEG_CPU_GFLOPS", "1000")
    again = ensure_plan(fed, log=lambda m: None, device="cpu", batch=2)
    assert again.to_json() == first.to_json()
    fresh = plan_federation(fed, log=lambda m: None, budget=device_budget("cpu", batch=2))
    assert fresh.budget is not None and fresh.budget["rung"] >= first.budget["rung"]  # a new plan could differ


def test_gpu_memory_gives_nnunets_plan_and_records_the_gpu(tmp_path, capsys):
    """``fedseg plan --gpu-memory 8``: the patch, network and batch of ``network_plan`` at 8 GiB (the plan
    tests/runs/test_networks.py holds to nnU-Net's), DynUNet, the budget recorded as that GPU."""
    spec = write_federation(tmp_path)
    assert main(["plan", str(spec), "--gpu-memory", "8"]) == 0
    plan = json.loads((tmp_path / "fed.plan.json").read_text())
    assert "made for a GPU of 8.0 GiB" in capsys.readouterr().out
    assert plan["budget"] == {"device": "cuda", "gpu_memory": 8.0} and plan["gpu_memory"] == 8.0
    assert plan["network"] == "dynunet"
    default = plan_federation(load_federation(spec), log=lambda m: None)  # no budget: the 8 GiB GPU
    assert {k: plan[k] for k in ("patch_size", "channels", "strides", "batch_size")} == {
        "patch_size": default.patch_size,
        "channels": default.channels,
        "strides": default.strides,
        "batch_size": default.batch_size,
    }


def test_auto_network_follows_the_plans_device_and_the_run_logs_a_rounds_cost():
    """A CPU plan makes ``model.name = "auto"`` the plan's network and logs the estimated cost: 10 steps of
    U-Net's 10 steps of batch 2 on a 4³ patch pooled once with channels 2 → 4 = 10 × 120000 flop at 1 GFLOP/s:
    0.00012 s a step, 0.0012 s a round."""
    from fedseg.data.volumes.plan import Plan

    plan = Plan(
        target_spacing=[1.0, 1.0, 1.0],
        volume_shape=[8, 8, 8],
        patch_size=[4, 4, 4],
        channels=[2, 4],
        strides=[[2, 2, 2]],
        intensity={"mode": "zscore"},
        budget={"device": "cpu", "step_seconds": 0.5, "gflops": 1.0, "batch": 2, "rung": 0, "estimate_s": 0.0},
        network="unet",
    )
    logs: list[str] = []
    cfg = RunConfig(federation="x", train=TrainConfig(batch_size=2, local_steps=10, local_epochs=None))
    out = plan_for_run(cfg, plan, log=logs.append, sites={"a": (1, 20)}, volume=[8, 8, 8])
    assert out.model.name == "unet" and out.model.channels == (2, 4)
    line = round_cost(plan, out.model, 2, 10)
    assert line is not None and "0.00 s on this CPU" in line and line in logs
    assert "a round of 10 local steps" in line
    gpu = dict(plan.to_json(), budget={"device": "cuda", "gpu_memory": 8.0}, network="dynunet")
    assert round_cost(Plan.from_json(gpu), out.model, 2, 10) is None  # a GPU plan: the sites measure instead


def test_weakest_device_and_a_malformed_budget():
    """The server plans for a CPU when any site trains on one (the slowest per patch), else the smallest GPU;
    a site's malformed budget is refused with one error naming it, and so is a target of no time."""
    slow = DeviceBudget("cpu", step_seconds=0.5, gflops=5.0, batch=2)
    fast = DeviceBudget("cpu", step_seconds=0.5, gflops=50.0, batch=2)
    small, large = DeviceBudget("cuda", gpu_memory=8.0), DeviceBudget("cuda", gpu_memory=80.0)
    assert weakest([large, fast, slow]) == slow and weakest([large, small]) == small and weakest([]) is None
    assert DeviceBudget.from_json(slow.to_json()) == slow
    for bad in ({"device": "tpu"}, {"device": "cpu", "step_seconds": 0.5, "gflops": -1}, [1]):
        with pytest.raises(ConfigError, match="site x"):
            DeviceBudget.from_json(bad, "site x")
    with pytest.raises(ConfigError, match="step_seconds = 0"):
        device_budget("cpu", step_seconds=0)


def test_a_long_round_says_its_cost_and_progress(monkeypatch):
    """A clock that ticks 1 s a read, a round of 10 steps and progress every 5 s: after steps 2–4 (3 s) the
    site says 1.00 s a step and 4 + 6 = 10 s for the round; at step 5 (5 s since the start) it says 5 s left;
    its next round says no estimate again."""
    ticks = iter(range(1000))
    monkeypatch.setattr(calls.time, "perf_counter", lambda: float(next(ticks)))
    monkeypatch.setattr(calls, "PROGRESS_EVERY_S", 5.0)

    flag = calls.Flag()
    said: list[str] = []
    progress = calls.RoundProgress("s1", flag, 1, 10, said.append)
    for done in range(1, 11):
        progress.step(done)
    assert said[0] == "s1: round 1: about 1.00 s a training step measured, about 10 s for this round's 10 steps"
    assert said[1] == "s1: round 1: step 5/10, 5 s, about 5 s left"
    later = calls.RoundProgress("s1", flag, 2, 10, said.append)
    n = len(said)
    for done in range(1, 5):
        later.step(done)
    assert not any("measured" in m for m in said[n:])


def test_sites_say_the_cost_of_their_rounds_and_the_numbers_do_not_change(monkeypatch, capsys, workload):
    """A simulation whose rounds "last longer" than the progress interval (0 s here): each site says after
    its first round's first steps what a step took and the round's estimate, and where it is during the round;
    the run's Dice and losses equal those of the same run without those lines."""
    from fedseg.simulation.runner import simulate
    from tests.support.helpers import tiny_config, tiny_sites

    sites = tiny_sites(num_sites=2, n_train=4, size=8)
    cfg = tiny_config(rounds=2, local_steps=6, local_epochs=None)
    quiet = simulate(cfg, workload, sites, progress=False, log=lambda m: None)
    capsys.readouterr()
    monkeypatch.setattr(calls, "PROGRESS_EVERY_S", 0.0)
    loud = simulate(cfg, workload, sites, progress=False, log=lambda m: None)
    said = capsys.readouterr().out
    for site in ("site1", "site2"):
        assert f"{site}: round 1: about" in said and "for this round's 6 steps" in said
        assert f"{site}: round 2: step 5/6" in said
        assert f"{site}: round 2: about" not in said  # the estimate once, in the first round
    assert loud["per_site_dice"] == quiet["per_site_dice"]
    assert [h.get("train_loss") for h in loud["history"]] == [h.get("train_loss") for h in quiet["history"]]
