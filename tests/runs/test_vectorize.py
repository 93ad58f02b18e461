"""Vectorized simulation (``simulation.vectorize``): the same numbers as sequential, to rounding.

The equality tests use the tiny U-Net *without* normalization (``model.norm = "none"``).  With
instance norm, a convolution's bias right before the norm has a gradient that is exactly zero in
exact arithmetic; in floating point it is rounding noise, which Adam normalizes into steps of up
to ``lr`` (for |g| << eps the step is lr·g/eps, i.e. 10⁵·g).  Those biases then differ between any
two correct implementations (a vmapped convolution sums in another order), without changing
any output — :func:`test_instance_norm_model_gives_the_same_best_rounds_and_table` checks
exactly that on the default tiny model.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fedseg.algorithms.fedprox import proximal_loss
from fedseg.evaluation.tables import table3
from fedseg.execution.engine import Engine
from fedseg.foundation.config import RunConfig, SimulationConfig, load_run_config
from fedseg.foundation.errors import ConfigError, PayloadError
from fedseg.foundation.messages import Reply, Task
from fedseg.simulation.runner import build_transport, simulate
from fedseg.simulation.vectorize import (
    AUTO_MIN_SITES,
    VectorizedExecutor,
    group_size_for,
    lockstep,
    resolve_vectorize,
)
from fedseg.simulation.vectorize import fit as stacked_fit
from fedseg.simulation.vectorize.scheduler import Handler
from fedseg.site.calls import LocalExecutor
from fedseg.site.workload import segmentation_workload
from tests.support.helpers import TINY_MODEL, assert_same_checkpoints, tiny_config, tiny_sites

PLAIN = dataclasses.replace(TINY_MODEL, norm="none")


def _cfg(
    method: str,
    vectorize: str,
    dtype: str = "float64",
    model=PLAIN,
    rounds: int = 2,
    params=None,
    group: int = 0,
    **train,
) -> RunConfig:
    cfg = tiny_config(method, rounds=rounds, dtype=dtype, **train)
    return dataclasses.replace(
        cfg, model=model, simulation=SimulationConfig(vectorize=vectorize, vectorize_group=group), params=params or {}
    )


_SEQUENTIAL: dict[str, tuple[Path, dict, list[str]]] = {}
"""The sequential runs of this process on the tiny sites, by config: several tests compare with the same one."""


def _run(tmp_path, cfg, name, sites=None):
    """``cfg`` simulated into ``tmp_path / name``: ``(results, log lines)``.  A sequential run on the tiny sites
    that this process has run before is copied from that run's folder (the same config gives the same bytes)."""
    key = json.dumps(cfg.to_dict(), sort_keys=True, default=str)
    if sites is None and cfg.simulation.vectorize == "off" and key in _SEQUENTIAL:
        folder, res, logs = _SEQUENTIAL[key]
        shutil.copytree(folder, tmp_path / name)
        return copy.deepcopy(res), list(logs)
    logs: list[str] = []
    wl = segmentation_workload(2, 1, ["fg"], cfg.model)
    res = simulate(cfg, wl, sites or tiny_sites(), out=tmp_path / name, progress=False, log=logs.append)
    if sites is None and cfg.simulation.vectorize == "off":
        _SEQUENTIAL[key] = (tmp_path / name, copy.deepcopy(res), list(logs))
    return res, logs


def _states(out) -> dict[str, dict[str, torch.Tensor]]:
    """Server state and every site's saved state (models, optimizer moments and steps, store)."""
    ck = out / "checkpoints"
    states = {"server": load_file(str(ck / "server.safetensors"))}
    for f in sorted((ck / "sites").glob("*.safetensors")):
        states[f.stem] = load_file(str(f))
    return states


def _assert_close(a, b, rtol: float, atol: float, control_atol: float | None = None) -> None:
    assert a.keys() == b.keys()
    for who in a:
        assert a[who].keys() == b[who].keys(), who  # same checkpoint layout
        for k in a[who]:
            control = k.startswith(("control/", "store/scaffold/"))
            tol = (rtol, control_atol) if control and control_atol is not None else (rtol, atol)
            torch.testing.assert_close(
                b[who][k], a[who][k], rtol=tol[0], atol=tol[1], msg=lambda m, who=who, k=k: f"{who} {k}: {m}"
            )


def _vectorized(logs: list[str]) -> bool:
    return any(
        "trains as one vectorized computation" in m or "are computed as one vectorized computation" in m for m in logs
    )


# ------------------------------------------------------------------ settings
def test_auto_on_cuda_says_why_a_small_federation_trains_sequentially(monkeypatch):
    """On CUDA, ``auto`` vectorizes from AUTO_MIN_SITES sites and says so below (the device is faked for the
    transport's choice alone; the sites themselves stay on the CPU)."""
    import fedseg.simulation.runner as runner

    monkeypatch.setattr(runner, "resolve_device", lambda name: torch.device("cuda", 0))
    cfg = _cfg("fedavg", "auto")
    wl = segmentation_workload(2, 1, ["fg"], cfg.model)
    for k in (AUTO_MIN_SITES - 1, AUTO_MIN_SITES):
        logs: list[str] = []
        transport = build_transport(cfg, wl, tiny_sites(k), log=logs.append)
        assert (transport.vectorized is not None) == (k >= AUTO_MIN_SITES)
        said = [m for m in logs if "train one after another" in m]
        assert len(said) == (0 if k >= AUTO_MIN_SITES else 1), logs
        assert all("vectorize=on" in m for m in said), logs


def test_auto_is_off_on_the_cpu_and_on_on_cuda():
    assert resolve_vectorize("auto", torch.device("cpu")) is False
    assert resolve_vectorize("auto", torch.device("cuda", 0)) is True
    assert resolve_vectorize("auto", torch.device("cuda", 0), AUTO_MIN_SITES) is True
    assert resolve_vectorize("auto", torch.device("cuda", 0), AUTO_MIN_SITES - 1) is False  # no gain measured
    assert resolve_vectorize("on", torch.device("cuda", 0), 2) is True
    assert resolve_vectorize("on", torch.device("cpu")) is True
    assert resolve_vectorize("off", torch.device("cuda", 0)) is False
    with pytest.raises(ConfigError, match="simulation.vectorize = 'yes'.*'auto', 'on' or 'off'"):
        RunConfig(federation="x", simulation=SimulationConfig(vectorize="yes")).validate()
    with pytest.raises(ConfigError, match="simulation.vectorize_group"):
        SimulationConfig(vectorize_group=-1).validate()


def test_set_simulation_vectorize(tmp_path):
    p = tmp_path / "run.toml"
    p.write_text('federation = "fed.toml"\n')
    cfg = load_run_config(p, ["simulation.vectorize=on", "simulation.vectorize_group=4"])
    assert (cfg.simulation.vectorize, cfg.simulation.vectorize_group) == ("on", 4)
    assert load_run_config(p).simulation.vectorize == "auto"


def test_default_on_the_cpu_runs_sites_one_after_another(workload):
    transport = build_transport(tiny_config("fedavg"), workload, tiny_sites(), log=lambda m: None)
    assert transport.vectorized is None  # auto → off on the CPU: the bitwise guarantees hold unchanged


