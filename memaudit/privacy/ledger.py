"""The privacy ledger of a run: every noise-adding step as an event, ε recomputed from them.

Events are `dp_accounting` DpEvents, or `RdpCurveEvent` (memaudit's own) for mechanisms that
dp_accounting cannot describe, such as distributed DP, which carry their per-step RDP
curve. Consecutive identical steps are coalesced into one `SelfComposedDpEvent` (or one
`RdpCurveEvent` with a larger count), so a 10^4-step run is one line of JSON.

The ledger counts *completed* steps. A run that resumes from a checkpoint taken at step s
calls `truncate_steps(s)` before recording again, so steps that ran after the checkpoint but
were lost in the crash are not counted twice.

Saved as `RUN_DIR/privacy.json` (DEVELOPERS.md):
`{"schema": 1, "unit", "delta", "events", "epsilon": {"rdp", "pld"}, "noise_multiplier",
"sampling_rate", "steps", "per_user", "protects", "document", "calibration", "mechanisms",
"adjacency", "reproducible_randomness", "guarantees"}`. `protects` names the unit (sequence or
user) and its contribution bound; on an example-level ledger `document` gives the ε per
document, composed for the most sequences one document spans (`document_events`). `mechanisms` holds what each mechanism declared
(unit, adjacency, sensitivity, what it assumes hidden, its view of the server); `guarantees`
splits the ε into the release's and the server's. The stored ε is informational; every reader
recomputes it from the events (`PrivacyLedger.load(path).epsilon("rdp")`).

>>> led = PrivacyLedger(unit="example", delta=1e-5)
>>> led.record_steps(0.04, 1.5, 1000); led.record_steps(0.04, 1.5, 1250)
>>> len(led.events), led.steps, round(led.epsilon("rdp"), 3)
(1, 2250, 7.329)
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from dp_accounting import dp_event

from memaudit.io import atomic_write_json, read_json
from memaudit.privacy.accounting import (
    Accountant,
    check_delta,
    dpsgd_event,
    epsilon_from_rdp,
    group_epsilon,
    has_mixture,
    mixture_step_event,
    rdp_curve,
)
from memaudit.privacy.accounting import (
    epsilon as event_epsilon,
)
from memaudit.privacy.events import (
    Event,
    RdpCurveEvent,
    coalescable,
    event_from_dict,
    event_to_dict,
    repeated,
    steps_of,
    with_count,
)

SCHEMA = 1
Unit = Literal["example", "user"]
# ----------------------------------------------------------------------------- ledger
@dataclass
class PrivacyLedger:
    """Events of one run at one unit of privacy ("example" = one training sequence)."""

    unit: Unit
    delta: float
    events: list[Event] = field(default_factory=list)
    max_sequences_per_user: int | None = None
    # the most packed training sequences one trained document spans (None: unknown, data
    # prepared before memaudit counted it); example-level ledgers only
    max_sequences_per_document: int | None = None
    calibration: dict[str, Any] | None = None
    # what each recorded mechanism declared (unit, adjacency, sensitivity, assumes_hidden,
    # server_view), one entry per distinct declaration, from `record_mechanism`
    mechanisms: list[dict[str, Any]] = field(default_factory=list)
    # True: sampling and noise keys came from train.seed (privacy.reproducible_randomness), so
    # every ε here is void against an adversary who knows the seed
    reproducible_randomness: bool | None = None

    def __post_init__(self) -> None:
        if self.unit not in ("example", "user"):
            raise ValueError(f"ledger unit must be 'example' or 'user', got {self.unit!r}")
        check_delta(self.delta)
        m = self.max_sequences_per_document
        if m is not None and (int(m) != m or m < 1):
            raise ValueError(f"max_sequences_per_document must be a whole number >= 1, got {m}")

    # -------------------------------------------------------------- recording
    def record(self, event: Event) -> None:
        """Append an event, merging it into the last one when both repeat the same step."""
        if not isinstance(event, dp_event.DpEvent | RdpCurveEvent):
            raise TypeError(f"not a privacy event: {type(event).__name__}")
        if self.events and coalescable(event) and coalescable(self.events[-1]):
            last = self.events[-1]
            if type(last) is type(event) and with_count(last, 1) == with_count(event, 1):
                self.events[-1] = with_count(last, steps_of(last) + steps_of(event))
                return
        self.events.append(event)

    def record_mechanism(self, mechanism: Any, metrics: Any = None, steps: int = 1) -> None:
        """Record ``steps`` steps of ``mechanism`` (its own ``dp_event(metrics)``) and its declaration.

        ``mechanism`` is a :mod:`memaudit.privacy.mechanisms` object (``DPSGD.mechanism``,
        ``dpfedavg_mechanism(...)``, ``DistributedDiscreteGaussian()``); the one call the
        trainers make per step or round.
        """
        decl = mechanism.declaration()
        if decl["unit"] != self.unit:
            raise ValueError(f"a {decl['unit']}-level mechanism cannot go into a {self.unit}-level ledger")
        if decl not in self.mechanisms:
            self.mechanisms.append(decl)
        if steps:

            self.record(repeated(mechanism.dp_event(metrics), steps))

    def record_steps(self, q: float, sigma: float, steps: int = 1) -> None:
        """Record `steps` DP-SGD steps with Poisson rate q and noise multiplier σ."""
        if steps:
            self.record(dpsgd_event(q, sigma, steps))

    @property
    def steps(self) -> int:
        """Number of noise-adding steps (or rounds) recorded."""
        return sum(steps_of(e) for e in self.events)

    def truncate_steps(self, steps: int) -> None:
        """Keep only the first `steps` steps (resume from a checkpoint taken at that step)."""
        if steps < 0 or steps > self.steps:
            raise ValueError(f"cannot truncate a ledger of {self.steps} steps to {steps}")
        kept, done = [], 0
        for e in self.events:
            n = steps_of(e)
            if done + n <= steps:
                kept.append(e)
                done += n
            elif done < steps:
                if not coalescable(e):
                    raise ValueError("cannot split a composite privacy event; resume at its end")
                kept.append(with_count(e, steps - done))
                done = steps
        self.events = kept

    # -------------------------------------------------------------- epsilon
    def epsilon(self, accountant: Accountant = "rdp") -> float:
        """ε at the ledger's δ, recomputed from the events; 0 for an empty ledger.

        PLD cannot interpret `RdpCurveEvent`s: for a ledger holding one, "pld" raises.
        """
        if not self.events:
            return 0.0
        custom = [e for e in self.events if isinstance(e, RdpCurveEvent)]
        standard = [e for e in self.events if not isinstance(e, RdpCurveEvent)]
        if not custom:
            return _events_epsilon(standard, self.delta, accountant)
        if accountant != "rdp":
            raise ValueError("the ledger holds RDP-curve events; only accountant='rdp' applies")
        orders = np.unique(np.concatenate([np.asarray(e.orders, float) for e in custom]))
        total = sum(e.at(orders) for e in custom)
        if standard:
            total = total + rdp_curve(dp_event.ComposedDpEvent(standard), tuple(orders))
        return epsilon_from_rdp(orders, total, self.delta)

    def epsilons(self) -> dict[str, float | None]:
        """ε by each accountant that can interpret every event (None where one cannot)."""
        mixture = any(not isinstance(e, RdpCurveEvent) and has_mixture(e) for e in self.events)
        out: dict[str, float | None] = {"rdp": None if mixture else self.epsilon("rdp")}
        has_custom = any(isinstance(e, RdpCurveEvent) for e in self.events)
        out["pld"] = None if has_custom else self.epsilon("pld")
        return out

    def guarantees(self, eps: dict[str, float | None] | None = None) -> dict[str, Any]:
        """Who the ε holds against, from the recorded mechanisms' declarations.

        "release": an adversary who sees only the released updates/model (sampling hidden).
        "server": the aggregator, who picks the cohort and (central DP) sees the clipped sum
        before noise: no guarantee ("none"), or the same events ("same", distributed DP). A
        user-level DP-SGD mechanism (ELS, ULS: "n/a") has no separate server, and the party that
        runs training sees the unnoised sums: no guarantee against it either. Only a ledger whose
        every mechanism holds against the server ("same") states an ε against it.
        """
        eps = self.epsilons() if eps is None else eps
        views = {d.get("server_view", "n/a") for d in self.mechanisms}
        release = {"epsilon": eps, "delta": self.delta,
                   "assumes_hidden": sorted({d["assumes_hidden"] for d in self.mechanisms})}
        if self.reproducible_randomness:
            release["void_if_seed_known"] = True
        out: dict[str, Any] = {"release": release}
        if self.unit == "user":
            if views and views != {"same"} and "none" not in views:  # ELS, ULS: central DP-SGD
                out["server"] = {"epsilon": {"rdp": math.inf, "pld": math.inf},
                                 "why": "central DP-SGD: the party that runs training sees every clipped "
                                        "gradient sum before it adds noise, and which examples or users were sampled; "
                                        "no DP guarantee against it"}
            elif views != {"same"}:
                out["server"] = {"epsilon": {"rdp": math.inf, "pld": math.inf},
                                 "why": "central DP: the server sees the clipped sum before it adds noise, "
                                        "and who took part; no DP guarantee against it"}
            else:
                out["server"] = {"epsilon": {"rdp": eps["rdp"], "pld": eps.get("pld")},
                                 "why": "distributed DP: no amplification by sampling is claimed, so the "
                                        "release's epsilon also holds against the server"}
        return out

    def per_user(self, eps: float | None = None) -> dict[str, Any] | None:
        """Group-privacy bound for the user with the most sequences (example-level ledgers)."""
        if self.unit != "example" or self.max_sequences_per_user is None:
            return None
        if eps is None:
            eps = min(v for v in self.epsilons().values() if v is not None)
        return group_epsilon(eps, self.delta, self.max_sequences_per_user)

    def protects(self) -> dict[str, Any]:
        """The unit the ε is per, and its contribution bound, in words a report can quote."""
        if self.unit == "example":
            return {"unit": "sequence", "contribution_bound": "one packed training sequence, clipped to C"}
        ks = {d["max_examples_per_user"] for d in self.mechanisms if d.get("max_examples_per_user") is not None}
        bound = (f"at most {max(ks)} training sequences per user, clipped to C" if ks
                 else "one clipped model update per user per round")
        return {"unit": "user", "contribution_bound": bound}

    def document_events(self) -> list[Event] | None:
        """The events against add/remove of one document's m sequences (m =
        `max_sequences_per_document`); None where m is unknown or an event is not a
        Poisson-sampled Gaussian step.

        Each of the document's sequences is sampled independently at rate q and clipped alone,
        so j ~ Binomial(m, q) of them are in a step's batch: the ELS event with k = m
        (`accounting.mixture_step_event`). With m = 1 they are the ledger's own events.
        """
        m = self.max_sequences_per_document
        if self.unit != "example" or m is None:
            return None
        return self.group_events(m)

    def group_events(self, k: int) -> list[Event] | None:
        """The events against add/remove of k training sequences at once (example-level ledgers;
        None otherwise, or where an event is not a Poisson-sampled Gaussian step).

        Every sequence is sampled into a step's batch on its own at rate q and clipped alone, so
        j ~ Binomial(k, q) of the k are in the batch and move the clipped sum by at most jC: one
        mixture of Gaussians per step (`accounting.mixture_step_event`), the k sequences as one
        event. Tight where the group-privacy lemma's (kε, k e^{(k-1)ε} δ) is loose or vacuous.
        """
        if self.unit != "example" or int(k) != k or k < 1:
            return None
        if k == 1:
            return list(self.events)
        m = int(k)
        out: list[Event] = []
        for e in self.events:
            if isinstance(e, dp_event.NoOpDpEvent):
                out.append(e)
                continue
            inner = e.event if isinstance(e, dp_event.SelfComposedDpEvent) else None
            if not (isinstance(inner, dp_event.PoissonSampledDpEvent)
                    and isinstance(inner.event, dp_event.GaussianDpEvent)):
                return None
            step = mixture_step_event(inner.sampling_probability, inner.event.noise_multiplier, m)
            out.append(dp_event.SelfComposedDpEvent(step, e.count))
        return out

    def group_epsilon(self, k: int) -> float | None:
        """ε at the ledger's δ against add/remove of k sequences together (`group_events`, PLD);
        None where the events are not Poisson-sampled Gaussian steps or the unit is not example."""
        events = self.group_events(k)
        if events is None:
            return None
        if not events:
            return 0.0
        if k == 1:
            known = [v for v in self.epsilons().values() if v is not None]
            return min(known) if known else None
        return _document_pld(json.dumps([event_to_dict(e) for e in events]), self.delta)

    def document(self, eps: dict[str, float | None] | None = None) -> dict[str, Any] | None:
        """ε per document (example-level ledgers; None otherwise), recomputed from the events.

        ``eps`` is this ledger's own `epsilons()` when the caller has them (the m = 1 case).
        Returns {"unit": "document", "max_sequences_per_document", "epsilon": {"rdp", "pld"},
        "delta", "composed_as"}; with m unknown the ε is None and `composed_as` says so.
        """
        if self.unit != "example":
            return None
        m = self.max_sequences_per_document
        out: dict[str, Any] = {"unit": "document", "max_sequences_per_document": m, "delta": self.delta}
        if m is None:
            return {**out, "epsilon": None, "composed_as": "unknown: the data was prepared before memaudit "
                    "counted the sequences a document spans; prepare it again to know"}
        if m == 1:
            return {**out, "epsilon": dict(self.epsilons() if eps is None else eps),
                    "composed_as": "no document crosses a packed-sequence boundary: the sequence's epsilon"}
        events = self.document_events()
        if events is None:
            return {**out, "epsilon": None, "composed_as": "not composed: the ledger holds an event other "
                    "than Poisson-sampled Gaussian steps"}
        pld = _document_pld(json.dumps([event_to_dict(e) for e in events]), self.delta) if events else 0.0
        return {**out, "epsilon": {"rdp": None, "pld": pld},
                "composed_as": f"a document spans up to {m} packed sequences: each step a mixture of "
                               f"Gaussians over the j ~ Binomial({m}, q) of them in the batch (PLD)"}

    # -------------------------------------------------------------- (de)serialisation
    def _last_dpsgd(self) -> tuple[float | None, float | None]:
        for e in reversed(self.events):
            if isinstance(e, dp_event.SelfComposedDpEvent) and isinstance(e.event, dp_event.PoissonSampledDpEvent):
                inner = e.event
                if isinstance(inner.event, dp_event.GaussianDpEvent):
                    return inner.event.noise_multiplier, inner.sampling_probability
            if isinstance(e, dp_event.SelfComposedDpEvent) and isinstance(e.event, dp_event.MixtureOfGaussiansDpEvent):
                return e.event.standard_deviation, None  # ELS: the rate is in the mixture's weights
        return None, None

    def to_json(self, *, with_epsilon: bool = True, with_document: bool = True) -> dict[str, Any]:
        """privacy.json. ``with_document=False`` leaves the per-document ε (a mixture PLD, about
        a second) to the run's last write: a checkpoint's copy has ``document: null``, and
        `ledger_summary`, the report and ``memaudit epsilon --run`` recompute it from the events."""
        sigma, q = self._last_dpsgd()
        eps = self.epsilons() if with_epsilon else {"rdp": None, "pld": None}
        known = [v for v in eps.values() if v is not None]
        return {
            "schema": SCHEMA,
            "unit": self.unit,
            "delta": self.delta,
            "events": [event_to_dict(e) for e in self.events],
            "epsilon": eps,
            "noise_multiplier": sigma,
            "sampling_rate": q,
            "steps": self.steps,
            "max_sequences_per_user": self.max_sequences_per_user,
            "per_user": self.per_user(min(known)) if known else None,
            "protects": self.protects(),
            "max_sequences_per_document": self.max_sequences_per_document,
            "document": self.document(eps) if with_epsilon and with_document else None,
            "calibration": self.calibration,
            "mechanisms": self.mechanisms,
            "adjacency": sorted({d["adjacency"] for d in self.mechanisms}),
            "reproducible_randomness": self.reproducible_randomness,
            "guarantees": self.guarantees(eps) if with_epsilon else None,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> PrivacyLedger:
        if obj.get("schema") != SCHEMA:
            raise ValueError(f"privacy ledger schema {obj.get('schema')!r} is not {SCHEMA}; "
                             "re-run with this memaudit version")
        return cls(
            unit=obj["unit"],
            delta=float(obj["delta"]),
            events=[event_from_dict(e) for e in obj.get("events", [])],
            max_sequences_per_user=obj.get("max_sequences_per_user"),
            max_sequences_per_document=obj.get("max_sequences_per_document"),
            calibration=obj.get("calibration"),
            mechanisms=list(obj.get("mechanisms") or []),
            reproducible_randomness=obj.get("reproducible_randomness"),
        )

    def save(self, path: str | os.PathLike) -> None:
        """Write privacy.json atomically (ε recomputed on the way)."""
        atomic_write_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> PrivacyLedger:
        try:
            obj = read_json(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"no privacy ledger at '{path}'; was the run trained with DP?") from None
        return cls.from_json(obj)


def no_privacy_json() -> dict[str, Any]:
    """privacy.json content for a run trained without DP (ε = inf)."""
    return {"schema": SCHEMA, "unit": None, "epsilon": {"rdp": math.inf, "pld": math.inf}}


_EPSILONS: dict[tuple[str, float, str], float] = {}


def _events_epsilon(events: list[Event], delta: float, accountant: Accountant) -> float:
    """ε of the events by one accountant, remembered by their JSON (the key only: a value this
    JSON cannot write is keyed by its repr). The run's writes of privacy.json, each report and
    the sweep's planning ask for the same ledger's ε again; a PLD costs ~0.1-1 s each time."""
    key = (json.dumps([event_to_dict(e) for e in events], default=repr), delta, accountant)
    if key not in _EPSILONS:
        if len(_EPSILONS) >= 256:
            _EPSILONS.clear()
        _EPSILONS[key] = event_epsilon(dp_event.ComposedDpEvent(events), delta, accountant)
    return _EPSILONS[key]


@functools.lru_cache(maxsize=64)
def _document_pld(events_json: str, delta: float) -> float:
    """PLD ε of the per-document events (their JSON: the cache key). A report, `memaudit
    epsilon` and the run's last write ask for the same ledger's figure several times."""
    events = [event_from_dict(d) for d in json.loads(events_json)]
    return event_epsilon(dp_event.ComposedDpEvent(events), delta, "pld")


def ledger_summary(obj: dict[str, Any] | None, *, with_document: bool = True) -> dict[str, Any]:
    """What a report or a probe may show about a run's privacy, recomputed from the events.

    Never reads the stored ε and has no fallback: a ledger this version cannot interpret
    raises ``ValueError``. ``obj`` is privacy.json's content (None or unit None: no DP).
    ``with_document=False`` skips the per-document ε (a mixture-of-Gaussians PLD, ~1 s).

    Returns:
      {"epsilon" (the tightest accountant's), "epsilons", "unit", "delta", "adjacency",
      "mechanisms", "assumes_hidden", "server_epsilon", "server_note",
      "reproducible_randomness", "void_if_seed_known", "per_user", "protects", "document"}
    """
    if not obj or obj.get("unit") is None:
        return {"epsilon": math.inf, "epsilons": {"rdp": math.inf, "pld": math.inf}, "unit": None, "delta": None,
                "adjacency": [], "mechanisms": [], "assumes_hidden": [], "server_epsilon": math.inf,
                "server_note": "no DP", "reproducible_randomness": None, "void_if_seed_known": False,
                "per_user": None, "protects": None, "document": None}
    led = PrivacyLedger.from_json(obj)
    eps = led.epsilons()
    best = min(v for v in eps.values() if v is not None)
    g = led.guarantees(eps)
    server = g.get("server")
    return {
        "epsilon": best,
        "epsilons": eps,
        "unit": led.unit,
        "delta": led.delta,
        "adjacency": sorted({d["adjacency"] for d in led.mechanisms}),
        "mechanisms": [d["mechanism"] for d in led.mechanisms],
        "assumes_hidden": g["release"]["assumes_hidden"],
        "server_epsilon": None if server is None else server["epsilon"]["rdp"],
        "server_note": None if server is None else server["why"],
        "reproducible_randomness": led.reproducible_randomness,
        "void_if_seed_known": bool(led.reproducible_randomness),
        "per_user": led.per_user(best),
        "protects": led.protects(),
        "document": led.document(eps) if with_document else None,
    }
