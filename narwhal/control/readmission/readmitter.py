"""Readmission: the checks an engine must pass to return to placement, when they run, and drains.

The chain, run in this order on the control pool and stopped at the first failure:

    check          passes when
    -------------  ---------------------------------------------------------------
    health         GET /health answers a success (2xx, classify.health_answer)
    attestation    GET /narwhal/identity names the engine; POST /narwhal/attest with a
                   fresh random nonce echoes that nonce, for the same engine_id, signed
                   hex HMAC-SHA256(fleet key, "engine_id|nonce|generation")
    newer_process  (maintenance only) identity process_started_at is later than the
                   maintenance start
    model          identity model and one of GET /v1/models's ids are the engine's model
                   ([[engines]] model, else fleet.model)
    generation     identity generation is the model's generation ([[fleet.models]]
                   generation, else fleet.generation)
    kv_role        identity kv_roles has "producer" (prefill) or "consumer" (decode)
    final_health   GET /health answers a success again
    inference      (only while a failure quarantine stands that a health 200 may not
                   clear) an inference probe through the engine succeeds

Why this order. Identity is read once, in the attestation step, because the
signature binds the engine_id it names; the signature covers the generation
the engine *claims*, so an engine of the wrong generation that holds the key
fails at ``generation`` with that reason, not as a bad signature. The
newer-process requirement comes first among the identity facts: an engine that
was never restarted answers every later question about its old process, and
"restart it" is what the operator needs to hear.

The inference step. A quarantine caused by stream, inference_status or
kv_handoff evidence ends only at its deadline or by a successful inference
check (``narwhal.fleet.tables.QUARANTINE_CLEARED_BY_HEALTH``): the identity
checks prove nothing about decodes that fail. So while such a quarantine
stands, the chain ends with an inference probe (``inference_check``, the
supervisor's), whose success clears the quarantine before the readmission.

Schedule (``schedule``). An ejected engine is
tried as soon as a health check sees it answer with a success: the monitor's
health sweep and the recheck (every ``recovery.recheck_interval_s``, of the
engines that are out only, ``recheck``) report each answer to
``health_observed``, which starts the chain at once, in the same pass. After a
refusal (or a readmission that did not last ``probe_interval_s``) the next
health-started attempt backs off: ``recheck_interval_s``, doubling, at most
``probe_interval_s``. Whatever health says, the engine is also tried
``probe_interval_s`` after its ejection and then every ``probe_interval_s``
after its previous attempt began, never giving up. Neither happens while its
failure quarantine is unexpired, unless that quarantine is one the inference
step may clear (a health success clears the others first). Engines under an
operator drain or maintenance are left to the operator's readmit. Attempts for
different engines run concurrently, in ``Readmitter.run``'s nursery; each
engine has at most one attempt at a time.

First read (``first_identity_read``). Engines configured at startup are
placeable at once; before the router serves, each one's model is read once,
concurrently, with the health timeout: ``GET /narwhal/identity`` (an engine
without the identity plugin answers 404 there, and ``GET /v1/models`` alone
decides) and ``GET /v1/models``. An engine whose answers name another model is
ejected (cause ``model``) and its result is a refusal at the ``model`` check,
naming both models; the chain then refuses it there until it serves its own.
One that does not answer is left to the health and liveness rules. This read
and every ``model`` check record the engine's ``max_model_len``.

A success calls ``Fleet.readmit`` (ending the ejection and clearing drains,
maintenance, quarantine and verification holds); a failure changes nothing in
the fleet. Either way one ``readmission`` log event names the engine, the check
that failed and why, and ``narwhal_readmission_attempts_total`` counts it. A
readmission also reports how long the engine waited since its health returned
(``health_to_eligible_s`` on ``readmission`` and ``engine_readmitted``; the
``narwhal_readmission_health_to_eligible_seconds`` histogram for automatic ones).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import trio

from narwhal.config import Config, EngineSpec, RunningConfig
from narwhal.control import contract
from narwhal.control.fleet_writer import FleetWriter
from narwhal.control.model_lengths import ModelLengths
from narwhal.control.readmission.model import CHAIN, Check, ReadmissionResult, ReadmissionState
from narwhal.control.readmission.recheck import Rechecker
from narwhal.control.readmission.schedule import EngineSchedule, ReadmissionSchedule
from narwhal.errors import EngineFailure, PoolSaturated, SuccessKind
from narwhal.fleet import DRAIN_HOLDS, EjectionCause, EngineView, FleetEvent, Hold, HoldKind
from narwhal.fleet.placement import InFlightCounts
from narwhal.fleet.tables import drained
from narwhal.kv_events.sources import KvPublishers
from narwhal.obs.logs import log_event
from narwhal.obs.router_metrics import RouterMetrics
from narwhal.pools.classify import health_answer
from narwhal.pools.control import ControlCalls
from narwhal.wire import AttestRequest, EngineIdentity

# A readmission reason (logged, kept, shown) is cut here, whatever the engine sent.
_MAX_REASON_CHARS = 1000

__all__ = ["Readmitter"]


# Ejections for failed inference: a health success says nothing about them, so on its own
# (without a failed or silent check before it: a restart) it does not start the chain.
_INFERENCE_EJECTIONS = frozenset({EjectionCause.STREAM, EjectionCause.INFERENCE_STATUS, EjectionCause.KV_HANDOFF,
                                  EjectionCause.PROBE})

# A check failed; ``reason`` is the operator-facing why (the contract's own verdicts raise it too).
_Refused = contract.ContractViolation


@dataclasses.dataclass
class _Attempt:
    """What one run of the chain has learnt so far."""

    spec: EngineSpec
    # Wall-clock start of the engine's maintenance, None when not under maintenance.
    maintenance_started_at: float | None
    # An inference-caused quarantine stands: the chain must end with an inference probe.
    needs_inference: bool = False
    # Wall-clock start of the oldest hold the engine is under (drain, maintenance, ...), None without one.
    held_since_wall: float | None = None
    identity: EngineIdentity | None = None
    current: Check = Check.HEALTH
    passed: list[str] = dataclasses.field(default_factory=list)


def _iso(wall: float) -> str:
    """Unix seconds as UTC ISO-8601, for reasons an operator reads."""
    if not math.isfinite(wall):
        return repr(wall)
    return datetime.datetime.fromtimestamp(wall, datetime.UTC).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


def _began_wall(hold: Hold, now: float, wall_now: float) -> float:
    """When ``hold`` began, in unix seconds: as read then, else converted from its monotonic ``since``."""
    return hold.since_wall if hold.since_wall is not None else wall_now - (now - hold.since)


class Readmitter:
    """Runs the readmission chain for the operator and on schedule, and applies operator drains."""

    def __init__(self, *, config: Config, fleet: FleetWriter, control_pool: ControlCalls, in_flight: InFlightCounts,
                 metrics: RouterMetrics, clock: Callable[[], float] = trio.current_time,
                 wall_clock: Callable[[], float] = time.time, attestation_key: bytes | None,
                 inference_check: Callable[[str], Awaitable[str]] | None = None,
                 on_newer_process: Callable[[str], None] | None = None,
                 model_lengths: ModelLengths | None = None,
                 kv_publishers: KvPublishers | None = None, acting: Callable[[], bool] | None = None) -> None:
        """``acting()`` False (a replica, whose fleet is the controller's): no attempt starts.

        ``clock`` is trio's (monotonic, the fleet's time base); ``wall_clock`` unix seconds.

        ``inference_check(name)`` runs an inference probe and returns its outcome
        ("success", "failed", "inconclusive"); without it, an inference-caused
        quarantine waits for its deadline.
        """
        self.config = config
        self._acting = acting
        self.fleet = fleet
        self.control_pool = control_pool
        self.in_flight = in_flight
        self.metrics = metrics
        self.clock = clock
        self.wall_clock = wall_clock
        self._key = attestation_key
        self._inference_check = inference_check
        recovery = config.recovery
        self._specs: dict[str, EngineSpec] = {spec.name: spec for spec in config.engines}
        self._locks: dict[str, trio.Lock] = {name: trio.Lock() for name in self._specs}
        self._last: dict[str, ReadmissionResult] = {}
        self.schedule = ReadmissionSchedule(self._specs, probe_interval_s=recovery.probe_interval_s,
                                            backoff_base_s=recovery.recheck_period_s)
        self.rechecker = Rechecker(engines=self._specs, control_pool=control_pool, targets=self.recheck_targets,
                                   on_health=self._rechecked, interval_s=recovery.recheck_period_s,
                                   timeout_s=config.engine.health_timeout_s, clock=clock)
        # Every way an engine goes out (ejection, quarantine, a drain lifted, a hold applied) is a
        # fleet event: it wakes the recheck, which sleeps while nothing is out. A bare Fleet (no
        # writer to tell us of its events) keeps the recheck ticking.
        listeners: list[Callable[[FleetEvent], None]] | None = getattr(fleet, "listeners", None)
        if listeners is None:
            self.rechecker.sleeps_when_idle = False
        else:
            listeners.append(lambda _event: self.rechecker.wake())
        self._scheduled: set[str] = set()
        self._nursery: trio.Nursery | None = None
        # The process_started_at each engine's attested identity last reported.
        self._process_started: dict[str, float] = {}
        # Told when an engine proves to be a newer process than the one placement knew: its caches are
        # empty (the router drops its prefix-index entries). Called with the engine's name.
        self.on_newer_process = on_newer_process
        # Each engine's max_model_len from its /v1/models (the first read and every model check).
        self.model_lengths = model_lengths if model_lengths is not None else ModelLengths()
        # Each engine's KV event publisher as its identity reports it (the first read and every attestation).
        self.kv_publishers = kv_publishers if kv_publishers is not None else KvPublishers()

    def __repr__(self) -> str:
        last = ", ".join(f"{name} {result.outcome}" + (f" {result.check}" if result.check else "")
                         for name, result in self._last.items())
        running = ", ".join(sorted(name for name, lock in self._locks.items() if lock.locked()))
        return f"<Readmitter [running: {running or '-'} | last: {last or '-'}]>"

    def configure(self, running: RunningConfig) -> None:
        """A reload (``apply_config``)."""
        self.apply_config(running.config, running.attestation_key)

    def apply_config(self, config: Config, attestation_key: bytes | None) -> None:
        """A reload: later checks use its generation, attestation key and health timeout; the schedule its periods."""
        self.config = config
        self._key = attestation_key
        recovery = config.recovery
        self.schedule.probe_interval_s = recovery.probe_interval_s
        self.schedule.backoff_base_s = min(recovery.recheck_period_s, recovery.probe_interval_s)
        self.rechecker.interval_s = recovery.recheck_period_s
        self.rechecker.timeout_s = config.engine.health_timeout_s

    def add_engine(self, spec: EngineSpec) -> None:
        """An engine a config reload added (the fleet holds it ejected): try it at once, then on schedule."""
        self._specs[spec.name] = spec
        self._locks[spec.name] = trio.Lock()
        self._last.pop(spec.name, None)
        now = self.clock()
        self.schedule.add(spec.name, now)
        self.rechecker.engines[spec.name] = spec
        if spec.name in self.fleet and self._synced(self.fleet.view(spec.name, now)).not_before > now:
            return  # back soon after it left, in backoff: a health answer after it (or the tick) starts the chain
        if self._nursery is not None and spec.name not in self._scheduled:
            self._start(spec.name, now, on_health=False)

    def remove_engine(self, name: str) -> None:
        """Forget ``name`` (it left the fleet); an attempt still running ends without effect."""
        self._specs.pop(name, None)
        self._locks.pop(name, None)
        self._last.pop(name, None)
        self._process_started.pop(name, None)
        self.model_lengths.forget(name)
        self.kv_publishers.forget(name)
        self.schedule.remove(name, self.clock())
        self.rechecker.engines.pop(name, None)

    def knows(self, name: str) -> bool:
        """Whether ``name`` is a configured engine."""
        return name in self._specs

    # ----- drains ----------------------------------------------------------------------

    def drain(self, name: str, now: float) -> None:
        """Stop new placements on ``name`` (an operator_drain hold); in-flight requests finish."""
        self._spec(name)
        self.fleet.add_hold(name, HoldKind.OPERATOR_DRAIN, "operator drain", now, wall=self.wall_clock())
        log_event("engine_drain_requested", engine=name, in_flight=self.in_flight[name],
                  model=self.config.model_of(self._spec(name)))

    def maintenance(self, name: str, now: float) -> float:
        """Drain ``name`` for planned maintenance; returns the maintenance start (unix seconds).

        The start is the wall clock read as the hold is added, kept by the hold itself (and by
        the handoff, so a resume or takeover keeps it too). Asking again keeps the first start.
        """
        self._spec(name)
        self.fleet.add_hold(name, HoldKind.MAINTENANCE, "planned maintenance", now, wall=self.wall_clock())
        started_at = self.maintenance_started_at(name)
        assert started_at is not None  # the hold was just added
        log_event("engine_maintenance_started", engine=name, started_at=started_at,
                  in_flight=self.in_flight[name], model=self.config.model_of(self._spec(name)))
        return started_at

    def maintenance_started_at(self, name: str) -> float | None:
        """When ``name``'s maintenance began (unix seconds), or None when it is not under maintenance."""
        now = self.clock()
        return self._maintenance_started_at(self.fleet.view(name, now), now)

    def _maintenance_started_at(self, view: EngineView, now: float) -> float | None:
        hold = next((h for h in view.holds if h.kind is HoldKind.MAINTENANCE), None)
        if hold is None:
            return None
        return _began_wall(hold, now, self.wall_clock())

    def drained(self, name: str) -> bool:
        """True when ``name`` is under a drain or maintenance hold and has nothing in flight."""
        return self._drained(self.fleet.view(name, self.clock()))

    def _drained(self, view: EngineView) -> bool:
        return drained((hold.kind for hold in view.holds), self.in_flight[view.name])

    # ----- the admin view ---------------------------------------------------------------

    def last_result(self, name: str) -> ReadmissionResult | None:
        """The latest readmission attempt for ``name``, or None."""
        return self._last.get(name)

    def admin_state(self, name: str, view: EngineView | None = None) -> ReadmissionState:
        """What ``/admin/engines`` shows of ``name`` from here: drained, maintenance start, last attempt.

        ``view``: the engine's view the caller already has (``/admin/engines`` lists hundreds: one view each)."""
        now = self.clock()
        if view is None:
            view = self.fleet.view(name, now)
        schedule = self._synced(view)
        next_at = self.next_attempt_at(view)
        if next_at is not None and schedule.health_since is not None:
            next_at = min(next_at, max(schedule.not_before, now))
        return ReadmissionState(drained=self._drained(view),
                                maintenance_started_at=self._maintenance_started_at(view, now),
                                readmission_running=self._locks[name].locked(), last_readmission=self._last.get(name),
                                health_answered_at=schedule.health_since if view.ejected else None,
                                readmission_backoff_s=self.schedule.backoff_s(schedule.level) if view.ejected else 0.0,
                                next_readmission_at=next_at)

    # ----- the chain -----------------------------------------------------------------------

    async def readmit(self, name: str, *, operator: bool) -> ReadmissionResult:
        """Run the chain for ``name`` (waiting for any attempt already running); KeyError if unknown.

        On success the engine returns to placement, its drains and holds cleared;
        on failure nothing changes and the result names the check and why.
        """
        spec = self._spec(name)
        try:
            async with self._locks[name]:
                return await self._attempt(spec, operator=operator)
        finally:
            self.rechecker.wake()  # an engine still out after its attempt is the recheck's again

    async def _attempt(self, spec: EngineSpec, *, operator: bool, on_health: bool = False) -> ReadmissionResult:
        started = self.clock()
        started_wall = self.wall_clock()
        self._synced(self.fleet.view(spec.name, started))
        self.schedule.started(spec.name, started)
        held_before = self._drain_kinds(spec.name, started)
        holds = self.fleet.view(spec.name, started).holds
        attempt = _Attempt(spec, self.maintenance_started_at(spec.name),
                           needs_inference=self.fleet.quarantine_needs_inference_check(spec.name, started),
                           held_since_wall=min(_began_wall(h, started, started_wall) for h in holds) if holds else None)
        check: str | None = None
        health_to_eligible_s: float | None = None
        try:
            await self._run_chain(attempt)
        except _Refused as refused:
            check, reason = str(attempt.current), refused.reason
        except Exception as exc:  # noqa: BLE001 - a broken check is a refusal, never a readmission
            message = contract.bounded(str(exc), _MAX_REASON_CHARS)
            check, reason = str(attempt.current), f"internal error: {type(exc).__name__}: {message}"
            log_event("readmission_error", level=logging.ERROR, engine=spec.name, check=check,
                      **{"class": type(exc).__name__}, message=message)
        else:
            now = self.clock()
            if self._specs.get(spec.name) is not spec:
                return self._dropped(attempt, operator, started, started_wall)
            late = self._drain_kinds(spec.name, now) - held_before
            if late:
                check = str(Check.OPERATOR_HOLD)
                reason = (f"{' and '.join(sorted(late))} began while this readmission ran; "
                          f"ask for readmission again to clear it")
            else:
                health_to_eligible_s = self.schedule.readmitted(spec.name, now)
                self.fleet.readmit(spec.name, now, health_to_eligible_s=health_to_eligible_s)
                reason = "every check passed"
        if self._specs.get(spec.name) is not spec:
            return self._dropped(attempt, operator, started, started_wall)
        if check is not None and not operator:
            self.schedule.refused(spec.name, self.clock(), check=check, on_health=on_health)
        # The reason quotes the engine; it is logged, kept for /admin/engines and counted: bounded once more here.
        result = ReadmissionResult(
            engine=spec.name, outcome="refused" if check else "readmitted", check=check,
            reason=contract.bounded(reason, _MAX_REASON_CHARS),
            operator=operator, passed=attempt.passed, at=started_wall, duration_s=self.clock() - started,
            health_to_eligible_s=health_to_eligible_s)
        self._record(result, self.config.model_of(spec))
        return result

    def _dropped(self, attempt: _Attempt, operator: bool, started: float, started_wall: float) -> ReadmissionResult:
        """A reload removed the engine (or replaced it under the same name) while the chain ran: nothing applies."""
        name = attempt.spec.name
        log_event("readmission_dropped", engine=name, reason="engine removed by a config reload",
                  model=self.config.model_of(attempt.spec))
        return ReadmissionResult(engine=name, outcome="refused", check=str(attempt.current),
                                 reason="engine removed by a config reload while the checks ran", operator=operator,
                                 passed=attempt.passed, at=started_wall, duration_s=self.clock() - started)

    async def _run_chain(self, attempt: _Attempt) -> None:
        steps: dict[Check, Callable[[_Attempt], Awaitable[None]]] = {
            Check.HEALTH: self._check_health,
            Check.ATTESTATION: self._check_attestation,
            Check.NEWER_PROCESS: self._check_newer_process,
            Check.MODEL: self._check_model,
            Check.GENERATION: self._check_generation,
            Check.KV_ROLE: self._check_kv_role,
            Check.FINAL_HEALTH: self._check_health,
            Check.INFERENCE: self._check_inference,
        }
        for check in CHAIN:
            if check is Check.NEWER_PROCESS and attempt.maintenance_started_at is None:
                continue
            if check is Check.INFERENCE and not attempt.needs_inference:
                continue
            attempt.current = check
            try:
                await steps[check](attempt)
            except EngineFailure as exc:
                raise _Refused(f"{exc.failure_class}: {exc.message}") from exc
            except PoolSaturated as exc:
                raise _Refused(f"control pool saturated: {exc}") from exc
            attempt.passed.append(str(check))

    async def _get_ok(self, spec: EngineSpec, path: str) -> bytes:
        response = await self.control_pool.get(spec, path)
        if response.status != 200:
            raise _Refused(contract.status_reason("GET", path, response.status, response.body))
        return response.body

    async def _check_health(self, attempt: _Attempt) -> None:
        response = await self.control_pool.get(attempt.spec, "/health")
        # The one status table decides what a successful health response is, as for the health stage.
        if health_answer(attempt.spec.name, response.status) is not SuccessKind.HEALTH_200:
            raise _Refused(contract.status_reason("GET", "/health", response.status, response.body))
        # "Any successful health response" counts: it clears its row (liveness included).
        self.fleet.record_success(attempt.spec.name, SuccessKind.HEALTH_200, self.clock())

    async def _check_inference(self, attempt: _Attempt) -> None:
        if self._inference_check is None:
            raise _Refused("a quarantine caused by failed inference stands, and no inference probe "
                           "is available to clear it: wait for its deadline")
        outcome = await self._inference_check(attempt.spec.name)
        if outcome != "success":
            raise _Refused(f"inference probe {outcome} (see its probe_result event)")

    async def _check_attestation(self, attempt: _Attempt) -> None:
        if self._key is None:
            raise _Refused("no fleet attestation key configured: set [fleet] attestation_key "
                           "or attestation_key_file")
        identity = contract.read_identity(await self._get_ok(attempt.spec, "/narwhal/identity"))
        attempt.identity = identity
        self.kv_publishers.record(attempt.spec.name, identity.kv_events)
        nonce = secrets.token_hex(16)
        response = await self.control_pool.post_json(attempt.spec, "/narwhal/attest",
                                                     msgspec.json.encode(AttestRequest(nonce)))
        if response.status != 200:
            raise _Refused(contract.status_reason("POST", "/narwhal/attest", response.status, response.body))
        contract.verify_attestation(self._key, identity, nonce, response.body)
        self._note_process(attempt.spec.name, identity.process_started_at, attempt.held_since_wall)

    def process_started(self, name: str) -> float | None:
        """The process start ``name``'s attested identity last reported (None: none attested)."""
        return self._process_started.get(name)

    def _note_process(self, name: str, started: float, held_since_wall: float | None) -> None:
        """Tell ``on_newer_process`` when the attested process is not the one placement knew.

        Newer: another start than the identity this router last attested for the engine;
        or, with none attested yet (a fresh router), a start after the engine's oldest hold
        began (an engine restarted while drained). Either way its KV cache is empty. Like
        ``newer_process``, the second comparison trusts the engine's clock to be the router's.
        """
        if not math.isfinite(started):
            return
        seen = self._process_started.get(name)
        self._process_started[name] = started
        newer = started != seen if seen is not None else held_since_wall is not None and started > held_since_wall
        if newer and self.on_newer_process is not None:
            self.on_newer_process(name)

    async def _check_newer_process(self, attempt: _Attempt) -> None:
        assert attempt.identity is not None and attempt.maintenance_started_at is not None
        started = attempt.identity.process_started_at
        # Written so that a NaN start is refused too.
        if not started > attempt.maintenance_started_at:
            raise _Refused(f"engine process started at {_iso(started)}, "
                           f"not after maintenance began at {_iso(attempt.maintenance_started_at)}: "
                           f"restart the engine, then readmit it")

    async def _check_model(self, attempt: _Attempt) -> None:
        assert attempt.identity is not None
        model = self.config.model_of(attempt.spec)
        contract.check_identity_model(attempt.identity, model)
        # vLLM's own answer too: a plugin claiming the fleet's model cannot pass for an engine serving another.
        listed = await self._get_ok(attempt.spec, "/v1/models")
        contract.check_listed_model(contract.listed_models(listed), model)
        self.model_lengths.record(attempt.spec.name, contract.listed_max_model_len(listed, model))

    # ----- the first read after startup ----------------------------------------------------

    async def first_identity_read(self) -> None:
        """Read every engine's model once (concurrently, within the health timeout); eject those naming another."""
        timeout_s = self.config.engine.health_timeout_s
        async with trio.open_nursery() as nursery:
            for spec in list(self._specs.values()):
                nursery.start_soon(self._first_read, spec, timeout_s, name=f"first identity read {spec.name}")

    async def _first_read(self, spec: EngineSpec, timeout_s: float) -> None:
        lock = self._locks.get(spec.name)
        if lock is None:
            return
        started, started_wall = self.clock(), self.wall_clock()
        model = self.config.model_of(spec)
        async with lock:
            try:
                with trio.fail_after(timeout_s):
                    await self._read_model(spec, model)
            except _Refused as refused:
                reason = refused.reason
            except (EngineFailure, PoolSaturated, trio.TooSlowError):
                return  # no answer: the health and liveness rules decide
            except Exception as exc:  # noqa: BLE001 - a broken read must not stop the router starting
                log_event("readmission_error", level=logging.ERROR, engine=spec.name, check=str(Check.MODEL),
                          **{"class": type(exc).__name__}, message=contract.bounded(str(exc), _MAX_REASON_CHARS))
                return
            else:
                return
            if self._specs.get(spec.name) is not spec:
                return  # a reload removed or replaced it meanwhile
            reason = contract.bounded(reason, _MAX_REASON_CHARS)
            self.fleet.eject(spec.name, f"model check: {reason}", self.clock(), label=EjectionCause.MODEL)
            self._record(ReadmissionResult(engine=spec.name, outcome="refused", check=str(Check.MODEL), reason=reason,
                                           operator=False, passed=[], at=started_wall,
                                           duration_s=self.clock() - started), self.config.model_of(spec))

    async def _read_model(self, spec: EngineSpec, model: str) -> None:
        """The engine's identity (when it has the plugin) and its /v1/models name ``model``; else ``_Refused``.

        An answer that says nothing (another status, an unreadable document) is no verdict: it returns.
        """
        identity = await self.control_pool.get(spec, "/narwhal/identity")
        if identity.status == 200:
            try:
                claimed = contract.read_identity(identity.body)
            except _Refused:
                claimed = None  # an unreadable identity is no verdict: /v1/models decides below
            if claimed is not None:
                self.kv_publishers.record(spec.name, claimed.kv_events)
                contract.check_identity_model(claimed, model)
        listed = await self.control_pool.get(spec, "/v1/models")
        if listed.status != 200:
            return
        try:
            names = contract.listed_models(listed.body)
        except _Refused:
            return
        contract.check_listed_model(names, model)
        self.model_lengths.record(spec.name, contract.listed_max_model_len(listed.body, model))

    async def _check_generation(self, attempt: _Attempt) -> None:
        assert attempt.identity is not None
        contract.check_generation(attempt.identity, self.config.fleet.generation_of(self.config.model_of(attempt.spec)))

    async def _check_kv_role(self, attempt: _Attempt) -> None:
        assert attempt.identity is not None
        contract.check_kv_role(attempt.spec.role, attempt.identity)

    def _record(self, result: ReadmissionResult, model: str) -> None:
        self._last[result.engine] = result
        self.metrics.readmissions.inc(result.engine, result.outcome, result.check or "none", model)
        if result.health_to_eligible_s is not None and not result.operator:
            self.metrics.health_to_eligible.observe(result.health_to_eligible_s, result.engine, model)
        level = logging.INFO if result.readmitted else logging.WARNING
        extra = ({} if result.health_to_eligible_s is None
                 else {"health_to_eligible_s": round(result.health_to_eligible_s, 6)})
        log_event("readmission", level=level, engine=result.engine, outcome=result.outcome,
                  check=result.check, reason=result.reason, operator=result.operator,
                  passed=result.passed, duration_s=round(result.duration_s, 6), model=model, **extra)

    # ----- the schedule --------------------------------------------------------------------

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Own the nursery that attempts and the recheck run in, until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                await nursery.start(self.rechecker.run)
                task_status.started()
                await trio.sleep_forever()
            finally:
                self._nursery = None

    async def readmit_due(self) -> None:
        """Start an attempt for every ejected engine whose retry is due; returns at once.

        Called on every monitor pass; the attempts run in ``run``'s nursery, so a
        slow engine never holds up the monitor's readmission stage.
        """
        if self._nursery is None:
            raise RuntimeError("readmitter is not running: start Readmitter.run first")
        now = self.clock()
        # Only an ejected engine can be due (both checks below ask): the unsettled ones hold them all.
        for view in self.fleet.views_of_unsettled(now):
            on_health = self._due_on_health(view, now)
            if on_health or self._due_on_tick(view, now):
                self._start(view.name, now, on_health=on_health)

    def health_observed(self, name: str, ok: bool) -> None:
        """A health check of ``name`` answered (``ok``: a success); an ejected engine that is due starts now.

        The health stage calls this for every answer of its sweep, after the
        fleet recorded it (so a quarantine the success cleared is gone), and so
        does the recheck: the chain starts in the same pass that saw the engine back.
        """
        if name not in self._specs or name not in self.fleet:
            return  # a config reload removed it while its check ran
        now = self.clock()
        if self.fleet.is_eligible(name, now):
            # Not ejected (most answers): no view to build (a sweep of 256 engines built 256 a pass).
            return
        view = self.fleet.view(name, now)
        if not view.ejected or view.removing:
            return
        self._synced(view)
        self.schedule.health(name, ok, now)
        if ok and self._nursery is not None and self._due_on_health(view, now):
            self._start(name, now, on_health=True)

    def recheck_targets(self, now: float) -> list[str]:
        """The engines the recheck watches: ejected and not drained, or held by a failure quarantine.

        A health success is what may bring either back (it starts the chain, or
        clears a quarantine whose cause is on the health row); an engine whose
        chain is running is left to it.
        """
        targets = []
        for view in self.fleet.views(now):
            lock = self._locks.get(view.name)
            if (lock is None or lock.locked() or view.removing
                    or any(hold.kind in DRAIN_HOLDS for hold in view.holds)):
                continue
            quarantined = any(hold.kind is HoldKind.FAILURE_QUARANTINE and not hold.deferred for hold in view.holds)
            if view.ejected or quarantined:
                targets.append(view.name)
        return targets

    def next_attempt_at(self, view: EngineView) -> float | None:
        """When ``view``'s engine is next due on the ``probe_interval_s`` tick (monotonic), or None."""
        if not view.ejected or view.removing or any(hold.kind in DRAIN_HOLDS for hold in view.holds):
            return None
        return self.schedule.tick_at(view.name, view.ejected_at)

    def _rechecked(self, name: str, ok: bool) -> None:
        if ok:
            # "Any successful health response" counts, as the sweep's does (clears its evidence row).
            self.fleet.record_success(name, SuccessKind.HEALTH_200, self.clock())
        self.health_observed(name, ok)

    def _synced(self, view: EngineView) -> EngineSchedule:
        """The engine's schedule, told of the ejection ``view`` shows (a new one resets its health run)."""
        if view.ejected:
            self.schedule.ejected(view.name, view.ejected_at if view.ejected_at is not None else -math.inf,
                                  health_decides=view.ejected_cause not in _INFERENCE_EJECTIONS)
        return self.schedule.state(view.name)

    def _may_start(self, view: EngineView, now: float) -> bool:
        allowed = view.readmission_allowed or (
            self._inference_check is not None and self.fleet.quarantine_needs_inference_check(view.name, now))
        lock = self._locks.get(view.name)
        return (view.ejected and not view.removing and allowed and lock is not None
                and not any(hold.kind in DRAIN_HOLDS for hold in view.holds)
                and view.name not in self._scheduled and not lock.locked())

    def _due_on_health(self, view: EngineView, now: float) -> bool:
        if not view.ejected:
            return False
        self._synced(view)
        return self.schedule.due_on_health(view.name, now) and self._may_start(view, now)

    def _due_on_tick(self, view: EngineView, now: float) -> bool:
        due_at = self.next_attempt_at(view)
        return due_at is not None and due_at <= now and self._may_start(view, now)

    def _start(self, name: str, now: float, *, on_health: bool) -> None:
        assert self._nursery is not None
        if self._acting is not None and not self._acting():
            return
        # Anchor the tick now, so the next pass does not start it again.
        self.schedule.started(name, now)
        self._scheduled.add(name)
        self._nursery.start_soon(functools.partial(self._scheduled_attempt, name, on_health=on_health),
                                 name=f"readmission {name}")

    async def _scheduled_attempt(self, name: str, *, on_health: bool = False) -> None:
        lock = self._locks.get(name)
        try:
            if lock is None:
                return  # removed by a reload before it started
            async with lock:
                # The operator may have readmitted or drained it while this waited for the lock;
                # a reload may have removed it.
                spec = self._specs.get(name)
                if spec is None or name not in self.fleet:
                    return
                view = self.fleet.view(name, self.clock())
                if not view.ejected or view.removing or any(hold.kind in DRAIN_HOLDS for hold in view.holds):
                    return
                await self._attempt(spec, operator=False, on_health=on_health)
        finally:
            self._scheduled.discard(name)
            self.rechecker.wake()  # an engine still out after its attempt is the recheck's again

    def _spec(self, name: str) -> EngineSpec:
        return self._specs[name]  # KeyError for an unknown engine: the API's 404

    def _drain_kinds(self, name: str, now: float) -> set[HoldKind]:
        return {hold.kind for hold in self.fleet.view(name, now).holds if hold.kind in DRAIN_HOLDS}
