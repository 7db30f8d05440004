"""Performance-drift decisions and consolidation risk: pure functions over closed intervals.

An engine *drifts* in an interval when its median latency for its role (time to
first token for prefill, inter-token latency for decode) exceeds
``drift_factor`` times the median of its peers' medians, peers being the other
engines of the same model and role with data in that interval (one model's
engines are never compared with another's: a bigger model is slower, not drifting). ``DriftTracker`` turns
``drift_intervals`` consecutive drifting intervals into "hold" and the same
number of consecutive intervals back within bounds into "lift". It keeps only
streak counters; whether an engine is held is read from the fleet each time.

A held engine takes no new requests, so it usually has no latency of its own:
an interval without data counts as back within bounds for an engine whose
drift hold is active (the hold is a pause of ``drift_intervals`` intervals, after
which the engine is measured afresh and held again if still slow). For an
engine that is serving, an interval without data, or without peers to compare
with, is no evidence either way and breaks both streaks.

No trio, no I/O, no clock: every call is given what it needs.
"""

from __future__ import annotations

import enum
import statistics
from collections.abc import Iterable, Mapping

import msgspec

from narwhal.fleet.telemetry import EngineInterval, Interval

__all__ = [
    "DriftDecision",
    "DriftTracker",
    "Risk",
    "Verdict",
    "consolidation_risk",
    "judge_interval",
    "risk_by_role",
    "role_metric",
]


class Verdict(enum.StrEnum):
    """How one engine compared with its role's peers in one interval."""

    DRIFTING = "drifting"
    WITHIN = "within"
    NO_DATA = "no_data"


class Risk(enum.StrEnum):
    """Consolidation risk of a role: how close it is to having no eligible engine."""

    NONE = "none"
    ELEVATED = "elevated"
    CRITICAL = "critical"


class DriftDecision(msgspec.Struct, frozen=True, kw_only=True):
    """Apply (``hold=True``) or lift a performance-drift hold on ``engine``, and why."""

    engine: str
    hold: bool
    reason: str


def consolidation_risk(eligible: int, total: int) -> Risk:
    """``critical`` at one or no eligible engine, ``elevated`` below half of ``total``, else ``none``."""
    if eligible <= 1:
        return Risk.CRITICAL
    if eligible * 2 < total:
        return Risk.ELEVATED
    return Risk.NONE


def role_metric(figures: EngineInterval) -> float | None:
    """The median that drift compares for this engine's role (TTFT for prefill, inter-token for decode)."""
    return figures.ttft_p50_s if figures.role == "prefill" else figures.inter_token_p50_s


def judge_interval(interval: Interval, drift_factor: float,
                   models: Mapping[str, str] | None = None) -> dict[str, tuple[Verdict, str]]:
    """Each engine's verdict in ``interval`` with a one-line explanation; ``models`` (engine -> model) makes
    the peers those of the engine's own model and role (an engine it does not name: model "")."""
    of = models or {}
    by_pool: dict[tuple[str, str], dict[str, float]] = {}
    for name, figures in interval.engines.items():
        value = role_metric(figures)
        if value is not None:
            by_pool.setdefault((of.get(name, ""), figures.role), {})[name] = value
    verdicts: dict[str, tuple[Verdict, str]] = {}
    for name, figures in interval.engines.items():
        values = by_pool.get((of.get(name, ""), figures.role), {})
        own = values.get(name)
        peers = [value for peer, value in values.items() if peer != name]
        if own is None or not peers:
            verdicts[name] = (Verdict.NO_DATA, "no data" if own is None else "no peer with data")
            continue
        peer_median = statistics.median(peers)
        metric = "time to first token" if figures.role == "prefill" else "inter-token latency"
        explanation = (f"median {metric} {own * 1000:.1f} ms vs peers' median "
                       f"{peer_median * 1000:.1f} ms (drift_factor {drift_factor:g})")
        verdict = Verdict.DRIFTING if own > drift_factor * peer_median else Verdict.WITHIN
        verdicts[name] = (verdict, explanation)
    return verdicts


class DriftTracker:
    """Consecutive drifting / recovered interval counts per engine, turned into decisions."""

    def __init__(self, *, drift_factor: float, drift_intervals: int) -> None:
        if drift_factor <= 1 or drift_intervals < 1:
            raise ValueError("drift_factor must be > 1 and drift_intervals >= 1")
        self.drift_factor = drift_factor
        self.drift_intervals = drift_intervals
        self.drifting: dict[str, int] = {}
        self.recovered: dict[str, int] = {}

    def observe(self, interval: Interval, *, held: Iterable[str] = (),
                pausing: Iterable[str] = (), models: Mapping[str, str] | None = None) -> list[DriftDecision]:
        """Count one closed interval and return the holds to apply and lift.

        ``held``: engines with a performance-drift hold (active or deferred);
        ``pausing``: those among them whose hold is active (they take no new work);
        ``models``: each engine's model, whose engines alone are its peers.
        """
        held_set, pausing_set = set(held), set(pausing)
        decisions: list[DriftDecision] = []
        for name, (verdict, explanation) in judge_interval(interval, self.drift_factor, models).items():
            if verdict is Verdict.NO_DATA and name in pausing_set:
                verdict, explanation = Verdict.WITHIN, "held: no new requests, counted as within bounds"
            if verdict is Verdict.DRIFTING:
                self.drifting[name] = self.drifting.get(name, 0) + 1
                self.recovered[name] = 0
            elif verdict is Verdict.WITHIN:
                self.recovered[name] = self.recovered.get(name, 0) + 1
                self.drifting[name] = 0
            else:
                self.drifting[name] = self.recovered[name] = 0
            if name not in held_set and self.drifting[name] >= self.drift_intervals:
                decisions.append(DriftDecision(engine=name, hold=True, reason=(
                    f"performance drift for {self.drifting[name]} consecutive intervals: {explanation}")))
            elif name in held_set and self.recovered[name] >= self.drift_intervals:
                decisions.append(DriftDecision(engine=name, hold=False, reason=(
                    f"within bounds for {self.recovered[name]} consecutive intervals: {explanation}")))
        return decisions

    def forget(self, name: str) -> None:
        """Drop ``name``'s counts (it left the fleet): added back, it starts from zero."""
        self.drifting.pop(name, None)
        self.recovered.pop(name, None)

    def applied(self, decision: DriftDecision) -> None:
        """Start counting afresh for an engine whose hold was just applied or lifted."""
        self.drifting[decision.engine] = 0
        self.recovered[decision.engine] = 0


def risk_by_role(eligible: Mapping[str, int], total: Mapping[str, int]) -> dict[str, Risk]:
    """``consolidation_risk`` for every role in ``total``."""
    return {role: consolidation_risk(eligible.get(role, 0), count) for role, count in total.items()}