def test_the_shrinking_stack_of_unequal_sites_is_logged(workload):
    """Sites taking different numbers of steps: the log says how the stack shrinks as they finish and that the
    arithmetic is that of training them in turn; on the CPU also when vectorizing is slower."""
    logs: list[str] = []
    cfg = dataclasses.replace(tiny_config("fedavg"), simulation=SimulationConfig(vectorize="on"))
    build_transport(cfg, workload, tiny_sites(n_train=2), log=logs.append)  # 2, 4, 6 images: 1, 1, 2 batches
    said = [m for m in logs if "stacked steps computing" in m]
    assert said == [
        "simulation.vectorize: the sites take 1 to 2 local steps a round; the stack drops each site as it finishes "
        "(sites stacked for steps: 3 for 1, 1 for 1): 2 stacked steps computing 4 site-steps, the arithmetic of "
        "training them one after another"
    ]
    assert any("on the CPU vectorizing gains" in m and "simulation.vectorize = off" in m for m in logs)
    logs.clear()
    build_transport(cfg, workload, tiny_sites(n_train=8, num_sites=1), log=logs.append)
    assert not [m for m in logs if "stacked steps computing" in m]


# ------------------------------------------------------------------ equality
# tiny_sites() has 6, 8 and 10 training cases at batch 4: in epoch mode the sites take 2, 2 and 3
# steps, and the last batch of site1 and site3 has 2 cases — unequal steps and unequal batch shapes.
METHODS = [
    ("fedavg", {}),
    ("fedavg-even", {}),
    ("fedprox", {"fedprox": {"mu": 0.5}}),
    ("scaffold", {}),
    ("scaffold", {"scaffold": {"correction": "gradient"}}),
    ("local", {}),
    ("ditto", {}),
    ("ft", {}),
    ("apfl", {}),  # gradients at w and at the mixture α v + (1 − α) w (Site.gradient(at=...)), fused steps
    ("fedsm", {}),
    ("fedsm", {"fedsm": {"personalization": "apfl"}}),
    ("fedsm", {"fedsm": {"selector_augment": "flip"}}),  # each site's seeded flips before its selector gradient
    ("fedsm", {"fedsm": {"global_training": "fga"}}),  # the global model's lockstep gradients, the PMs' fits
    ("fga", {}),
    ("fedsm-extra", {"fedsm": {"selector_rounds": 1}}),  # round 2: selector on Eq. 1 labels of frozen models
    ("fedsm-extra", {"fedsm": {"selector_rounds": 1, "extra_objective": "experts"}}),  # by the experts objective
    ("fedsm-ensemble", {"fedsm": {"selector_rounds": 1}}),  # round 2: selector by the experts objective
    ("fedsm-ensemble", {"fedsm": {"selector_rounds": 1, "ensemble_objective": "mix"}}),  # by the output mix's loss
    ("pfedme", {}),  # its inner steps' gradients at θ (Site.gradient)
    ("perfedavg", {}),  # FO: gradients at w and at w̃ = w − α∇f (Site.gradient(at=...))
    ("perfedavg", {"perfedavg": {"variant": "hf"}}),  # + the Hessian-vector product, per site
]


@pytest.mark.parametrize(
    "method,params",
    METHODS,
    ids=[m + ("-" + "-".join(str(v) for s in p.values() for v in s.values()) if p else "") for m, p in METHODS],
)
def test_float64_equals_sequential(tmp_path, method, params):
    """Every tensor a site keeps (weights, Adam moments and steps, SCAFFOLD's c_i) and the server
    state after 2 rounds equal the sequential run's to 1e-10 in float64; the train losses too."""
    seq, _ = _run(tmp_path, _cfg(method, "off", params=params), "seq")
    vec, logs = _run(tmp_path, _cfg(method, "on", params=params), "vec")
    assert _vectorized(logs), logs
    _assert_close(_states(tmp_path / "seq"), _states(tmp_path / "vec"), rtol=1e-10, atol=1e-10)
    for a, b in zip(seq["history"], vec["history"]):
        for key in ("train_loss", "selector_loss"):
            assert (key in a) == (key in b)
            for s, loss in a.get(key, {}).items():
                assert b[key][s] == pytest.approx(loss, rel=1e-10)


FLOAT32 = [
    ("fedavg", {}),
    ("fedavg-even", {}),
    ("fedprox", {"fedprox": {"mu": 0.5}}),
    ("scaffold", {}),
    ("local", {}),
    ("ditto", {}),
    ("ft", {}),
    ("fedsm", {}),
    ("fedsm-extra", {"fedsm": {"selector_rounds": 1}}),
    ("fedsm-ensemble", {"fedsm": {"selector_rounds": 1}}),
    ("fga", {}),
    ("pfedme", {}),
    ("perfedavg", {}),
    ("apfl", {}),
]


@pytest.mark.parametrize("method,params", FLOAT32, ids=[m for m, _ in FLOAT32])
def test_float32_equals_sequential_to_rounding(tmp_path, method, params):
    """Weights and moments to rtol 1e-4, the same best rounds.  SCAFFOLD's control variates
    c_i = c_i − c + (x − y)/(K η_l) divide a difference of two nearly equal float32 weights by
    K η_l = 2e-3: one ulp of a weight (6e-8 at |w| ≈ 0.5) becomes 3e-5, in any implementation —
    that is their absolute tolerance.  Everything else: absolute 1e-5 = lr / 100.  Adam's step is
    lr · m̂/(√v̂ + ε) whatever the gradient's size, so a weight whose gradient is at rounding level
    (m̂/√v̂ of noise, O(1)) moves by up to about lr per step in a direction the rounding decides: on an
    AMD EPYC (AVX2, no AVX-512) one weight of FedSM-ensemble's selector (1 of 18,432) ends 2.5e-6 =
    0.0025 lr apart, with the code that passed at 1e-6 on the earlier machine.  The float64 test above
    is the exactness check (1e-10)."""
    seq, _ = _run(tmp_path, _cfg(method, "off", dtype="float32", params=params, rounds=3), "seq")
    vec, logs = _run(tmp_path, _cfg(method, "on", dtype="float32", params=params, rounds=3), "vec")
    assert _vectorized(logs)
    _assert_close(_states(tmp_path / "seq"), _states(tmp_path / "vec"), rtol=1e-4, atol=1e-5, control_atol=5e-5)
    assert [(r["name"], r["best_round"]) for r in seq["rows"]] == [(r["name"], r["best_round"]) for r in vec["rows"]]


