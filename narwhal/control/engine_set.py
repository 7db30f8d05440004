"""The engine registry's shell: applies a new engine set, times removals, and tells every per-engine table.

``EngineSet.apply`` (a config reload) hands the registry the new set and then
each ``RegistryEvent`` to every ``EngineSetListener``, in the order given
(the fleet first: its events are the logged ``engine_added``,
``engine_removing``, ``engine_removal_cancelled`` and ``engine_removed``). A
removal waits in ``run``'s nursery for the engine's requests to finish, until
its deadline (``narwhal.fleet.registry.removal_deadline``); before ``run``
(nothing can be in flight) it completes at once.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import trio

from narwhal.config import EngineSpec
from narwhal.control.fleet_writer import FleetWriter
from narwhal.fleet.placement import SharedIndex
from narwhal.fleet.registry import EngineEntry, EngineRegistry, RegistryDiff, RegistryEventKind
from narwhal.fleet.telemetry import Telemetry
from narwhal.state.handoff import EngineSetEntry

__all__ = ["REMOVAL_POLL_S", "EngineSet", "EngineSetListener", "FleetFollower", "InFlightFollower",
           "PrefixIndexFollower", "SetFollower", "TablesFollower"]

# How often a removal looks whether the engine's last request finished.
REMOVAL_POLL_S = 0.05


class EngineSetListener(Protocol):
    """A table kept per engine: told of each transition of the engine set, after the registry made it.

    A table subclassing it hears nothing of the transitions it does not override.
    """

    def on_added(self, entry: EngineEntry) -> None:
        """``entry`` joined the set (held by the fleet until readmission admits it)."""
        return None

    def on_removing(self, entry: EngineEntry) -> None:
        """``entry`` takes no new request; it stays in the tables while its requests finish."""
        return None

    def on_removal_cancelled(self, entry: EngineEntry) -> None:
        """``entry`` was put back unchanged before it left: it stays, as it was."""
        return None

    def on_removed(self, entry: EngineEntry) -> None:
        """``entry`` left: forget it."""
        return None


class _WholeSetFollower(EngineSetListener):
    """A table rebuilt from the whole set on every transition (``_follow``)."""

    def on_added(self, entry: EngineEntry) -> None:
        self._follow()

    def on_removing(self, entry: EngineEntry) -> None:
        self._follow()

    def on_removal_cancelled(self, entry: EngineEntry) -> None:
        self._follow()

    def on_removed(self, entry: EngineEntry) -> None:
        self._follow()

    @abstractmethod
    def _follow(self) -> None:
        """Rebuild the table from the registry's whole set."""


class _InFlight(Protocol):
    def __getitem__(self, name: str) -> int: ...


class EngineSet:
    """The registry, the tables that follow it, and the removals waiting for their engines' requests."""

    def __init__(self, registry: EngineRegistry, listeners: Sequence[EngineSetListener], *, in_flight: _InFlight,
                 clock: Callable[[], float] = trio.current_time) -> None:
        self.registry = registry
        self._listeners = list(listeners)
        self._in_flight = in_flight
        self._clock = clock
        # Each running removal's wait, cancelled when its engine is put back unchanged.
        self._waits: dict[str, trio.CancelScope] = {}
        self._nursery: trio.Nursery | None = None

    def __repr__(self) -> str:
        return f"<EngineSet {self.registry!r} [waits: {sorted(self._waits) or '-'}]>"

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Own the nursery removals wait in, until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    def apply(self, entries: Sequence[EngineEntry]) -> RegistryDiff:
        """Make ``entries`` the engine set: every table hears of each change, removals start waiting."""
        diff = self.registry.apply(entries, self._clock())
        self._publish()
        self._follow_removals()
        return diff

    def _follow_removals(self) -> None:
        """One wait per engine leaving: a cancelled removal's wait ends, a new one's starts."""
        leaving = self.registry.leaving
        for name in [name for name in self._waits if name not in leaving]:
            self._waits.pop(name).cancel()
        for name, deadline in list(leaving.items()):
            if name in self._waits:
                continue
            if self._nursery is None:
                self._finish(name)
            else:
                scope = self._waits[name] = trio.CancelScope()
                self._nursery.start_soon(self._wait_then_finish, name, deadline, scope, name=f"removal {name}")

    async def _wait_then_finish(self, name: str, deadline: float, scope: trio.CancelScope) -> None:
        # Requests in flight finish (the count falls as they end), bounded by the deadline;
        # ``scope`` is cancelled when the engine comes back before that.
        with scope:
            with trio.move_on_at(deadline):
                while self._in_flight[name] > 0:
                    await trio.sleep(REMOVAL_POLL_S)
            if self._waits.get(name) is scope:
                del self._waits[name]
                self._finish(name)

    def _finish(self, name: str) -> None:
        self.registry.finish_removal(name)
        self._publish()

    def _publish(self) -> None:
        for event in self.registry.drain_events():
            for listener in self._listeners:
                if event.kind is RegistryEventKind.ADDED:
                    listener.on_added(event.entry)
                elif event.kind is RegistryEventKind.REMOVING:
                    listener.on_removing(event.entry)
                elif event.kind is RegistryEventKind.REMOVAL_CANCELLED:
                    listener.on_removal_cancelled(event.entry)
                else:
                    listener.on_removed(event.entry)


