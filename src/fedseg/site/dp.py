"""A site's differential privacy: its privatized local steps and gradients, its batches, and its ε, kept by
the site in a ledger that no one else can rewind.

**Sample level** (``privacy.dp = "sample"``).  Every :meth:`Site.fit <fedseg.site.runtime.Site.fit>` step
and every :meth:`Site.gradient <fedseg.site.runtime.Site.gradient>` (lockstep gradient averaging: FGA,
FedSM's global model by FGA and its selector) uses DP-SGD's privatized gradient
(:func:`fedseg.privacy.dp.privatized_gradient`) instead of the batch gradient (the site's executor,
:class:`fedseg.site.dpsgd.DPExecutor`).  A data-independent extra loss (FedProx's proximal term) is added after
the noise, as are SCAFFOLD's corrections (``after_backward``, ``after_step``): none reads the data.  The batches
are Poisson samples (:meth:`SiteDP.batch`, through :class:`fedseg.site.dpsgd.PoissonSampler`): each training case enters
batch j of round r independently with probability q = B / n, and the privatized sum is divided by the
expected batch size B — the mechanism the accountant analyses.

**Randomness** (:mod:`fedseg.privacy.randomness`).  Noise and sampling are keyed by the operating system's
CSPRNG, fresh per draw, so the server — which ships the run seed and assigns the site indices — cannot
regenerate either.  ``privacy.dp_randomness = "seeded"`` keys them by the run seed instead, for bitwise
reproducible tests; such a run records ε against the server as ∞.

**Ledger** (:mod:`fedseg.site.ledger`).  Every privatized release is booked before it leaves the site, and a
step or update that would take ε past ``privacy.epsilon`` is refused (:class:`PayloadError`).

**Several models on one batch.**  FedSM trains its global and personalized models (and, in its joint
phase, its selector) on the same batches of a round.  m models privatized with noise multiplier σ on one
batch are booked as one subsampled Gaussian mechanism with noise multiplier σ/√m (:meth:`SiteDP.history`).
Derivation: each model's release is ``Σ_i clip(g_i) + N(0, σ²C²I)``; adding or removing one case changes
each clipped sum by at most C, so the m releases together are a Gaussian mechanism on their concatenation
with L2 sensitivity √(m C²) = C√m and noise σC per coordinate, i.e. noise multiplier σC / (C√m) = σ/√m.
The models are trained one after another, each release depending on the earlier ones; Gaussian mechanisms
compose adaptively exactly as their concatenation does (Dong, Roth & Su, "Gaussian Differential Privacy",
2022: μ_i-GDP mechanisms compose to √(Σμ_i²)-GDP, adaptively), and the batch is one Poisson sample for all m,
so the subsampling is applied once.  Booking them as m independent subsampled steps instead counts m
subsamplings that never happened and under-states ε.

**Client level** (``privacy.dp = "client"``, which needs ``privacy.secure_aggregation = true``).  A site clips
its round's update and adds its share N(0, σ²C²/K) of the noise, where K is the number of sites it masks
with under secure aggregation (the participant list it was keyed with, never a task field): the server's
unmasked sum holds the survivors' shares only, N(0, |U| σ²C²/K) for the |U| sites whose inputs survived,
i.e. noise multiplier σ√(|U|/K).  Before masking the site books the worst case |U| = t
(:func:`fedseg.privacy.secagg.threshold_for`) and refuses if even that would pass its budget; when it reveals
(:meth:`SiteDP.on_reveal`) it books what the survivors' noise gives.  Without secure aggregation the server
would see each update with only σ/√K of noise: the setting is refused (``privacy.secure_aggregation``).

**Losses.**  Under DP a site sends no training loss (:meth:`fedseg.site.runtime.Site.asks` blanks every
``*loss`` metric): a loss of one batch is a membership signal that no noise covers.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from fedseg.foundation.arrays import Arrays
from fedseg.foundation.config import RunConfig
from fedseg.foundation.errors import ConfigError, PayloadError
from fedseg.privacy import accountant
from fedseg.privacy.dp import clip_update, noise_like
from fedseg.privacy.randomness import Randomness
from fedseg.privacy.secagg import threshold_for
from fedseg.site.ledger import Ledger, Tally

__all__ = ["Ledger", "PrivateSite", "SiteDP"]


class PrivateSite(Protocol):
    """What a site's differential privacy reads of its :class:`~fedseg.site.runtime.Site` (which imports this
    module): its name, index and settings, the method's plan of privatized batches, its training-set size, its
    saved store (the seeded mode's draw counter), its secure-aggregation party (client level) and its shared
    arrays."""

    name: str
    index: int
    cfg: RunConfig
    algorithm: Any  # the site half: its name, dp_batches_per_round / dp_steps_per_round (optional)
    store: Arrays
    scratch: dict[str, Any]
    device: torch.device

    @property
    def num_train(self) -> int: ...

    def arrays(self, role: str) -> Arrays: ...


_DRAWS = "privacy/draws"
"""``site.store`` key of the seeded mode's draw counter (keys the seeded noise; restored with the site)."""

WORST_CASE_SURVIVORS = 0.5
"""Client level: the fewest survivors secure aggregation unmasks with are t = ⌊K/2⌋ + 1 > K/2, so every booking
is at noise multiplier at least σ√(1/2); a σ derived from ``privacy.epsilon`` plans for that worst case."""


class SiteDP:
    """The differential privacy of one :class:`~fedseg.site.runtime.Site` (``site.dp``; module docstring)."""

    def __init__(self, site: PrivateSite):
        self.site = site
        """The site whose data this protects."""
        self.settings = site.cfg.privacy
        self.random = Randomness(self.settings.dp_randomness, site.cfg.seed, site.index)
        """Where the noise and the batches come from (:mod:`fedseg.privacy.randomness`)."""
        self.ledger = Ledger()
        """Every privatized release of this site (:class:`Ledger`); ε is computed from it."""
        self._sigma: float | None = None
        self._drawn: dict[tuple[int, str, str, int], tuple[str, torch.Tensor, float, int]] = {}
        self._current: tuple[str, float, int] | None = None  # the last batch drawn: (name, q, B)
        self._pending: dict[str, tuple[int, int]] = {}  # exchange -> (K masked with, threshold t)
        self._reported: int | None = None  # ledger entries at the last report (in this process)
        self._tallied: Tally | None = None
        self.lifetime_ceiling: float | None = None
        """A deployed site's ε ceiling over every run in its ledger (its policy's ``max_epsilon``): each
        privatized release is refused when the composition of every run's entries would pass it.  None: no
        ceiling over runs (simulation; a site without one)."""
        self._other_runs: tuple[int, dict[tuple[float, float], int]] | None = None

    # ------------------------------------------------------------- accounting
    @property
    def client(self) -> bool:
        """Client-level DP (``privacy.dp = "client"``): one clipped, noised update per round."""
        return self.settings.dp == "client"

    def plan(self) -> tuple[int, int]:
        """``(batches, models per batch)`` of one planned round: the method's privatized batches
        (``algorithm.dp_batches_per_round``, else ``dp_steps_per_round`` batches of one model each);
        client level: one update."""
        if self.client:
            return 1, 1
        algo = self.site.algorithm
        batches = getattr(algo, "dp_batches_per_round", None)
        if batches is not None:
            got = batches(self.site.cfg, self.site.num_train)
            if got is not None:
                return int(got[0]), int(got[1])
        plan = getattr(algo, "dp_steps_per_round", None)
        steps = plan(self.site.cfg, self.site.num_train) if plan is not None else None
        if steps is None:
            raise ConfigError(
                f"privacy.dp = 'sample' is not available for method {algo.name!r}; "
                "use --set privacy.dp=off or a method whose local steps it privatizes"
            )
        return int(steps), 1

    def planned_steps_per_round(self) -> int:
        """Privatized batches of one planned round (client level: its one update)."""
        return self.plan()[0]

    @property
    def batch_size(self) -> int:
        return self.site.cfg.train.batch_size

    @property
    def sample_rate(self) -> float:
        """q = B / n (client level: 1, every site's update in every round)."""
        return 1.0 if self.client else accountant.sample_rate(self.batch_size, self.site.num_train)

    @property
    def sigma(self) -> float:
        """The site's noise multiplier σ (given, or derived from ``privacy.epsilon`` once).  Derived: the σ_b
        whose planned batches (``plan()``'s batches × ``rounds``) spend ``privacy.epsilon`` at q, times √m for
        m models per batch (each batch is booked at σ/√m = σ_b); client level: times √2, the worst case of
        dropouts (:data:`WORST_CASE_SURVIVORS`)."""
        if self._sigma is None:
            s = self.settings
            if s.noise_multiplier is not None:
                self._sigma = float(s.noise_multiplier)
            else:
                batches, models = self.plan()
                planned = batches * self.site.cfg.rounds
                base = accountant.noise_multiplier(s.epsilon, s.delta, self.sample_rate, planned, s.accountant)
                factor = 1.0 / math.sqrt(WORST_CASE_SURVIVORS) if self.client else math.sqrt(models)
                self._sigma = base * factor
        return self._sigma

    def _planned_sigma(self) -> float:
        """The noise multiplier each planned batch (or update) is booked at."""
        if self.client:
            return self.sigma * math.sqrt(WORST_CASE_SURVIVORS)
        return self.sigma / math.sqrt(self.plan()[1])

    def history(self, extra: list[dict[str, Any]] | None = None) -> list[tuple[float, float, int]]:
        """The accountant history ``[(σ_eff, q, count)]`` of the ledger (plus ``extra`` entries not booked):
        a batch released by m models counts once at σ/√m; an update of a secure-aggregation exchange counts
        once at its latest booking (the worst case, or what the revealed survivors give).  The ledger's tally
        is kept up to date incrementally (it only grows), so a check before every step costs O(1) entries."""
        tally = self._tally()
        counts = dict(tally.counts)
        if extra:
            overlay = Tally(counts)
            for e in extra:
                overlay.add(e, fallback=tally)
        return [(s, q, t) for (s, q), t in sorted(counts.items()) if t > 0]

    def _tally(self) -> Tally:
        entries = self.ledger.entries
        t = self._tallied
        if t is None or t.source is not entries or t.seen > len(entries):
            t = self._tallied = Tally({}, source=entries)
        for e in entries[t.seen :]:
            t.add(e)
        t.seen = len(entries)
        return t

    def other_run_counts(self) -> dict[tuple[float, float], int]:
        """The accountant's counts ``{(σ_eff, q): releases}`` of every other run in the ledger, each run tallied on
        its own (batch and exchange names are per run), then summed: RDP composes over runs as over steps."""
        runs = self.ledger.other_runs
        size = sum(len(v) for v in runs.values())
        if self._other_runs is None or self._other_runs[0] != size:
            counts: dict[tuple[float, float], int] = {}
            for entries in runs.values():
                tally = Tally({})
                for e in entries:
                    tally.add(e)
                for key, n in tally.counts.items():
                    counts[key] = counts.get(key, 0) + n
            self._other_runs = (size, counts)
        return self._other_runs[1]

    def lifetime_history(
        self, extra_rounds: int = 0, extra: list[dict[str, Any]] | None = None
    ) -> list[tuple[float, float, int]]:
        """The accountant history of every run in the ledger, this one's (plus ``extra``) included."""
        counts = dict(self.other_run_counts())
        for sigma, q, t in self.history(extra):
            counts[(sigma, q)] = counts.get((sigma, q), 0) + t
        hist = [(s, q, t) for (s, q), t in sorted(counts.items()) if t > 0]
        if extra_rounds:
            hist.append((self._planned_sigma(), self.sample_rate, self.plan()[0] * extra_rounds))
        return hist

    def lifetime_epsilon(self, extra_rounds: int = 0, extra: list[dict[str, Any]] | None = None) -> float:
        """ε at this run's ``privacy.delta`` of every run in the ledger composed (this one's ``extra`` included):
        what the site's data has spent over its life."""
        s = self.settings
        return accountant.epsilon(self.lifetime_history(extra_rounds, extra), s.delta, s.accountant)

    def epsilon(self, extra_rounds: int = 0, extra: list[dict[str, Any]] | None = None) -> float:
        """ε at ``privacy.delta`` of the ledger (plus ``extra_rounds`` planned rounds and ``extra`` entries)."""
        s = self.settings
        hist = self.history(extra)
        if extra_rounds:
            hist.append((self._planned_sigma(), self.sample_rate, self.plan()[0] * extra_rounds))
        return accountant.epsilon(hist, s.delta, s.accountant)

    def steps(self) -> int:
        """Privatized releases booked so far (model steps on batches; client level: updates)."""
        return sum(1 for e in self.ledger.entries if e["kind"] in ("sample", "client"))

    def _refuse_past_budget(self, entry: dict[str, Any], what: str) -> None:
        """A :class:`PayloadError` naming ``privacy.epsilon`` if booking ``entry`` would pass the run's budget, or
        naming the site's lifetime ceiling (:attr:`lifetime_ceiling`) if it would take every run's ε past it."""
        ceiling = self.lifetime_ceiling
        if ceiling is not None:
            after = self.lifetime_epsilon(extra=[entry])
            if after > ceiling:
                raise PayloadError(
                    f"site {self.site.name}: {what} would take the ε of this site's data over all its runs to "
                    f"{after:.4g} > its policy's max_epsilon = {ceiling:g} (δ = {self.settings.delta:g}; "
                    f"{len(self.ledger.other_runs)} other runs in its ledger): the site refuses it whatever the "
                    "server asks; the ceiling is a lifetime budget, not one per run"
                )
        budget = self.settings.epsilon
        if budget is None:
            return
        if self.settings.accountant != "rdp":  # RDP bounds the true ε: within it the step fits (PRV is slow)
            hist = self.history([entry])
            if accountant.epsilon(hist, self.settings.delta, "rdp") <= budget:
                return
        after = self.epsilon(extra=[entry])
        if after > budget:
            raise PayloadError(
                f"site {self.site.name}: {what} would take its ε to {after:.4g} > privacy.epsilon = {budget:g} "
                f"(δ = {self.settings.delta:g}, {self.steps()} releases booked); the site refuses it whatever the "
                "server asks; raise privacy.epsilon or privacy.noise_multiplier for a new run"
            )

    def _book(self, entry: dict[str, Any], what: str) -> None:
        self._refuse_past_budget(entry, what)
        self.ledger.append(entry)

    @property
    def against_server(self) -> str:
        """What the reported ε means against the server: "ε" (it cannot regenerate noise or batches) or "∞"
        (``dp_randomness = "seeded"``: it can)."""
        return "∞" if self.random.seeded else "ε"

    def forecast(self) -> float:
        """ε after one more round: the larger of the planned round's and a repeat of what was booked since the
        last report (a lockstep round can take more batches than this site's plan: the largest site's)."""
        planned = self.epsilon(extra_rounds=1)
        again = self._repeat()
        return max(planned, self.epsilon(extra=again)) if again else planned

    def _repeat(self) -> list[dict[str, Any]]:
        """The sample-level bookings since the last report, as a next round would book them again (new batch
        names); [] before the first report and at client level."""
        if self._reported is None or self.client:
            return []
        entries = self.ledger.entries[self._reported :]
        return [{**e, "batch": f"{e['batch']}+next"} for e in entries if e.get("kind") == "sample"]

    def report(self) -> dict[str, Any]:
        """What the engine records per site and round: ε spent, ε after one more round (:meth:`forecast`), σ, q,
        releases booked, distinct batches, and the randomness (``"seeded"``: ε against the server is ∞); with
        other runs in the ledger or a lifetime ceiling also ``epsilon_lifetime`` (every run composed),
        ``epsilon_lifetime_next`` (every run and one more round, forecast as :meth:`forecast` does) and
        ``epsilon_ceiling``."""
        epsilon_next = self.forecast()
        again = self._repeat()
        self._reported = len(self.ledger.entries)
        out: dict[str, Any] = {
            "epsilon": self.epsilon(),
            "epsilon_next": epsilon_next,
            "noise_multiplier": self.sigma,
            "sample_rate": self.sample_rate,
            "steps": self.steps(),
            "batches": len({e["batch"] for e in self.ledger.entries if e["kind"] == "sample"}),
            "dp_randomness": self.random.mode,
            "epsilon_against_server": "inf" if self.random.seeded else "epsilon",
        }
        if self.ledger.other_runs or self.lifetime_ceiling is not None:  # a deployed site's ε over all its runs
            spent = self.lifetime_epsilon()
            nxt = self.lifetime_epsilon(extra_rounds=1)  # as forecast(): a lockstep round can take more batches
            if again:
                nxt = max(nxt, self.lifetime_epsilon(extra=again))
            out["epsilon_lifetime"] = spent
            out["epsilon_lifetime_next"] = max(nxt, spent)
            out["epsilon_ceiling"] = self.lifetime_ceiling
        return out

    # ---------------------------------------------------------------- batches
    def batch(self, rnd: int, stream: str, split: str, step: int, n: int, batch_size: int) -> torch.Tensor:
        """The case indices of batch ``step`` of round ``rnd`` (a Poisson sample at q = B / n), drawn once per
        round and stream: a second model trained on the same round's batches gets the same ones (and its
        release is booked on the same batch).  Marks the batch current: the next privatized gradient is
        booked on it."""
        key = (int(rnd), stream, split, int(step))
        got = self._drawn.get(key)
        if got is None:
            if any(k[0] != key[0] for k in self._drawn):  # one round's draws are kept at a time
                self._drawn.clear()
            q = accountant.sample_rate(batch_size, n)
            idx = self.random.poisson(n, q, "batch", *key)
            name = f"{rnd}/{stream}/{split}/{step}" if self.random.seeded else os.urandom(8).hex()
            got = self._drawn[key] = (name, idx, q, int(batch_size))
        self._current = (got[0], got[2], got[3])
        return got[1]

    # ------------------------------------------------------------------ steps
    def book_step(self, role: str) -> int:
        """Book a privatized step of model ``role`` on the current batch (:meth:`batch`; a batch that did not
        come from it is booked as one of its own at the configured rate), refused past the budget; returns the
        batch's expected size B, which the privatized sum is divided by."""
        current = self._current
        if current is None:  # not from :meth:`batch`: a batch of its own at the configured rate
            name = f"draw/{len(self.ledger.entries)}" if self.random.seeded else os.urandom(8).hex()
            current = (name, self.sample_rate, self.batch_size)
        self._current = None
        batch, q, expected = current
        entry = {"kind": "sample", "batch": batch, "role": role, "sigma": self.sigma, "q": q}
        self._book(entry, f"a privatized step of model {role!r}")
        return expected

    def next_draw(self) -> int:
        """The number of this noise draw (kept in the site's store in the seeded mode, restored with the site)."""
        store = self.site.store
        draw = int(store[_DRAWS]) if _DRAWS in store else 0
        if self.random.seeded:
            store[_DRAWS] = torch.tensor(draw + 1, dtype=torch.int64)
        return draw

    # ----------------------------------------------------------- client level
    def masked_with(self, task: Any) -> tuple[str, int]:
        """``(exchange, K)`` of the secure-aggregation exchange this client-level update is masked in: K is the
        size of the participant list the site was keyed with (``secagg/shares``), never a task field.  A
        task without secure aggregation is refused (``privacy.secure_aggregation``)."""
        config = task.config.get("secagg")
        if not isinstance(config, dict):
            raise PayloadError(
                f"site {self.site.name}: privacy.dp = 'client' sends its update only masked under secure "
                "aggregation (the server would otherwise see it with σ/√K of noise); the task asks for a plain "
                "reply: set privacy.secure_aggregation = true"
            )
        party = self.site.scratch.get("secagg")
        order = list(getattr(party, "order", []) or [])
        if party is None or party.exchange != config.get("exchange") or not order:
            raise PayloadError(
                f"site {self.site.name}: no keyed secure-aggregation exchange {config.get('exchange')!r} to mask "
                "its client-level update with"
            )
        return str(party.exchange), len(order)

    def client_update(self, role: str, start: Mapping[str, torch.Tensor], task: Any) -> dict[str, torch.Tensor]:
        """Client-level DP: the role's shared arrays as ``start + Δ̃``, where Δ̃ = clip(w_k − start, C) +
        N(0, σ²C²/K) for the K sites it masks with (:meth:`masked_with`).  Booked before it leaves the site at
        the worst case of dropouts, |U| = t survivors (noise multiplier σ√(t/K)), and refused if even that
        would pass the budget; :meth:`on_reveal` books what the survivors give."""
        site, s = self.site, self.settings
        exchange, k = self.masked_with(task)
        t = threshold_for(k)
        entry = {
            "kind": "client",
            "exchange": exchange,
            "sigma": self.sigma * math.sqrt(t / k),
            "q": 1.0,
            "masked": k,
            "threshold": t,
        }
        self._book(entry, f"the client-level update of exchange {exchange!r}")
        self._pending[exchange] = (k, t)
        arrays = site.arrays(role)
        delta = {n: v - start[n].to(v) for n, v in arrays.items() if v.is_floating_point()}
        clipped, _ = clip_update(delta, s.clip)
        position = ("client-noise", role, self.next_draw())
        noise = noise_like(
            clipped,
            self.sigma * s.clip / k**0.5,
            lambda c, std: self.random.normal(c, std, *position, device=site.device),
        )
        out = dict(arrays)
        out.update({n: start[n].to(clipped[n]) + clipped[n] + noise[n] for n in clipped})
        return out

    def on_reveal(self, exchange: str, masked: list[str], survived: list[str]) -> None:
        """Secure aggregation's step 4 at this site (called by :mod:`fedseg.site.secure` before it reveals):
        the server's sum of ``exchange`` holds the noise of the ``survived`` sites only, σ√(|U|/K) with K =
        ``len(masked)``; booked for an exchange that carried this site's client-level update."""
        pending = self._pending.pop(exchange, None)
        if pending is None:
            return
        k = len(masked) or pending[0]
        u = len(set(survived) & set(masked)) if masked else len(survived)
        if u < pending[1]:
            raise PayloadError(
                f"site {self.site.name}: exchange {exchange!r} would be unmasked with {u} survivors, fewer than the "
                f"threshold t = {pending[1]} its client-level noise was booked for"
            )
        entry = {
            "kind": "reveal",
            "exchange": exchange,
            "sigma": self.sigma * math.sqrt(u / k),
            "q": 1.0,
            "survived": u,
        }
        self.ledger.append(entry)  # less noise than booked only if u < t, refused above: never past the budget
