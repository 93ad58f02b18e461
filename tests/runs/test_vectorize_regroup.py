"""Vectorized training of sites of different sizes (epoch mode): the stack regroups as sites finish.

Sites of 3, 11, 2 and 15 training cases at batch 4 take 1, 3, 1 and 4 local steps a round (each site's last
batch smaller than the others).  After the first step sites 1 and 3 have finished: sites 2 and 4 go on as a
stack of 2; after the third, site 4 goes on alone.  A round then computes 4 + 2 + 2 + 1 = 9 = Σ steps site-steps,
the arithmetic of training the sites one after another, where a stack that kept every row until the last site
finished would compute 4 · 4 = 16.  Everything a site carries through the regroups (weights, Adam moments and
step counts, buffers, batch streams, loss sums, optimizer wrappers, the methods' own states) must come out as
in the sequential run.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.data import TensorDataset

from fedseg.simulation.runner import build_transport, vectorized_schedule
from fedseg.simulation.vectorize import VectorizedExecutor
from fedseg.simulation.vectorize import fit as stacked_fit
from fedseg.site.batches import SiteData
from fedseg.site.calls import LocalExecutor
from fedseg.site.workload import segmentation_workload
from tests.runs.test_vectorize import PLAIN, _assert_close, _cfg, _run, _states

SIZES = [3, 11, 2, 15]  # 1, 3, 1 and 4 steps at batch 4
STEPS = [1, 3, 1, 4]


def _sites(sizes=SIZES, seed: int = 0) -> dict[str, SiteData]:
    g = torch.Generator().manual_seed(seed)
    data = {}
    for k, n in enumerate(sizes):

        def split(m: int) -> TensorDataset:
            x = torch.rand(m, 1, 16, 16, generator=g)
            return TensorDataset(x, (x > 0.3 + 0.1 * k).float())  # noqa: B023

        data[f"site{k + 1}"] = SiteData(split(n), split(3), split(3))
    return data


@pytest.fixture
def stacks(monkeypatch) -> list[int]:
    """The size of every stack a step is computed on, step by step (one entry per stacked step)."""
    sizes: list[int] = []
    real = stacked_fit.StackedFit.step

    def step(self, ex, batch):
        assert len(batch) == self.k  # every row of a stack is a site that still trains
        sizes.append(self.k)
        return real(self, ex, batch)

    monkeypatch.setattr(stacked_fit.StackedFit, "step", step)
    return sizes


def test_schedule_of_unequal_sites():
    """The stacks a round passes through: (stack size, stacked steps) from the sites' steps; the fundus preset's
    training sets at batch 8 (7, 13, 6, 29, 10 and 50 steps) take 50 stacked steps for 115 site-steps."""
    assert vectorized_schedule(STEPS) == [(4, 1), (2, 2), (1, 1)]
    assert vectorized_schedule([5, 5, 5]) == [(3, 5)]
    fundus = vectorized_schedule([7, 13, 6, 29, 10, 50])
    assert fundus == [(6, 6), (5, 1), (4, 3), (3, 3), (2, 16), (1, 21)]
    assert sum(n for _, n in fundus) == 50 and sum(k * n for k, n in fundus) == 115
    assert vectorized_schedule([]) == []


class _Gained(torch.nn.Module):
    """The tiny U-Net behind an affine instance norm of its input and a fixed per-site input gain (a buffer the
    training never changes, which each site's row of the stacked buffers must carry through the regroups)."""

    def __init__(self, net: torch.nn.Module):
        super().__init__()
        self.norm = torch.nn.InstanceNorm2d(1, affine=True)
        self.net = net
        self.register_buffer("gain", torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.norm(x * self.gain))


def _calls(rnd: int, transport=None):
    """FitCalls of the four sites for round ``rnd`` in epoch mode (steps from each site's size); the first
    round's build a transport whose sites hold _Gained models with gains 1, 1.25, 1.5, 1.75, in float64."""
    if transport is None:
        cfg = _cfg("fedavg", "on", weight_decay=1e-3)
        base = segmentation_workload(2, 1, ["fg"], PLAIN)
        wl = dataclasses.replace(base, build_model=lambda: _Gained(base.build_model()))
        transport = build_transport(cfg, wl, _sites(), log=lambda m: None)
        torch.manual_seed(0)
        init = {k: v.double() for k, v in wl.build_model().state_dict().items()}
        for k, name in enumerate(transport.sites):
            model = transport.site(name).load("global", init)
            model.gain.fill_(1.0 + 0.25 * k)
    calls = []
    for name in transport.sites:
        site = transport.site(name)
        calls.append(next(site.fit("global", rnd, "train", site.optimizer("global"))))
    return transport, calls


def test_regrouped_fit_equals_each_sites_own_fit_and_computes_no_finished_row(stacks):
    """Two rounds of the four sites trained stacked equal each site's own two rounds in float64 (1e-12): weights,
    Adam moments and step counts (weight decay on; in round 2 the sites are at step counts 1, 3, 1 and 4, so the
    stacked Adam steps with per-site factors), the per-site buffer and the mean loss and steps.  Each round steps
    stacks of 4, 2, 2 and 1 rows: 9 site-steps, Σ steps, and no step computes a finished site's row."""
    seq_t, _ = _calls(1)
    vec_t, _ = _calls(1)
    ex = VectorizedExecutor(log=lambda m: None)
    for rnd in (1, 2):
        _, seq = _calls(rnd, seq_t)
        seq_out = [LocalExecutor().answer(c) for c in seq]
        _, vec = _calls(rnd, vec_t)
        stacks.clear()
        vec_out = ex.fit_together(vec)
        assert stacks == [4, 2, 2, 1] and sum(stacks) == sum(STEPS)
        assert [o["steps"] for o in vec_out] == STEPS == [o["steps"] for o in seq_out]
        for a, b, out_a, out_b in zip(seq, vec, seq_out, vec_out):
            assert out_b["loss"] == pytest.approx(out_a["loss"], rel=1e-12)
            ma, mb = a.model, b.model
            assert torch.equal(ma.gain, mb.gain)
            for pa, pb in zip(ma.parameters(), mb.parameters()):
                torch.testing.assert_close(pb, pa, rtol=1e-12, atol=1e-13)
                sa, sb = a.optimizer.state[pa], b.optimizer.state[pb]
                assert float(sb["step"]) == float(sa["step"]) and sb["step"].dtype == sa["step"].dtype
                for key in ("exp_avg", "exp_avg_sq"):
                    torch.testing.assert_close(sb[key], sa[key], rtol=1e-12, atol=1e-16)
    assert ex.vectorized_fits == 8
    assert [
        float(vec_t.site(n).optimizer("global").state[next(iter(vec_t.site(n).model("global").parameters()))]["step"])
        for n in vec_t.sites
    ] == [2.0 * s for s in STEPS]
    # the site views of the stacked weights are gone: each model owns its tensors again
    ptrs = {next(vec_t.site(n).model("global").parameters()).untyped_storage().data_ptr() for n in vec_t.sites}
    assert len(ptrs) == len(SIZES)


METHODS = [
    ("fedavg", {}),
    ("fedprox", {"fedprox": {"mu": 0.5}}),  # a per-site extra loss on the regrouped stack
    ("scaffold", {}),  # an optimizer wrapper acting on the site's row, control variates
    ("ditto", {}),  # two fits a round (global and personal models)
    ("fedsm", {}),  # global and personal models, the selector's lockstep steps and its Adam state
]


@pytest.mark.parametrize("method,params", METHODS, ids=[m for m, _ in METHODS])
def test_unequal_sites_in_epoch_mode_equal_sequential(tmp_path, stacks, method, params):
    """Epoch mode with sites of 3, 11, 2 and 15 cases: every tensor a site keeps (weights, Adam moments and
    steps, SCAFFOLD's c_i, FedSM's selector and personal models) and the server state after 2 rounds equal
    the sequential run's to 1e-10 in float64, the train losses too; the stacks regrouped mid-round."""
    seq, _ = _run(tmp_path, _cfg(method, "off", params=params), "seq", _sites())
    vec, logs = _run(tmp_path, _cfg(method, "on", params=params), "vec", _sites())
    assert any("trains as one vectorized computation" in m for m in logs), logs
    assert 4 in stacks and 2 in stacks and 1 in stacks  # regrouped as sites finished
    _assert_close(_states(tmp_path / "seq"), _states(tmp_path / "vec"), rtol=1e-10, atol=1e-10)
    for a, b in zip(seq["history"], vec["history"]):
        for key in ("train_loss", "selector_loss"):
            assert (key in a) == (key in b)
            for s, loss in a.get(key, {}).items():
                assert b[key][s] == pytest.approx(loss, rel=1e-10)


def test_the_same_seed_gives_the_same_weights(tmp_path):
    """Two vectorized runs of unequal sites with one seed end with bitwise the same state (float32)."""
    cfg = _cfg("fedavg", "on", dtype="float32")
    _run(tmp_path, cfg, "a", _sites())
    _run(tmp_path, cfg, "b", _sites())
    a, b = _states(tmp_path / "a"), _states(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[w][k], b[w][k]) for w in a for k in a[w])