class FleetFollower(EngineSetListener):
    """The fleet machine: an addition held until readmission, a removal that says what it waits for."""

    def __init__(self, fleet: FleetWriter, in_flight: _InFlight, *, grace_s: float,
                 clock: Callable[[], float] = trio.current_time) -> None:
        self._fleet = fleet
        self._in_flight = in_flight
        self._grace_s = grace_s
        self._clock = clock

    def on_added(self, entry: EngineEntry) -> None:
        how = "discovered" if entry.source == "discovery" else "added by a config reload"
        self._fleet.add_engine(entry.name, entry.role, self._clock(),
                               f"{how}: enters placement once the readmission checks pass", entry.model)

    def on_removing(self, entry: EngineEntry) -> None:
        self._fleet.start_removal(entry.name, self._clock(),
                                  f"{_gone(entry)}: no new requests; leaves once its "
                                  f"{self._in_flight[entry.name]} request(s) in flight finish "
                                  f"(cut after {self._grace_s:g} s)")

    def on_removal_cancelled(self, entry: EngineEntry) -> None:
        self._fleet.cancel_removal(entry.name, self._clock(),
                                   ("registered again" if entry.source == "discovery" else "put back into the config")
                                   + " unchanged before it left: its removal is called off")

    def on_removed(self, entry: EngineEntry) -> None:
        left = self._in_flight[entry.name]
        reason = (f"{_gone(entry)}; its requests finished" if not left else
                  f"{_gone(entry)}; {left} request(s) still in flight after serving.shutdown_grace_s "
                  "are cut (their clients get an error, or the stream continues on another engine; "
                  "never evidence)")
        self._fleet.remove_engine(entry.name, self._clock(), reason)


def _gone(entry: EngineEntry) -> str:
    return "gone from discovery" if entry.source == "discovery" else "removed from the config"


class _Readmitter(Protocol):
    def add_engine(self, spec: EngineSpec) -> None: ...
    def remove_engine(self, name: str) -> None: ...


class _Controller(Protocol):
    def engines_changed(self, removed: Iterable[str] = ()) -> None: ...


class _Specs(Protocol):
    engines: dict[str, EngineSpec]


class _HealthSweep(Protocol):
    engines: list[EngineSpec]


class _Drain(Protocol):
    drained: set[str]


class TablesFollower(EngineSetListener):
    """The control plane's tables: the supervisor's addresses, the health sweep, readmission, drains, drift."""

    def __init__(self, *, supervisor: _Specs, health: _HealthSweep, readmitter: _Readmitter, drain: _Drain,
                 controller: _Controller) -> None:
        self._supervisor = supervisor
        self._health = health
        self._readmitter = readmitter
        self._drain = drain
        self._controller = controller

    def on_added(self, entry: EngineEntry) -> None:
        spec = entry.spec()
        self._supervisor.engines[entry.name] = spec
        self._health.engines.append(spec)
        # Tried at once, then on schedule (the fleet holds it until then).
        self._readmitter.add_engine(spec)
        self._controller.engines_changed()

    def on_removing(self, entry: EngineEntry) -> None:
        self._controller.engines_changed()

    def on_removal_cancelled(self, entry: EngineEntry) -> None:
        self._controller.engines_changed()

    def on_removed(self, entry: EngineEntry) -> None:
        name = entry.name
        self._supervisor.engines.pop(name, None)
        self._health.engines = [spec for spec in self._health.engines if spec.name != name]
        self._readmitter.remove_engine(name)
        self._drain.drained.discard(name)
        # Its drift counts go, and the consolidation totals are counted again.
        self._controller.engines_changed(removed=[name])


class InFlightFollower(EngineSetListener):
    """This process's in-flight counts (with workers, the hub's sums follow its engine set instead)."""

    def __init__(self, forget: Callable[[str], None]) -> None:
        self._forget = forget

    def on_removed(self, entry: EngineEntry) -> None:
        self._forget(entry.name)


class _Forgets(Protocol):
    def forget(self, engine: str) -> None: ...


class PrefixIndexFollower(_WholeSetFollower):
    """Cache-aware placement's prefix index: it indexes the prefill engines; one that left is forgotten everywhere.

    (Each worker's copy follows its snapshots; ``forget`` reaches them through
    the index relay.) A later engine of that name starts fresh.
    """

    def __init__(self, registry: EngineRegistry, index: SharedIndex, forget: _Forgets) -> None:
        self._registry = registry
        self._index = index.index
        self._forget = forget

    def on_removed(self, entry: EngineEntry) -> None:
        if entry.name in self._index.engines:
            self._forget.forget(entry.name)
        self._follow()

    def _follow(self) -> None:
        self._index.set_engines(entry.name for entry in self._registry.entries() if entry.role == "prefill")


class _Hub(Protocol):
    def set_engines(self, names: Iterable[str]) -> None: ...
    def publish(self) -> None: ...


class _Persistence(Protocol):
    engine_set: list[EngineSetEntry]


class SetFollower(_WholeSetFollower):
    """Tables that hold the whole set: telemetry, the handoff's engine set, and the workers' snapshots (last)."""

    def __init__(self, registry: EngineRegistry, *, telemetry: Telemetry, persistence: _Persistence,
                 hub: _Hub) -> None:
        self._registry = registry
        self._telemetry = telemetry
        self._persistence = persistence
        self._hub = hub

    def _follow(self) -> None:
        registry = self._registry
        entries, specs = registry.entries(), registry.specs
        self._telemetry.set_engines([(entry.name, entry.role) for entry in entries])
        self._hub.set_engines(entry.name for entry in entries)
        # The handoff records the running set: what this router serves and keeps serving.
        self._persistence.engine_set = [EngineSetEntry(name=entry.name, url=specs[entry.name].base_url,
                                                       role=entry.role, model=entry.model)
                                        for entry in registry.serving()]
        # Now, not at the publisher's next turn: an engine that left has its legs cut by the
        # data plane as it takes this snapshot (one in this process reads it only per request).
        self._hub.publish()
