"""Auto-FedAvg: aggregation weights learned from the sites' data (Xia et al., 2021).

FedAvg sets w ← Σ_k α_k w_k with α_k = n_k / n.  Auto-FedAvg (paper Section 3,
Algorithm 1) learns α instead.  Every ``interval`` (t0) rounds, after local
training and before aggregating, the server runs **LearnAggWeight**:

1. it sends each site the other sites' locally trained models w_j (j ≠ k) once;
2. for S steps, each site receives β^{s−1}, samples a batch x, forms
   w(α) = Σ_j α_j w_j with α = γ(β^{s−1}), computes l(w(α); x), updates β with
   its own Adam and replies β^{s,k}; the server sets β^s = mean_k β^{s,k}
   (Alg. 1: uniform mean; ``beta_weighting = "samples"`` weights by n_k);
3. the server aggregates with α = γ(β^S).  Between learning phases it aggregates
   with the last α (Alg. 1, ``α^t ← α^{t−1}``).

The objective (paper Eq. 2) is  min_α Σ_k L_k(Σ_j α_j w_j)  s.t. Σ α = 1, α > 0,
with the w_j fixed during the phase.  γ is one of

* **softmax** (Eq. 4): α = softmax(β); β are logits, initialised at 0 (α = 1/K,
  FedAvg-even) or at log n_k (α = n_k/n, FedAvg) — ``softmax_init``;
* **dirichlet** (Eq. 5–6): α ~ Dir(β) in training, sampled with implicit
  reparameterized gradients (``torch.distributions.Dirichlet.rsample``, Figurnov
  et al. 2018), and the mode α_k = (β_k − 1)/(Σβ − K) at aggregation.  β is
  initialised at 6.0 (the paper's COVID setting) and kept ≥ ``min_concentration``
  (> 1, so the mode exists and is > 0) by clamping after every Adam step
  (projected gradient); the average of clamped values stays clamped.

Granularity:

* **network**-wise: one α_k per site; β has one entry ``"*"`` of shape (K,).
* **layer**-wise: one α per site per *parameter tensor* (our definition of the
  paper's "layer" p = 1..P: every tensor of ``model.named_parameters()``, so a
  conv's weight and bias are two layers).  β has one (K,) entry per parameter
  name.  A floating buffer (batch-norm running statistics) follows the first
  parameter of its own module (``bn.running_mean`` uses the α of ``bn.weight``);
  a buffer of a module without parameters uses the mean over layers of α.
  Integer buffers are never averaged (taken from the first site, as in
  :func:`fedseg.foundation.arrays.weighted_mean`).

Variant ``reinit = true`` resets β to its initial value before each learning
phase (the paper's "Auto-FedAvg-N-Dirichlet*").

Communication (Section 3.3): FedAvg moves 2 models per site per round (2K·M
bytes); each learning phase adds K(K−1)·M bytes for the peer models, so the
extra ratio is (K−1)/(2 t0) — :func:`extra_cost_ratio` — plus 2·S·K·|β| bytes
of β messages (8 bytes × K × P per message), reported separately in the
history (``extra_bytes``).

Not given by the paper (our defaults, documented in docs/algorithms.md):
the number of weight-learning steps S (``steps = 10``), the β optimizer (Adam,
``lr = 0.01``, torch's default betas), the batch (``train.batch_size``).

Site-side scratch of a learning phase lives in ``site.scratch`` (never saved with the
site): ``site.scratch["autofedavg/peers"]`` holds ``{site: its trained model}`` (the
others' models and a copy of its own), ``site.scratch["autofedavg/beta"]`` the β
optimizer.  A phase never spans a checkpoint; both are removed on its last step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch.func import functional_call

from fedseg.algorithms.fedavg import aggregation_weights, train_global
from fedseg.algorithms.learned_weights import (
    NETWORK,
    aggregate,
    alpha_eval,
    alpha_per_tensor,
    alpha_train,
    mean_alpha,
    mix,
    tensor_layers,
)
from fedseg.algorithms.weighting import Weighting
from fedseg.foundation.arrays import Arrays, check_compatible, is_float, nbytes, prefixed, strip_prefix, weighted_mean
from fedseg.foundation.errors import ConfigError, PayloadError
from fedseg.foundation.messages import Reply, Task
from fedseg.foundation.seeding import derive_seed
from fedseg.seams.algorithm import Algorithm, Candidate, ServerContext
from fedseg.site.runtime import Site

__all__ = ["AutoFedAvg", "AutoFedAvgParams", "extra_cost_ratio", "init_beta", "site_selected_candidates"]

DESCRIBE = "autofedavg-describe"
PEERS = "autofedavg-peers"
STEP = "autofedavg-step"
_SCRATCH = "autofedavg/peers"
_OPT = "autofedavg/beta"


# --------------------------------------------------------------------- params
@dataclass(frozen=True)
class AutoFedAvgParams:
    """Settings of Auto-FedAvg (``[autofedavg]``).

    param
        ``"dirichlet"`` (α ~ Dir(β), mode at aggregation; the paper's best, Table 2)
        or ``"softmax"`` (α = softmax(β), Eq. 4).
    granularity
        ``"network"`` (one α_k per site) or ``"layer"`` (one α per site per parameter tensor).
    interval
        t0: learn α every this many rounds (paper Table 2: 10; Table 3: 5; Fig. 4: 1, 5, 10).
    steps
        S, weight-learning steps per phase (not given in the paper; our default 10).
    lr
        Adam learning rate of β at the sites (not given in the paper; our default 0.01).
    concentration
        Initial Dirichlet β per site (paper Section 4.2: 6.0).
    min_concentration
        Lower bound of the Dirichlet β (clamped after each step; must be > 1 so the mode exists).
    softmax_init
        Initial softmax logits: ``"zeros"`` (α = 1/K) or ``"log_samples"`` (β_k = log n_k, α = n_k/n).
    reinit
        Reset β to its initial value before each learning phase (paper's Auto-FedAvg-N-Dirichlet*).
    beta_weighting
        How the server averages the sites' β: ``"even"`` (Alg. 1: 1/K) or ``"samples"`` (n_k/n).
    site_selection
        Also track the global model at the round of best validation on each single site
        (candidates ``global@<site>``): the "best local models" of Table 2 (local avg / local gen).
    """

    param: Literal["dirichlet", "softmax"] = "dirichlet"
    """Parametrization of the aggregation weights: 'dirichlet' (alpha ~ Dir(beta), its mode used) or 'softmax' (alpha = softmax(beta))."""
    granularity: Literal["network", "layer"] = "network"
    """'network': one weight per site; 'layer': one weight per site per parameter tensor."""
    interval: int = 10
    """Learn the aggregation weights every this many rounds (t0)."""
    steps: int = 10
    """Weight-learning steps per learning phase (S)."""
    lr: float = 0.01
    """Adam learning rate of beta at the sites."""
    concentration: float = 6.0
    """Initial Dirichlet beta per site."""
    min_concentration: float = 1.001
    """Lower bound of the Dirichlet beta, clamped after each step (> 1 so the mode exists)."""
    softmax_init: Literal["zeros", "log_samples"] = "zeros"
    """Initial softmax logits: 'zeros' (alpha = 1/K) or 'log_samples' (beta_k = log n_k, alpha = n_k / n)."""
    reinit: bool = False
    """Reset beta to its initial value before each learning phase."""
    beta_weighting: Weighting = "even"
    """How the server averages the sites' beta: 'even' (1/K) or 'samples' (n_k / n)."""
    site_selection: bool = True
    """Also track the global model at its best validation round on each single site (candidates global@<site>)."""

    def validate(self) -> None:
        if self.interval < 1:
            raise ConfigError(f"autofedavg.interval must be >= 1 (learn every t0 rounds), got {self.interval}")
        if self.steps < 1:
            raise ConfigError(f"autofedavg.steps must be >= 1 (weight-learning steps S), got {self.steps}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"autofedavg.lr must be a positive number, got {self.lr}")
        if not self.min_concentration > 1.0:
            raise ConfigError(
                f"autofedavg.min_concentration must be > 1 so that the Dirichlet mode exists, got {self.min_concentration}"
            )
        if not self.concentration >= self.min_concentration:
            raise ConfigError(
                f"autofedavg.concentration = {self.concentration} is below autofedavg.min_concentration = "
                f"{self.min_concentration}; use a value > 1 (the paper uses 6.0)"
            )


# ------------------------------------------------------------- pure functions
def extra_cost_ratio(num_sites: int, interval: int) -> float:
    """Extra model traffic of Auto-FedAvg over FedAvg, (K − 1) / (2 t0) (paper Section 3.3).

    FedAvg moves 2K models per round; a learning phase every t0 rounds moves K(K−1) more.
    """
    if num_sites < 1 or interval < 1:
        raise ValueError(f"need num_sites >= 1 and interval >= 1, got {num_sites}, {interval}")
    return (num_sites - 1) / (2 * interval)


def init_beta(params: AutoFedAvgParams, num_samples: Sequence[int], layers: Sequence[str]) -> dict[str, torch.Tensor]:
    """Initial β (float64, (K,) per layer): Dirichlet ``concentration``, or softmax logits 0 / log n_k."""
    k = len(num_samples)
    if params.param == "dirichlet":
        row = torch.full((k,), float(params.concentration), dtype=torch.float64)
    elif params.softmax_init == "zeros":
        row = torch.zeros(k, dtype=torch.float64)
    else:
        if any(n <= 0 for n in num_samples):
            raise ValueError(f"autofedavg.softmax_init = 'log_samples' needs n_k > 0, got {list(num_samples)}")
        row = torch.log(torch.tensor([float(n) for n in num_samples], dtype=torch.float64))
    return {layer: row.clone() for layer in layers}


def site_selected_candidates(global_arrays: Arrays, sites: Sequence[str]) -> list[Candidate]:
    """The global model selected on each single site's validation set (Table 2's "best local models")."""
    return [Candidate(f"global@{s}", global_arrays, val_sites=(s,), home_site=s) for s in sites]


# ----------------------------------------------------------------- site half
def describe(site: Site, task: Task) -> Reply:
    """Report the names of the model's shared parameter tensors (the "layers") and n_k."""
    model = site.model("global")
    shared = set(site.arrays("global"))
    params = [n for n, _ in model.named_parameters() if n in shared]
    return Reply(metrics={"parameters": params}, num_samples=site.num_train)


def receive_peers(site: Site, task: Task) -> Reply:
    """Keep the other sites' models (and a copy of its own trained model) for the learning phase,
    in ``site.scratch`` (not saved with the site)."""
    sites = task.config["sites"]
    own = site.arrays("global")
    peers: dict[str, Arrays] = {}
    for s in sites:
        arrays = own if s == site.name else strip_prefix(s, task.arrays)
        check_compatible(own, arrays, what=f"site {site.name}: peer model of {s}")
        peers[s] = arrays
    site.scratch[_SCRATCH] = peers
    return Reply(num_samples=site.num_train)


def beta_step(site: Site, task: Task) -> Reply:
    """One LearnAggWeight step at a site: α from β, loss of Σ α_k w_k on a seeded batch, Adam step on β."""
    p: AutoFedAvgParams = cast(Algorithm, site.algorithm).params
    cfg = task.config
    rnd, step, sites = cfg["round"], cfg["step"], cfg["sites"]
    beta_in = strip_prefix("beta", task.arrays)
    layers = sorted(beta_in)
    peers: dict[str, Arrays] = site.scratch.get(_SCRATCH, {})
    missing = [s for s in sites if s not in peers]
    if missing:
        raise PayloadError(
            f"site {site.name}: no models of {missing} for the weight-learning step; the server must send '{PEERS}' first"
        )
    opt = site.scratch.get(_OPT) if step > 0 else None
    if opt is None:
        leaves = [beta_in[n].detach().clone().requires_grad_(True) for n in layers]
        opt = torch.optim.Adam(leaves, lr=p.lr)
        site.scratch[_OPT] = opt
    leaves = opt.param_groups[0]["params"]
    with torch.no_grad():
        for leaf, n in zip(leaves, layers):
            leaf.copy_(beta_in[n])
    models = [peers[s] for s in sites]
    model = site.model("global")
    full = {
        k: v.detach().clone() for k, v in model.state_dict().items()
    }  # clones: BN must not touch the site's own buffers
    groups = tensor_layers([n for n, v in models[0].items() if is_float(v)], layers)
    x, y = next(site.batches(rnd, f"autofedavg/{step}", steps=1))
    seed = derive_seed(site.cfg.seed, site.index, rnd, "autofedavg-dirichlet", step)
    model.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(site.cfg.seed, site.index, rnd, "autofedavg-forward", step))
        alpha = alpha_train(dict(zip(layers, leaves)), p.param, seed)
        full.update(mix(models, alpha_per_tensor(alpha, groups)))
        with site.autocast():
            loss = site.workload.loss(functional_call(model, full, (x,)), y)
    opt.zero_grad(set_to_none=True)
    site.roles.step(_OPT, opt, loss)
    if p.param == "dirichlet":
        with torch.no_grad():
            for leaf in leaves:
                leaf.clamp_(min=p.min_concentration)
    reply = Reply(
        arrays=prefixed("beta", {n: leaf.detach().clone() for n, leaf in zip(layers, leaves)}),
        metrics={"loss": float(loss.detach())},
        num_samples=site.num_train,
    )  # one read per task (one step)
    if cfg.get("last", False):
        site.scratch.pop(_OPT, None)
        site.scratch.pop(_SCRATCH, None)
    return reply


# --------------------------------------------------------------- server half
class AutoFedAvg(Algorithm):
    name = "autofedavg"
    title = "Auto-FedAvg"
    section = "autofedavg"
    Params = AutoFedAvgParams

    def secure_aggregation_unsupported(self) -> str | None:
        return "its β step learns the mixing weights from every site's model, which each site must hold (they are sent to all sites)"

    @classmethod
    def label_for(cls, params: AutoFedAvgParams) -> str:
        """The paper's row names (Table 2): "Auto-FedAvg-N-Dirichlet" (N: network-wise, L: layer-wise;
        Dirichlet or Softmax), with ``*`` when β is re-initialized before each phase (``reinit``)."""
        gran = "N" if params.granularity == "network" else "L"
        return f"{cls.title}-{gran}-{params.param.capitalize()}{'*' if params.reinit else ''}"

    def init_state(self, ctx: ServerContext) -> Arrays:
        state = prefixed("global", ctx.init_arrays("global"))
        replies = ctx.ask({s: Task(DESCRIBE) for s in ctx.sites})
        if not replies:
            raise PayloadError("autofedavg: no site described its model; start the run again when the sites answer")
        # a deployed site left out of this first exchange starts at the answering sites' mean count (only
        # softmax_init = "log_samples" reads it; β is learned anyway)
        mean_n = sum(r.num_samples for r in replies.values()) / len(replies)
        n = [replies[s].num_samples if s in replies else max(1, round(mean_n)) for s in ctx.sites]
        if self.params.granularity == "network":
            layers = [NETWORK]
        else:  # the parameter list most sites report, of those naming only the model's tensors (one site
            # cannot choose β's layers); none valid: every floating tensor is a layer
            names = {k.removeprefix("global/") for k, v in state.items() if is_float(v)}
            lists: list[tuple[str, ...]] = [
                tuple(ps)
                for r in replies.values()
                if isinstance(ps := r.metrics.get("parameters"), list)
                and ps
                and all(isinstance(q, str) and q in names for q in ps)
            ]
            if lists:
                most: tuple[str, ...] = max(lists, key=lists.count)
                layers = list(most)
            else:
                layers = sorted(names)
        beta = init_beta(self.params, n, layers)
        state.update(prefixed("autofedavg/beta", beta))
        state.update(
            prefixed("autofedavg/beta0", {k: v.clone() for k, v in beta.items()})
        )  # no shared storage (safetensors)
        return state

    def learn(
        self,
        ctx: ServerContext,
        rnd: int,
        models: dict[str, Arrays],
        beta: dict[str, torch.Tensor],
        num_samples: list[int],
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """LearnAggWeight (Alg. 1): peers once, then S rounds of β steps averaged at the server."""
        p = self.params
        names = list(models)  # the sites whose trained models are mixed (β's rows, in this order)
        peer_tasks = {
            s: Task(
                PEERS,
                {f"{o}/{k}": v for o in names if o != s for k, v in models[o].items()},
                {"round": rnd, "sites": names},
            )
            for s in names
        }
        model_bytes = sum(nbytes(t.arrays) for t in peer_tasks.values())
        # a deployed site left out of an exchange takes no further β steps this phase (a site without the
        # peer models cannot take one); its model stays in the mixture, and β is averaged over the sites
        # that answered each step
        got = ctx.ask(peer_tasks)
        active = [s for s in names if s in got]
        count = dict(zip(names, num_samples))
        losses, beta_bytes = [], 0
        for step in range(p.steps):
            if not active:
                break
            payload = prefixed("beta", beta)
            cfg = {"round": rnd, "step": step, "sites": names, "last": step == p.steps - 1}
            replies = ctx.ask({s: Task(STEP, payload, cfg) for s in active})
            active = [s for s in active if s in replies]
            if not active:
                break
            beta_bytes += sum(nbytes(payload) + nbytes(replies[s].arrays) for s in active)
            weights = aggregation_weights([count[s] for s in active], p.beta_weighting)
            beta = weighted_mean([strip_prefix("beta", replies[s].arrays) for s in active], weights)
            if p.param == "dirichlet":
                beta = {k: v.clamp(min=p.min_concentration) for k, v in beta.items()}
            losses.append(sum(replies[s].metrics["loss"] for s in active) / len(active))
        return beta, {"agg_loss": losses, "extra_bytes": {"models": model_bytes, "beta": beta_bytes}}

    def server_round(self, ctx: ServerContext, state: Arrays, rnd: int) -> tuple[Arrays, dict[str, Any]]:
        p = self.params
        replies = ctx.ask(
            {s: Task("train", prefixed("global", strip_prefix("global", state)), {"round": rnd}) for s in ctx.sites}
        )
        names = [s for s in ctx.sites if s in replies]
        if not names:
            raise PayloadError(f"autofedavg: no site replied in round {rnd}")
        models = {s: strip_prefix("global", replies[s].arrays) for s in names}
        n = [replies[s].num_samples for s in names]
        full = strip_prefix("autofedavg/beta", state)
        if p.reinit and rnd % p.interval == 0:
            full = strip_prefix("autofedavg/beta0", state)
        # the rows of β of the sites that answered (all of them in simulation): a deployed site left out of
        # this round keeps its β, and α over the others is γ of their rows (for Dirichlet: the mode of the
        # renormalized sub-vector, Dir(β_S))
        rows = torch.tensor([ctx.sites.index(s) for s in names])
        beta = {k: v[rows] for k, v in full.items()}
        metrics: dict[str, Any] = {
            "train_loss": {s: replies[s].metrics.get("loss") for s in names},
            "alpha_learned": False,
        }
        if len(names) < len(ctx.sites):
            metrics["left_out"] = [s for s in ctx.sites if s not in replies]
        if rnd % p.interval == 0:
            beta, info = self.learn(ctx, rnd, models, beta, n)
            metrics.update(info, alpha_learned=True)
        full = {k: v.clone().index_copy_(0, rows, beta[k]) for k, v in full.items()}
        alpha = alpha_eval(beta, p.param)
        first = models[names[0]]
        groups = tensor_layers([k for k, v in first.items() if is_float(v)], list(beta))
        new = dict(state)
        new.update(prefixed("global", aggregate([models[s] for s in names], alpha_per_tensor(alpha, groups))))
        new.update(prefixed("autofedavg/beta", full))
        a, b = mean_alpha(alpha), mean_alpha(beta)
        metrics["alpha"] = {s: float(a[i]) for i, s in enumerate(names)}
        metrics["beta"] = {s: float(b[i]) for i, s in enumerate(names)}
        return new, metrics

    def candidates(self, state: Arrays, ctx: ServerContext) -> list[Candidate]:
        g = strip_prefix("global", state)
        out = [Candidate("global", g)]
        if self.params.site_selection:
            out += site_selected_candidates(g, ctx.sites)
        return out

    def site_handlers(self):
        return {"train": train_global, DESCRIBE: describe, PEERS: receive_peers, STEP: beta_step}
