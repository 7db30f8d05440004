"""What a worker's request path reads and writes: the controller's last snapshot, and evidence out.

``WorkerView`` stands where the request core expects the supervisor and the
admission gate. Reads (eligible engines, capacity, admission) come from the
last ``Snapshot``; writes (failures, successes) become ``Evidence`` messages.
It decides nothing: the controller does, and sends a new snapshot.

Admission is checked against the lease-derived ``admit_until`` on the worker's
own clock at the moment a request is admitted, so a worker whose controller
froze stops admitting on time by itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from narwhal.auth.client_auth import AuthSettings
from narwhal.config import EngineConfig, EngineSpec, FleetConfig, PlacementConfig, TracingConfig
from narwhal.errors import FailureClass, SuccessKind
from narwhal.workers.protocol import Evidence, RequestSample, Snapshot

__all__ = ["TelemetryRelay", "WorkerView"]

EMPTY_SNAPSHOT = Snapshot(seq=0, eligible={}, admission_reason="starting: no snapshot from the controller yet")


class WorkerView:
    """The request path's supervisor and admission, served from snapshots."""

    def __init__(self, send: Callable[[Evidence], None], *, clock: Callable[[], float] = time.monotonic,
                 refresh: Callable[[], None] | None = None,
                 record_success: Callable[[str, SuccessKind], None] | None = None,
                 success_clears: Callable[[str, SuccessKind], bool] | None = None,
                 on_engines: Callable[[list[EngineSpec]], None] | None = None,
                 on_settings: Callable[[PlacementConfig, EngineConfig], None] | None = None,
                 on_fleet: Callable[[FleetConfig], None] | None = None,
                 on_auth: Callable[[AuthSettings | None], None] | None = None,
                 on_tracing: Callable[[TracingConfig], None] | None = None) -> None:
        self._send = send
        self._clock = clock
        # In one process the hub is asked before each read whether the fleet
        # changed (one cheap comparison), so placement is as current as the fleet.
        self._refresh = refresh
        # In one process a success goes to the hub as a call (two a request: no message built for them),
        # and only when the fleet says it may clear something (``Fleet.success_clears``): the usual one,
        # on an engine with no failure streak, changes nothing and costs that one check.
        self._record_success = record_success
        self._success_clears = success_clears
        self.snapshot = EMPTY_SNAPSHOT
        self._local_reason: str | None = None
        # Told the engine set when a snapshot changes it (the request core's ``set_engines``).
        self.on_engines = on_engines
        # Told the data plane's reloadable settings when a snapshot changes them (``LocalDataPlane.configure``).
        self.on_settings = on_settings
        # Told the [fleet] keys (models, aliases, their limits) when a snapshot changes them (``set_fleet``).
        self.on_fleet = on_fleet
        # Told the client keys' settings when a snapshot changes them (``LocalDataPlane.configure_auth``).
        self.on_auth = on_auth
        # Told [tracing] when a snapshot changes it (``LocalDataPlane.configure_tracing``).
        self.on_tracing = on_tracing

    def apply(self, snapshot: Snapshot) -> None:
        """Take a newer snapshot (older ones, reordered or replayed, are ignored).

        A changed engine set (and changed settings) is handed on first, so placement
        never reads a name whose address this process does not know yet.
        """
        if snapshot.seq >= self.snapshot.seq:
            last = self.snapshot
            if snapshot.fleet is not None and snapshot.fleet != last.fleet and self.on_fleet is not None:
                self.on_fleet(snapshot.fleet)
            if snapshot.tracing is not None and snapshot.tracing != last.tracing and self.on_tracing is not None:
                self.on_tracing(snapshot.tracing)
            if snapshot.auth != last.auth and self.on_auth is not None:
                self.on_auth(snapshot.auth)
            if snapshot.engines is not None and snapshot.engines != last.engines and self.on_engines is not None:
                self.on_engines(snapshot.engines)
            if (snapshot.placement is not None and snapshot.engine_config is not None and self.on_settings is not None
                    and (snapshot.placement, snapshot.engine_config) != (last.placement, last.engine_config)):
                self.on_settings(snapshot.placement, snapshot.engine_config)
            self.snapshot = snapshot

    def close_locally(self, reason: str) -> None:
        """Refuse new requests for a reason of this process (shutdown, controller gone)."""
        if self._local_reason is None:
            self._local_reason = reason

    def _current(self) -> Snapshot:
        if self._refresh is not None:
            self._refresh()
        return self.snapshot

    # -- the request core's Supervisor protocol ------------------------------------------

    def eligible(self, role: str, model: str | None = None) -> list[str]:
        snapshot = self._current()
        if model is None:
            return snapshot.eligible.get(role, [])
        pool = snapshot.pools.get(model)
        return [] if pool is None else pool.get(role, [])

    def capacity_problem(self, model: str | None = None) -> str | None:
        snapshot = self._current()
        if model is None:
            return snapshot.capacity_problem
        if model not in snapshot.pools:
            return f"serving capacity exhausted: model {model!r} has no engines"
        return snapshot.capacity_problems.get(model)

    def capacity_problems(self) -> dict[str, str]:
        return self._current().capacity_problems

    def record_failure(self, engine: str, failure_class: FailureClass) -> None:
        self._send(Evidence(engine=engine, failure_class=failure_class.value))

    def record_success(self, engine: str, kind: SuccessKind) -> None:
        record = self._record_success
        if record is None:
            self._send(Evidence(engine=engine, success_kind=kind.value))
        elif self._success_clears is None or self._success_clears(engine, kind):
            record(engine, kind)

    # -- the admission gate --------------------------------------------------------------

    def reason(self) -> str | None:
        """Why a new request is refused now, or None; the lease deadline is checked here, every time."""
        if self._local_reason is not None:
            return self._local_reason
        snapshot = self.snapshot
        if snapshot.admission_reason is not None:
            return snapshot.admission_reason
        if snapshot.admit_until is not None and self._clock() >= snapshot.admit_until:
            return snapshot.admit_until_reason
        return None

    def refusal(self, now: float) -> str | None:
        """As ``reason``; ``now`` is the caller's trio clock, so the lease deadline is compared on ours."""
        return self.reason()

    def readiness(self) -> str | None:
        """What ``/ready`` says: the admission reason, else the fleet's capacity problem."""
        return self.reason() or self.capacity_problem()


class TelemetryRelay:
    """Collects finished requests for the next report, in place of the controller's telemetry."""

    def __init__(self, max_samples: int = 100_000) -> None:
        self._samples: list[RequestSample] = []
        self._max = max_samples
        self.dropped = 0

    def record_request(self, *, prefill: str | None, decode: str | None, ttft_s: float | None,
                       inter_token_s: float | None, error_engine: str | None, status: int = 0,
                       error_class: str | None = None, failed: bool = False) -> None:
        if len(self._samples) >= self._max:
            # Bounded: a controller that stops reading reports must not grow a worker's memory.
            self.dropped += 1
            return
        self._samples.append(RequestSample(prefill, decode, ttft_s, inter_token_s, error_engine, status,
                                           error_class, failed))

    def take(self) -> list[RequestSample]:
        samples, self._samples = self._samples, []
        return samples
