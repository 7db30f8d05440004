"""The engine registry: the one engine set a router serves, and how a new set is applied (pure: no I/O, no clock).

Every table kept per engine (the fleet machine, the supervisor's addresses,
readmission, in-flight counts, the prefix index, telemetry, the handoff's
engine set, the workers' snapshots) follows this set: ``EngineRegistry``
records each transition as a ``RegistryEvent`` and its shell
(``narwhal.control.engine_set``) hands the events to the tables in order.

A new set (a config reload) is ``apply``: the difference from the set asked
for last (``diff_entries``) becomes removals, additions and cancelled
removals. A removed engine first leaves placement (``removing``) and leaves
the tables (``removed``) once its requests finished or at its deadline
(``removal_deadline``); the same engine put back meanwhile was never gone,
and a changed one of that name is added once the old one left.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

import msgspec

from narwhal.config import Config, EngineSpec

__all__ = ["EngineEntry", "EngineRegistry", "RegistryDiff", "RegistryEvent", "RegistryEventKind",
           "diff_entries", "entries_from_config", "removal_deadline"]


class EngineEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One engine as the registry knows it: where it is, what it does, what it serves, who named it."""

    name: str
    url: str
    role: Literal["prefill", "decode"]
    # The model the engine serves (its [[engines]] model, else [fleet] model): its pool.
    model: str
    # Where the engine came from: the config file, or discovery (narwhal.control.discovery) at run time.
    source: Literal["file", "discovery"] = "file"
    # Its KV event publisher as configured or registered (narwhal.kv_events.sources); not part of what the
    # engine is: a change re-subscribes, it does not remove and add the engine.
    kv_events: str | None = None
    kv_events_replay: str | None = None
    kv_events_topic: str | None = None

    def spec(self) -> EngineSpec:
        """The address the pools, probes and snapshots use."""
        return EngineSpec(name=self.name, url=self.url, role=self.role, model=self.model, kv_events=self.kv_events,
                          kv_events_replay=self.kv_events_replay, kv_events_topic=self.kv_events_topic)

    def same_engine(self, other: EngineEntry) -> bool:
        """Whether ``other`` is this engine (url, role, model, source), whatever its KV event publisher."""
        return (self.name, self.url, self.role, self.model, self.source) == \
            (other.name, other.url, other.role, other.model, other.source)


def entries_from_config(config: Config) -> list[EngineEntry]:
    """``config``'s engines in file order, each with its model."""
    return [EngineEntry(name=spec.name, url=spec.url, role=spec.role, model=config.model_of(spec),
                        kv_events=spec.kv_events, kv_events_replay=spec.kv_events_replay,
                        kv_events_topic=spec.kv_events_topic)
            for spec in config.engines]


class RegistryDiff(msgspec.Struct, frozen=True, kw_only=True):
    """Names added and removed from one set to the next; a changed entry is in all three lists."""

    added: list[str] = []
    removed: list[str] = []
    # Same name, another url, role, model or source: a removal then an addition (its evidence was another's).
    changed: list[str] = []


def diff_entries(old: Sequence[EngineEntry], new: Sequence[EngineEntry]) -> RegistryDiff:
    """From ``old`` to ``new``, matched by name: ``added`` in ``new``'s order, ``removed`` in ``old``'s."""
    before = {entry.name: entry for entry in old}
    after = {entry.name: entry for entry in new}
    changed = [entry.name for entry in new if entry.name in before and not before[entry.name].same_engine(entry)]
    moved = set(changed)
    return RegistryDiff(added=[entry.name for entry in new if entry.name not in before or entry.name in moved],
                        removed=[entry.name for entry in old if entry.name not in after or entry.name in moved],
                        changed=changed)


def removal_deadline(started_at: float, grace_s: float) -> float:
    """When a removed engine's requests still in flight are cut: ``grace_s`` (serving.shutdown_grace_s) after."""
    return started_at + grace_s


class RegistryEventKind(enum.StrEnum):
    ADDED = "added"
    REMOVING = "removing"
    REMOVAL_CANCELLED = "removal_cancelled"
    REMOVED = "removed"


class RegistryEvent(msgspec.Struct, frozen=True):
    """One transition of the engine set, in the order it happened."""

    kind: RegistryEventKind
    entry: EngineEntry