# ------------------------------------------------------ lockstep gradients (FGA)
@pytest.mark.parametrize("method,role", [("fga", "global"), ("fedsm", "selector@3")])
def test_lockstep_gradients_of_all_sites_are_one_call(tmp_path, method, role):
    """FGA's step and FedSM's default (``selector_training = "fga"``) selector step: every exchange's
    gradients of the three sites are one vmapped call (2 rounds × (3 steps of the epoch + none in the
    apply-only last exchange) × 3 sites), every site stays bitwise in sync with the others, and no
    task of the method is said to run in its own loop but FedSM's routing."""
    cfg = _cfg(method, "on")
    wl = segmentation_workload(2, 1, ["fg"], cfg.model)
    logs: list[str] = []
    transport = build_transport(cfg, wl, tiny_sites(), log=logs.append)
    res = Engine(cfg, transport.site("site1").algorithm, transport, wl, out=None, progress=False, log=logs.append).run()
    assert (
        f"vectorize: the gradients of role {role!r} of sites site1, site2, site3 are computed as one vectorized computation"
        in logs
    )
    assert not any("computes it in its own loop" in m and "'route'" not in m for m in logs), logs
    assert transport.vectorized.vectorized_gradients == 2 * 3 * 3
    # every exchange but the first of a round applies the averaged gradient: 2 rounds × 3 exchanges × 3 sites
    assert (
        f"vectorize: the averaged gradients of role {role!r} of sites site1, site2, site3 are applied as one fused Adam step"
        in logs
    )
    assert transport.vectorized.vectorized_applies == 2 * 3 * 3
    assert all(e.get("in_sync", e.get("selector_in_sync")) for e in res["history"])


def test_sgd_with_momentum_equals_sequential(tmp_path):
    _run(tmp_path, _cfg("fedavg", "off", optimizer="sgd", lr=0.05, weight_decay=1e-3), "seq")
    _, logs = _run(tmp_path, _cfg("fedavg", "on", optimizer="sgd", lr=0.05, weight_decay=1e-3), "vec")
    assert _vectorized(logs)
    _assert_close(_states(tmp_path / "seq"), _states(tmp_path / "vec"), rtol=1e-10, atol=1e-10)


def test_groups_of_sites_equal_one_group(tmp_path):
    _run(tmp_path, _cfg("fedavg", "off"), "seq")
    _, logs = _run(tmp_path, _cfg("fedavg", "on", group=2), "vec")
    assert _vectorized(logs)
    _assert_close(_states(tmp_path / "seq"), _states(tmp_path / "vec"), rtol=1e-10, atol=1e-10)


def test_group_size_for_fills_the_free_memory_with_as_few_even_groups_as_fit():
    gib = 2**30
    assert group_size_for(10 * gib, gib, 6) == 6  # 8 fit (80 % of 10 GiB): all together
    assert group_size_for(5 * gib, gib, 10) == 4  # 4 fit: 3 groups → 4, 4, 2
    assert group_size_for(4 * gib, gib, 6) == 3  # 3 fit: 2 groups of 3
    assert group_size_for(int(3.75 * gib), gib, 24) == 3  # exactly 3 fit
    assert group_size_for(gib, 2 * gib, 6) == 1  # not even one fits: one at a time (the OOM split stays)
    assert group_size_for(0, gib, 1) == 1
    assert group_size_for(gib, 0, 5) == 5


def test_free_memory_is_known_on_cuda_only_and_activations_grow_with_the_batch(workload):
    from fedseg.simulation.vectorize.memory import activation_bytes, free_memory

    cpu = torch.device("cpu")
    assert free_memory(cpu) is None  # the CPU: all sites in one group unless simulation.vectorize_group says
    torch.manual_seed(0)
    model = workload.build_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.rand(4, 1, 16, 16), (torch.rand(4, 1, 16, 16) > 0.5).float()
    a1, a2, a4 = (activation_bytes(model, x[:n], y[:n], workload.loss, cpu, "fp32") for n in (1, 2, 4))
    assert 0 < a1 < a2 < a4
    # saved activations are linear in the batch (plus the weights the convolutions keep)
    assert a4 - a2 == pytest.approx(2 * (a2 - a1), rel=0.1)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the model is not touched


def test_groups_by_free_memory_equal_one_group(tmp_path, monkeypatch):
    """On CUDA with ``vectorize_group = 0`` the group size comes from the free memory and an estimate of
    the bytes per site; here both are set (on the CPU): 1000 bytes free, 400 per site → 2 fit in 80 %."""
    from fedseg.simulation.vectorize import memory

    monkeypatch.setattr(memory, "free_memory", lambda device: 1000)
    monkeypatch.setattr(memory, "fit_site_bytes", lambda item: 400)
    groups: list[int] = []
    real = stacked_fit.train_group
    monkeypatch.setattr(
        stacked_fit, "train_group", lambda state, items: groups.append(len(items)) or real(state, items)
    )
    _run(tmp_path, _cfg("fedavg", "off"), "seq")
    _, logs = _run(tmp_path, _cfg("fedavg", "on"), "vec")
    assert groups == [2, 1, 2, 1]  # 3 sites, 2 rounds
    said = [m for m in logs if "free on cpu" in m]  # said once: the group size did not change
    assert said == [
        "vectorize: role 'global' of sites site1, site2, site3: about 0 MiB per site and 0.0 GiB free on cpu: "
        "groups of at most 2 (set simulation.vectorize_group to choose)"
    ]
    _assert_close(_states(tmp_path / "seq"), _states(tmp_path / "vec"), rtol=1e-10, atol=1e-10)


def test_lockstep_gradients_are_grouped_by_free_memory(tmp_path, monkeypatch):
    """The same for FGA's lockstep gradients: 2 of 3 sites fit, and the log says so again only when
    the free memory changes the group size (here from the third exchange on: all 3 fit)."""
    from fedseg.simulation.vectorize import memory

    free = iter([1000, 1000] + [10_000] * 100)
    monkeypatch.setattr(memory, "free_memory", lambda device: next(free))
    monkeypatch.setattr(memory, "gradient_site_bytes", lambda call, loss: 400)
    groups: list[int] = []
    real = lockstep.gradient_group
    monkeypatch.setattr(
        lockstep, "gradient_group", lambda state, calls, loss: groups.append(len(calls)) or real(state, calls, loss)
    )
    _, logs = _run(tmp_path, _cfg("fga", "on"), "vec")
    assert groups[:4] == [2, 1, 2, 1] and set(groups[4:]) == {3}
    assert [m.split(": ", 2)[2] for m in logs if "free on cpu" in m] == [
        "about 0 MiB per site and 0.0 GiB free on cpu: groups of at most 2 (set simulation.vectorize_group to choose)",
        "about 0 MiB per site and 0.0 GiB free on cpu: all together (set simulation.vectorize_group to choose)",
    ]


def _fit_calls(steps: list[int], mu: float = 0.0):
    cfg = _cfg("fedavg", "on", local_steps=1, local_epochs=None)
    wl = segmentation_workload(2, 1, ["fg"], PLAIN)
    transport = build_transport(cfg, wl, tiny_sites(len(steps)), log=lambda m: None)
    torch.manual_seed(0)
    init = {k: v.double() for k, v in wl.build_model().state_dict().items()}
    sites, calls = [], []
    for name, n in zip(transport.sites, steps):
        site = transport.site(name)
        model = site.load("global", init)
        anchor = {k: v.detach().clone() for k, v in model.named_parameters()}
        extra = proximal_loss(anchor, mu) if mu else None
        sites.append(site)
        calls.append(next(site.fit("global", 1, "train", site.optimizer("global"), extra, None, n)))
    return sites, calls


