"""Per-engine request telemetry in fixed-length intervals, for drift control and operators.

The request path calls ``record_request`` once per finished request: the
prefill engine is charged the request's time to first token, the decode engine
its inter-token latency, and the engine that failed (if any) an error. That call
is on the hot path, so it only bumps two integers and appends floats to lists.
The monitor's rollover stage calls ``roll(now)``; once ``interval_s`` has passed
since the current interval opened, the interval is closed into a frozen
``Interval`` with percentiles, and the last ``keep_intervals`` are kept.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Sequence

import msgspec

from narwhal.config import RunningConfig

__all__ = ["EngineInterval", "Interval", "Telemetry", "percentile"]


class EngineInterval(msgspec.Struct, frozen=True, kw_only=True):
    """One engine's figures over one closed interval; percentiles are None without samples."""

    role: str
    requests: int
    errors: int
    ttft_samples: int
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    inter_token_samples: int
    inter_token_p50_s: float | None
    inter_token_p90_s: float | None


class Interval(msgspec.Struct, frozen=True, kw_only=True):
    """A closed telemetry interval [start, end) on the monotonic clock; ``index`` counts from 0."""

    index: int
    start: float
    end: float
    engines: dict[str, EngineInterval]


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """The q-quantile (0..1) of already sorted values, linearly interpolated; None when empty."""
    if not sorted_values:
        return None
    position = (len(sorted_values) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    fraction = position - low
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * fraction


class _Accumulator:
    """The open interval's raw figures for one engine; mutated on the hot path."""

    __slots__ = ("role", "requests", "errors", "ttft", "inter_token")

    def __init__(self, role: str) -> None:
        self.role = role
        self.requests = 0
        self.errors = 0
        self.ttft: list[float] = []
        self.inter_token: list[float] = []

    def close(self) -> EngineInterval:
        ttft = sorted(self.ttft)
        gaps = sorted(self.inter_token)
        return EngineInterval(
            role=self.role, requests=self.requests, errors=self.errors,
            ttft_samples=len(ttft), ttft_p50_s=percentile(ttft, 0.5), ttft_p90_s=percentile(ttft, 0.9),
            inter_token_samples=len(gaps), inter_token_p50_s=percentile(gaps, 0.5),
            inter_token_p90_s=percentile(gaps, 0.9))


class Telemetry:
    """The open interval being recorded into, plus the last ``keep_intervals`` closed ones."""

    def __init__(self, engines: Sequence[tuple[str, str]], *, interval_s: float, keep_intervals: int,
                 clock: Callable[[], float]) -> None:
        """Track ``engines`` given as (name, role) pairs; the first ``roll`` opens the first interval."""
        if interval_s <= 0 or keep_intervals < 1:
            raise ValueError("interval_s must be > 0 and keep_intervals >= 1")
        self.interval_s = interval_s
        self.keep_intervals = keep_intervals
        self._clock = clock
        self._roles = dict(engines)
        self._current = {name: _Accumulator(role) for name, role in self._roles.items()}
        # None until the first roll: the router is built before trio's clock runs.
        self._opened_at: float | None = None
        self._closed: collections.deque[Interval] = collections.deque(maxlen=keep_intervals)
        self._next_index = 0

    def configure(self, running: RunningConfig) -> None:
        """A reload: the open interval is cut by the new ``telemetry.interval_s``."""
        self.interval_s = running.config.telemetry.interval_s

    def __repr__(self) -> str:
        return (f"<Telemetry [{len(self._closed)}/{self.keep_intervals} intervals kept | "
                f"interval_s {self.interval_s} | open since {self._opened_at}]>")

    def record_request(self, *, prefill: str | None, decode: str | None, ttft_s: float | None,
                       inter_token_s: float | None, error_engine: str | None, status: int = 0,
                       error_class: str | None = None, failed: bool = False) -> None:
        """Charge one finished request to its engines (hot path: O(1)); unknown names are ignored.

        ``status`` and ``error_class`` are the timeline's (``narwhal.obs.timeline``), not drift's.
        """
        current = self._current
        if prefill is not None and (acc := current.get(prefill)) is not None:
            acc.requests += 1
            if ttft_s is not None:
                acc.ttft.append(ttft_s)
        if decode is not None and (acc := current.get(decode)) is not None:
            acc.requests += 1
            if inter_token_s is not None:
                acc.inter_token.append(inter_token_s)
        if error_engine is not None and (acc := current.get(error_engine)) is not None:
            acc.errors += 1

    def set_engines(self, engines: Sequence[tuple[str, str]]) -> None:
        """Track exactly ``engines`` from now on (a config reload); a removed engine's open figures go."""
        self._roles = dict(engines)
        current = self._current
        self._current = {name: current.get(name) or _Accumulator(role) for name, role in self._roles.items()}

    def roll(self, now: float | None = None) -> bool:
        """Close the open interval if ``interval_s`` has passed since it opened; True when closed.

        The closed interval ends at ``now`` (so it covers exactly the requests
        recorded into it) and the next one opens at ``now``.
        """
        if now is None:
            now = self._clock()
        if self._opened_at is None:
            self._opened_at = now
            return False
        if now - self._opened_at < self.interval_s:
            return False
        current = self._current
        # Swap in fresh accumulators first: the request path keeps recording into the new interval.
        self._current = {name: _Accumulator(role) for name, role in self._roles.items()}
        self._closed.append(Interval(index=self._next_index, start=self._opened_at, end=now,
                                     engines={name: acc.close() for name, acc in current.items()}))
        self._next_index += 1
        self._opened_at = now
        return True

    def closed_intervals(self) -> list[Interval]:
        """The kept closed intervals, oldest first."""
        return list(self._closed)

    def latest(self) -> Interval | None:
        """The most recently closed interval, or None before the first one closes."""
        return self._closed[-1] if self._closed else None

    def as_json(self) -> dict:
        """The kept intervals and the open interval's shape, for ``GET /admin/telemetry``."""
        return {
            "interval_s": self.interval_s,
            "keep_intervals": self.keep_intervals,
            "current": {
                "opened_at": self._opened_at,
                "now": self._clock(),
                "requests": {name: acc.requests for name, acc in self._current.items()},
            },
            "intervals": msgspec.to_builtins(list(self._closed)),
        }
