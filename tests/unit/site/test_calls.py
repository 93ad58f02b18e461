"""The executor core on requests built by hand (no ``Site``): ``drive``, ``as_asks``, the local executor's answers
to a fit, a gradient and an apply request, the order of a fit's hooks, and the vectorized executor handing a
request it does not stack to the site's own executor.

The model is ``nn.Linear(2, 1)`` in float64 with the squared error ``L(w, b) = mean_i (w·x_i + b − t_i)²``, whose
gradient by hand is ``∂L/∂w = (2/N) Σ_i r_i x_i`` and ``∂L/∂b = (2/N) Σ_i r_i`` with residuals
``r_i = w·x_i + b − t_i``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from fedseg.foundation.errors import ConfigError
from fedseg.foundation.messages import Reply
from fedseg.simulation.vectorize import VectorizedExecutor
from fedseg.simulation.vectorize.scheduler import Handler
from fedseg.site.calls import ApplyCall, FitCall, Flag, GradientCall, LocalExecutor, as_asks, drive

X = torch.tensor([[1.0, 2.0], [3.0, -1.0], [0.5, 0.5]], dtype=torch.float64)
T = torch.tensor([[1.0], [0.0], [2.0]], dtype=torch.float64)
LR = 0.1


class Batches:
    """A hand-made batch source: the same list of batches on every pass."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]):
        self.batches = batches
        self.passes = 0

    @property
    def steps(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self.passes += 1
        return iter(self.batches)


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def linear(w: list[float], b: float) -> nn.Linear:
    m = nn.Linear(2, 1).double()
    with torch.no_grad():
        m.weight.copy_(torch.tensor([w], dtype=torch.float64))
        m.bias.fill_(b)
    return m


def by_hand(w: torch.Tensor, b: float, x: torch.Tensor = X, t: torch.Tensor = T) -> tuple[torch.Tensor, float, float]:
    """(∂L/∂w, ∂L/∂b, L) of the squared error at (w, b), from the formulas of the module docstring."""
    r = x @ w + b - t[:, 0]
    n = x.shape[0]
    return (2.0 / n) * (r[:, None] * x).sum(0), float((2.0 / n) * r.sum()), float((r**2).mean())


def fit_call(model: nn.Module, opt: torch.optim.Optimizer, batches: Batches, **hooks) -> FitCall:
    return FitCall(
        "a",
        "global",
        1,
        model,
        opt,
        batches,
        mse,
        torch.device("cpu"),
        "fp32",
        contextlib.nullcontext,
        **hooks,
    )


# ------------------------------------------------------------------ driving
def test_drive_answers_each_request_in_turn_and_returns_the_handlers_result():
    asked: list[str] = []

    def handler():
        a = yield "first"
        b = yield "second"
        return a + b

    def answer(call):
        asked.append(call)
        return len(asked) * 10

    assert drive(handler(), answer) == 30 and asked == ["first", "second"]  # 10 + 20


def test_as_asks_turns_a_plain_reply_into_a_handler_that_asks_nothing():
    reply = Reply(metrics={"x": 1.0})
    asked: list[object] = []
    assert drive(as_asks(reply), asked.append) is reply and asked == []

    def gen():
        yield "call"
        return reply

    g = gen()
    assert as_asks(g) is g  # a generator passes through


# --------------------------------------------------------------- local answers
def test_a_fit_step_is_sgd_then_the_after_step_correction_in_that_order():
    """One SGD step at lr η of the squared error, then ``after_step``'s w ← w − η c (SCAFFOLD's step correction
    with c = (c − c_i)): w₁ = w₀ − η ∂L/∂w(w₀) − η c, b₁ = b₀ − η ∂L/∂b − η c_b, by hand.  ``after_backward`` sees
    the gradient before the step and ``after_step`` the stepped weights."""
    model = linear([0.5, -0.25], 0.125)
    w0, b0 = model.weight.detach()[0].clone(), float(model.bias.detach())
    corr = {
        "weight": torch.tensor([[0.3, -0.2]], dtype=torch.float64),
        "bias": torch.tensor([0.05], dtype=torch.float64),
    }
    order: list[str] = []

    def after_backward(m: nn.Module) -> None:
        order.append("after_backward")
        assert m.weight.grad is not None and torch.equal(m.weight.detach()[0], w0)  # not stepped yet

    def after_step(m: nn.Module) -> None:
        order.append("after_step")
        with torch.no_grad():
            for k, p in m.named_parameters():
                p.sub_(corr[k], alpha=LR)

    opt = torch.optim.SGD(model.parameters(), lr=LR)
    batches = Batches([(X, T)])
    out = LocalExecutor().answer(fit_call(model, opt, batches, after_backward=after_backward, after_step=after_step))
    gw, gb, loss = by_hand(w0, b0)
    assert order == ["after_backward", "after_step"]
    assert out["steps"] == 1 and out["loss"] == pytest.approx(loss, rel=1e-15)
    torch.testing.assert_close(model.weight.detach()[0], w0 - LR * gw - LR * corr["weight"][0], rtol=0, atol=1e-15)
    assert float(model.bias.detach()) == pytest.approx(b0 - LR * gb - LR * 0.05, abs=1e-15)
    assert batches.passes == 1  # the batch source is drawn once, lazily, by the executor


def test_a_fit_adds_the_extra_loss_and_reports_the_mean_loss_of_its_steps():
    """``extra_loss(model) = λ‖w‖²`` adds 2λw to the weight's gradient; two steps, the loss mean over both."""
    lam = 0.5
    model = linear([1.0, 1.0], 0.0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = LocalExecutor().answer(
        fit_call(model, opt, Batches([(X, T), (X, T)]), extra_loss=lambda m: lam * m.weight.pow(2).sum())
    )
    w, b, losses = torch.tensor([1.0, 1.0], dtype=torch.float64), 0.0, []
    for _ in range(2):
        gw, gb, loss = by_hand(w, b)
        losses.append(loss + lam * float(w.pow(2).sum()))
        w, b = w - LR * (gw + 2 * lam * w), b - LR * gb
    assert out["steps"] == 2 and out["loss"] == pytest.approx(sum(losses) / 2, rel=1e-14)
    torch.testing.assert_close(model.weight.detach()[0], w, rtol=0, atol=1e-15)


def test_fp16_loss_scaling_refuses_a_correction_after_each_step():
    model = linear([1.0, 1.0], 0.0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    call = fit_call(model, opt, Batches([(X, T)]), after_step=lambda m: None)
    call.scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ConfigError, match="site a: train.precision = 'fp16'"):
        LocalExecutor().answer(call)


def test_a_gradient_request_is_the_batch_gradient_at_the_model_or_at_given_weights():
    model = linear([0.5, -0.25], 0.125)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    call = GradientCall("a", "global", model, X, T, mse, torch.device("cpu"), "fp32", contextlib.nullcontext)
    grads, loss = LocalExecutor().answer(call)
    gw, gb, value = by_hand(before["weight"][0], float(before["bias"]))
    torch.testing.assert_close(grads["weight"][0], gw, rtol=0, atol=1e-15)
    assert float(grads["bias"]) == pytest.approx(gb, abs=1e-15) and float(loss) == pytest.approx(value, rel=1e-15)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # no step
    at = {"weight": torch.tensor([[2.0, 0.0]], dtype=torch.float64), "bias": torch.tensor([1.0], dtype=torch.float64)}
    model.zero_grad(set_to_none=True)
    call.at = at
    grads, _ = LocalExecutor().answer(call)
    gw, gb, _ = by_hand(at["weight"][0], 1.0)
    torch.testing.assert_close(grads["weight"][0], gw, rtol=0, atol=1e-15)
    assert model.weight.grad is None  # the model's own parameters are not touched


def test_an_apply_request_steps_with_the_given_gradient_and_leaves_an_unnamed_parameter():
    model = linear([1.0, 2.0], 3.0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    g = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    assert LocalExecutor().answer(ApplyCall("a", "global", model, opt, {"weight": g})) is None
    torch.testing.assert_close(model.weight.detach(), torch.tensor([[0.9, 2.1]], dtype=torch.float64))
    assert float(model.bias.detach()) == 3.0 and model.bias.grad is None


# ------------------------------------------------------- the vectorized fallback
class Recording(LocalExecutor):
    """A site's own executor that records what it answers."""

    def __init__(self) -> None:
        self.answered: list[object] = []

    def answer(self, call):
        self.answered.append(call)
        return super().answer(call)


def _drive_two(executors, model_of, logs):
    """Two sites' handlers of one fit each, driven by a vectorized executor: (the executor, the calls, the
    steps each handler got back)."""
    calls, results = [], []

    def handler(i: int):
        model = model_of()
        call = fit_call(model, torch.optim.SGD(model.parameters(), lr=LR), Batches([(X, T)]))
        call.site = f"s{i}"
        calls.append(call)
        out = yield call
        results.append(out["steps"])
        return Reply(metrics={"steps": out["steps"]})

    ex = VectorizedExecutor(log=logs.append)
    replies = ex.run([Handler(f"s{i}", "train", handler(i), executors[i], "m") for i in range(2)])
    assert [r.metrics["steps"] for r in replies] == results == [1, 1]
    return ex, calls


def test_a_request_the_vectorized_executor_does_not_stack_goes_to_the_sites_own_executor():
    """Two sites whose models have dropout (which does not run under vmap): each fit is answered by that
    site's own executor, and the handler goes on with the result."""
    executors, logs = [LocalExecutor(), LocalExecutor()], []
    answered: list[list[object]] = [[], []]
    for i, e in enumerate(executors):  # record on the instances: the executors stay plain LocalExecutors
        e.answer = lambda call, i=i, real=e.answer: answered[i].append(call) or real(call)  # type: ignore[method-assign]
    ex, calls = _drive_two(executors, lambda: nn.Sequential(nn.Linear(2, 1), nn.Dropout(0.5)).double(), logs)
    assert answered == [[calls[0]], [calls[1]]] and ex.vectorized_fits == 0
    assert any("role 'global' of site s0 trains sequentially: dropout" in m for m in logs)


def test_a_site_whose_executor_computes_otherwise_answers_all_its_own_requests():
    """Sites whose own executor is not the plain local one (under ``privacy.dp = "sample"`` their DP executor)
    are never stacked, even with models that would stack: each answers its own requests, as it would alone, so
    vectorize + DP keeps DP-SGD's steps."""
    executors, logs = [Recording(), Recording()], []
    ex, calls = _drive_two(executors, lambda: linear([1.0, 1.0], 0.0), logs)
    assert [e.answered for e in executors] == [[calls[0]], [calls[1]]] and ex.vectorized_fits == 0
    assert "vectorize: site s0 answers its own requests: its executor (Recording) computes them otherwise" in logs[0]
    plain, logs = [LocalExecutor(), LocalExecutor()], []
    ex, _ = _drive_two(plain, lambda: linear([1.0, 1.0], 0.0), logs)
    assert ex.vectorized_fits == 2  # the same models with the plain executor: stacked


def test_round_progress_sets_the_sites_flag_once():
    from fedseg.site.calls import FIRST_STEPS, RoundProgress

    said = Flag()
    p = RoundProgress("a", said, 1, 10, log=lambda m: None)
    for done in range(1, FIRST_STEPS + 2):
        p.step(done)
    assert said.set and not RoundProgress("a", said, 2, 10, log=lambda m: None).first