def _handler(site, task):
    """A site's handler of ``task`` as the vectorized executor drives it (the in-process transport's)."""
    return Handler(site.name, task.kind, site.asks(task), site.executor, site.algorithm.name)


def test_a_site_that_has_finished_is_not_touched_by_padding_steps():
    """Site 1 takes 1 step, site 2 takes 4: site 1's weights, Adam moments and step count are those
    of its single sequential step — the three padding steps change nothing (not just a zero gradient,
    which Adam would still turn into a step through its moments)."""
    _, seq = _fit_calls([1, 4], mu=0.1)
    seq_out = [LocalExecutor().answer(c) for c in seq]
    _, vec = _fit_calls([1, 4], mu=0.1)
    ex = VectorizedExecutor(log=lambda m: None)
    vec_out = ex.fit_together(vec)
    assert ex.vectorized_fits == 2
    assert [o["steps"] for o in vec_out] == [1, 4] == [o["steps"] for o in seq_out]
    for a, b, out_a, out_b in zip(seq, vec, seq_out, vec_out):
        assert out_b["loss"] == pytest.approx(out_a["loss"], rel=1e-12)
        ma, mb = a.model, b.model
        for pa, pb in zip(ma.parameters(), mb.parameters()):
            torch.testing.assert_close(pb, pa, rtol=1e-12, atol=1e-13)
            sa, sb = a.optimizer.state[pa], b.optimizer.state[pb]
            assert float(sb["step"]) == float(sa["step"]) and sb["step"].dtype == sa["step"].dtype
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(sb[key], sa[key], rtol=1e-12, atol=1e-16)
    # the site views of the stacked weights are gone: each model owns its tensors again
    p1, p2 = (next(c.model.parameters()) for c in vec)
    assert p1.untyped_storage().data_ptr() != p2.untyped_storage().data_ptr()


def test_batches_are_the_sites_seeded_batches(monkeypatch):
    """The vectorized step draws every site's batches from its call's batch source (the site's seeded streams),
    as the site's own executor does."""
    from fedseg.site import batches as site_batches

    seen: dict[str, list[torch.Tensor]] = {}
    real = site_batches.training_batches

    def spy(b):
        for x, y in real(b):
            seen.setdefault(f"{b.site}/{threading.current_thread() is threading.main_thread()}", []).append(x.clone())
            yield x, y

    monkeypatch.setattr(site_batches, "training_batches", spy)
    _, calls = _fit_calls([2, 3])
    VectorizedExecutor(log=lambda m: None).fit_together(calls)
    vec = {k: v for k, v in seen.items()}
    seen.clear()
    for c in _fit_calls([2, 3])[1]:
        LocalExecutor().answer(c)
    assert vec.keys() == seen.keys() == {"site1/True", "site2/True"}
    for k in vec:
        assert len(vec[k]) == len(seen[k]) and all(torch.equal(a, b) for a, b in zip(vec[k], seen[k]))


# ------------------------------------------------------------------ fallbacks
def test_batch_norm_model_falls_back_with_the_reason_logged(tmp_path):
    bn = dataclasses.replace(TINY_MODEL, norm="batch")
    _run(tmp_path, _cfg("fedavg", "off", dtype="float32", model=bn), "seq")
    _, logs = _run(tmp_path, _cfg("fedavg", "on", dtype="float32", model=bn), "vec")
    said = [m for m in logs if m.startswith("vectorize:")]
    assert said == [
        "vectorize: role 'global' of site site1 trains sequentially: batch norm with running statistics "
        "(model.0.conv.unit0.adn.N: its in-place buffer updates do not vectorize)",
        "vectorize: role 'global' of site site2 trains sequentially: batch norm with running statistics "
        "(model.0.conv.unit0.adn.N: its in-place buffer updates do not vectorize)",
        "vectorize: role 'global' of site site3 trains sequentially: batch norm with running statistics "
        "(model.0.conv.unit0.adn.N: its in-place buffer updates do not vectorize)",
    ]
    a, b = _states(tmp_path / "seq"), _states(tmp_path / "vec")
    assert all(torch.equal(a[w][k], b[w][k]) for w in a for k in a[w])  # the fallback is the sequential path: bitwise


def test_a_method_with_its_own_loop_runs_sequentially_and_says_so(tmp_path):
    outputs = {"apfl": {"mix": "outputs"}}  # APFL's output mixture: autograd through both models' outputs
    _run(tmp_path, _cfg("apfl", "off", rounds=1, params=outputs), "seq")
    _, logs = _run(tmp_path, _cfg("apfl", "on", rounds=1, params=outputs), "vec")
    assert (
        "vectorize: task 'train' of sites site1, site2, site3 runs sequentially: method 'apfl' computes it in its own loop, not through Site.fit or Site.gradient"
        in logs
    )
    a, b = _states(tmp_path / "seq"), _states(tmp_path / "vec")
    assert all(torch.equal(a[w][k], b[w][k]) for w in a for k in a[w])


def test_an_error_in_one_site_ends_the_ask_and_closes_the_other_handlers():
    sites, _ = _fit_calls([1, 1, 1])
    closed: list[str] = []

    def bad(site, task):
        if site.name == "site2":
            raise PayloadError("site2: hostile payload")
        try:
            yield from site.fit("global", 1, "train", steps=1)
        except GeneratorExit:
            closed.append(site.name)
            raise
        return Reply()

    for s in sites:
        s._handlers = {"train": bad}
    ex = VectorizedExecutor(log=lambda m: None)
    with pytest.raises(PayloadError, match="hostile"):
        ex.run([_handler(s, Task("train")) for s in sites])
    assert closed == ["site1"]  # site1 waited for its fit; site3 never started (site2 failed first)


def test_the_vectorized_executor_starts_no_thread_and_computes_a_fallback_at_the_site(monkeypatch):
    """A vectorized FedSM round with its FGA selector (fits, lockstep gradients, fused steps) and an FGA round
    run with threading.Thread.start failing inside the executor's asks; a request the stacked functions leave computes at its site, in
    the calling thread, and the handler goes on with its result."""
    from fedseg.simulation.vectorize.scheduler import SEQUENTIAL

    inside = {"run": 0}
    real_start, real_run = threading.Thread.start, VectorizedExecutor.run

    def refuse(self):
        if inside["run"]:
            raise AssertionError("the vectorized executor started a thread")
        real_start(self)

    def run(self, calls):
        inside["run"] += 1
        try:
            return real_run(self, calls)
        finally:
            inside["run"] -= 1

    monkeypatch.setattr(threading.Thread, "start", refuse)
    monkeypatch.setattr(VectorizedExecutor, "run", run)
    for method in ("fedsm", "fga"):
        cfg = _cfg(method, "on", rounds=1, local_steps=2, local_epochs=None)
        logs: list[str] = []
        simulate(cfg, segmentation_workload(2, 1, ["fg"], cfg.model), tiny_sites(), progress=False, log=logs.append)
        assert _vectorized(logs), logs
    seen: list[int] = []

    def handler(site, task):
        out = yield from site.fit("global", 1, "train", steps=1)
        seen.append(out["steps"])
        return Reply()

    sites, _ = _fit_calls([1, 1, 1])
    for s in sites:
        s._handlers = {"train": handler}
    monkeypatch.setattr(VectorizedExecutor, "fit_together", lambda self, calls: [SEQUENTIAL] * len(calls))
    ex = VectorizedExecutor(log=lambda m: None)
    ex.run([_handler(s, Task("train")) for s in sites])
    assert seen == [1, 1, 1] and ex.vectorized_fits == 0


