"""Pure aggregation maths on hand-computed tensors."""

import pytest
import torch

from fedseg import arrays as A
from fedseg.algorithms.fedavg import aggregation_weights
from fedseg.errors import PayloadError


def test_weighted_mean_hand_computed():
    # Prepare: two sites, n = (1, 3) -> p = (0.25, 0.75)
    a = {"w": torch.tensor([0.0, 4.0]), "n": torch.tensor(7)}
    b = {"w": torch.tensor([4.0, 8.0]), "n": torch.tensor(9)}
    # Execute
    out = A.weighted_mean([a, b], [1, 3])
    # Assert: 0.25*0 + 0.75*4 = 3; 0.25*4 + 0.75*8 = 7; integer buffer taken from the first, not averaged
    assert torch.equal(out["w"], torch.tensor([3.0, 7.0]))
    assert out["n"].dtype == torch.int64 and int(out["n"]) == 7


def test_weighted_mean_uniform_and_single_item_exact():
    x = {"w": torch.randn(5, generator=torch.Generator().manual_seed(0))}
    assert torch.equal(A.weighted_mean([x])["w"], x["w"])
    assert torch.equal(A.weighted_mean([x, x, x])["w"], x["w"])


def test_weighted_mean_rejects_mismatch_and_bad_weights():
    a = {"w": torch.zeros(2)}
    with pytest.raises(PayloadError, match="'w' has shape"):
        A.weighted_mean([a, {"w": torch.zeros(3)}])
    with pytest.raises(PayloadError, match="missing"):
        A.weighted_mean([a, {"v": torch.zeros(2)}])
    with pytest.raises(ValueError, match=">= 0"):
        A.weighted_mean([a, a], [1, -1])
    with pytest.raises(ValueError, match="sum to 0"):
        A.weighted_mean([a, a], [0, 0])


def test_lerp_add_sub_scale_dot_flatten():
    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0])}
    b = {"w": torch.tensor([3.0, 6.0]), "b": torch.tensor([-1.0])}
    assert torch.equal(A.lerp(a, b, 0.5)["w"], torch.tensor([2.0, 4.0]))
    assert torch.equal(A.sub(b, a)["w"], torch.tensor([2.0, 4.0]))
    assert torch.equal(A.scale(a, 2.0)["b"], torch.tensor([6.0]))
    # <a, b> = 1*3 + 2*6 + 3*(-1) = 12
    assert float(A.dot(a, b)) == 12.0
    # flatten orders by name: b then w
    assert A.flatten(a).tolist() == [3.0, 1.0, 2.0]
    assert A.nbytes(a) == 12


def test_prefix_roundtrip_and_nonfinite():
    a = {"w": torch.tensor([1.0, float("nan")])}
    assert A.strip_prefix("g", A.prefixed("g", a)).keys() == a.keys()
    assert A.nonfinite(a) == ["w"]


def test_fedavg_weights():
    assert aggregation_weights([1, 3], "samples") == [0.25, 0.75]
    assert aggregation_weights([1, 3], "even") == [0.5, 0.5]
    with pytest.raises(ValueError):
        aggregation_weights([0, 0], "samples")
