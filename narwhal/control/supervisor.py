"""The shell around the pure ``Fleet``: evidence in, probes out.

The request path and the monitor report outcomes here; the supervisor passes
them to the fleet's one writer (``narwhal.control.fleet_writer``), which logs
the events and hands every returned action back to ``run_action``; the
supervisor carries them out at once (not at the next monitor pass) in its own
nursery, on the control pool. It owns no policy of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any, NoReturn

import msgspec
import trio

from narwhal.config import Config, EngineSpec, RunningConfig
from narwhal.control import contract
from narwhal.control.fleet_writer import FleetWriter
from narwhal.errors import EngineFailure, FailureClass, NarwhalError, PoolSaturated, SuccessKind, UpstreamClientError
from narwhal.fleet import Action, ActionKind
from narwhal.fleet.tables import PROBE_LEG_INCONCLUSIVE
from narwhal.obs.logs import log_event
from narwhal.obs.router_metrics import RouterMetrics
from narwhal.pools import classify
from narwhal.pools.control import ControlCalls
from narwhal.wire import extract_handoff

__all__ = ["Supervisor"]



class _LegInconclusive(NarwhalError):
    """A probe leg could not decide about the suspect (peer failed, no peer)."""


class Supervisor:
    """Feeds the fleet (through its one writer) and carries out the actions it returns."""

    def __init__(self, *, config: Config, fleet: FleetWriter, control_pool: ControlCalls, metrics: RouterMetrics,
                 clock: Callable[[], float] = trio.current_time) -> None:
        self.config = config
        self.fleet = fleet
        self.control_pool = control_pool
        self.metrics = metrics
        self.clock = clock
        self.engines: dict[str, EngineSpec] = {spec.name: spec for spec in config.engines}
        self._nursery: trio.Nursery | None = None
        # (engine, probe kind) pairs with a probe in flight: never two at once.
        self._running: set[tuple[str, str]] = set()
        # Asked for again while running: started once more when the running one ends.
        self._again: set[tuple[str, str]] = set()

    def configure(self, running: RunningConfig) -> None:
        """A reload: probes read the new engine timeouts."""
        self.config = running.config

    @property
    def _probe_timeout_s(self) -> float:
        # Read per probe: a reload may change the engine timeouts.
        engine = self.config.engine
        return max(engine.health_timeout_s, engine.first_token_deadline_s)

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Own the nursery that probes run in, until cancelled; the fleet's actions come here meanwhile."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                self.fleet.attach(self)
                task_status.started()
                await trio.sleep_forever()
            finally:
                self.fleet.attach(None)
                self._nursery = None

    # -- the request path's view ------------------------------------------------

    def eligible(self, role: str, model: str | None = None) -> list[str]:
        return self.fleet.eligible(role, self.clock(), model)

    def capacity_problem(self, model: str | None = None) -> str | None:
        return self.fleet.capacity_problem(self.clock(), model)

    def capacity_problems(self) -> dict[str, str]:
        """Each model that cannot serve now, with the reason."""
        return self.fleet.capacity_problems(self.clock())

    def eligible_pools(self) -> dict[str, dict[str, list[str]]]:
        """Eligible engines by model, then role."""
        return self.fleet.eligible_pools(self.clock())

    def state_version(self) -> int:
        """Changes whenever the eligible engines change: workers' snapshots are republished on it."""
        return self.fleet.eligibility_version(self.clock())

    def valid_until(self) -> float | None:
        """The next hold deadline, when eligibility may change by itself."""
        return self.fleet.next_deadline(self.clock())

    def record_failure(self, engine: str, failure_class: FailureClass) -> None:
        self.metrics.engine_failures.inc(engine, failure_class.value, self._model_of(engine))
        self.fleet.record_failure(engine, failure_class, self.clock())

    def _model_of(self, engine: str) -> str:
        # An engine a reload removed meanwhile (a request that outlived it) has left the fleet: its spec says.
        if engine in self.fleet:
            return self.fleet.model_of(engine)
        spec = self.engines.get(engine)
        return (spec.model or "") if spec is not None else ""

    def record_success(self, engine: str, kind: SuccessKind) -> None:
        self.fleet.record_success(engine, kind, self.clock())

    def record_health_sweep(self, results: Mapping[str, bool], *, unchecked: Collection[str] = (),
                            answered: Collection[str] = ()) -> None:
        self.fleet.record_health_sweep(results, self.clock(), unchecked=unchecked, answered=answered)

    # -- actions -------------------------------------------------------------------

    def run_action(self, action: Action) -> None:
        """Start the probe an action asks for (the fleet writer calls this for every action)."""
        if action.kind is ActionKind.HEALTH_PROBE:
            self._start_probe(action.engine, "health")
        elif action.kind is ActionKind.INFERENCE_PROBE:
            self._start_probe(action.engine, "inference")

    def start_due_probes(self) -> None:
        """Start the inference probes the fleet has scheduled for now or earlier."""
        self.fleet.start_due_probes(self.clock())

    def _start_probe(self, engine: str, kind: str) -> None:
        key = (engine, kind)
        if key in self._running:
            # Never dropped: the running probe answers an older question, so ask again after it.
            self._again.add(key)
            return
        if self._nursery is None:
            raise RuntimeError("supervisor is not running: start Supervisor.run first")
        self._running.add(key)
        probe = self.health_probe if kind == "health" else self.inference_probe
        self._nursery.start_soon(self._run_probe, key, probe)

    async def _run_probe(self, key: tuple[str, str], probe: Callable[[str], Awaitable[object]]) -> None:
        try:
            await probe(key[0])
        except Exception as exc:
            # A probe that breaks must still end in a verdict, or its hold would never be revisited.
            log_event("probe_error", level=logging.ERROR, engine=key[0], probe=key[1],
                      **{"class": type(exc).__name__}, message=str(exc), model=self._model_of(key[0]))
            if key[1] == "inference":
                self.fleet.record_probe(key[0], "inconclusive", self.clock(),
                                        reason=f"probe error: {type(exc).__name__}")
        finally:
            self._running.discard(key)
            if key in self._again and self._nursery is not None:
                self._again.discard(key)
                self._start_probe(*key)

    # -- probes ----------------------------------------------------------------------

    async def health_probe(self, name: str) -> bool:
        """GET /health on the control pool; the answer is classified by ``classify``'s table."""
        engine = self.engines[name]
        try:
            response = await self.control_pool.get(engine, "/health")
        except EngineFailure as exc:
            self._probe_result(name, "health", "failed", str(exc))
            self.record_failure(name, exc.failure_class)
            return False
        answer = classify.health_answer(name, response.status)
        if answer is SuccessKind.HEALTH_200:
            self._probe_result(name, "health", "success", "")
            self.record_success(name, SuccessKind.HEALTH_200)
            return True
        self._probe_result(name, "health", "failed", f"HTTP {response.status}")
        if isinstance(answer, EngineFailure):
            self.record_failure(name, answer.failure_class)
        else:
            self.record_success(name, answer)
        return False

    def _probe_result(self, name: str, kind: str, outcome: str, reason: str) -> None:
        self.metrics.probes.inc(name, kind, outcome, self._model_of(name))
        level = logging.INFO if outcome == "success" else logging.WARNING
        log_event("probe_result", level=level, engine=name, probe=kind, outcome=outcome, reason=reason,
                  model=self._model_of(name))

    async def inference_probe(self, name: str) -> str:
        """A tiny prefill and decode through the suspect and a partner of the other role.

        A failed leg on the suspect ejects it; a leg that cannot decide (the
        partner failed, no partner, overload or a timeout on the suspect's own
        leg) leaves the inference-verification hold and the fleet schedules
        another probe. Returns the outcome.
        """
        suspect = self.engines[name]
        now = self.clock
        try:
            with trio.fail_after(self._probe_timeout_s * 2):
                if suspect.role == "prefill":
                    peer = self._probe_peer("decode", name)
                    kv = await self._probe_prefill(suspect, suspect_leg=True)
                    await self._probe_decode(peer, kv, suspect_leg=False)
                else:
                    peer = self._probe_peer("prefill", name)
                    kv = await self._probe_prefill(peer, suspect_leg=False)
                    await self._probe_decode(suspect, kv, suspect_leg=True)
        except _SuspectLegFailed as failed:
            self._probe_result(name, "inference", "failed", failed.reason)
            self.fleet.record_probe(name, "failed", now(), leg=failed.leg, reason=failed.reason,
                                    failure_class=failed.failure_class)
            return "failed"
        except (_LegInconclusive, trio.TooSlowError) as exc:
            reason = str(exc) or "probe cut short"
            self._probe_result(name, "inference", "inconclusive", reason)
            self.fleet.record_probe(name, "inconclusive", now(), reason=reason)
            return "inconclusive"
        self._probe_result(name, "inference", "success", "")
        self.fleet.record_probe(name, "success", now())
        return "success"

    def _probe_peer(self, role: str, suspect: str) -> EngineSpec:
        # Held peers too, when none is eligible: a role held all at once must not deadlock.
        partners = self.fleet.probe_partners(role, self.clock(), exclude=suspect)
        if not partners:
            raise _LegInconclusive(f"no {role} engine to probe with (all ejected or drained)")
        return self.engines[partners[0]]

    async def _probe_prefill(self, engine: EngineSpec, *, suspect_leg: bool) -> msgspec.Raw:
        body = contract.probe_prefill_body(self.config.model_of(engine))
        problem, raw = await self._probe_call(engine, "/v1/completions", body)
        if problem is None:
            kv = extract_handoff(raw, max_bytes=self.config.engine.max_handoff_bytes)
            if kv is None:
                problem = _LegProblem(FailureClass.KV_HANDOFF,
                                      "kv_handoff: prefill response carries no readable kv_transfer_params")
        if problem is not None:
            self._leg_problem("prefill", engine, problem, suspect_leg=suspect_leg)
        assert kv is not None
        return kv

    async def _probe_decode(self, engine: EngineSpec, kv: msgspec.Raw, *, suspect_leg: bool) -> None:
        body = contract.probe_decode_body(self.config.model_of(engine), kv)
        problem, _ = await self._probe_call(engine, "/v1/completions", body, stream=True)
        if problem is not None:
            self._leg_problem("decode", engine, problem, suspect_leg=suspect_leg)

    @staticmethod
    def _leg_problem(leg: str, engine: EngineSpec, problem: _LegProblem, *, suspect_leg: bool) -> NoReturn:
        if not suspect_leg:
            raise _LegInconclusive(f"partner {engine.name} {leg} failed: {problem.reason}")
        if problem.failure_class is None or problem.failure_class in PROBE_LEG_INCONCLUSIVE:
            raise _LegInconclusive(f"{leg} leg inconclusive: {problem.reason}")
        raise _SuspectLegFailed(leg, problem.reason, problem.failure_class)

    async def _probe_call(self, engine: EngineSpec, path: str, body: bytes, *,
                          stream: bool = False) -> tuple[_LegProblem | None, bytes]:
        """One probe request: (None, body) when it succeeded, else (what went wrong, b"").

        Statuses and stream endings are classified by ``classify``, as on the data path.
        """
        try:
            response = await self.control_pool.post_json(engine, path, body, timeout_s=self._probe_timeout_s)
        except EngineFailure as exc:
            return _LegProblem(exc.failure_class, f"{exc.failure_class}: {exc.message}"), b""
        except PoolSaturated as exc:
            # Our own control pool was full: no verdict on the engine either way.
            return _LegProblem(None, f"control pool saturated: {exc}"), b""
        failure = classify.status_failure(engine.name, response.status, response.body)
        if isinstance(failure, UpstreamClientError):
            # The engine refused a well-formed probe: it cannot serve the fleet's requests.
            return _LegProblem(FailureClass.INFERENCE_STATUS, f"HTTP {response.status} to the probe"), b""
        if failure is None and stream:
            failure = classify.sse_body_failure(engine.name, response.body)
        if failure is not None:
            return _LegProblem(failure.failure_class, f"{failure.failure_class}: {failure.message}"), b""
        return None, response.body


class _LegProblem(msgspec.Struct, frozen=True):
    """What went wrong on one probe leg; ``failure_class`` None means no verdict on the engine."""

    failure_class: FailureClass | None
    reason: str


class _SuspectLegFailed(NarwhalError):
    def __init__(self, leg: str, reason: str, failure_class: FailureClass) -> None:
        super().__init__(reason)
        self.leg = leg
        self.reason = reason
        self.failure_class = failure_class