# ------------------------------------------------------------------ results
def test_instance_norm_model_gives_the_same_best_rounds_and_table(tmp_path):
    """The default (instance-norm) tiny U-Net in float32: same best rounds, same results table."""
    seq, _ = _run(tmp_path, _cfg("fedavg", "off", dtype="float32", model=TINY_MODEL, rounds=3), "seq")
    vec, logs = _run(tmp_path, _cfg("fedavg", "on", dtype="float32", model=TINY_MODEL, rounds=3), "vec")
    assert _vectorized(logs)
    assert [(r["name"], r["best_round"]) for r in seq["rows"]] == [(r["name"], r["best_round"]) for r in vec["rows"]]
    assert table3([seq]) == table3([vec])


def test_a_group_out_of_memory_at_its_first_step_is_split_and_a_vmap_failure_falls_back(tmp_path, monkeypatch):
    """Out of memory at a group's first step (nothing updated yet): the group trains as two halves.
    Any other error at the first step: the group trains sequentially, with the error logged."""
    real = stacked_fit.stacked_gradients

    def oom_for_groups(batch, *rest):
        if len(batch) > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(batch, *rest)

    _run(tmp_path, _cfg("fedavg", "off", local_steps=2, local_epochs=None), "seq")
    monkeypatch.setattr(stacked_fit, "stacked_gradients", oom_for_groups)
    _, logs = _run(tmp_path, _cfg("fedavg", "on", local_steps=2, local_epochs=None), "split")
    assert (
        "vectorize: a group of 3 sites does not fit in memory; training groups of at most 1 (set simulation.vectorize_group)"
        in logs
    )
    _assert_close(_states(tmp_path / "seq"), _states(tmp_path / "split"), rtol=1e-10, atol=1e-10)

    def unsupported(*args):
        raise RuntimeError("vmap: an op without a batching rule (simulated)")

    monkeypatch.setattr(stacked_fit, "stacked_gradients", unsupported)
    _, logs = _run(tmp_path, _cfg("fedavg", "on", local_steps=2, local_epochs=None), "fallback")
    assert any(
        "trains sequentially: its loss does not run under torch.func.vmap (RuntimeError: vmap: an op" in m for m in logs
    )
    a, b = _states(tmp_path / "seq"), _states(tmp_path / "fallback")
    assert all(torch.equal(a[w][k], b[w][k]) for w in a for k in a[w])


@pytest.mark.parametrize("method", ["fedavg", "fga"])
def test_bf16_autocast_runs_vectorized(tmp_path, method):
    """train.precision = bf16: the vmapped loss (FedAvg's fit, FGA's lockstep gradient) runs under the
    same autocast; losses agree to bf16 rounding."""
    seq, _ = _run(tmp_path, _cfg(method, "off", dtype="float32", model=TINY_MODEL, precision="bf16"), "seq")
    vec, logs = _run(tmp_path, _cfg(method, "on", dtype="float32", model=TINY_MODEL, precision="bf16"), "vec")
    assert _vectorized(logs)
    for a, b in zip(seq["history"], vec["history"]):
        for s, loss in a["train_loss"].items():
            assert b["train_loss"][s] == pytest.approx(loss, abs=1e-2)


def test_a_vectorized_run_resumes_exactly(tmp_path):
    """Checkpoints of a vectorized run hold each site's own state, so an interrupted vectorized
    run resumed from them equals the uninterrupted vectorized run (here bitwise: same arithmetic)."""
    cfg = _cfg("fedprox", "on", rounds=3, params={"fedprox": {"mu": 0.5}})
    wl = segmentation_workload(2, 1, ["fg"], cfg.model)
    full = simulate(cfg, wl, tiny_sites(), out=tmp_path / "full", progress=False, log=lambda m: None)
    assert (
        simulate(cfg, wl, tiny_sites(), out=tmp_path / "cut", progress=False, log=lambda m: None, stop_after=1) is None
    )
    resumed = simulate(cfg, wl, tiny_sites(), out=tmp_path / "cut", progress=False, log=lambda m: None, resume=True)
    assert_same_checkpoints(tmp_path / "full", tmp_path / "cut")
    assert [e["train_loss"] for e in full["history"]] == [e["train_loss"] for e in resumed["history"]]


def test_vectorized_fga_equals_centralized_training_in_float64(tmp_path):
    """FGA's property (Remedios et al. 2020; hand derivation in tests/unit/algorithms/test_fga.py) holds vectorized:
    3 sites of 8, 12 and 6 samples, batch 4 → T = max(2, 3, 2) = 3 lockstep steps per round, site 3's
    second batch has 2 samples (a separate vmap), sites 1 and 3 cycle into their next permutation.
    The sample-weighted mean of the per-site gradients is the pooled batch's gradient, so after 4
    rounds (12 Adam steps) the weights equal one model trained centrally on the concatenated batches,
    to float64 rounding, and every site holds bitwise the same weights and Adam moments."""
    from tests.unit.algorithms.test_fga import (
        centralized_reference,
        class_sites,
        config,
        mlp_workload,
        rel_diff,
        server_weights,
    )

    data, wl = class_sites([8, 12, 6]), mlp_workload()
    cfg = dataclasses.replace(config(rounds=4), simulation=SimulationConfig(vectorize="on"))
    logs: list[str] = []
    res = simulate(cfg, wl, data, out=tmp_path, progress=False, log=logs.append)
    assert _vectorized(logs), logs
    assert [h["steps"] for h in res["history"]] == [3] * 4 and all(h["in_sync"] for h in res["history"])
    assert rel_diff(server_weights(tmp_path), centralized_reference(cfg, wl, data, steps=3)) <= 1e-9


def test_lockstep_gradients_of_a_batch_norm_model_fall_back_with_the_reason_logged(tmp_path):
    """Batch norm with running statistics: each site's gradient is computed by Site.gradient, one site
    after another (bitwise the sequential run), and the log says why, once per site."""
    from tests.unit.algorithms.test_fga import class_sites, config, mlp_workload

    data, wl = class_sites([8, 4]), mlp_workload(batch_norm=True)
    runs = {}
    for mode in ("off", "on"):
        cfg = dataclasses.replace(config(rounds=2), simulation=SimulationConfig(vectorize=mode))
        logs: list[str] = []
        with pytest.warns(UserWarning, match="batch-norm"):  # FGA's own warning: no longer centralized training
            simulate(cfg, wl, data, out=tmp_path / mode, progress=False, log=logs.append)
        runs[mode] = _states(tmp_path / mode)
    assert [m for m in logs if m.startswith("vectorize:")] == [
        f"vectorize: the gradient of role 'global' of site {s} is computed sequentially: batch norm with running "
        "statistics (2: its in-place buffer updates do not vectorize)"
        for s in ("site1", "site2")
    ]
    a, b = runs["off"], runs["on"]
    assert all(torch.equal(a[w][k], b[w][k]) for w in a for k in a[w])


