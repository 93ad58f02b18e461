"""FedSM-extra's and the ensemble's K + 1-class selectors trained through the lockstep
(``fedsm.selector_training = "fga"``) on a federation whose classes are separable, and their
routing measured against Eq. 1's oracle labels.

The fixture: two sites whose images differ in mean intensity (0.8 vs 0.2, noise sd 0.05) and
whose masks differ in position (top half vs bottom half).  With λ = 1 SoftPull leaves each
personalized model its own site's (A = I in Eq. 11), so after the model phase site k's
personalized model has the lowest loss on site k's images: Eq. 1 labels are 1 on site 1 and
2 on site 2 — one class per site, the label skew of Eq. 2 again, and a class that the
selector can read from the intensity alone.
"""

from __future__ import annotations

import dataclasses

import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import TensorDataset

from fedseg.algorithms import get_algorithm
from fedseg.algorithms.fedsm import oracle_accuracy
from fedseg.algorithms.softpull import oracle_labels
from fedseg.models import Selector
from fedseg.simulation.runner import simulate
from fedseg.site.batches import SiteData
from fedseg.site.runtime import Site
from tests.support.helpers import tiny_config, tiny_sites

# the selector as drawn (no flips): these tests follow the batches image by image
SEL = {"selector_width": 0.0625, "selector_hidden": 8, "selector_lr": 0.01, "selector_augment": "none"}


