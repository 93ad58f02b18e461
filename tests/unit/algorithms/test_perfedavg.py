"""Per-FedAvg's Hessian-vector products and meta-gradient against explicit Hessians."""

from __future__ import annotations

import pytest
import torch

from fedseg.algorithms.perfedavg import grad_of, hvp_autograd, hvp_finite_difference, meta_gradient


def quadratic():
    """f(w) = ½ aᵀ A a + bᵀ a + ½ c² with A symmetric positive definite: ∇²f = blockdiag(A, 1) exactly."""
    g = torch.Generator().manual_seed(0)
    m = torch.randn(3, 3, generator=g, dtype=torch.float64)
    A = m @ m.T + 3 * torch.eye(3, dtype=torch.float64)
    b = torch.randn(3, generator=g, dtype=torch.float64)

    def f(p):
        a = p["a"]
        return 0.5 * a @ A @ a + b @ a + 0.5 * p["c"].pow(2).sum()

    w = {"a": torch.randn(3, generator=g, dtype=torch.float64), "c": torch.randn(1, generator=g, dtype=torch.float64)}
    v = {"a": torch.randn(3, generator=g, dtype=torch.float64), "c": torch.randn(1, generator=g, dtype=torch.float64)}
    return f, A, w, v


def test_autograd_hvp_equals_explicit_hessian_on_a_quadratic():
    # Prepare
    f, A, w, v = quadratic()
    # Execute
    hv = hvp_autograd(f, w, v)
    # Assert: A v for the block a, 1 · v for c
    torch.testing.assert_close(hv["a"], A @ v["a"], rtol=0, atol=1e-12)
    torch.testing.assert_close(hv["c"], v["c"], rtol=0, atol=1e-12)


def test_finite_difference_hvp_is_exact_on_a_quadratic_and_second_order_on_a_cubic():
    """Central differences of a linear gradient are exact (up to rounding); on f = Σ w³/… the error is O(δ²)."""
    # Prepare
    f, A, w, v = quadratic()
    # Execute / Assert: quadratic
    hv = hvp_finite_difference(f, w, v, delta=1e-3)
    torch.testing.assert_close(hv["a"], A @ v["a"], rtol=0, atol=1e-9)
    # Prepare: cubic with a full Hessian from torch.autograd.functional.hessian
    g = torch.Generator().manual_seed(1)
    M = torch.randn(4, 4, generator=g, dtype=torch.float64)
    x0 = torch.randn(4, generator=g, dtype=torch.float64)
    u = torch.randn(4, generator=g, dtype=torch.float64)

    def cubic(p):
        z = M @ p["x"]
        return (z.pow(3)).sum() / 6 + torch.sin(p["x"]).sum()

    H = torch.autograd.functional.hessian(lambda x: cubic({"x": x}), x0)
    # Execute
    exact = hvp_autograd(cubic, {"x": x0}, {"x": u})["x"]
    err1 = (hvp_finite_difference(cubic, {"x": x0}, {"x": u}, 1e-2)["x"] - H @ u).abs().max()
    err2 = (hvp_finite_difference(cubic, {"x": x0}, {"x": u}, 5e-3)["x"] - H @ u).abs().max()
    # Assert: autograd matches the explicit Hessian; halving δ divides the FD error by ~4
    torch.testing.assert_close(exact, H @ u, rtol=1e-12, atol=1e-12)
    assert err1 < 1e-3 and 3.0 < float(err1 / err2) < 5.0


def test_meta_gradient_first_order_and_hessian_free():
    """FO: g; HF: g − α H g.  With g = (1, 2), Hg = (4, −2), α = 0.5 → (−1, 3)."""
    g = {"w": torch.tensor([1.0, 2.0])}
    assert torch.equal(meta_gradient(g, 0.5)["w"], g["w"])
    assert torch.equal(meta_gradient(g, 0.5, {"w": torch.tensor([4.0, -2.0])})["w"], torch.tensor([-1.0, 3.0]))


def test_maml_gradient_matches_autograd_through_the_inner_step():
    """The HF meta-gradient (I − α∇²f(w)) ∇f(w̃) with w̃ = w − α∇f(w) equals d/dw f(w − α∇f(w)) when the
    three batches are the same (the MAML gradient, Per-FedAvg Eq. 6), computed here by autograd end to end."""
    # Prepare
    g = torch.Generator().manual_seed(2)
    X = torch.randn(6, 3, generator=g, dtype=torch.float64)
    y = torch.randn(6, generator=g, dtype=torch.float64)
    w0 = torch.randn(3, generator=g, dtype=torch.float64)
    alpha = 0.1

    def f(p):
        return (torch.tanh(X @ p["w"]) - y).pow(2).mean()

    # Execute: our pieces
    g1 = grad_of(f, {"w": w0})
    w_tilde = {"w": w0 - alpha * g1["w"]}
    g2 = grad_of(f, w_tilde)
    ours = meta_gradient(g2, alpha, hvp_autograd(f, {"w": w0}, g2))["w"]
    # Execute: full autograd of F(w) = f(w − α ∇f(w))
    w = w0.clone().requires_grad_(True)
    inner = torch.autograd.grad(f({"w": w}), w, create_graph=True)[0]
    full = torch.autograd.grad(f({"w": w - alpha * inner}), w)[0]
    # Assert
    torch.testing.assert_close(ours, full, rtol=1e-12, atol=1e-14)
    assert not torch.allclose(g2["w"], full, atol=1e-6)  # FO differs: the Hessian term matters here


@pytest.mark.parametrize("delta", [1e-2, 1e-3])
def test_finite_difference_meta_gradient_close_to_exact(delta):
    """With the finite-difference HVP the meta-gradient stays within O(δ²) of the exact one."""
    f, _A, w, _v = quadratic()
    g2 = grad_of(f, w)
    exact = meta_gradient(g2, 0.1, hvp_autograd(f, w, g2))
    fd = meta_gradient(g2, 0.1, hvp_finite_difference(f, w, g2, delta))
    torch.testing.assert_close(fd["a"], exact["a"], rtol=0, atol=1e-8)
