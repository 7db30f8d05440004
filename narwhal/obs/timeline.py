"""The router's last minutes in one-second buckets: what ``GET /admin/timeline`` and the fleet page draw.

A fixed ring of ``window_s`` complete seconds' buckets (15 minutes by default) and the open second's. Each bucket holds
the requests that finished in its second, their errors and recoveries by
class, their time to first token (a bounded reservoir while the second is open, reduced to p50/p99
when the next second starts), and the last sample of requests in flight and
state (eligible, held, ejected) per engine. Memory is bounded by the window,
the configured engines, ``max_ttft_samples`` and ``max_error_classes``, however
many requests arrive. Pure: callers pass ``now`` (the router's monotonic
seconds); no trio, no I/O.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

import msgspec

from narwhal.fleet.telemetry import percentile

__all__ = ["OTHER_ERROR_CLASS", "Timeline", "TimelineView", "error_class_of"]

# Error classes past ``max_error_classes`` in one bucket are counted under this one.
OTHER_ERROR_CLASS = "other"


def error_class_of(status: int, error_class: str | None) -> str:
    """The class a failed request counts under in ``errors``: its error class, else ``http_<status>``."""
    return error_class if error_class is not None else f"http_{status}"


class TimelineView(msgspec.Struct, frozen=True, kw_only=True):
    """``GET /admin/timeline``: one entry per complete second, oldest first, in parallel arrays.

    Point ``i`` is the second starting at ``start + i`` on the router's monotonic
    clock (the clock of hold ``since``/``deadline`` in ``/admin/engines``), which
    was ``start_unix + i`` on the wall clock. ``None`` means nothing was sampled.
    """

    bucket_s: int
    window_s: int
    now: float
    now_unix: float
    start: float
    start_unix: float
    engines: list[str]
    requests: list[int]
    # Requests whose client saw a failure, by class.
    errors: dict[str, list[int]]
    # Requests that succeeded after an engine failure (a retry or a stream continuation), by that failure's class.
    recovered: dict[str, list[int]]
    ttft_p50_ms: list[float | None]
    ttft_p99_ms: list[float | None]
    in_flight: dict[str, list[int | None]]
    state: dict[str, list[str | None]]


class _Bucket:
    """One second's figures; ``ttft`` holds raw samples only while the second is open."""

    __slots__ = ("second", "requests", "errors", "recovered", "ttft", "ttft_seen", "p50_ms", "p99_ms", "in_flight",
                 "state")

    def __init__(self, second: int) -> None:
        self.second = second
        self.requests = 0
        self.errors: dict[str, int] = {}
        self.recovered: dict[str, int] = {}
        self.ttft: list[float] | None = []
        self.ttft_seen = 0
        self.p50_ms: float | None = None
        self.p99_ms: float | None = None
        self.in_flight: dict[str, int] | None = None
        self.state: dict[str, str] | None = None

    def seal(self) -> None:
        """Reduce the TTFT samples to percentiles and drop them: a closed bucket keeps only numbers."""
        if self.ttft is None:
            return
        samples = sorted(self.ttft)
        self.ttft = None
        p50, p99 = percentile(samples, 0.5), percentile(samples, 0.99)
        self.p50_ms = None if p50 is None else round(p50 * 1000, 3)
        self.p99_ms = None if p99 is None else round(p99 * 1000, 3)