@pytest.mark.parametrize("method", ["fedavg", "fedsm"])
def test_buffers_kept_across_rounds_on_the_cpu_give_bitwise_the_same_run(tmp_path, monkeypatch, method):
    """On the CPU a stack whose buffers reach ``_CPU_KEEP_BYTES`` keeps them across rounds (an arena per role and
    stack size, never captured); with the threshold at 0 every stack of the tiny model does.  The run is
    bitwise the run that allocates its buffers anew (the same operations on other memory), and one arena
    exists per role and stack size the rounds passed through (4, 2 and 1 sites)."""
    from fedseg.algorithms import get_algorithm
    from fedseg.execution.engine import Engine
    from fedseg.simulation.vectorize import graphs

    def run(name: str):
        cfg = _cfg(method, "on")
        wl = segmentation_workload(2, 1, ["fg"], cfg.model)
        algorithm = get_algorithm(cfg)
        transport = build_transport(cfg, wl, _sites(), algorithm, log=lambda m: None)
        Engine(cfg, algorithm, transport, wl, out=tmp_path / name, progress=False, log=lambda m: None).run()
        return transport.vectorized

    assert not run("fresh").arenas  # the tiny model's buffers are far below the threshold
    monkeypatch.setattr(graphs, "_CPU_KEEP_BYTES", 0)
    ex = run("kept")
    roles = {"fedavg": {"global"}, "fedsm": {"global", "personal"}}[method]
    assert {(key[0], size) for key, size in ex.arenas} == {(r, k) for r in roles for k in (4, 2, 1)}
    assert all(not a.graphs and a.pool is None for a in ex.arenas.values())  # nothing captured on the CPU
    a, b = _states(tmp_path / "fresh"), _states(tmp_path / "kept")
    assert a.keys() == b.keys() and all(torch.equal(a[w][k], b[w][k]) for w in a for k in a[w])


