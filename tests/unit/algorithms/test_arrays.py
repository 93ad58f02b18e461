"""Pure aggregation maths on hand-computed tensors."""

import pytest
import torch

from fedseg.algorithms.fedavg import aggregation_weights
from fedseg.foundation import arrays as A
from fedseg.foundation.arrays import aggregate, check_aggregation, weighted_mean
from fedseg.foundation.errors import ConfigError, PayloadError


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


# ------------------------------------------------------- robust aggregation
def _vals(*xs):
    return [{"w": torch.tensor([x, -x], dtype=torch.float32), "n": torch.tensor(7 + i)} for i, x in enumerate(xs)]


def test_aggregate_mean_is_weighted_mean_bitwise():
    """rule='mean' is FedAvg's weighted mean itself (the paper-faithful default, bitwise unchanged)."""
    items = [{"w": torch.randn(5, generator=torch.Generator().manual_seed(i))} for i in range(3)]
    assert torch.equal(aggregate(items, [1, 2, 3])["w"], weighted_mean(items, [1, 2, 3])["w"])


def test_trimmed_mean_by_hand():
    """Values 1, 2, 3, 100 with trim 0.25: ⌊0.25·4⌋ = 1 dropped at each end → mean(2, 3) = 2.5.
    With weights 1, 2, 3, 4 the kept 2 (p=2) and 3 (p=3) give (2·2 + 3·3)/5 = 2.6; the second
    coordinate (−1, −2, −3, −100) sorts the other way and keeps −3 (p=3), −2 (p=2): −2.6.
    Integer tensors come from the first item."""
    items = _vals(1.0, 2.0, 3.0, 100.0)
    assert torch.allclose(aggregate(items, None, "trimmed_mean", 0.25)["w"], torch.tensor([2.5, -2.5]))
    out = aggregate(items, [1, 2, 3, 4], "trimmed_mean", 0.25)
    assert torch.allclose(out["w"], torch.tensor([2.6, -2.6])) and out["w"].dtype == torch.float32
    assert int(out["n"]) == 7


def test_trimmed_mean_with_too_few_sites_trims_nothing():
    """⌊0.1·3⌋ = 0: the trimmed mean of 3 sites at trim 0.1 is the weighted mean (1·1 + 2·2 + 3·3)/6 = 14/6."""
    assert torch.allclose(
        aggregate(_vals(1.0, 2.0, 3.0), [1, 2, 3], "trimmed_mean", 0.1)["w"], torch.tensor([14 / 6, -14 / 6])
    )


def test_median_by_hand_and_bounded_by_honest_values():
    """Median of 5, 1, 3 is 3; of 1, 2, 3, 1e30 it is (2 + 3)/2 = 2.5, whatever the weights: one hostile
    site cannot move it outside the honest values."""
    assert torch.allclose(aggregate(_vals(5.0, 1.0, 3.0), None, "median")["w"], torch.tensor([3.0, -3.0]))
    assert torch.allclose(
        aggregate(_vals(1.0, 2.0, 3.0, 1e30), [1, 1, 1, 1e9], "median")["w"], torch.tensor([2.5, -2.5])
    )


def test_aggregation_settings_are_validated_with_the_key():
    with pytest.raises(
        ConfigError, match=r"fedavg.aggregation = 'avg'; use one of \['mean', 'trimmed_mean', 'median'\]"
    ):
        check_aggregation("avg", 0.1, "fedavg")
    with pytest.raises(ConfigError, match=r"fedprox.trim = 0.5; it must be in \[0, 0.5\)"):
        check_aggregation("trimmed_mean", 0.5, "fedprox")