class Timeline:
    """A ring of one-second buckets over the last ``window_s`` seconds."""

    def __init__(self, engines: Sequence[str], *, window_s: int = 900, max_ttft_samples: int = 512,
                 max_error_classes: int = 16, max_engines: int = 256, rng: random.Random | None = None) -> None:
        if window_s < 1 or max_ttft_samples < 1 or max_error_classes < 1:
            raise ValueError("window_s, max_ttft_samples and max_error_classes must be >= 1")
        # Engines in first-seen order: the configured ones, then any a config reload adds (up to max_engines).
        self.engines = list(engines)
        # The same names as a set: the once-a-second sample asks for each engine whether it is known.
        self._known = set(self.engines)
        self.max_engines = max(max_engines, len(self.engines))
        self.window_s = window_s
        self.max_ttft_samples = max_ttft_samples
        self.max_error_classes = max_error_classes
        # Seeded: the reservoir's choice never depends on anything outside this object.
        self._rng = rng or random.Random(0)
        # One slot more than the window: the open second must not take the slot of the oldest complete one.
        self._slots = window_s + 1
        self._ring: list[_Bucket | None] = [None] * self._slots
        self._open: _Bucket | None = None

    def __repr__(self) -> str:
        filled = sum(bucket is not None for bucket in self._ring)
        return f"<Timeline [{filled}/{self._slots} buckets | {len(self.engines)} engines]>"

    def _bucket(self, now: float) -> _Bucket:
        second = math.floor(now)
        open_ = self._open
        if open_ is not None and open_.second == second:
            return open_
        if open_ is not None and second < open_.second:
            # Late news (a worker's report crossing a second): charge it to the open second, never rewrite history.
            return open_
        if open_ is not None:
            open_.seal()
        bucket = _Bucket(second)
        self._ring[second % self._slots] = bucket
        self._open = bucket
        return bucket

    def record(self, now: float, *, status: int, error_class: str | None, ttft_s: float | None,
               failed: bool | None = None) -> None:
        """Count one finished request (hot path: O(1), bounded memory).

        ``failed``: the client saw a failure (default: ``status >= 400``); a request
        that did not fail but carries an ``error_class`` recovered from an engine failure.
        """
        bucket = self._bucket(now)
        bucket.requests += 1
        if failed is None:
            failed = status >= 400
        if failed or error_class is not None:
            counts = bucket.errors if failed else bucket.recovered
            klass = error_class_of(status, error_class)
            if klass not in counts and len(counts) >= self.max_error_classes:
                klass = OTHER_ERROR_CLASS
            counts[klass] = counts.get(klass, 0) + 1
        if ttft_s is not None and bucket.ttft is not None:
            bucket.ttft_seen += 1
            samples = bucket.ttft
            if len(samples) < self.max_ttft_samples:
                samples.append(ttft_s)
            else:
                # Reservoir sampling: every request of the second has the same chance to be kept.
                slot = self._rng.randrange(bucket.ttft_seen)
                if slot < self.max_ttft_samples:
                    samples[slot] = ttft_s

    def sample(self, now: float, *, in_flight: Mapping[str, int], state: Mapping[str, str]) -> None:
        """Record requests in flight and state per engine for the second of ``now`` (the last sample wins).

        ``state`` names the engines the fleet has now: one not seen before (added by
        a config reload) gets its series from this second on.
        """
        bucket = self._bucket(now)
        known = self._known
        if not known.issuperset(state):
            # A list membership test per engine made this O(engines^2) a second: 32,000 string comparisons at 256.
            for name in state:
                if name not in known and len(known) < self.max_engines:
                    known.add(name)
                    self.engines.append(name)
        bucket.in_flight = {name: int(in_flight.get(name, 0)) for name in state}
        bucket.state = dict(state)

    def view(self, now: float, now_unix: float, seconds: int | None = None) -> TimelineView:
        """The last ``seconds`` complete seconds before ``now`` (the whole window by default)."""
        count = self.window_s if seconds is None else max(0, min(int(seconds), self.window_s))
        end = math.floor(now)  # the open second is not complete: it is not shown
        start = end - count
        open_ = self._open
        if open_ is not None and open_.second < end:
            open_.seal()
        requests: list[int] = []
        errors: dict[str, list[int]] = {}
        recovered: dict[str, list[int]] = {}
        p50: list[float | None] = []
        p99: list[float | None] = []
        in_flight: dict[str, list[int | None]] = {name: [] for name in self.engines}
        state: dict[str, list[str | None]] = {name: [] for name in self.engines}
        for i, second in enumerate(range(start, end)):
            bucket = self._ring[second % self._slots]
            if bucket is None or bucket.second != second:
                bucket = None
            requests.append(bucket.requests if bucket else 0)
            p50.append(bucket.p50_ms if bucket else None)
            p99.append(bucket.p99_ms if bucket else None)
            if bucket is not None:
                for klass, n in bucket.errors.items():
                    errors.setdefault(klass, [0] * count)[i] = n
                for klass, n in bucket.recovered.items():
                    recovered.setdefault(klass, [0] * count)[i] = n
            sampled_in = bucket.in_flight if bucket is not None else None
            sampled_state = bucket.state if bucket is not None else None
            for name in self.engines:
                in_flight[name].append(None if sampled_in is None else sampled_in.get(name))
                state[name].append(None if sampled_state is None else sampled_state.get(name))
        return TimelineView(bucket_s=1, window_s=self.window_s, now=now, now_unix=now_unix, start=float(start),
                            start_unix=now_unix - (now - start), engines=list(self.engines), requests=requests,
                            errors=errors, recovered=recovered, ttft_p50_ms=p50, ttft_p99_ms=p99,
                            in_flight=in_flight, state=state)
