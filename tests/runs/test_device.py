"""Devices, mixed precision and the background checkpoint writer.

Every device path runs here on the CPU (``device = "cpu"`` explicitly and ``"auto"``
resolving to the CPU).  Tests marked ``gpu`` need CUDA and are skipped without it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fedseg.cli import main
from fedseg.foundation.config import RunConfig, TrainConfig, load_run_config
from fedseg.foundation.device import autocast, resolve_device, to_host
from fedseg.foundation.errors import ConfigError
from fedseg.seams.checkpoint import JsonDoc, commit_checkpoint
from fedseg.seams.writer import CheckpointWriter, SiteCopies
from fedseg.simulation.runner import build_transport, simulate
from tests.support.helpers import (
    assert_same_arrays,
    assert_same_checkpoints,
    count_host_reads,
    same_arrays,
    server_state,
    strip_times,
    tiny_config,
    tiny_sites,
)


def _no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# ------------------------------------------------------------------ settings
def test_device_resolution_on_a_machine_without_cuda(monkeypatch):
    _no_cuda(monkeypatch)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("CPU") == torch.device("cpu")
    for name in ("cuda", "cuda:1"):
        with pytest.raises(ConfigError, match="--device cpu"):
            resolve_device(name)
    with pytest.raises(ConfigError, match="'auto', 'cpu', 'cuda' or 'cuda:N'"):
        resolve_device("gpu")


def test_cuda_index_beyond_the_machine_names_the_devices(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ConfigError, match=r"2 CUDA device\(s\)"):
        resolve_device("cuda:5")


def test_cuda_without_an_index_resolves_to_the_current_device(monkeypatch):
    """Tensors report ``cuda:0``, never ``cuda``; an unindexed run device made every "already on
    the device?" test fail, so the sites pinned CUDA tensors (found on the first H100 run)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device("cuda") == torch.device("cuda:1")
    assert resolve_device("auto") == torch.device("cuda:1")


def test_config_validates_device_and_precision():
    with pytest.raises(ConfigError, match="device = 'gpu'"):
        RunConfig(federation="x", device="gpu").validate()
    with pytest.raises(ConfigError, match="train.precision = 'fp8'.*'fp32', 'bf16' or 'fp16'"):
        TrainConfig(precision="fp8").validate()
    with pytest.raises(ConfigError, match="train.dtype = 'float32'"):
        TrainConfig(precision="bf16", dtype="float64").validate()
    with pytest.raises(ConfigError, match="train.data"):
        TrainConfig(data="disk").validate()
    RunConfig(federation="x", device="cuda:3").validate()  # valid syntax; availability is checked when a run starts


def test_set_device_and_precision_overrides(tmp_path):
    p = tmp_path / "run.toml"
    p.write_text('federation = "fed.toml"\n')
    cfg = load_run_config(p, ["device=cpu", "train.precision=bf16", "train.data=stream"])
    assert (cfg.device, cfg.train.precision, cfg.train.data) == ("cpu", "bf16", "stream")
    assert load_run_config(p, device="cuda:1").device == "cuda:1"  # what --device passes


