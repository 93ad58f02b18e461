"""Networks by name from the run config, a user's factory, pretrained weights, deep supervision, and the
plan nnU-Net's planner gives for a memory budget."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from fedseg.data.volumes.plan import network_plan, topology
from fedseg.foundation.config import ModelConfig, load_run_config
from fedseg.foundation.errors import ConfigError
from fedseg.models import build_model, deep_supervision_loss, deep_supervision_weights
from fedseg.simulation.vectorize.eligibility import vectorize_reason
from fedseg.site.workload import make_loss

EINOPS = importlib.util.find_spec("einops") is not None

# Tiny settings of every named network for a 2D 32 x 32 federation (the [model] table of a run config).
TINY = {
    "unet": "channels = [4, 8, 16]\nstrides = [2, 2]\nnum_res_units = 1\n",
    "fga-unet": "channels = [2, 4, 8]\nstrides = [2, 2]\n",
    "dynunet": "channels = [4, 8, 16, 16]\nstrides = [2, 2, 2]\n",
    "segresnet": "[model.kwargs]\ninit_filters = 8\nblocks_down = [1, 1, 1]\nblocks_up = [1, 1]\n",
    "basicunet": "[model.kwargs]\nfeatures = [4, 4, 8, 8, 16, 4]\n",
    "attentionunet": "channels = [4, 8, 16]\nstrides = [2, 2]\n",
    "swinunetr": '[model.kwargs]\nfeature_size = 12\ndepths = [1, 1, 1, 1]\nnum_heads = [1, 1, 1, 1]\nnorm_name = "batch"\n',
    "unetr": "[model.kwargs]\nimg_size = [32, 32]\nfeature_size = 4\nhidden_size = 24\nmlp_dim = 24\nnum_heads = 2\n",
}


def tiny_factory(spatial_dims: int, in_channels: int, out_channels: int, width: int = 4) -> nn.Module:
    """A user's own network (``model.module = "tests.runs.test_networks:tiny_factory"``)."""
    conv = nn.Conv2d if spatial_dims == 2 else nn.Conv3d
    return nn.Sequential(conv(in_channels, width, 3, padding=1), nn.ReLU(), conv(width, out_channels, 1))


@pytest.fixture(scope="module")
def fundus(tmp_path_factory):
    from fedseg.data.synth import synthesize

    return synthesize("fundus", tmp_path_factory.mktemp("fed"), scale=0.05, size=32, progress=False)


@pytest.mark.parametrize("name", [*TINY, "module"])
def test_every_named_network_runs_a_fedavg_round_from_the_run_config(fundus, tmp_path, name):
    """``[model] name`` (or ``module``) and ``[model.kwargs]`` in a run config TOML build that network at the
    server and every site: one FedAvg round runs, the run's config keeps the kwargs, and the checkpoint holds
    that network's weights.  The vectorized executor's reason (None: it stacks) is what the docs list."""
    if name in ("swinunetr", "unetr") and not EINOPS:
        with pytest.raises(ConfigError, match="einops"):
            build_model(2, 3, 2, ModelConfig(name=name))
        pytest.skip("MONAI's transformer networks need einops")
    from safetensors.torch import load_file

    from fedseg.simulation.runner import run

    table = (
        'module = "tests.runs.test_networks:tiny_factory"\n[model.kwargs]\nwidth = 3\n'
        if name == "module"
        else f'name = "{name}"\n{TINY[name]}'
    )
    cfg_path = tmp_path / "run.toml"
    cfg_path.write_text(
        f'federation = "{fundus}"\nmethod = "fedavg"\nrounds = 1\ncheckpoint_keep = "final"\n[train]\nbatch_size = 2\nlocal_steps = 2\n[model]\n{table}'
    )
    cfg = load_run_config(cfg_path)
    res = run(cfg, out=tmp_path / "out", progress=False, log=lambda m: None)
    assert res is not None
    saved = load_run_config(tmp_path / "out" / "config.toml")
    assert saved.model == cfg.model
    weights = load_file(str(tmp_path / "out" / "checkpoints" / "server.safetensors"))
    built = build_model(2, 3, 2, cfg.model)
    assert {f"global/{k}" for k in built.state_dict()} <= set(weights)
    reason = vectorize_reason(built)
    # AttentionUnet's gates hold batch norm; SwinUNETR is built here with batch norm, since at 32² its deepest
    # stage is 1 x 1, where instance norm cannot train
    assert (reason is None) == (name not in ("attentionunet", "swinunetr")), reason