def test_a_loss_that_fails_under_vmap_computes_the_gradients_sequentially(tmp_path, monkeypatch):
    """Any error of the vmapped gradient falls back to the sites' own Site.gradient (nothing at a site
    changes while a gradient is computed), is logged once and is not tried again."""
    tries = {"n": 0}

    def unsupported(state, calls, loss):
        tries["n"] += 1
        raise RuntimeError("vmap: an op without a batching rule (simulated)")

    _run(tmp_path, _cfg("fga", "off"), "seq")
    monkeypatch.setattr(lockstep, "gradient_group", unsupported)
    _, logs = _run(tmp_path, _cfg("fga", "on"), "vec")
    assert [m for m in logs if m.startswith("vectorize:")] == [
        "vectorize: the gradients of role 'global' of sites site1, site2, site3 are computed as one vectorized computation",
        "vectorize: the gradients of role 'global' of sites site1, site2, site3 are computed sequentially: the loss does "
        "not run under torch.func.vmap (RuntimeError: vmap: an op without a batching rule (simulated))",
    ]
    assert tries["n"] == 1
    a, b = _states(tmp_path / "seq"), _states(tmp_path / "vec")
    assert all(torch.equal(a[w][k], b[w][k]) for w in a for k in a[w])


def test_gradients_together_equal_each_sites_own_gradient_at_different_weights():
    """Site.gradient vectorized does not rely on the sites holding the same weights (lockstep keeps them
    equal, but the stacked rows are the sites' own): two sites with different weights and different
    batch sizes get exactly the gradients and losses their own Site.gradient computes."""
    sites, _ = _fit_calls([1, 1])
    with torch.no_grad():
        for p in sites[1].model("global").parameters():
            p.mul_(0.5).add_(0.01)
    batches = [next(s.batches(1, "train", 1, batch_size=b)) for s, b in zip(sites, (4, 3))]
    grads = [next(s.gradient("global", x, y)) for s, (x, y) in zip(sites, batches)]
    ex = VectorizedExecutor(log=lambda m: None)
    vec = ex.gradients_together(grads)
    assert ex.vectorized_gradients == 2
    for s, (x, y), (g_vec, loss_vec) in zip(sites, batches, vec):
        g_seq, loss_seq = s.now(s.gradient("global", x, y))
        assert g_vec.keys() == g_seq.keys() and len(g_seq) == len(list(s.model("global").parameters()))
        torch.testing.assert_close(loss_vec, loss_seq, rtol=1e-12, atol=0)
        for n in g_seq:
            torch.testing.assert_close(g_vec[n], g_seq[n], rtol=1e-10, atol=1e-12, msg=lambda m, n=n: f"{n}: {m}")


def test_lockstep_adam_steps_together_equal_each_sites_own_step():
    """The averaged gradient applied by one fused Adam call over all sites' parameters equals each site's
    own ``apply_gradient`` (torch.optim.Adam's step) to float64 rounding: sites with different weights,
    Adam step counts (site 1 and 3 have taken a step, site 2 none: its state is created as Adam creates
    it), weight decay, and a parameter the gradient leaves out (no gradient: not stepped, no state).
    Sites 1 and 3 hold the same weights, moments and gradient, and stay bitwise identical to each other
    (FGA's in-sync check)."""
    import copy

    from fedseg.algorithms.gradients import apply_gradient

    sites, _ = _fit_calls([1, 1, 1])
    with torch.no_grad():
        for p in sites[1].model("global").parameters():
            p.mul_(0.5).add_(0.01)
    models = [s.model("global") for s in sites]
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2, weight_decay=1e-3) for m in models]
    x, y = next(sites[0].batches(1, "train", 1, batch_size=4))
    ex = VectorizedExecutor(log=lambda m: None)
    grads = [g for g, _ in ex.gradients_together([next(s.gradient("global", x, y)) for s in sites])]
    grads[2] = grads[0]  # site 3: site 1's gradient
    left_out = list(grads[0])[-1]
    for i in (0, 2):  # sites 1 and 3 take a first step, the same one
        apply_gradient(models[i], opts[i], grads[0])
    grads = [{n: g * (1 + i) for n, g in gr.items() if n != left_out} for i, gr in enumerate(grads)]
    grads[2] = grads[0]
    ref_models = [copy.deepcopy(m) for m in models]
    ref_opts = []
    for m, o in zip(ref_models, opts):
        ref = torch.optim.Adam(m.parameters(), lr=1e-2, weight_decay=1e-3)
        ref.load_state_dict(copy.deepcopy(o.state_dict()))
        ref_opts.append(ref)
    for m, o, g in zip(ref_models, ref_opts, grads):
        apply_gradient(m, o, g)
    out = ex.apply_together([next(s.step_with_gradient(m, o, g)) for s, m, o, g in zip(sites, models, opts, grads)])
    assert out == [True] * 3 and ex.vectorized_applies == 3
    for m, o, rm, ro in zip(models, opts, ref_models, ref_opts):
        for (n, p), rp in zip(m.named_parameters(), rm.parameters()):
            torch.testing.assert_close(p, rp, rtol=1e-12, atol=1e-12, msg=n)
            torch.testing.assert_close(p.grad, rp.grad, rtol=0, atol=0, msg=n)
            st, rst = o.state.get(p, {}), ro.state.get(rp, {})
            assert st.keys() == rst.keys(), n
            for key in st:
                torch.testing.assert_close(st[key], rst[key], rtol=1e-12, atol=1e-12, msg=f"{n} {key}")
    assert opts[1].state[next(models[1].parameters())]["step"] == 1
    assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[2].parameters()))
    for a, b in zip(models[0].parameters(), models[2].parameters()):
        assert all(torch.equal(opts[0].state[a][k], opts[2].state[b][k]) for k in opts[0].state[a])