def test_cli_device_cuda_without_cuda_is_one_clear_error(tmp_path, capsys, monkeypatch):
    _no_cuda(monkeypatch)
    cfg = tmp_path / "run.toml"
    cfg.write_text('federation = "fed.toml"\n')  # never read: the device is checked first
    assert main(["run", str(cfg), "--out", str(tmp_path / "r"), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "--device cpu" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


def test_help_documents_device_and_precision(capsys):
    for verb in (["run"], ["compare"], ["deploy", "site"]):
        with pytest.raises(SystemExit):
            main([*verb, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "--device" in text and "cuda:N" in text, verb
        if verb == ["run"]:
            assert "train.precision=bf16" in text


def test_deploy_site_config_keeps_its_own_device(tmp_path, monkeypatch):
    from fedseg.deployment.run import configure_site
    from fedseg.deployment.site import SiteConfig, read_site_config, write_site_config

    path = write_site_config(tmp_path / "site.json", SiteConfig("siteA", "dl.json", str(tmp_path), "cuda:1"))
    assert read_site_config(path).device == "cuda:1"
    raw = json.loads(path.read_text())
    del raw["device"]  # a site config written before devices existed
    path.write_text(json.dumps(raw))
    assert read_site_config(path).device == "auto"
    _no_cuda(monkeypatch)
    with pytest.raises(ConfigError, match="--device cpu"):
        configure_site(tmp_path / "kit", tmp_path / "dl.json", tmp_path / "work", device="cuda")


# ---------------------------------------------------------------- runs, CPU
def test_explicit_cpu_and_auto_give_the_same_run_and_record_the_device(tmp_path, workload, monkeypatch):
    _no_cuda(monkeypatch)
    cpu = dataclasses.replace(tiny_config("fedavg", rounds=2), device="cpu")
    auto = tiny_config("fedavg", rounds=2)
    assert auto.device == "auto"
    logs: list[str] = []
    r_cpu = simulate(cpu, workload, tiny_sites(), out=tmp_path / "cpu", progress=False, log=logs.append)
    r_auto = simulate(auto, workload, tiny_sites(), out=tmp_path / "auto", progress=False, log=lambda m: None)
    assert r_cpu["device"] == r_auto["device"] == "cpu" and r_cpu["precision"] == "fp32"
    assert json.loads((tmp_path / "cpu" / "results.json").read_text())["device"] == "cpu"
    assert any("device cpu, precision fp32" in m for m in logs)
    assert (tmp_path / "auto" / "config.toml").read_text().startswith("# ran on device cpu, precision fp32\n")
    assert_same_arrays(server_state(tmp_path / "cpu"), server_state(tmp_path / "auto"))
    # the recorded config.toml still loads (the comment is ignored) and keeps the requested "auto"
    assert load_run_config(tmp_path / "auto" / "config.toml").device == "auto"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_runs_are_finite_and_keep_float32_weights(tmp_path, workload, precision):
    fp32 = simulate(
        tiny_config("fedavg", rounds=2),
        workload,
        tiny_sites(),
        out=tmp_path / "fp32",
        progress=False,
        log=lambda m: None,
    )
    mixed = simulate(
        tiny_config("fedavg", rounds=2, precision=precision),
        workload,
        tiny_sites(),
        out=tmp_path / precision,
        progress=False,
        log=lambda m: None,
    )
    w, w32 = server_state(tmp_path / precision), server_state(tmp_path / "fp32")
    assert all(torch.isfinite(v).all() for v in w.values())
    assert all(v.dtype == w32[k].dtype for k, v in w.items())  # fp32 master weights, float32 aggregate
    assert not same_arrays(w, w32)  # autocast really ran the forward pass in low precision
    losses = [v for e in mixed["history"] for v in e["train_loss"].values()]
    assert all(torch.isfinite(torch.tensor(losses))) and mixed["precision"] == precision
    assert (
        abs(sum(losses) / len(losses) - sum(v for e in fp32["history"] for v in e["train_loss"].values()) / len(losses))
        < 0.05
    )


def test_autocast_is_bf16_on_the_cpu():
    conv = torch.nn.Conv2d(1, 2, 3)
    with autocast(torch.device("cpu"), "bf16"):
        assert conv(torch.rand(1, 1, 8, 8)).dtype == torch.bfloat16
    with autocast(torch.device("cpu"), "fp32"):
        assert conv(torch.rand(1, 1, 8, 8)).dtype == torch.float32


def test_fp16_scaler_state_is_checkpointed_and_resume_is_bitwise(tmp_path, workload):
    """fp16's loss scale changes during training (it backs off on overflow and grows every
    2000 good steps), so it is part of the site state: resume must restore it."""
    cfg = tiny_config("fedavg", rounds=3, precision="fp16")
    simulate(cfg, workload, tiny_sites(), out=tmp_path / "full", progress=False, log=lambda m: None)
    assert (
        simulate(cfg, workload, tiny_sites(), out=tmp_path / "part", progress=False, stop_after=1, log=lambda m: None)
        is None
    )
    meta = json.loads((tmp_path / "part" / "checkpoints" / "sites" / "site1.json").read_text())
    assert meta["scalers"]["global"]["scale"] > 0
    simulate(cfg, workload, tiny_sites(), out=tmp_path / "part", progress=False, resume=True, log=lambda m: None)
    assert_same_checkpoints(tmp_path / "full", tmp_path / "part")


def test_fp16_overflow_step_is_skipped_and_the_loss_scale_backs_off(workload):
    """GradScaler logic (on the CPU): a step whose scaled gradients overflow is skipped and
    the scale halves (65536 → 32768); the next finite step trains."""
    cfg = tiny_config("fedavg", rounds=1, local_steps=1, local_epochs=None, precision="fp16")
    site = build_transport(cfg, workload, tiny_sites()).site("site1")
    model = site.model("global")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    huge = lambda m: 1e36 * sum(p.sum() for p in m.parameters())  # noqa: E731 - gradient 1e36 × scale overflows
    site.now(site.fit("global", 1, extra_loss=huge))
    assert_same_arrays(before, dict(model.state_dict()))
    assert site.roles.scalers["global"].get_scale() == 32768.0
    site.now(site.fit("global", 2))
    assert not same_arrays(before, dict(model.state_dict()))


def test_cuda_determinism_settings(monkeypatch):
    """The CUDA branch only sets flags, so it is checked here without a GPU (then restored)."""
    from fedseg.foundation.device import configure_determinism

    cudnn = torch.backends.cudnn
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        cudnn.benchmark,
        cudnn.deterministic,
        cudnn.allow_tf32,
    )
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        configure_determinism(torch.device("cpu"))
        assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ and torch.are_deterministic_algorithms_enabled() == saved[0]
        configure_determinism(torch.device("cuda"))
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert (
            torch.are_deterministic_algorithms_enabled()
            and cudnn.deterministic
            and not cudnn.benchmark
            and not cudnn.allow_tf32
        )
        configure_determinism(torch.device("cuda"), deterministic=False)
        assert not torch.are_deterministic_algorithms_enabled() and cudnn.benchmark and not cudnn.deterministic
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
        configure_determinism(torch.device("cuda"))
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"  # a user's own setting is kept
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32 = saved[2:]


def test_fit_reads_the_loss_once_per_round(workload, monkeypatch):
    """No per-step host synchronisation in the loop itself: the loss is summed on the device and
    converted once (Adam reads its own CPU step counter, which is no device sync: not counted)."""
    cfg = tiny_config("fedavg", rounds=1, local_steps=5, local_epochs=None)
    site = build_transport(cfg, workload, tiny_sites()).site("site1")
    site.model("global")
    calls = count_host_reads(monkeypatch, "fedseg/site/calls.py")
    out = site.now(site.fit("global", 1))
    assert out["steps"] == 5 and calls["n"] == 1


def test_data_placement_on_the_cpu_copies_nothing_and_changes_no_number(tmp_path, workload):
    from torch.utils.data import Dataset

    class Generic(Dataset):  # not in-memory tensors: batches are gathered item by item
        def __init__(self, base):
            self.base = base

        def __len__(self):
            return len(self.base)

        def __getitem__(self, i):
            return self.base[i]

    sites = tiny_sites()
    placed = {
        mode: build_transport(tiny_config("fedavg", data=mode), workload, sites).site("site1")
        for mode in ("auto", "device", "stream")
    }
    train = sites["site1"].train
    for mode in ("auto", "device"):
        ds = placed[mode].split_data("training")
        assert ds is not train and ds.images.data_ptr() == train.tensors[0].data_ptr()  # wrapped, not copied
        assert placed[mode].split_data("train") is ds  # placed once
    assert placed["stream"].split_data("train") is train
    generic = Generic(train)
    site = build_transport(
        tiny_config("fedavg"), workload, {"g": dataclasses.replace(sites["site1"], train=generic)}
    ).site("g")
    assert site.split_data("train") is generic
    weights = {}
    for mode in ("device", "stream"):
        simulate(
            tiny_config("fedavg", rounds=2, data=mode),
            workload,
            tiny_sites(),
            out=tmp_path / mode,
            progress=False,
            log=lambda m: None,
        )
        weights[mode] = server_state(tmp_path / mode)
    assert_same_arrays(weights["device"], weights["stream"])


def test_site_state_is_host_tensors(workload):
    cfg = tiny_config("fedavg", rounds=1)
    site = build_transport(cfg, workload, tiny_sites()).site("site1")
    site.now(site.fit("global", 1))
    arrays, meta = site.state_arrays()
    assert arrays and all(v.device.type == "cpu" for v in arrays.values())
    json.dumps(meta)  # JSON-able, nothing device-specific
    live = dict(site.models["global"].state_dict())
    k = next(iter(live))
    assert arrays[f"model/global/{k}"].data_ptr() != live[k].data_ptr()  # a copy: training may go on


# ------------------------------------------------------- checkpoint writer
def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_background_writer_writes_the_same_files_as_the_synchronous_one(tmp_path, workload):
    runs = {}
    for bg in (True, False):
        cfg = dataclasses.replace(tiny_config("scaffold", rounds=3), checkpoint_background=bg)
        out = tmp_path / f"bg{bg}"
        assert simulate(cfg, workload, tiny_sites(), out=out, progress=False, stop_after=2, log=lambda m: None) is None
        runs[bg] = _files(out / "checkpoints")
    a, b = runs[True], runs[False]
    assert a.keys() == b.keys() and "progress.json" in a and not any(k.endswith((".next", ".tmp")) for k in a)
    for name in a:
        if name == "progress.json":  # holds the per-round wall times
            assert strip_times(json.loads(a[name])) == strip_times(json.loads(b[name]))
        else:
            assert a[name] == b[name], name
    # and the checkpoint the background writer left resumes bitwise into an uninterrupted run
    cfg = tiny_config("scaffold", rounds=3)
    simulate(cfg, workload, tiny_sites(), out=tmp_path / "bgTrue", progress=False, resume=True, log=lambda m: None)
    simulate(cfg, workload, tiny_sites(), out=tmp_path / "full", progress=False, log=lambda m: None)
    assert_same_checkpoints(tmp_path / "bgTrue", tmp_path / "full")


def test_writer_commits_in_order_and_a_failed_write_leaves_the_previous_checkpoint(tmp_path):
    d = tmp_path / "ck"
    d.mkdir()
    w = CheckpointWriter(background=True)
    for rnd in (1, 2):
        files = {
            "server.safetensors.next": {"w": torch.full((3,), float(rnd))},
            "progress.json.next": JsonDoc({"round": rnd, "staged": ["server.safetensors"]}),
        }
        w.submit(d, files)
    w.wait()
    assert json.loads((d / "progress.json").read_text())["round"] == 2
    assert torch.equal(load_file(str(d / "server.safetensors"))["w"], torch.full((3,), 2.0))
    # a write that fails half-way (after the server file, before the commit record) ...
    bad = {
        "server.safetensors.next": {"w": torch.full((3,), 3.0)},
        "best.safetensors.next": {"b": "not a tensor"},
        "progress.json.next": JsonDoc({"round": 3, "staged": ["server.safetensors"]}),
    }
    w.submit(d, bad)
    with pytest.raises(Exception):  # noqa: B017 (whatever the writer raised is re-raised)
        w.wait()  # ... is reported to the round loop
    commit_checkpoint(d)  # what a resume does first: drop the staged leftovers
    assert json.loads((d / "progress.json").read_text())["round"] == 2
    assert torch.equal(load_file(str(d / "server.safetensors"))["w"], torch.full((3,), 2.0))
    assert not list(d.glob("*.next"))


def test_a_site_is_released_to_the_round_loop_only_once_the_writer_has_copied_it(tmp_path):
    """The round loop trains site a as soon as its copy is taken, while the writer is still at site b: the
    checkpoint holds both sites as they were when it was staged, and site b stays held until its copy."""
    d = tmp_path / "ck"
    d.mkdir()
    live = {"a": {"w": torch.zeros(3)}, "b": {"w": torch.zeros(3)}}
    b_may_be_read = threading.Event()

    def state_of(name):
        def read():
            if name == "b":
                b_may_be_read.wait()
            return live[name], {"site": name}

        return read

    w = CheckpointWriter(background=True)
    gate = SiteCopies(["a", "b"])
    record = {"progress.json.next": JsonDoc({"round": 1, "staged": []})}
    w.submit(d, record, {n: state_of(n) for n in ("a", "b")}, gate)
    gate.wait(["a"])
    live["a"]["w"].add_(1.0)  # the next round trains site a
    held = threading.Thread(target=gate.wait, args=(["b"],))
    held.start()
    held.join(0.3)
    assert held.is_alive() and gate.pending()  # site b is not released before its copy
    b_may_be_read.set()
    held.join()
    live["b"]["w"].add_(1.0)
    w.wait()
    for n in ("a", "b"):
        assert torch.equal(load_file(str(d / "sites" / f"{n}.safetensors"))["w"], torch.zeros(3)), n
        assert json.loads((d / "sites" / f"{n}.json").read_text()) == {"site": n}
    assert json.loads((d / "progress.json").read_text())["round"] == 1


def test_a_failed_site_copy_releases_every_site_and_is_raised(tmp_path):
    def broken():
        raise RuntimeError("cannot read the site")

    w = CheckpointWriter(background=True)
    gate = SiteCopies(["a", "b"])
    w.submit(tmp_path, {"progress.json.next": JsonDoc({"round": 1, "staged": []})}, {"a": broken}, gate)
    with pytest.raises(RuntimeError, match="cannot read the site"):
        gate.wait(["b"])  # released (no deadlock) and told
    with pytest.raises(RuntimeError, match="cannot read the site"):
        w.wait()
    assert not (tmp_path / "progress.json").exists()


def test_writer_host_buffers_are_reused_copies():
    w = CheckpointWriter(background=False)
    live = {"a": torch.ones(3), "n": torch.tensor(2)}
    first = w.host_copy("server", live)
    live["a"].add_(1)
    assert torch.equal(first["a"], torch.ones(3)) and first["a"].data_ptr() != live["a"].data_ptr()  # a snapshot
    second = w.host_copy("server", live)
    assert second["a"].data_ptr() == first["a"].data_ptr() and torch.equal(second["a"], torch.full((3,), 2.0))  # reused
    assert w.host_copy("other", live)["a"].data_ptr() != first["a"].data_ptr()  # one buffer per group and name


def test_to_host_copies(tmp_path):
    t = {"a": torch.ones(2)}
    h = to_host(t)
    t["a"].add_(1)
    assert h["a"].device.type == "cpu" and torch.equal(h["a"], torch.ones(2))


# ------------------------------------------------------------------- on CUDA
def _cuda(cfg: RunConfig) -> RunConfig:
    return dataclasses.replace(cfg, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_gpu_run_matches_cpu_run_within_tolerance(tmp_path, workload, dtype):
    """The GPU computes the CPU's function.  In float64 both agree to 1e-8 after two rounds.  In float32
    Adam amplifies rounding: a weight whose gradient is near zero (a bias before a normalization) moves
    by m/√v ≈ ±1 times the learning rate whatever its size, so when summation-order differences (cuDNN
    vs oneDNN) flip the sign of that gradient, the two runs step lr apart in opposite directions: up to
    2·lr = 2e-3 (seen on an H100: 7.7e-4 and 1.13e-3 on a one-element bias); the bound is therefore
    twice the learning rate."""
    cfg = tiny_config("fedavg", rounds=2, dtype=dtype)
    simulate(dataclasses.replace(cfg, device="cpu"), workload, tiny_sites(), out=tmp_path / "cpu", progress=False)
    res = simulate(_cuda(cfg), workload, tiny_sites(), out=tmp_path / "gpu", progress=False)
    assert res["device"].startswith("cuda")
    a, b = server_state(tmp_path / "cpu"), server_state(tmp_path / "gpu")
    tol = {"rtol": 1e-6, "atol": 1e-8} if dtype == "float64" else {"rtol": 0, "atol": 2 * cfg.train.lr}
    for k in a:
        torch.testing.assert_close(a[k], b[k], **tol)


@pytest.mark.gpu
@pytest.mark.parametrize("data", ["device", "stream"])
def test_gpu_same_seed_twice_is_bitwise(tmp_path, workload, data):
    cfg = _cuda(tiny_config("fedavg", rounds=2, data=data))
    simulate(cfg, workload, tiny_sites(), out=tmp_path / "a", progress=False)
    simulate(cfg, workload, tiny_sites(), out=tmp_path / "b", progress=False)
    assert_same_arrays(server_state(tmp_path / "a"), server_state(tmp_path / "b"))


@pytest.mark.gpu
def test_gpu_data_on_device_equals_streamed(tmp_path, workload):
    for data in ("device", "stream"):
        simulate(
            _cuda(tiny_config("fedavg", rounds=2, data=data)),
            workload,
            tiny_sites(),
            out=tmp_path / data,
            progress=False,
        )
    assert_same_arrays(server_state(tmp_path / "device"), server_state(tmp_path / "stream"))


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_gpu_mixed_precision_is_finite(tmp_path, workload, precision):
    res = simulate(
        _cuda(tiny_config("fedavg", rounds=2, precision=precision)),
        workload,
        tiny_sites(),
        out=tmp_path,
        progress=False,
    )
    assert all(torch.isfinite(v).all() for v in server_state(tmp_path).values())
    assert all(torch.isfinite(torch.tensor(list(e["train_loss"].values()))).all() for e in res["history"])


@pytest.mark.gpu
def test_checkpoint_on_gpu_resumes_on_cpu(tmp_path, workload):
    cfg = tiny_config("fedavg", rounds=3)
    assert simulate(_cuda(cfg), workload, tiny_sites(), out=tmp_path / "run", progress=False, stop_after=2) is None
    res = simulate(
        dataclasses.replace(cfg, device="cpu"),
        workload,
        tiny_sites(),
        out=tmp_path / "run",
        progress=False,
        resume=True,
    )
    assert res["device"] == "cpu"
    simulate(_cuda(cfg), workload, tiny_sites(), out=tmp_path / "gpu", progress=False)
    a, b = server_state(tmp_path / "run"), server_state(tmp_path / "gpu")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=1e-4)


def test_cli_run_and_compare_with_device_and_precision(tmp_path, capsys):
    from fedseg.data.synth import synthesize
    from tests.runs.test_cli import SMALL

    spec = synthesize("fundus", tmp_path / "fed", seed=0, scale=0.05, size=32)
    out = tmp_path / "run"
    assert (
        main(
            [
                "run",
                str(spec),
                "--device",
                "cpu",
                "--set",
                "train.precision=bf16",
                "--rounds",
                "1",
                "--out",
                str(out),
                *SMALL,
            ]
        )
        == 0
    )
    assert "device cpu, precision bf16" in capsys.readouterr().out
    res = json.loads((out / "results.json").read_text())
    assert (res["device"], res["precision"], res["config"]["device"]) == ("cpu", "bf16", "cpu")
    assert (out / "config.toml").read_text().startswith("# ran on device cpu, precision bf16")
    cmp = tmp_path / "cmp"
    assert (
        main(
            ["compare", str(spec), "--methods", "fedavg", "--device", "cpu", "--rounds", "1", "--out", str(cmp), *SMALL]
        )
        == 0
    )
    assert [json.loads(p.read_text())["device"] for p in cmp.rglob("results.json")] == ["cpu"]


def test_each_deployed_site_trains_on_its_own_device(tmp_path):
    """The run config's device is the server's; a deployed site uses the device of its own
    site config (``fedseg deploy site --device``) and still gives the simulation's weights."""
    from fedseg.deployment.server import serve
    from fedseg.deployment.site import SiteConfig, SiteRuntime
    from fedseg.deployment.transport import LoopbackChannel
    from tests.deploy.test_deploy import _cfg, _prepare, _workload

    cfg, data = _cfg(), tiny_sites(2)
    assert cfg.device == "auto"
    _prepare(tmp_path / "dep", cfg, list(data))

    def loader(name, datalist, header, site_cfg):
        return data[name], _workload(site_cfg)

    runtimes = {
        n: SiteRuntime(SiteConfig(n, "(in memory)", str(tmp_path / "sites" / n), device="cpu"), loader=loader)
        for n in data
    }
    serve(tmp_path / "dep", LoopbackChannel(runtimes), log=lambda m: None)
    assert all(r.site.cfg.device == "cpu" and r.site.device == torch.device("cpu") for r in runtimes.values())
    simulate(cfg, _workload(cfg), tiny_sites(2), out=tmp_path / "sim", progress=False, log=lambda m: None)
    assert_same_arrays(server_state(tmp_path / "dep"), server_state(tmp_path / "sim"))