class EngineRegistry:
    """The engine set: engines serving, engines leaving (with their deadlines), additions waiting for a name."""

    def __init__(self, entries: Iterable[EngineEntry], *, grace_s: float) -> None:
        self.grace_s = grace_s
        # Every engine the router tracks, leaving ones included, in the order they joined.
        self._entries: dict[str, EngineEntry] = {}
        self._specs: dict[str, EngineSpec] = {}
        for entry in entries:
            self._entries[entry.name] = entry
            self._specs[entry.name] = entry.spec()
        # The set the last ``apply`` asked for: the next one is diffed against it.
        self._wanted = list(self._entries.values())
        # Engines leaving, each with the deadline its requests are cut at.
        self._leaving: dict[str, float] = {}
        # Additions waiting for an engine of the same name (a changed url or role) to leave first.
        self._pending: dict[str, EngineEntry] = {}
        self._events: list[RegistryEvent] = []

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __repr__(self) -> str:
        return (f"<EngineRegistry {list(self._entries)} [leaving: {sorted(self._leaving) or '-'} | "
                f"pending: {sorted(self._pending) or '-'}]>")

    def entries(self) -> list[EngineEntry]:
        """Every engine tracked, leaving ones included."""
        return list(self._entries.values())

    def source_of(self, name: str) -> str:
        """Where engine ``name`` came from ("file" or "discovery"); "file" for one not tracked."""
        entry = self._entries.get(name)
        return entry.source if entry is not None else "file"

    def serving(self) -> list[EngineEntry]:
        """The engines tracked and not leaving: what this router serves and keeps serving."""
        return [entry for name, entry in self._entries.items() if name not in self._leaving]

    @property
    def specs(self) -> Mapping[str, EngineSpec]:
        """Every tracked engine's address by name (live: it follows the set)."""
        return self._specs

    def spec_list(self) -> list[EngineSpec]:
        """The addresses of every engine tracked, in order (what workers get in their snapshots)."""
        return list(self._specs.values())

    @property
    def leaving(self) -> Mapping[str, float]:
        """Engines being removed, each with its deadline (``removal_deadline``)."""
        return self._leaving

    def drain_events(self) -> list[RegistryEvent]:
        """The transitions since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def apply(self, entries: Sequence[EngineEntry], now: float) -> RegistryDiff:
        """Make ``entries`` the set asked for: start removals, then add (or keep, or queue) the additions."""
        diff = diff_entries(self._wanted, entries)
        self._wanted = list(entries)
        wanted = {entry.name: entry for entry in entries}
        for name, entry in wanted.items():
            # The same engine with another KV event publisher: taken as it is, no event (see EngineEntry).
            held = self._entries.get(name)
            if held is not None and held != entry and held.same_engine(entry) and name not in self._leaving:
                self._entries[name] = entry
                self._specs[name] = entry.spec()
        for name in diff.removed:
            self._start_removal(name, now)
        for name in diff.added:
            entry = wanted[name]
            if name in self._leaving and self._entries[name] == entry:
                # Put back unchanged before it left: it was never gone.
                del self._leaving[name]
                self._events.append(RegistryEvent(RegistryEventKind.REMOVAL_CANCELLED, entry))
            elif name in self._entries:
                self._pending[name] = entry
            else:
                self._add(entry)
        return diff

    def finish_removal(self, name: str) -> None:
        """``name``'s requests finished or its deadline passed: it leaves; an addition waiting for it comes in."""
        if name not in self._leaving:
            return
        del self._leaving[name]
        entry = self._entries.pop(name)
        del self._specs[name]
        self._events.append(RegistryEvent(RegistryEventKind.REMOVED, entry))
        pending = self._pending.pop(name, None)
        if pending is not None:
            self._add(pending)

    def _start_removal(self, name: str, now: float) -> None:
        if self._pending.pop(name, None) is not None:
            return  # never added: the engine of that name still leaving goes on leaving
        if name in self._leaving or name not in self._entries:
            return
        self._leaving[name] = removal_deadline(now, self.grace_s)
        self._events.append(RegistryEvent(RegistryEventKind.REMOVING, self._entries[name]))

    def _add(self, entry: EngineEntry) -> None:
        self._entries[entry.name] = entry
        self._specs[entry.name] = entry.spec()
        self._events.append(RegistryEvent(RegistryEventKind.ADDED, entry))
