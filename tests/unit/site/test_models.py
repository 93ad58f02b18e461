"""A site's models by role (:class:`fedseg.site.models.SiteModels`), on its own, without a site."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedseg.foundation.config import ModelConfig, TrainConfig
from fedseg.site.models import SiteModels, bn_buffers
from fedseg.site.workload import segmentation_workload

MODEL = ModelConfig(channels=(4, 8), strides=(2,), num_res_units=0, norm="batch")


@pytest.fixture(scope="module")
def wl():
    made = segmentation_workload(2, 1, ["fg"], MODEL)
    made.build_model()  # the network library and torch's optimizers import outside the tests' time
    torch.optim.Adam([nn.Parameter(torch.zeros(1))])
    return made


def _models(wl, **train) -> SiteModels:
    return SiteModels("a", wl, TrainConfig(**train), torch.device("cpu"))


def test_workload_roles_copy_the_first_and_a_factory_role_is_its_own(wl):
    """The first workload role is built (and becomes the template); a later workload role is a copy of it
    (same weights, its own tensors); a role with a factory is built by the factory and is no template."""
    part = _models(wl)
    first = part.model("global")
    torch.manual_seed(1)  # a rebuilt workload model would draw other weights
    second = part.model("eval")
    assert part.template_role == "global" and second is not first
    for (k, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr(), k
    own = part.model("head", lambda: nn.Linear(3, 1))
    assert isinstance(own, nn.Linear) and part.template_role == "global"
    assert part.model("global") is first and part.role_of(own) == "head" and part.role_of(nn.Linear(1, 1)) == "?"


def test_local_bn_policy_shares_all_but_the_running_statistics(wl):
    part = _models(wl, bn_policy="local")
    model = part.model("global")
    bn = bn_buffers(model)
    assert bn and all(k.endswith(("running_mean", "running_var", "num_batches_tracked")) for k in bn)
    assert set(part.arrays("global")) == set(model.state_dict()) - bn
    everything = _models(wl, bn_policy="average")
    everything.model("global")
    assert set(everything.arrays("global")) == set(model.state_dict())


def test_optimizer_follows_train_and_is_kept_until_reset(wl):
    sgd = _models(wl, optimizer="sgd", lr=0.5, momentum=0.9, nesterov=True)
    opt = sgd.optimizer("global")
    assert isinstance(opt, torch.optim.SGD)
    assert opt.param_groups[0]["lr"] == 0.5 and opt.param_groups[0]["nesterov"] is True
    assert sgd.optimizer("global") is opt and sgd.optimizer("global", reset=True) is not opt
    adam = _models(wl, optimizer="adam", lr=0.25).optimizer("global", lr=0.125)
    assert isinstance(adam, torch.optim.Adam) and adam.param_groups[0]["lr"] == 0.125


def test_a_role_has_a_scaler_only_under_fp16(wl):
    assert _models(wl).scaler("global") is None and not _models(wl).scalers
    fp16 = _models(wl, precision="fp16")
    sc = fp16.scaler("global")
    assert isinstance(sc, torch.amp.GradScaler) and fp16.scaler("global") is sc and list(fp16.scalers) == ["global"]
