"""The operator's view of the fleet: what ``GET /admin/engines`` answers, as typed structs.

``EngineViewer`` joins the fleet's frozen ``EngineView`` with what only the
shell knows (the engine's URL, requests in flight, the readmitter's drain and
last readmission, the monitor's streak, consolidation risk) and returns
``EnginesView``; the app encodes it as is. It reads and never changes anything.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import msgspec
import trio

from narwhal.config import Config, EngineSpec, RunningConfig
from narwhal.control.readmission import ReadmissionResult, ReadmissionState
from narwhal.errors import FailureClass
from narwhal.fleet import EjectionCause, EngineView, HoldKind
from narwhal.fleet.placement import InFlightCounts

__all__ = [
    "EngineCountersEntry",
    "EngineEntry",
    "EngineViewer",
    "EnginesView",
    "HoldEntry",
    "MonitorEntry",
    "PrefixIndexEntry",
]


class HoldEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One hold on an engine; times are the router's monotonic seconds."""

    kind: HoldKind
    reason: str
    since: float
    deadline: float | None
    deferred: bool
    # failure_quarantine: the evidence that caused it, which decides what may clear it early.
    cause: str | None = None


class EngineCountersEntry(msgspec.Struct, frozen=True, kw_only=True):
    """Totals since the router started (or since the handoff it resumed from)."""

    ejections: int
    probes: dict[str, int]
    failures: dict[FailureClass, int]


class PrefixIndexEntry(msgspec.Struct, frozen=True, kw_only=True):
    """What the prefix index holds for one prefill engine: block hashes, and their bytes by its accounting."""

    entries: int
    bytes: int


class _PrefixIndex(Protocol):
    def entries(self, engine: str) -> int: ...
    def bytes(self, engine: str) -> int: ...


class EngineEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One engine in ``/admin/engines`` and ``/admin/engines/{name}``."""

    name: str
    role: str
    url: str
    eligible: bool
    ejected: bool
    ejected_reason: str | None
    # A bounded label for the ejection (the same one ``narwhal_engine_ejections_total`` counts).
    ejected_cause: EjectionCause | None
    holds: list[HoldEntry]
    evidence: dict[FailureClass, int]
    liveness_misses: int
    in_flight: int
    next_probe_at: float | None
    counters: EngineCountersEntry
    drained: bool
    maintenance_started_at: float | None
    readmission_running: bool
    last_readmission: ReadmissionResult | None
    # Out engines: when a health check first saw it answer a success since its ejection,
    # the backoff refused or short-lived readmissions have earned, the next automatic attempt
    # (router monotonic seconds, as hold times; None when none is scheduled).
    health_answered_at: float | None = None
    readmission_backoff_s: float = 0.0
    next_readmission_at: float | None = None
    # Cache-aware placement's prefix index for this engine (prefill engines; None for decode).
    prefix_index: PrefixIndexEntry | None = None
    # Removed from the config by a reload: takes no new request, leaves once its requests finish.
    removing: bool = False
    # The model it serves ([[engines]] model, else [fleet] model).
    model: str = ""
    # Where it came from: the config file ("file") or discovery ("discovery", [discovery]).
    source: str = "file"


class MonitorEntry(msgspec.Struct, frozen=True, kw_only=True):
    """The monitor's state: ``passes`` counts the passes started since this router began."""

    failure_streak: int
    degraded: str | None
    passes: int


class EnginesView(msgspec.Struct, frozen=True, kw_only=True):
    """The whole answer of ``GET /admin/engines``."""

    engines: list[EngineEntry]
    consolidation_risk: dict[str, str]
    monitor: MonitorEntry


class _FleetViews(Protocol):
    def view(self, name: str, now: float) -> EngineView: ...
    def views(self, now: float) -> list[EngineView]: ...


class _Readmitter(Protocol):
    def admin_state(self, name: str, view: EngineView | None = None) -> ReadmissionState: ...


class _Controller(Protocol):
    def consolidation_risk(self, now: float | None = None) -> Mapping[str, str]: ...


class _Monitor(Protocol):
    @property
    def failure_streak(self) -> int: ...
    @property
    def degraded_reason(self) -> str | None: ...
    @property
    def passes(self) -> int: ...


class EngineViewer:
    """Builds ``EnginesView`` from the fleet and the shell's parts, at the current time."""

    def __init__(self, *, config: Config, fleet: _FleetViews, in_flight: InFlightCounts, readmitter: _Readmitter,
                 controller: _Controller, monitor: _Monitor, clock: Callable[[], float] = trio.current_time,
                 prefix_index: _PrefixIndex | None = None, specs: Mapping[str, EngineSpec] | None = None,
                 source_of: Callable[[str], str] = lambda name: "file") -> None:
        self.config = config
        self.prefix_index = prefix_index
        self.fleet = fleet
        self.in_flight = in_flight
        self.readmitter = readmitter
        self.controller = controller
        self.monitor = monitor
        self.clock = clock
        # Engine addresses by name, including one a reload is removing (no longer in the config);
        # None: read from the config.
        self.specs = specs
        self.source_of = source_of

    def configure(self, running: RunningConfig) -> None:
        """A reload: engines outside the registry's addresses are read from the new config."""
        self.config = running.config

    def engines(self) -> EnginesView:
        """Every engine in configured order, consolidation risk and the monitor."""
        now = self.clock()
        monitor = self.monitor
        return EnginesView(
            engines=[self._entry(view) for view in self.fleet.views(now)],
            consolidation_risk=dict(self.controller.consolidation_risk(now)),
            monitor=MonitorEntry(failure_streak=monitor.failure_streak, degraded=monitor.degraded_reason,
                                 passes=monitor.passes),
        )

    def engine(self, name: str) -> EngineEntry:
        """One engine's entry; KeyError when ``name`` is not configured."""
        return self._entry(self.fleet.view(name, self.clock()))

    def _entry(self, view: EngineView) -> EngineEntry:
        spec = self.specs[view.name] if self.specs is not None else self.config.engine_spec(view.name)
        readmission = self.readmitter.admin_state(view.name, view)
        counters = view.counters
        return EngineEntry(
            name=view.name,
            role=view.role,
            url=spec.url,
            eligible=view.eligible,
            ejected=view.ejected,
            ejected_reason=view.ejected_reason,
            ejected_cause=view.ejected_cause,
            holds=[HoldEntry(kind=hold.kind, reason=hold.reason, since=hold.since, deadline=hold.deadline,
                             deferred=hold.deferred, cause=None if hold.cause is None else str(hold.cause))
                   for hold in view.holds],
            evidence=dict(view.evidence),
            liveness_misses=view.liveness_misses,
            in_flight=self.in_flight[view.name],
            next_probe_at=view.next_probe_at,
            counters=EngineCountersEntry(ejections=counters.ejections, probes=dict(counters.probes),
                                         failures=dict(counters.failures)),
            drained=readmission.drained,
            maintenance_started_at=readmission.maintenance_started_at,
            readmission_running=readmission.readmission_running,
            last_readmission=readmission.last_readmission,
            health_answered_at=readmission.health_answered_at,
            readmission_backoff_s=readmission.readmission_backoff_s,
            next_readmission_at=readmission.next_readmission_at,
            prefix_index=self._prefix_entry(view),
            removing=view.removing,
            model=view.model,
            source=self.source_of(view.name),
        )

    def _prefix_entry(self, view: EngineView) -> PrefixIndexEntry | None:
        index = self.prefix_index
        if index is None or view.role != "prefill":
            return None
        return PrefixIndexEntry(entries=index.entries(view.name), bytes=index.bytes(view.name))