def _separable_sites(n_train: int = 8, size: int = 16) -> dict[str, SiteData]:
    g = torch.Generator().manual_seed(0)
    data = {}
    for k, level in enumerate((0.8, 0.2)):

        def split(n: int) -> TensorDataset:
            x = level + 0.05 * torch.randn(n, 1, size, size, generator=g)  # noqa: B023
            y = torch.zeros(n, 1, size, size)
            y[..., k * size // 2 : (k + 1) * size // 2, :] = 1  # noqa: B023
            return TensorDataset(x, y)

        data[f"site{k + 1}"] = SiteData(split(n_train), split(4), split(4))
    return data


def _cfg(method: str, training: str):
    # 8 model rounds, then 12 selector rounds of 5 lockstep steps each (the pooled-batch selector
    # of this size needs ~30 Adam steps at lr 0.01 to separate the two intensities)
    cfg = tiny_config(method, rounds=20, lr=0.01, local_steps=5, local_epochs=None)
    fedsm = {**SEL, "lam": 1.0, "selector_rounds": 12, "selector_training": training, "selector_steps": "all"}
    # validated once, after the last round (the routing accuracy read here is the training history's)
    return dataclasses.replace(cfg, params={"fedsm": fedsm}, eval=dataclasses.replace(cfg.eval, every=20))


def _server_models(out, workload, data):
    """The frozen global + personalized models and the selector the server holds at the end."""
    server = load_file(str(out / "checkpoints/server.safetensors"))

    def part(name: str, module: nn.Module) -> nn.Module:
        module.load_state_dict({k.removeprefix(name + "/"): v for k, v in server.items() if k.startswith(name + "/")})
        return module.eval()

    frozen = [part(name, workload.build_model()) for name in ["global", *(f"personal/{s}" for s in data)]]
    sel = part("selector", Selector(2, 1, len(data) + 1, width=SEL["selector_width"], hidden=SEL["selector_hidden"]))
    return frozen, sel


def test_fga_selector_of_fedsm_extra_learns_eq1_labels_that_are_one_class_per_site(tmp_path, workload):
    # Prepare
    data = _separable_sites()
    # Execute
    res = simulate(_cfg("fedsm-extra", "fga"), workload, data, out=tmp_path, progress=False)
    # Assert: the fixture gives one Eq. 1 class per site (1 on site 1, 2 on site 2) …
    frozen, sel = _server_models(tmp_path, workload, data)
    with torch.no_grad():
        for k, d in enumerate(data.values()):
            x, y = d.val.tensors
            assert oracle_labels([m(x) for m in frozen], y, workload.loss).tolist() == [k + 1] * len(x)
            # … and the selector learned both: every validation image routed to its Eq. 1 label
            assert sel(x).argmax(dim=1).tolist() == [k + 1] * len(x)
    last = res["history"][-1]
    assert last["phase"] == "selector" and last["selector_in_sync"]
    # the selector the sites held at the start of the last round already routed right, as reported
    assert last["routing_acc"] == {"site1": 1.0, "site2": 1.0}
    # negative control: the averaged selector (5 local steps, then the mean) collapses to one class
    res_avg = simulate(_cfg("fedsm-extra", "fedavg"), workload, data, out=tmp_path / "avg", progress=False)
    _, sel_avg = _server_models(tmp_path / "avg", workload, data)
    with torch.no_grad():
        picks = {int(c) for d in data.values() for c in sel_avg(d.val.tensors[0]).argmax(dim=1)}
    assert len(picks) == 1
    assert sorted(res_avg["history"][-1]["routing_acc"].values()) == [0.0, 1.0]


class _Constant(nn.Module):
    """A 'model' whose output is a fixed tensor broadcast over the batch."""

    def __init__(self, out: torch.Tensor):
        super().__init__()
        self.out = out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out.expand(x.shape[0], *self.out.shape[1:])


def test_k_plus_1_routing_accuracy_is_agreement_with_eq1_labels_not_the_site_label(workload):
    """Site 2 of 2 (Eq. 2 label: own site → class 2 of K + 1).  Its masks are all foreground; the
    global model outputs logit +5 everywhere (loss near 0), both personalized models −5 (loss
    high), so Eq. 1's label is 0 (global) for every image.  A selector that always picks class 0
    agrees with Eq. 1 on every image — routing accuracy 1 — though it never picks the site's own
    class (Eq. 2 would say 0)."""
    # Prepare
    data = tiny_sites(2)
    for d in data.values():
        x, y = d.val.tensors
        d.val.tensors = (x, torch.ones_like(y))
    cfg = dataclasses.replace(tiny_config("fedsm-extra", rounds=2), params={"fedsm": SEL})
    site = Site("site2", 1, data["site2"], workload, cfg, get_algorithm(cfg))
    shape = (1, 1, 16, 16)
    models = [_Constant(torch.full(shape, 5.0)), _Constant(torch.full(shape, -5.0)), _Constant(torch.full(shape, -5.0))]
    picks_global = _Constant(torch.tensor([[3.0, 0.0, 0.0]]))
    picks_own = _Constant(torch.tensor([[0.0, 0.0, 3.0]]))
    # Execute / Assert
    assert oracle_accuracy(site, picks_global, models, "validation") == 1.0
    assert oracle_accuracy(site, picks_own, models, "validation") == 0.0


def _ensemble_weights(out, workload, data):
    """Per site, the (N, K + 1) softmax of the server's final ensemble selector on its validation images,
    and Eq. 1's labels of those images under the server's frozen models."""
    frozen, sel = _server_models(out, workload, data)
    res = {}
    with torch.no_grad():
        for s, d in data.items():
            x, y = d.val.tensors
            res[s] = (torch.softmax(sel(x), dim=1), oracle_labels([m(x) for m in frozen], y, workload.loss))
    return res


def test_ensemble_selector_learns_with_the_experts_objective_and_not_with_the_papers_mix(tmp_path, workload):
    """The ensemble's selector (K + 1 classes) on the separable fixture, trained by ``fga`` (= centrally), its
    mixed output the composite (``mode = "mix"``).

    Default objective (``ensemble_objective = "experts"``): every validation image gets most of its weight
    on its Eq. 1 label (site k's own personalized model), and the reported routing accuracy (agreement with
    Eq. 1) is 1 at both sites.  The paper's literal objective (``"mix"``, the loss of the mixed output) on
    the same data, same seeds: not one image gets its Eq. 1 label as the argmax — the selector collapses to
    one class for all images (the global model: the single model with the lowest loss over the pooled
    batch, which the selector's input-independent part learns first; see docs/algorithms.md)."""
    # Prepare
    data = _separable_sites()
    # 8 model rounds as above, then 6 selector rounds (30 pooled Adam steps)
    cfg = _cfg("fedsm-ensemble", "fga")
    fedsm = {**cfg.params["fedsm"], "selector_rounds": 6}
    cfg = dataclasses.replace(cfg, rounds=14, params={"fedsm": fedsm}, eval=dataclasses.replace(cfg.eval, every=14))
    mix = dataclasses.replace(cfg, params={"fedsm": {**fedsm, "ensemble_objective": "mix"}})
    # Execute
    res = simulate(cfg, workload, data, out=tmp_path / "experts", progress=False)
    res_mix = simulate(mix, workload, data, out=tmp_path / "mix", progress=False)
    # Assert: default objective — the argmax is Eq. 1's label on every image, with more than the uniform
    # weight 1 / (K + 1) on it
    assert res["config"]["fedsm"]["ensemble_objective"] == "experts"
    for k, (w, eq1) in enumerate(_ensemble_weights(tmp_path / "experts", workload, data).values()):
        assert eq1.tolist() == [k + 1] * len(eq1)
        assert w.argmax(dim=1).tolist() == eq1.tolist()
        assert float(w[:, k + 1].min()) > 1 / 3
    assert res["history"][-1]["routing_acc"] == {"site1": 1.0, "site2": 1.0}
    # the paper's mix: one class for every image of both sites, never the Eq. 1 label
    weights = _ensemble_weights(tmp_path / "mix", workload, data)
    picks = {int(c) for w, _ in weights.values() for c in w.argmax(dim=1)}
    assert picks == {0}
    assert all(int((w.argmax(dim=1) == eq1).sum()) == 0 for w, eq1 in weights.values())
    assert sorted(res_mix["history"][-1]["routing_acc"].values()) == [0.0, 0.0]
