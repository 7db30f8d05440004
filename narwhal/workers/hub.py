"""The controller's side of the workers: apply what they report, publish what they need.

Evidence from every worker is applied to the one fleet in arrival order, so a
failure streak counts across workers. Whatever can change what workers may do
(evidence, any change of the fleet, admission, the lease deadline, a report's
in-flight counts) pokes the hub; its publisher then builds the snapshot and
sends it to every worker if, and only if, its content differs from the last
one sent. The comparison is of the snapshot itself, so no part of it can be
left out of the decision; an idle router sends nothing. Time-based changes
(a quarantine ending) wake the publisher at their deadline.

In-flight counts and metrics arrive in periodic ``Report``s and are summed
here. A count a worker took before it had the snapshot that excluded an engine
cannot show that engine idle: a drain settles only on counts taken after every
worker knew of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import msgspec
import trio

from narwhal.auth.client_auth import AuthSettings
from narwhal.config import Config, EngineSpec
from narwhal.errors import FailureClass, SuccessKind
from narwhal.fleet.admission import FENCED_REASON
from narwhal.fleet.model import ROLES
from narwhal.fleet.placement import SharedIndex
from narwhal.fleet.placement.shared_index import IndexRecord
from narwhal.kv_events.feed import FeedSource
from narwhal.obs.logs import log_event
from narwhal.workers.index_relay import IndexRelay
from narwhal.workers.metrics_sum import MetricsSum
from narwhal.workers.protocol import Evidence, MetricsState, Report, Snapshot

__all__ = ["AggregateInFlight", "ControlPlane", "Poke", "WorkerHub"]


class ControlPlane(Protocol):
    """What the hub needs of the controller's supervisor."""

    def eligible(self, role: str, model: str | None = None) -> list[str]: ...
    def capacity_problem(self, model: str | None = None) -> str | None: ...
    def capacity_problems(self) -> dict[str, str]: ...
    def eligible_pools(self) -> dict[str, dict[str, list[str]]]: ...
    def record_failure(self, engine: str, failure_class: FailureClass) -> None: ...
    def record_success(self, engine: str, kind: SuccessKind) -> None: ...
    def state_version(self) -> int: ...
    def valid_until(self) -> float | None: ...


class _Gate(Protocol):
    def reason(self) -> str | None: ...


