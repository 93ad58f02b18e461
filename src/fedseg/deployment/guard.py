"""What a deployed site checks of the server's evaluations and planning requests, and its salt.

**Evaluation that is not an oracle** (:class:`Guard`).  A model the server crafts and has a site evaluate is a
question about the site's labels: an all-foreground model's Dice on a case gives that case's foreground size.
With a policy (:class:`~fedseg.deployment.policy.SitePolicy`) the site

* refuses evaluation (``evaluate``, FedSM's ``route``) on its training split
  (:meth:`~fedseg.deployment.policy.SitePolicy.evaluation_refusal`): no DP noise covers an evaluation;
* evaluates a candidate only if its arrays are a model the site saw leave training in this run — a round's
  model as the server sent it to train from, or the site's own plain reply — or the first new model after each
  round it trained (the engine evaluates each round's aggregate before it sends it as the next round's model),
  or one new model on the testing split per run (the final test), or a digest its policy lists in
  ``allowed_models`` (:func:`fedseg.privacy.protocol.model_digest`).  A candidate without arrays is the site's
  own model.  FedSM's ``route`` is held to the same rule for each part of the composite it loads (selector,
  global and personalized models; :meth:`Guard.unseen_route`) and spends the same allowance, plus one route of
  new models on validation per run (the composite assembled after the last round).  A server that crafts probes
  thus gets at most one per round it runs, and two more per run, each a mean over validation or testing cases
  (the default ``evaluation = "aggregates"``) or a route's counts;
* answers the volume plan's requests (``fingerprint``, ``histogram``, ``volumes``) only where its ``tasks``
  allow them, and at most ``max_histogram_requests`` intervals between two setups, none with bins narrower
  than ``min_histogram_width`` (:meth:`~fedseg.deployment.policy.SitePolicy.histogram_refusal`).

**The salt** (:func:`site_salt`).  Without DP a site's update is a function of the weights, the run seed and its
index, all the server's: two runs that differ by one site give that site's update as the difference of their
sums.  A site whose policy does not set ``reproducible = true`` mixes a salt of its own into its non-DP batch
order and augmentation (:func:`fedseg.site.batches.stream_generator`).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from fedseg.deployment.policy import SitePolicy
from fedseg.foundation.arrays import strip_prefix
from fedseg.foundation.errors import ConfigError
from fedseg.foundation.messages import Reply, Task, split_name
from fedseg.privacy.protocol import MASKED, model_digest

__all__ = ["SALT_NAME", "Guard", "model_digests", "site_salt"]

SALT_NAME = "site_salt"
"""A site's own random secret in its working folder (hex, made once from the OS): its salt per run."""