def test_selector_pools_as_adaptive_average_pooling_and_runs_under_vmap_without_the_slow_fallback():
    """FedSM's selector pools by a mean over the spatial positions: the same numbers as
    ``AdaptiveAvgPool(1)`` + ``Flatten`` (2D and 3D), and its stacked gradients run under vmap without
    torch's per-sample fallback (which warned "performance drop" for the adaptive pooling)."""
    import warnings

    from torch import nn
    from torch.func import functional_call, stack_module_state, vmap

    from fedseg.models import Selector
    from fedseg.models.selector import GlobalAvgPool

    g = torch.Generator().manual_seed(0)
    x2, x3 = torch.randn(3, 2, 5, 7, generator=g), torch.randn(2, 3, 4, 5, 6, generator=g)
    torch.testing.assert_close(GlobalAvgPool()(x2), nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())(x2))
    torch.testing.assert_close(GlobalAvgPool()(x3), nn.Sequential(nn.AdaptiveAvgPool3d(1), nn.Flatten())(x3))
    sels = [Selector(2, 3, 4, width=0.0625, hidden=8) for _ in range(3)]
    params, bufs = stack_module_state(sels)
    xs = torch.randn(3, 2, 3, 16, 16, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fallback's UserWarning fails the test
        out = vmap(lambda p, b, x: functional_call(sels[0], (p, b), (x,)))(params, bufs, xs)
        grads = torch.autograd.grad(out.sum(), list(params.values()))
    for k, sel in enumerate(sels):  # each row is that selector's own output
        torch.testing.assert_close(out[k], sel(xs[k]))
    assert all(gr.shape == p.shape for gr, p in zip(grads, params.values()))


# ------------------------------------------------------------------- on CUDA
def _cuda(cfg: RunConfig) -> RunConfig:
    return dataclasses.replace(cfg, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["fedavg", "fedsm", "fga", "apfl"])
def test_gpu_vectorized_equals_sequential_to_rounding(tmp_path, method):
    """On CUDA as on the CPU: weights and moments to rtol 1e-4, the same best rounds; the group size
    comes from the free GPU memory and the log says so (the CPU has no such number)."""
    seq, _ = _run(tmp_path, _cuda(_cfg(method, "off", dtype="float32", rounds=3)), "seq")
    vec, logs = _run(tmp_path, _cuda(_cfg(method, "on", dtype="float32", rounds=3)), "vec")
    assert seq["device"].startswith("cuda") and _vectorized(logs), logs
    assert any(re.search(r"MiB per site and [0-9.]+ GiB free on cuda", m) for m in logs), logs
    _assert_close(_states(tmp_path / "seq"), _states(tmp_path / "vec"), rtol=1e-4, atol=1e-6)
    assert [(r["name"], r["best_round"]) for r in seq["rows"]] == [(r["name"], r["best_round"]) for r in vec["rows"]]


@pytest.mark.gpu
def test_gpu_auto_vectorizes_and_bf16_runs_vectorized(tmp_path):
    """``simulation.vectorize = auto`` is on on CUDA from ``AUTO_MIN_SITES`` sites; under bf16 autocast the
    vectorized losses agree with the sequential ones to bf16 rounding and every weight stays finite."""
    sites = tiny_sites(AUTO_MIN_SITES)
    seq, _ = _run(
        tmp_path, _cuda(_cfg("fedavg", "off", dtype="float32", model=TINY_MODEL, precision="bf16")), "seq", sites
    )
    vec, logs = _run(
        tmp_path, _cuda(_cfg("fedavg", "auto", dtype="float32", model=TINY_MODEL, precision="bf16")), "vec", sites
    )
    assert _vectorized(logs), logs
    assert all(
        torch.isfinite(t).all()
        for st in _states(tmp_path / "vec").values()
        for t in st.values()
        if t.is_floating_point()
    )
    for a, b in zip(seq["history"], vec["history"]):
        for s, loss in a["train_loss"].items():
            assert b["train_loss"][s] == pytest.approx(loss, abs=1e-2)


def _graphs(cfg: RunConfig, on: bool) -> RunConfig:
    return dataclasses.replace(cfg, simulation=dataclasses.replace(cfg.simulation, cuda_graphs="on" if on else "off"))


def test_graph_arena_takes_a_batch_only_of_its_captured_shape():
    """The static batch of a captured step (``Arena``, device-agnostic): the first batch — every site's, of one
    shape — fixes its shape; later batches of that shape are copied into the same memory (a finished site's row
    keeps its last batch), any other shape or dtype (the last, smaller batch of an epoch) is refused and nothing
    is copied, so that step runs eagerly."""
    from fedseg.simulation.vectorize.graphs import Arena
    from fedseg.simulation.vectorize.layout import Layout

    params = [torch.zeros(3, 2), torch.zeros(4)]
    arena = Arena(Layout(params, 2), params[0], {})
    assert arena.flat.numel() == 2 * (6 + 4) and [w.shape for w in arena.weights] == [(2, 3, 2), (2, 4)]

    def b(n: int = 4):
        return torch.rand(n, 1, 8, 8), torch.rand(n, 1, 8, 8)

    assert not arena.load_batch({0: b()}, 2)  # not every site has a batch yet: no static batch to fill
    assert arena.x is None
    assert arena.load_batch({0: b(), 1: b()}, 2)
    first = arena.x.data_ptr()
    new = {0: b(), 1: b()}
    assert arena.load_batch(new, 2) and arena.x.data_ptr() == first  # copied into the captured memory
    torch.testing.assert_close(arena.x, torch.stack([new[0][0], new[1][0]]), rtol=0, atol=0)
    torch.testing.assert_close(arena.y, torch.stack([new[0][1], new[1][1]]), rtol=0, atol=0)
    only = b()
    assert arena.load_batch({1: only}, 2)  # site 0 has finished: its row keeps its last batch
    torch.testing.assert_close(arena.x, torch.stack([new[0][0], only[0]]), rtol=0, atol=0)
    assert not arena.load_batch({0: b(2), 1: b()}, 2)  # a smaller batch
    assert not arena.load_batch({0: (b()[0].double(), b()[1]), 1: b()}, 2)  # another dtype
    torch.testing.assert_close(arena.x, torch.stack([new[0][0], only[0]]), rtol=0, atol=0)  # nothing written


def test_masked_adam_first_step_moves_each_unmasked_element_by_lr_times_the_sign_of_its_gradient():
    """Adam's first step, by hand: m = (1 − β₁) g, v = (1 − β₂) g², the bias corrections 1 − β₁ and √(1 − β₂)
    cancel them, so p moves by −lr · g / (|g| + eps) (≈ −lr · sign g).  ``adam_`` (masked) does that where the
    mask holds and leaves p, m and v bitwise unchanged elsewhere; a second step equals torch's Adam."""
    from fedseg.simulation.vectorize.optimizer import adam_, adam_factors

    lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-8
    g = torch.tensor([0.5, -2.0, 1e-3, 3.0], dtype=torch.float64)
    p0 = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    mask = torch.tensor([True, True, True, False])
    sizes, bc2s = adam_factors([0.0, 1.0], lr, b1, b2)  # a site at t = 0 gets t = 1's factors
    assert sizes[0] == sizes[1] == pytest.approx(-lr / (1 - b1)) and bc2s[1] == pytest.approx((1 - b2) ** 0.5)
    p, m, v = p0.clone(), torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    adam_([p], [g], [m], [v], lr=lr, b1=b1, b2=b2, eps=eps, factors=(sizes[1], bc2s[1]), mask=mask)
    expected = p0 - lr * g / (g.abs() + eps)
    torch.testing.assert_close(p[:3], expected[:3], rtol=1e-12, atol=1e-12)
    assert p[3] == p0[3] and m[3] == 0 and v[3] == 0  # masked out: untouched
    ref = torch.nn.Parameter(p0[:3].clone())
    opt = torch.optim.Adam([ref], lr=lr, betas=(b1, b2), eps=eps)
    for grad in (g[:3], -0.5 * g[:3]):
        ref.grad = grad.clone()
        opt.step()
    sizes, bc2s = adam_factors([2.0], lr, b1, b2)
    adam_([p], [-0.5 * g], [m], [v], lr=lr, b1=b1, b2=b2, eps=eps, factors=(sizes[0], bc2s[0]), mask=mask)
    torch.testing.assert_close(p[:3], ref.detach(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("active", [[0, 2], [0, 1, 2]])
def test_masked_graph_step_arithmetic_equals_the_eager_stacked_adam_step(active):
    """The masked step a CUDA graph captures (``StackedOptimizer.begin_masked`` on the host, ``masked_kernels``
    on the device: per-element step sizes and bias corrections, a mask) is the eager stacked Adam step of the
    same sites, on the CPU too: three sites at Adam step counts 1, 2 and 3 (weight decay on), the active sites'
    weights and moments to float rounding, an inactive site's bitwise unchanged, the step counts advanced for
    the active sites only."""
    from fedseg.simulation.vectorize.graphs import Arena
    from fedseg.simulation.vectorize.layout import Layout
    from fedseg.simulation.vectorize.optimizer import StackedOptimizer

    g = torch.Generator().manual_seed(0)
    models = [torch.nn.Linear(5, 3) for _ in range(3)]
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2, weight_decay=1e-3) for m in models]
    for i, (m, o) in enumerate(zip(models, opts)):  # site i has taken i + 1 steps
        for _ in range(i + 1):
            o.zero_grad()
            m(torch.randn(4, 5, generator=g)).square().sum().backward()
            o.step()
    plist = [list(m.parameters()) for m in models]
    layout = Layout(plist[0], 3)
    grad = torch.randn(layout.numel, generator=g)

    with torch.no_grad():
        eager = StackedOptimizer(opts, plist, layout.pack(plist), layout)
        eager.step(grad.clone(), active)
        arena = Arena(layout, plist[0][0], {})
        layout.pack(plist, out=arena.flat)
        before = arena.flat.clone()
    graphed = StackedOptimizer(opts, plist, arena.flat, layout, arena)
    graphed.begin_masked(active, arena)
    graphed.masked_kernels(grad.clone(), arena)

    assert graphed.s == eager.s == [s + (1.0 if i in active else 0.0) for i, s in enumerate([1.0, 2.0, 3.0])]
    assert graphed.taken == eager.taken
    for a, b in ((graphed.flat, eager.flat), (graphed.m, eager.m), (graphed.v, eager.v)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
    for i in set(range(3)) - set(active):  # an inactive site's row is exactly what it was
        for blk, blk0 in zip(layout.blocks(arena.flat), layout.blocks(before)):
            assert torch.equal(blk[i], blk0[i])
    assert not torch.equal(arena.flat, before)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["fedavg", "fedsm"])
def test_gpu_cuda_graph_steps_equal_the_eager_vectorized_and_the_sequential_steps(tmp_path, method):
    """``simulation.cuda_graphs = on`` (default) captures a group's local step after its warm-up and replays it:
    the weights and moments equal the eager vectorized run's (the same kernels; rtol 1e-5) and the sequential
    run's to rounding (rtol 1e-4), with the same best rounds.  Four local steps a round over three rounds at
    batch 2 (every site's batches full, so every step has one shape): two warm-up steps, the capture, replays."""
    base = _cuda(_cfg(method, "on", dtype="float32", rounds=3, local_steps=4, local_epochs=None))
    base = dataclasses.replace(base, train=dataclasses.replace(base.train, batch_size=2))
    seq, _ = _run(tmp_path, dataclasses.replace(base, simulation=SimulationConfig(vectorize="off")), "seq")
    _, elogs = _run(tmp_path, _graphs(base, False), "eager")
    graph, glogs = _run(tmp_path, _graphs(base, True), "graph")
    assert any("captured CUDA graph" in m for m in glogs), glogs
    assert not any("could not be captured" in m for m in glogs), glogs
    assert not any("CUDA graph" in m for m in elogs), elogs
    _assert_close(_states(tmp_path / "eager"), _states(tmp_path / "graph"), rtol=1e-5, atol=1e-7)
    _assert_close(_states(tmp_path / "seq"), _states(tmp_path / "graph"), rtol=1e-4, atol=1e-6)
    assert [(r["name"], r["best_round"]) for r in seq["rows"]] == [(r["name"], r["best_round"]) for r in graph["rows"]]


@pytest.mark.gpu
def test_gpu_epoch_mode_with_unequal_sites_captures_the_masked_step(tmp_path):
    """Epoch mode with 6, 8 and 10 cases at batch 2 (3, 4 and 5 steps a round, moments kept): sites finish
    their rounds at different steps and are at different Adam step counts from round 2 on, so besides the fused
    step the masked one (finished sites' rows computed on their last batch and left unchanged) is captured; the
    weights and moments equal the eager vectorized run's to rtol 1e-5 and the sequential run's to rtol 1e-4."""
    base = _cuda(_cfg("fedavg", "on", dtype="float32", rounds=3))
    base = dataclasses.replace(base, train=dataclasses.replace(base.train, batch_size=2))
    _run(tmp_path, dataclasses.replace(base, simulation=SimulationConfig(vectorize="off")), "seq")
    _run(tmp_path, _graphs(base, False), "eager")
    _, logs = _run(tmp_path, _graphs(base, True), "graph")
    assert any("captured CUDA graph (every site at one step count" in m for m in logs), logs
    assert any("captured CUDA graph (sites at different step counts" in m for m in logs), logs
    _assert_close(_states(tmp_path / "eager"), _states(tmp_path / "graph"), rtol=1e-5, atol=1e-7)
    _assert_close(_states(tmp_path / "seq"), _states(tmp_path / "graph"), rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
def test_gpu_a_step_that_cannot_be_captured_runs_eagerly_and_says_why(tmp_path):
    """A loss that synchronizes with the host (here: reads a number back) runs under vmap but not inside a
    CUDA graph capture: the capture fails, the log names the role and the error, and the run goes on eagerly
    with the numbers of a run with ``cuda_graphs = off``."""
    from fedseg.site.workload import make_loss

    dice = make_loss("dice")

    def syncing_loss(out, target):
        scale = float(torch.ones((), device=out.device))  # a device-to-host read: not capturable
        return dice(out, target) * scale

    def run(name: str, on: bool):
        cfg = _graphs(_cuda(_cfg("fedavg", "on", dtype="float32", rounds=2, local_steps=4, local_epochs=None)), on)
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=2))  # full batches
        wl = dataclasses.replace(segmentation_workload(2, 1, ["fg"], cfg.model), loss=syncing_loss)
        logs: list[str] = []
        simulate(cfg, wl, tiny_sites(), out=tmp_path / name, progress=False, log=logs.append)
        return logs

    logs = run("graph", True)
    assert any("could not be captured as a CUDA graph" in m and "'global'" in m for m in logs), logs
    run("eager", False)
    _assert_close(_states(tmp_path / "eager"), _states(tmp_path / "graph"), rtol=1e-6, atol=1e-8)