class Poke:
    """The publisher's wake-up: built first, given to what pokes it (admission, the fleet writer) and to the hub."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def __call__(self) -> None:
        """Something a snapshot is built from may have changed: the publisher looks (cheap, any thread of trio)."""
        self._event.set()

    def rearm(self) -> None:
        """Before a publish: a poke from now on wakes the next ``wait``, none is lost."""
        self._event = trio.Event()

    async def wait(self) -> None:
        await self._event.wait()


class _WorkerState:
    __slots__ = ("data_in_use", "data_waiting", "in_flight", "metrics", "requests_in_flight", "send",
                 "snapshot_seq")

    def __init__(self, send: Callable[[Snapshot], None]) -> None:
        self.send = send
        self.snapshot_seq = 0
        self.in_flight: dict[str, int] = {}
        self.requests_in_flight = 0
        self.data_in_use = 0
        self.data_waiting = 0
        self.metrics = MetricsState()


class AggregateInFlight:
    """Requests in flight per engine summed over workers, for drains, readmission and views."""

    def __init__(self, hub: WorkerHub, names: Iterable[str]) -> None:
        self._hub = hub
        self._names = list(names)

    def set_names(self, names: Iterable[str]) -> None:
        self._names = list(names)

    def forget(self, name: str) -> None:
        """Nothing to drop: the names follow the hub's engine set (``set_names``), the counts the workers'."""

    @property
    def counts(self) -> dict[str, int]:
        return {name: self[name] for name in self._names}

    def __getitem__(self, name: str) -> int:
        hub = self._hub
        total = 0
        required = hub.excluded_since.get(name, 0)
        for state in hub.workers.values():
            total += state.in_flight.get(name, 0)
            if state.snapshot_seq < required:
                # That worker may still place on the engine: it is not idle yet.
                total = max(total, 1)
        return total

    def total(self) -> int:
        return sum(state.requests_in_flight for state in self._hub.workers.values())


class WorkerHub:
    """Applies workers' messages to the control plane and publishes snapshots to them."""

    def __init__(self, control: ControlPlane, admission: _Gate, *, engines: Iterable[str],
                 clock: Callable[[], float], to_link_clock: Callable[[float], float] | None = None,
                 record_sample: Callable[..., None] | None = None, share_in_flight: bool = False,
                 engine_specs: Callable[[], list[EngineSpec]] | None = None,
                 running_config: Callable[[], Config] | None = None, poke: Poke | None = None,
                 index: SharedIndex | None = None,
                 admit_until: Callable[[], float | None] | None = None,
                 kv_sources: Callable[[], Mapping[str, FeedSource]] | None = None,
                 admit_until_reason: Callable[[], str] | None = None,
                 on_placed: Callable[[list[IndexRecord]], None] | None = None,
                 auth: Callable[[], AuthSettings | None] | None = None,
                 fleet_mutations: Callable[[], int] | None = None,
                 success_clears: Callable[[str, SuccessKind], bool] | None = None) -> None:
        """``index``: the controller's prefix index, relayed between the workers (``IndexRelay``);
        ``admit_until``: the lease-derived admission deadline on the control clock, read at each publish (with
        ``admit_until_reason()``, what workers say past it); ``on_placed``: told of the workers' placements;
        ``fleet_mutations``: the count of the fleet's changes (``Fleet.mutations``) when ``control``'s
        eligibility is the fleet's own, so ``refresh_if_fleet_changed`` can skip asking while it stands;
        ``success_clears``: ``Fleet.success_clears`` when ``control``'s evidence is the fleet's own, for the
        request path in this process to skip a success that clears nothing (``WorkerView``)."""
        self._control = control
        self.success_clears = success_clears
        self._admission = admission
        self._clock = clock
        self._fleet_mutations = fleet_mutations
        # What the last full check saw: the fleet's change count, and until when its version stands by itself.
        self._seen_mutations = -1
        self._fresh_until = -math.inf
        # The control clock read at its source when it is trio's (``trio.current_time`` is three calls deep).
        self._now: Callable[[], float] | None = None
        # Snapshot deadlines are in the link's clock: CLOCK_MONOTONIC between
        # processes, the control clock itself in memory.
        self._to_link_clock = to_link_clock or (lambda t: t)
        self._record_sample = record_sample
        # Worker processes balance on everyone's in-flight counts; one process has them all already.
        self._share_in_flight = share_in_flight
        self.workers: dict[int, _WorkerState] = {}
        self.metrics = MetricsSum()
        self._engines = list(engines)
        self.in_flight = AggregateInFlight(self, self._engines)
        self.seq = 0
        self.snapshot: Snapshot | None = None
        # The content last sent (seq and published_at aside), and the fleet version it was built from.
        self._published_content: Snapshot | None = None
        self._published_version: int | None = None
        self._poke = poke if poke is not None else Poke()
        # engine -> seq of the first snapshot that took it out of placement.
        self.excluded_since: dict[str, int] = {}
        self._admit_until: Callable[[], float | None] = admit_until if admit_until is not None else lambda: None
        # Told of the prompts each worker placed: the placements go on to the other workers.
        self.index_relay = IndexRelay(index, self.workers, on_applied=on_placed) if index is not None else None
        self._admit_until_reason = admit_until_reason
        # The client keys' settings workers apply (None: no client auth).
        self._auth = auth
        # The engine set workers place on (the supervisor's); None: as in the config they were given.
        self.engine_specs = engine_specs
        # The running config (reloads change it): workers take its placement and engine timeouts.
        self.running_config = running_config
        # Each prefill engine's KV event publisher, as the controller resolved it: every worker subscribes.
        self.kv_sources = kv_sources

    def set_engines(self, names: Iterable[str]) -> None:
        """The engine set changed (a config reload): in-flight sums and exclusions follow it."""
        self._engines[:] = list(names)
        self.in_flight.set_names(self._engines)
        for name in list(self.excluded_since):
            if name not in self._engines:
                del self.excluded_since[name]
        self.poke()

    def poke(self) -> None:
        """Something a snapshot is built from may have changed: the publisher looks (cheap, any thread of trio)."""
        self._poke()

    async def run_publisher(self) -> None:
        """Publish whenever poked and at the fleet's next deadline; sleep otherwise."""
        while True:
            # A poke during publish() sets the new event: it is not lost.
            self._poke.rearm()
            self.publish()
            valid_until = self._control.valid_until()
            deadline = math.inf if valid_until is None else valid_until
            with trio.move_on_at(deadline):
                await self._poke.wait()

    # -- workers ---------------------------------------------------------------------------

    def attach(self, worker: int, send: Callable[[Snapshot], None]) -> None:
        """A worker connected; ``publish(force_to=worker)`` gives it the current snapshot."""
        self.workers[worker] = _WorkerState(send)

    def detach(self, worker: int) -> None:
        """A worker is gone: its in-flight counts go, its metrics stay counted."""
        state = self.workers.pop(worker, None)
        if state is not None:
            self.metrics.retire(worker)

    def record_success(self, engine: str, kind: SuccessKind) -> None:
        """A success from this process's own request path: ``receive``'s evidence with no message built."""
        self._control.record_success(engine, kind)
        self.refresh_if_fleet_changed()

    def receive(self, worker: int, message: object) -> None:
        """Apply one message from ``worker`` (in arrival order)."""
        if isinstance(message, Evidence):
            if message.failure_class is not None:
                self._control.record_failure(message.engine, FailureClass(message.failure_class))
            elif message.success_kind is not None:
                self._control.record_success(message.engine, SuccessKind(message.success_kind))
            # Only eligibility can change here; admission, lease and deadlines are the publish tick's.
            self.refresh_if_fleet_changed()
        elif isinstance(message, Report):
            state = self.workers.get(worker)
            if state is None:
                return
            state.snapshot_seq = message.snapshot_seq
            state.in_flight = message.in_flight
            state.requests_in_flight = message.requests_in_flight
            state.data_in_use = message.data_in_use
            state.data_waiting = message.data_waiting
            self.metrics.update(worker, message.metrics)
            if self._share_in_flight:
                self.poke()  # the router-wide in-flight counts are part of the snapshot
            if self.index_relay is not None:
                self.index_relay.on_report(worker, message)
            if self._record_sample is not None:
                for sample in message.samples:
                    self._record_sample(prefill=sample.prefill, decode=sample.decode, ttft_s=sample.ttft_s,
                                        inter_token_s=sample.inter_token_s, error_engine=sample.error_engine,
                                        status=sample.status, error_class=sample.error_class,
                                        failed=sample.failed)

    # -- snapshots -------------------------------------------------------------------------

    def _content(self) -> tuple[int, Snapshot]:
        """The fleet version, and the snapshot workers need now: ``seq`` 0, deadlines on the control clock.

        Deadlines are compared on the control clock and converted only to be sent:
        a conversion read twice differs in its last bits, which is no change.
        """
        control = self._control
        version = control.state_version()
        valid_until = control.valid_until()
        config = None if self.running_config is None else self.running_config()
        return version, Snapshot(
            seq=0, eligible={role: control.eligible(role) for role in ROLES}, pools=control.eligible_pools(),
            capacity_problem=control.capacity_problem(), capacity_problems=control.capacity_problems(),
            admission_reason=self._admission.reason(),
            admit_until=self._admit_until(),
            admit_until_reason=FENCED_REASON if self._admit_until_reason is None else self._admit_until_reason(),
            valid_until=None if valid_until is None or math.isinf(valid_until) else valid_until,
            in_flight=self._in_flight_totals() if self._share_in_flight else {},
            engines=None if self.engine_specs is None else self.engine_specs(),
            placement=None if config is None else config.placement,
            fleet=None if config is None else config.fleet,
            engine_config=None if config is None else config.engine,
            tracing=None if config is None else config.tracing,
            kv_sources={} if self.kv_sources is None else dict(self.kv_sources()),
            auth=None if self._auth is None else self._auth())

    def _for_link(self, content: Snapshot) -> Snapshot:
        """``content`` numbered and with its deadlines on the link's clock, ready to send."""
        to_link = self._to_link_clock
        return msgspec.structs.replace(
            content, seq=self.seq, published_at=to_link(self._clock()),
            admit_until=None if content.admit_until is None else to_link(content.admit_until),
            valid_until=None if content.valid_until is None else to_link(content.valid_until))

    def publish(self, *, force_to: int | None = None) -> None:
        """Send a new snapshot to every worker if its content changed (to ``force_to`` anyway)."""
        version, content = self._content()
        if content != self._published_content or self.snapshot is None:
            self._published_content = content
            self._published_version = version
            self.seq += 1
            self.snapshot = self._for_link(content)
            placeable = {name for names in content.eligible.values() for name in names}
            for name in self._engines:
                if name in placeable:
                    self.excluded_since.pop(name, None)
                else:
                    self.excluded_since.setdefault(name, self.seq)
            targets = list(self.workers.items())
        elif force_to is not None and force_to in self.workers:
            targets = [(force_to, self.workers[force_to])]
            # A late joiner gets the current snapshot; its delivery delay counts from now.
            self.snapshot = msgspec.structs.replace(self.snapshot, published_at=self._to_link_clock(self._clock()))
        else:
            return
        snapshot = self.snapshot
        for worker, state in targets:
            try:
                state.send(snapshot)
            except Exception as exc:  # a dead link is noticed and handled by the process layer
                fields: dict[str, Any] = {"worker": worker, "class": type(exc).__name__, "message": str(exc)}
                log_event("worker_snapshot_failed", **fields)

    def _in_flight_totals(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for state in self.workers.values():
            for name, count in state.in_flight.items():
                if count:
                    totals[name] = totals.get(name, 0) + count
        return totals

    def refresh_if_fleet_changed(self) -> None:
        """Republish when the fleet's eligibility changed (the cheap check after evidence and before reads).

        The version moves only when the fleet changes or a hold deadline passes: while neither happened
        since the last full check, nothing is asked (two reads of a count and the clock).
        """
        mutations = self._fleet_mutations
        seen = -1
        if mutations is not None:
            now = self._now
            if now is None:
                now = self._now = (trio.lowlevel.current_clock().current_time if self._clock is trio.current_time
                                   else self._clock)
            seen = mutations()
            if seen == self._seen_mutations and now() < self._fresh_until:
                return
            # The deadline first: one that passes while the version is read makes the next check a full one.
            valid_until = self._control.valid_until()
            self._fresh_until = math.inf if valid_until is None else valid_until
        if self._published_version is None or self._control.state_version() != self._published_version:
            self.publish()
        self._seen_mutations = seen