def site_salt(workdir: Path, run_id: str, site: str) -> int:
    """The site's salt for run ``run_id``: SHA-256 of its own secret (32 bytes from the operating system, made
    once and kept owner-only in ``workdir/site_salt``, never sent) and the run id, as a 63-bit integer.  Another
    run id gives other batches and augmentation; the same run id again (a restart, a resumed round) the same."""
    path = workdir / SALT_NAME
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(os.urandom(32).hex() + "\n")
            fh.flush()
            os.fsync(fh.fileno())
    try:
        secret = bytes.fromhex(path.read_text().strip())
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"site {site}: its salt {path} is unreadable ({e}); delete it (a new one is made at the next setup)"
        ) from None
    digest = hashlib.sha256(b"fedseg site salt|" + secret + b"|" + run_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


def model_digests(arrays: dict[str, Any]) -> set[str]:
    """Digests of the models in ``arrays``: the whole dict and each group under a path prefix (``global/…``,
    ``selector/…``, ``personal/<site>/…``), stripped of it (:func:`fedseg.privacy.protocol.model_digest`)."""
    if not arrays:
        return set()
    groups: dict[str, dict[str, Any]] = {}
    for name, v in arrays.items():
        parts = name.split("/")
        for i in range(1, len(parts)):
            groups.setdefault("/".join(parts[:i]), {})["/".join(parts[i:])] = v
    return {model_digest(arrays), *(model_digest(g) for g in groups.values())}


class Guard:
    """One run's record of what left training at a site, and the evaluation and planning checks it serves (see
    the module).  Made anew at every setup."""

    def __init__(self) -> None:
        self.seen: set[str] = set()  # digests of the models that left training here in this run
        self.trained: set[int] = set()  # the rounds of this run the site trained
        self.fresh = 0  # evaluations of models not seen before (validation)
        self.tested = 0  # the same on the testing split
        self.assembled = False  # the run's one final assembly's route of new models (validation) is spent
        self.histograms = 0  # histogram intervals answered since the last setup

    def task_refusal(self, policy: SitePolicy, task: Task) -> str | None:
        """Why ``task`` is refused by ``policy``: a kind it does not allow, evaluation on the training split, or
        an evaluation of a model the site did not see leave training (:meth:`unseen`)."""
        why = policy.task_refusal(task.kind) or policy.evaluation_refusal(task.kind, task.config)
        if why is None and task.kind == "evaluate":
            why = self.unseen(policy, task)
        elif why is None and task.kind == "route":
            why = self.unseen_route(policy, task)
        return why

    def saw(self, task: Task, reply: Reply) -> None:
        """Note the models that left training: the arrays of a method's task that names a round (the round's model
        as the server sent it to train from) and the plain arrays of any reply."""
        if task.kind not in ("evaluate", "privacy", "route") and not task.kind.startswith("secagg/"):
            rnd = task.config.get("round")
            if isinstance(rnd, int) and not isinstance(rnd, bool):
                self.trained.add(rnd)
                self.seen |= model_digests(task.arrays)
        self.seen |= model_digests({k: v for k, v in reply.arrays.items() if not k.startswith(MASKED)})

    def unseen(self, policy: SitePolicy, task: Task) -> str | None:
        """Why an ``evaluate`` task is refused: it names a candidate whose arrays are not a model this site saw
        leave training, nor one its policy allows, and the new models it evaluates (one per round it trained, one
        on the testing split per run) are spent.  Accepted new models count as seen from then on."""
        allowed = self.seen | set(policy.allowed_models)
        new = []
        for cand in task.config.get("candidates") or []:
            name = cand.get("name") if isinstance(cand, dict) else None
            if not isinstance(name, str):
                return "an evaluation candidate without a name"
            arrays = strip_prefix(name, task.arrays)
            if arrays and model_digest(arrays) not in allowed:
                new.append((name, model_digest(arrays)))
        why = self._spend(task, new)
        if why is None:  # the parts of an evaluated composite (a FedSM selector) count as seen too
            for cand in task.config.get("candidates") or []:
                self.seen |= model_digests(strip_prefix(cand["name"], task.arrays))
        return why

    def unseen_route(self, policy: SitePolicy, task: Task) -> str | None:
        """Why FedSM's ``route`` task is refused, by :meth:`unseen`'s rule applied to the parts of its composite the
        site loads (:func:`fedseg.algorithms.fedsm.selection.load_composite`): the selector (``selector/…``), the
        global model (``global/…``) and the personalized model of each site its config names
        (``personal/<site>/…``).  A route whose parts the site all saw (or its policy allows) is answered; one with
        new parts spends the same allowance as an evaluation (one per round it trained, one on the testing split
        per run) or, on validation, the run's one final assembly.  An answered route's parts and its whole
        composite count as seen from then on, so the engine's evaluation of that composite, and the final
        test-time route of a composite assembled from seen parts (``test_report``), spend nothing more."""
        sites = task.config.get("sites")
        if not isinstance(sites, list) or not all(isinstance(s, str) for s in sites):
            return "a route task without its list of sites"
        allowed = self.seen | set(policy.allowed_models)
        parts = {
            name: strip_prefix(name, task.arrays) for name in ["selector", "global", *(f"personal/{s}" for s in sites)]
        }
        digests = {name: model_digest(a) for name, a in parts.items() if a}
        why = self._spend(task, [(n, d) for n, d in digests.items() if d not in allowed], route=True)
        if why is None:
            self.seen |= set(digests.values()) | model_digests(task.arrays)
        return why

    def _spend(self, task: Task, new: list[tuple[str, str]], route: bool = False) -> str | None:
        """Accept ``new`` (name, digest) models of ``task`` under the allowance of its split, or say why not.  A
        ``route`` on validation past the per-round allowance takes the run's one final assembly (the composite
        FedSM assembles from its best parts after the last round, and routes on validation to pick its γ)."""
        if not new:
            return None
        testing = split_name(str(task.config.get("split"))) == "testing"
        used, most = (self.tested, 1) if testing else (self.fresh, len(self.trained))
        if route and not testing and used >= most and self.trained and not self.assembled:
            self.assembled = True
            self.seen |= {d for _, d in new}
            return None
        if used >= most:
            allowance = "one final test per run" if testing else f"one per round it trained ({most})"
            return (
                f"candidates {[n for n, _ in new]} are models this site did not see leave training, and the "
                f"evaluations of new models it allows ({allowance}) are spent; a model from outside the run is "
                "evaluated only when the site's policy lists its digest in allowed_models"
            )
        if testing:
            self.tested += 1
        else:
            self.fresh += 1
        self.seen |= {d for _, d in new}
        return None

    def planning_refusal(self, policy: SitePolicy, op: str, body: dict[str, Any]) -> str | None:
        """Why a planning request of a volume run is refused: a kind the policy's ``tasks`` do not allow, or a
        ``histogram`` request past its bounds."""
        why = policy.task_refusal(op)
        if why is None and op == "histogram":
            why = policy.histogram_refusal(body, self.histograms)
        return why

    def planned(self, op: str, body: dict[str, Any]) -> None:
        """Count the intervals of a ``histogram`` request answered."""
        if op == "histogram":
            self.histograms += len(body.get("requests") or [])
