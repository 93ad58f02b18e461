"""FGA's reduced U-Net (``model.name = "fga-unet"``): the paper's layer list, shapes, training, vectorization."""

from __future__ import annotations

import pytest
import torch

from fedseg.foundation.config import ModelConfig, load_run_config
from fedseg.foundation.errors import ConfigError
from fedseg.models import FGAUNet, build_model
from fedseg.models.fga_unet import PAPER_CHANNELS, PAPER_STRIDES
from fedseg.simulation.vectorize.eligibility import vectorize_reason
from fedseg.site.workload import make_loss

PAPER = ModelConfig(name="fga-unet", channels=PAPER_CHANNELS, strides=PAPER_STRIDES)


def _paper_count(d: int) -> int:
    """Parameters of the paper's network from its layer list (reduced_unet(ds=16) of its code): a k^d kernel from
    c to c' channels has k^d c c' + c' parameters; 5x5 strided convolutions 1->4->8->16->32, the 3x3 bottleneck
    32->64, 5x5 transposed convolutions 64->32, (32+32)->16, (16+16)->8, (8+8)->4, (4+4)->2, a 1x1 head 2->1."""
    layers = [(5, 1, 4), (5, 4, 8), (5, 8, 16), (5, 16, 32), (3, 32, 64)]
    layers += [(5, 64, 32), (5, 64, 16), (5, 32, 8), (5, 16, 4), (5, 8, 2), (1, 2, 1)]
    return sum(k**d * c * c2 + c2 for k, c, c2 in layers)


def test_parameter_count_is_the_papers_network():
    """2D: 120,721 parameters, the sum of the module docstring's table; 3D: the same layers with k^3 kernels."""
    for d in (2, 3):
        model = build_model(d, 1, 1, PAPER)
        assert isinstance(model, FGAUNet)
        assert sum(p.numel() for p in model.parameters()) == _paper_count(d)
    assert _paper_count(2) == 120_721 and _paper_count(3) == 565_985
    convs = [m for m in build_model(2, 1, 1, PAPER).modules() if isinstance(m, torch.nn.Conv2d)]
    assert [m.kernel_size for m in convs] == [(5, 5)] * 4 + [(3, 3), (1, 1)]
    assert [m.stride for m in convs] == [(2, 2)] * 5 + [(1, 1)]


@pytest.mark.parametrize("shape", [(2, 1, 64, 64), (1, 1, 32, 32, 64)])
def test_output_shape_is_the_input_shape(shape):
    x = torch.randn(shape)
    model = build_model(len(shape) - 2, 1, 2, PAPER)
    assert model(x).shape == (shape[0], 2, *shape[2:])


def test_channels_and_strides_come_from_the_config_and_odd_sizes_are_refused():
    cfg = load_run_config(
        None, ["federation=f.toml", "model.name=fga-unet", "model.channels=[3,6,12]", "model.strides=[2,1]"]
    )
    model = build_model(2, 1, 1, cfg.model)
    assert [m.out_channels for m in model.down] == [6, 12] and [m.out_channels for m in model.up] == [3, 6]
    assert model(torch.randn(1, 1, 10, 6)).shape == (1, 1, 10, 6)  # stride product 2
    with pytest.raises(ConfigError, match="not a multiple of 32"):
        build_model(2, 1, 1, PAPER)(torch.randn(1, 1, 48, 48))
    with pytest.raises(ConfigError, match="'unet', 'fga-unet'"):
        ModelConfig(name="fga").validate()


def test_it_learns_a_tiny_batch():
    """Eight Adam steps on one batch lower the Dice loss (the network trains end to end through every skip)."""
    torch.manual_seed(0)
    x = torch.rand(4, 1, 32, 32)
    y = (torch.nn.functional.avg_pool2d(x, 5, 1, 2) > 0.5).float()
    model = build_model(2, 1, 1, PAPER)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss_fn = make_loss("dice")
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05


def test_fedavg_trains_it_vectorized_as_sequentially(tmp_path):
    """Plain convolutions, no normalization, no dropout: the vectorized executor stacks it (no fallback reason)
    and two FedAvg rounds give the sequential run's weights (float64, 1e-10)."""
    from tests.support.helpers import fedavg_weights_sequential_and_vectorized

    small = ModelConfig(name="fga-unet", channels=(2, 4, 8), strides=(2, 2))
    assert vectorize_reason(build_model(2, 1, 1, small)) is None
    weights = fedavg_weights_sequential_and_vectorized(tmp_path, small)
    for k, v in weights["off"].items():
        torch.testing.assert_close(weights["on"][k], v, rtol=1e-10, atol=1e-10)
