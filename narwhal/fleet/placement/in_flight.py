"""Requests in flight per engine: what placement balances on, and drains and readmission wait for."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

__all__ = ["InFlight", "InFlightCounts"]


class InFlightCounts(Protocol):
    """What drains, readmission and views read: ``InFlight`` in one process, the hub's sums over workers."""

    @property
    def counts(self) -> Mapping[str, int]: ...
    def __getitem__(self, name: str) -> int: ...
    def total(self) -> int: ...


class _Counts(dict[str, int]):
    """Counts per engine; an engine without an entry reads 0 (without getting one), in C."""

    def __missing__(self, name: str) -> int:
        return 0


class InFlight:
    """Requests in flight per engine; owned by the request path, read by admin views."""

    def __init__(self, names: Iterable[str]) -> None:
        self.counts: dict[str, int] = _Counts.fromkeys(names, 0)
        # Requests other worker processes have in flight per engine, as the
        # controller last reported; empty in a single process.
        self.elsewhere: dict[str, int] = {}
        # Engines that left the fleet with requests still in flight: their entry goes with the last one.
        self._gone: set[str] = set()
        # The engines with a request in flight here (count > 0): decode placement finds the idle ones from it.
        self.busy: set[str] = set()

    def acquire(self, name: str) -> None:
        # .get: an engine a config reload added has no entry until its first request.
        self.counts[name] = self.counts.get(name, 0) + 1
        self.busy.add(name)

    def release(self, name: str) -> None:
        if name not in self.counts:
            raise KeyError(name)
        left = self.counts[name] - 1
        if not left:
            self.busy.discard(name)
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

    def loader(self) -> Callable[[str], int]:
        """``load`` as placement calls it per candidate: a C-level lookup when no other worker reports loads."""
        return self.load if self.elsewhere else self.counts.__getitem__

    def total(self) -> int:
        return sum(self.counts.values())

