"""Placement: pick an engine among the eligible ones, and count what is in flight.

Least outstanding requests wins; ties are broken at random so that a burst
after a quiet spell does not pile onto the first engine in the config.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

__all__ = ["InFlight", "InFlightCounts", "pick_least_outstanding"]


class InFlightCounts(Protocol):
    """What drains, readmission and views read: ``InFlight`` in one process, the hub's sums over workers."""

    @property
    def counts(self) -> Mapping[str, int]: ...
    def __getitem__(self, name: str) -> int: ...
    def total(self) -> int: ...


class InFlight:
    """Requests in flight per engine; owned by the request path, read by admin views."""

    def __init__(self, names: Iterable[str]) -> None:
        self.counts: dict[str, int] = {name: 0 for name in names}
        # Requests other worker processes have in flight per engine, as the
        # controller last reported; empty in a single process.
        self.elsewhere: dict[str, int] = {}
        # Engines that left the fleet with requests still in flight: their entry goes with the last one.
        self._gone: set[str] = set()

    def acquire(self, name: str) -> None:
        # .get: an engine a config reload added has no entry until its first request.
        self.counts[name] = self.counts.get(name, 0) + 1

    def release(self, name: str) -> None:
        left = self.counts[name] - 1
        if left or name not in self._gone:
            self.counts[name] = left
        else:
            del self.counts[name]
            self._gone.discard(name)

    def forget(self, name: str) -> None:
        """Drop ``name``'s entry (it left the fleet): now, or when its last request in flight ends."""
        if self.counts.get(name):
            self._gone.add(name)
        else:
            self.counts.pop(name, None)

    def __getitem__(self, name: str) -> int:
        return self.counts.get(name, 0)

    def load(self, name: str) -> int:
        """Requests in flight on the engine router-wide: this process's and the other workers' last report."""
        return self.counts.get(name, 0) + self.elsewhere.get(name, 0)

    def total(self) -> int:
        return sum(self.counts.values())


def pick_least_outstanding(candidates: Sequence[str], in_flight: InFlight,
                           rng: random.Random = random._inst) -> str | None:
    """The candidate with the fewest requests in flight (random among ties), or None."""
    if not candidates:
        return None
    if len(candidates) == 1:
        return candidates[0]
    counts = in_flight.counts
    elsewhere = in_flight.elsewhere
    if elsewhere:
        counts = {name: counts.get(name, 0) + elsewhere.get(name, 0) for name in candidates}
    best = min(counts.get(name, 0) for name in candidates)
    tied = [name for name in candidates if counts.get(name, 0) == best]
    return tied[0] if len(tied) == 1 else rng.choice(tied)