@pytest.mark.gpu
def test_gpu_one_captured_step_per_stack_size(tmp_path):
    """On CUDA with CUDA graphs, epoch mode with 6, 8 and 10 cases at batch 2 (3, 4 and 5 steps a round): the
    stacks of 3, 2 and 1 sites each get an arena of their own (keyed by group key and size, shared by every
    stack of that size) and, by the fourth round, a captured step (stack 2 takes one step a round: fused in
    round 1, masked from round 2 on, captured after two warm-up rounds).  The weights and moments equal the
    eager vectorized run's to rtol 1e-5 and the sequential run's to rtol 1e-4."""
    from fedseg.algorithms import get_algorithm
    from fedseg.execution.engine import Engine
    from fedseg.foundation.config import SimulationConfig
    from tests.runs.test_vectorize import _cuda, _graphs
    from tests.support.helpers import tiny_sites

    base = _cuda(_cfg("fedavg", "on", dtype="float32", rounds=4))
    base = dataclasses.replace(base, train=dataclasses.replace(base.train, batch_size=2))

    def run(name: str, cfg):
        wl = segmentation_workload(2, 1, ["fg"], cfg.model)
        algorithm = get_algorithm(cfg)
        transport = build_transport(cfg, wl, tiny_sites(), algorithm, log=lambda m: None)
        Engine(cfg, algorithm, transport, wl, out=tmp_path / name, progress=False, log=lambda m: None).run()
        return transport.vectorized

    run("seq", dataclasses.replace(base, simulation=SimulationConfig(vectorize="off")))
    run("eager", _graphs(base, False))
    ex = run("graph", _graphs(base, True))
    sizes = sorted(key[1] for key in ex.arenas)
    assert sizes == [1, 2, 3], sizes
    assert all(arena.graphs and arena.failed is None for arena in ex.arenas.values())
    assert len({arena.pool for arena in ex.arenas.values()}) == 1  # one graph memory pool for all stacks
    _assert_close(_states(tmp_path / "eager"), _states(tmp_path / "graph"), rtol=1e-5, atol=1e-7)
    _assert_close(_states(tmp_path / "seq"), _states(tmp_path / "graph"), rtol=1e-4, atol=1e-6)