def test_pretrained_weights_load_and_a_mismatch_names_the_keys(tmp_path):
    """``model.init`` (relative to the run config) loads every tensor; weights of another network are refused
    naming the missing, unexpected and mis-shaped keys; a bad name lists the choices."""
    cfg = ModelConfig(name="dynunet", channels=(4, 8, 16), strides=(2, 2))
    source = build_model(2, 1, 2, cfg)
    save_file({k: v.clone() for k, v in source.state_dict().items()}, str(tmp_path / "w.safetensors"))
    (tmp_path / "run.toml").write_text(
        'federation = "fed.toml"\n[model]\nname = "dynunet"\nchannels = [4, 8, 16]\nstrides = [2, 2]\n'
        'init = "w.safetensors"\n'
    )
    loaded = build_model(2, 1, 2, load_run_config(tmp_path / "run.toml").model)
    for k, v in source.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    fresh = build_model(2, 1, 2, cfg)
    assert not all(torch.equal(fresh.state_dict()[k], v) for k, v in source.state_dict().items())

    from monai.networks.nets import DynUNet

    monai_net = DynUNet(2, 1, 2, [[3, 3]] * 3, [[1, 1], [2, 2], [2, 2]], [[2, 2], [2, 2]], filters=[4, 8, 16])
    assert any(k.startswith("skip_layers.") for k in monai_net.state_dict())  # MONAI names each layer twice
    save_file({k: v.clone() for k, v in monai_net.state_dict().items()}, str(tmp_path / "monai.safetensors"))
    ours = build_model(2, 1, 2, dataclasses.replace(cfg, init=str(tmp_path / "monai.safetensors")))
    assert not any(k.startswith("skip_layers.") for k in ours.state_dict())
    x = torch.rand(1, 1, 16, 16)
    assert torch.equal(ours.eval()(x), monai_net.eval()(x))

    other = ModelConfig(name="dynunet", channels=(4, 8, 32), strides=(2, 2), init=str(tmp_path / "w.safetensors"))
    with pytest.raises(ConfigError, match=r"shape mismatch \d+: .*\(network: ") as e:
        build_model(2, 1, 2, other)
    assert "w.safetensors" in str(e.value)
    with pytest.raises(ConfigError, match="missing .*unexpected"):
        build_model(2, 1, 2, ModelConfig(name="unet", channels=(4, 8, 16), strides=(2, 2), init=other.init))
    with pytest.raises(ConfigError, match="no such file"):
        build_model(2, 1, 2, ModelConfig(init=str(tmp_path / "none.safetensors")))
    with pytest.raises(ConfigError, match="'dynunet'.*'segresnet'"):
        load_run_config(None, ["federation=x", "model.name=nnunet"])
    with pytest.raises(ConfigError, match="package.module:factory"):
        load_run_config(None, ["federation=x", "model.module=nocolon"])


def test_dynunet_deep_supervision_trains_on_halving_weights_and_evaluates_full_resolution():
    """A 5-level DynUNet returns, in training, the full-resolution output and 5 − 3 = 2 lower decoder outputs
    (nnU-Net supervises its decoder levels but the lowest); the loss weighs them 4/7, 2/7, 1/7 (2^-i,
    normalized); evaluated, it returns the full-resolution output only."""
    cfg = ModelConfig(name="dynunet", channels=(4, 8, 8, 8, 8), strides=(2, 2, 2, 2), kernels=((3, 1), 3, 3, 3, 3))
    net = build_model(2, 1, 1, cfg)
    x, y = torch.rand(2, 1, 32, 32), (torch.rand(2, 1, 32, 32) > 0.5).float()
    out = net.train()(x)
    assert out.shape == (2, 3, 1, 32, 32)
    assert deep_supervision_weights(3) == pytest.approx([4 / 7, 2 / 7, 1 / 7])
    base = make_loss("dicece")
    loss = deep_supervision_loss(base)
    expected = sum(w * base(out[:, i], y) for i, w in enumerate([4 / 7, 2 / 7, 1 / 7]))
    assert torch.allclose(loss(out, y), expected)
    assert net.eval()(x).shape == (2, 1, 32, 32)
    assert torch.equal(loss(out[:, 0], y), base(out[:, 0], y))
    assert net.input_block.conv1.conv.kernel_size == (3, 1)


def test_plan_for_30_cts_is_nnunets():
    """30 CTs of 512 × 512 × 150 at 0.8 × 0.8 × 2.5 mm, 8 GiB: nnU-Net v2 plans a 192 × 192 × 56 patch (RAS
    x, y, z), 6 stages of 32 → 320 features, a 3 × 3 × 1 first kernel (1 × 3 × 3 in its z-first order) and
    batch 2.  The plan must be within 1.5 × its voxels with the same stages; half the memory halves about
    the feature maps; a tiny volume gives a tiny plan."""
    p = network_plan([512, 512, 150], [0.8, 0.8, 2.5], labels=2, dataset_voxels=30 * 512 * 512 * 150)
    assert 1 / 1.5 <= math.prod(p["patch"]) / (192 * 192 * 56) <= 1.5
    assert len(p["channels"]) == 6 and p["channels"][0] == 32 and p["channels"][-1] == 320
    assert p["kernels"][0] == [3, 3, 1] and p["batch_size"] == 2
    assert p["strides"][0] == [2, 2, 1] and all(s == [2, 2, 2] for s in p["strides"][1:4])
    half = network_plan([512, 512, 150], [0.8, 0.8, 2.5], gpu_memory=4, labels=2)
    assert half["estimate"] <= 280_000_000 < p["estimate"]
    small = network_plan([24, 24, 12], [1.5, 1.5, 3.0], labels=1, dataset_voxels=5 * 24 * 24 * 12)
    assert small["patch"] == [24, 24, 12] and len(small["channels"]) == 3
    strides, kernels, patch = topology([20, 20, 9], [1.0, 1.0, 1.0])
    assert patch == [20, 20, 8] and strides == [[2, 2, 2], [2, 2, 1]] and len(kernels) == 3  # z rounded down
    print(json.dumps(p))


def test_dynunet_trains_vectorized_as_sequentially(tmp_path):
    """DynUNet (instance norm, no dropout, layers reachable under two names) is stacked by the vectorized
    executor, deep supervision included, and two FedAvg rounds give the sequential run's weights (float64)."""
    from tests.support.helpers import fedavg_weights_sequential_and_vectorized

    net = ModelConfig(name="dynunet", channels=(2, 4, 4, 4), strides=(2, 2, 2))
    weights = fedavg_weights_sequential_and_vectorized(tmp_path, net)
    for k, v in weights["off"].items():
        torch.testing.assert_close(weights["on"][k], v, rtol=1e-9, atol=1e-9)
