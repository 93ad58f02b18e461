"""Report building blocks on hand-made inputs: loss surface (FedSM Fig. 4), t-SNE (Fig. 3),
TensorBoard scalars, Markdown tables, best-so-far curves."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from fedseg.apps.report.figures import best_so_far, site_curve
from fedseg.apps.report.html import ReportOptions, markdown_html
from fedseg.apps.report.loss_surface import dataset_loss, loss_surface, random_directions, trainable_arrays
from fedseg.apps.report.tensorboard import round_scalars
from fedseg.apps.report.tsne import selector_features, tsne_embed
from fedseg.foundation.arrays import flatten
from fedseg.foundation.errors import ConfigError
from fedseg.models import Selector, build_unet
from fedseg.site.workload import make_loss
from tests.support.helpers import TINY_MODEL, tiny_sites


def _unet() -> nn.Module:
    torch.manual_seed(0)
    return build_unet(2, 1, 1, TINY_MODEL)


# ------------------------------------------------------------------ directions
def test_unit_directions_have_unit_norm_and_are_seeded():
    """ "unit" directions lie on the unit sphere of parameter space (FedSM: "unit vector directions");
    the same seed gives the same directions, another seed others."""
    # Prepare
    params = trainable_arrays(_unet())
    # Execute
    dirs = random_directions(params, n=4, seed=7, normalize="unit")
    again = random_directions(params, n=4, seed=7, normalize="unit")
    other = random_directions(params, n=1, seed=8, normalize="unit")
    # Assert
    assert len(dirs) == 4
    for d in dirs:
        assert set(d) == set(params)
        assert float(flatten(d).norm()) == pytest.approx(1.0, abs=1e-12)
    assert all(torch.equal(flatten(a), flatten(b)) for a, b in zip(dirs, again))
    assert not torch.equal(flatten(dirs[0]), flatten(other[0]))
    # two random unit vectors in ~3k dimensions are nearly orthogonal (|cos| ~ 1/sqrt(P) ≈ 0.02)
    assert abs(float(flatten(dirs[0]) @ flatten(dirs[1]))) < 0.1


def test_filter_normalized_directions_match_filter_norms_and_skip_1d_params():
    """Li et al.'s filter normalization: each output filter of d has the norm of θ's filter; biases get 0."""
    # Prepare: one conv weight with 2 filters of hand-known norms (3 and 4), one bias
    params = {"conv.weight": torch.tensor([[[[3.0, 0.0]]], [[[0.0, 4.0]]]]), "conv.bias": torch.tensor([1.0, 2.0])}
    # Execute
    (d,) = random_directions(params, n=1, seed=0, normalize="filter")
    # Assert
    norms = d["conv.weight"].reshape(2, -1).norm(dim=1)
    assert norms.tolist() == pytest.approx([3.0, 4.0])
    assert torch.count_nonzero(d["conv.bias"]) == 0


def test_directions_reject_bad_settings_with_a_clear_message():
    params = {"w": torch.ones(3)}
    with pytest.raises(ValueError, match="normalize = 'sphere'.*'unit'.*'filter'"):
        random_directions(params, normalize="sphere")
    with pytest.raises(ValueError, match="at least one direction"):
        random_directions(params, n=0)
    with pytest.raises(ValueError, match="no trainable floating-point parameters"):
        random_directions({"step": torch.tensor([1])})


# ---------------------------------------------------------------- loss surface
def test_loss_surface_of_a_one_weight_model_matches_the_hand_computed_parabola():
    """Model y = w·x (one weight), MSE loss: L(w) = mean((w x − y)²).

    In one dimension a unit direction is d = ±1, so L(θ + α d) = mean(((w ± α) x − y)²).
    With x = [1, 2], y = [2, 4], w = 1.5: L(w + t) = mean(((1.5 + t) x − 2x)²)
    = (t − 0.5)² · mean(x²) = 2.5 (t − 0.5)².
    """
    # Prepare
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.5)
    ds = TensorDataset(torch.tensor([[1.0], [2.0]]), torch.tensor([[2.0], [4.0]]))
    # Execute
    surf = loss_surface(model, nn.MSELoss(), ds, directions=2, radius=1.0, steps=5, seed=3, batch_size=1)
    # Assert
    assert surf.alphas.tolist() == [-1.0, -0.5, 0.0, 0.5, 1.0]
    assert surf.center == pytest.approx(2.5 * 0.25)
    for k, d in enumerate(random_directions(trainable_arrays(model), n=2, seed=3)):
        sign = float(d["weight"].flatten()[0])
        assert abs(sign) == pytest.approx(1.0)
        expected = [2.5 * (sign * a - 0.5) ** 2 for a in surf.alphas]
        assert surf.losses[k].tolist() == pytest.approx(expected)
    # the trained weight is restored afterwards
    assert float(model.weight.detach()) == 1.5


def test_loss_surface_at_step_zero_is_the_models_training_loss():
    """α = 0 is the trained model itself: its loss equals the Dice loss over the site's training set,
    computed here independently in one batch (the loss is a mean over cases, so batches average exactly)."""
    # Prepare
    model = _unet()
    loss = make_loss("dice")
    ds = tiny_sites(1, n_train=6)["site1"].train
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # Execute
    surf = loss_surface(model, loss, ds, directions=3, radius=2.0, steps=5, batch_size=4)
    # Assert
    model.eval()
    with torch.no_grad():
        direct = float(loss(model(ds.tensors[0]), ds.tensors[1]))
    assert surf.losses.shape == (3, 5)
    assert surf.losses[:, 2] == pytest.approx([direct] * 3, rel=1e-5)
    assert surf.center == pytest.approx(dataset_loss(model, loss, [(ds.tensors[0], ds.tensors[1])]), rel=1e-6)
    assert not np.allclose(surf.losses[:, 0], surf.center)  # moving away changes the loss
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert surf.sharpness >= 0.0


def test_loss_surface_rejects_an_even_grid_and_an_empty_dataset():
    model = nn.Linear(1, 1)
    ds = TensorDataset(torch.ones(2, 1), torch.ones(2, 1))
    with pytest.raises(ValueError, match="odd number >= 3"):
        loss_surface(model, nn.MSELoss(), ds, steps=4)
    with pytest.raises(ValueError, match="dataset is empty"):
        loss_surface(model, nn.MSELoss(), TensorDataset(torch.ones(0, 1), torch.ones(0, 1)))
    with pytest.raises(ConfigError, match="--steps = 4.*odd"):
        ReportOptions(steps=4)


# ----------------------------------------------------------------------- t-SNE
def test_selector_features_and_tsne_map_shapes():
    """Features (N, F) for the first images of every site, labels in site order; t-SNE gives (N, 2), seeded."""
    # Prepare
    torch.manual_seed(0)
    sel = Selector(2, 1, 3, width=0.0625, hidden=8)
    data = {s: d.test for s, d in tiny_sites(3).items()}  # 3 test images per site
    # Execute
    feats, sites = selector_features(sel, data, max_per_site=2)
    pts = tsne_embed(feats, seed=0)
    again = tsne_embed(feats, seed=0)
    # Assert
    assert feats.shape[0] == 6 and feats.ndim == 2
    assert sites == ["site1", "site1", "site2", "site2", "site3", "site3"]
    assert pts.shape == (6, 2)
    assert np.isfinite(pts).all()
    assert np.array_equal(pts, again)


def test_tsne_rejects_too_few_points_and_bad_shapes():
    with pytest.raises(ValueError, match="at least 3 points"):
        tsne_embed(np.zeros((2, 4)))
    with pytest.raises(ValueError, match=r"2-D array \(N, F\)"):
        tsne_embed(np.zeros(5))
    with pytest.raises(TypeError, match="embed"):
        selector_features(nn.Linear(1, 1), {})


# ----------------------------------------------------------------- tensorboard
def test_round_scalars_flattens_a_history_entry():
    """Nested dicts become '/'-tags; bytes get totals over sites; strings, None, bools, NaN are left out."""
    entry = {
        "round": 3,
        "phase": "joint",
        "alpha_learned": True,
        "train_loss": {"a": 0.5, "b": None},
        "bytes": {"a": {"sent": 10, "received": 20}, "b": {"sent": 1, "received": 2}},
        "val_dice": {"global": {"a": 0.7, "b": float("nan")}},
        "alpha": {"a": 0.25, "b": 0.75},
        "time_s": 1.5,
    }
    assert round_scalars(entry) == {
        "train_loss/a": 0.5,
        "bytes/a/sent": 10.0,
        "bytes/a/received": 20.0,
        "bytes/b/sent": 1.0,
        "bytes/b/received": 2.0,
        "bytes/total/sent": 11.0,
        "bytes/total/received": 22.0,
        "val_dice/global/a": 0.7,
        "alpha/a": 0.25,
        "alpha/b": 0.75,
        "time_s": 1.5,
    }


# ------------------------------------------------------------ tables and curves
def test_markdown_table_becomes_an_escaped_html_table():
    md = "| Method | a<b |\n|---|---|\n| FedAvg | 0.5 |\n\nDice note & more.\n"
    out = markdown_html(md)
    assert "<thead><tr><th>Method</th><th>a&lt;b</th></tr></thead>" in out
    assert "<tr><td>FedAvg</td><td>0.5</td></tr>" in out
    assert "---" not in out
    assert "<p>Dice note &amp; more.</p>" in out


def test_best_so_far_and_site_curve():
    """Running maximum of validation Dice (the papers keep the best round); rounds without validation skipped."""
    assert best_so_far([0.1, 0.3, 0.2, 0.4]) == [0.1, 0.3, 0.3, 0.4]
    hist = [
        {"round": 1, "val_dice": {"local/a": {"a": 0.2}}},
        {"round": 2},
        {"round": 3, "val_dice": {"local/a": {"a": 0.1}}},
    ]
    assert site_curve(hist, None, "a", {"a": "local/a"}) == ([1, 3], [0.2, 0.1])
    assert site_curve(hist, "global", "a") == ([], [])
