"""The engine state machine: every transition of every engine lives in this file.

It decides which engines may take new work, per role, from the failure evidence,
health sweeps, probe results, holds and ejections the shell reports. It does no
I/O and reads no clock: each call takes ``now`` (monotonic seconds), and what the
shell must do comes back as ``Action``s, what happened as ``FleetEvent``s.

Theory of operation
-------------------
Per engine the fleet keeps: a consecutive-failure streak for each failure class,
a liveness miss counter, an ejection (reason, time) or none, and at most one hold
of each ``HoldKind``. An engine is *eligible* when it is not ejected and has no
active hold; every hold kind pauses new requests. A hold is active unless it is
*deferred* (last-engine protection, below) or its deadline has passed
(``deadline <= now`` is expired).

Evidence. ``record_failure`` adds one to the class's streak. When the streak
reaches ``eject_after`` the class's row of ``FAILURE_ACTIONS`` answers, and again
at every further multiple of ``eject_after`` (so an engine whose evidence is
never cleared is looked at again, at the same rate, rather than never):

- EJECT: the engine is ejected now; the returned action reports it.
- HEALTH_PROBE: the shell runs ``GET /health`` on the control pool and reports a
  200 as ``record_success(HEALTH_200)``, a failure as ``record_failure``.
- INFERENCE_PROBE: the fleet first applies an inference-verification hold (the
  pause), then asks the shell for a prefill/decode probe, and marks it in flight.
  While that hold stands, further failures ask for no second probe.

Ejected engines collect evidence but get no actions: they come back only
through ``readmit``. ``record_success`` clears exactly the classes of its row of
``EVIDENCE_CLEARED``.

Probes. ``record_probe`` records the result of an inference probe: success
clears the inference-class streaks, the verification hold and any quarantine
hold; a failed prefill or decode leg ejects; an inconclusive result keeps the
hold and schedules the next probe at ``now + probe_interval_s``, which
``probes_due`` hands out (and marks in flight) once due. The shell must report
every probe it starts, as inconclusive when it was cut short; probes of
ejected engines are never scheduled.

Liveness. ``record_health_sweep`` gives each silent engine (no HTTP answer
within the timeout) a miss; an engine that answered is not silent, whatever
the status; ``liveness_misses`` consecutive misses eject. Any health 200
(sweep or probe) resets the counter, as the clearing table says.

Quarantine and ejection (the design decision). An *ejection* is a confirmed
failure: the engine is out until ``readmit`` (a successful readmission chain).
With ``failure_quarantine_s`` set, a *failure_quarantine* hold with deadline
``now + failure_quarantine_s`` goes with it in two cases:

1. On every ejection (streak, failed probe leg, liveness, explicit ``eject``):
   the quarantine is then the minimum time out before readmission may be
   tried; ``readmission_allowed`` is False until it expires or a successful
   health or inference check clears it.
2. Temporarily, for evidence short of ejection: when a timeout or overload
   streak asks for a health probe, the engine is quarantined while the probe
   decides. A health 200 clears it at once; otherwise the engine returns to
   placement by itself at the deadline. This *temporary quarantine* is a hold
   under last-engine protection.

Either way the hold expires when its deadline passes, checked by ``eligible``
itself (candidate selection), not by a monitor pass; for an ejected engine
expiry only permits readmission.

What clears a quarantine early depends on its typed ``cause`` (the failure
class, or ``liveness``, that put it there), read with the clearing table: a
health 200 clears it only when the cause is on the health row (connection,
timeout, overload, liveness; ``QUARANTINE_CLEARED_BY_HEALTH``). A quarantine
caused by stream, inference_status or kv_handoff evidence (an ejection by a
failed probe leg records the leg's class) ends only at its deadline or by a
successful inference probe: an engine whose decodes fail while its /health
answers 200 would otherwise be put back after the next routine sweep, and cost
clients another ``eject_after`` failures every ``probe_interval_s``.

The engine set. A config reload adds and removes engines. ``add_engine``
tracks a new one fresh and *ejected* (cause ``added``): it enters placement
only through ``readmit``, i.e. a passed readmission chain, and the shell's
readmission schedule retries it like any ejected engine. ``start_removal``
takes an engine out of placement for good (no hold or readmission brings it
back) while its requests in flight finish and their evidence still counts;
``remove_engine`` then forgets it entirely, so the same name added later
starts fresh. ``cancel_removal`` undoes ``start_removal`` when the same engine
comes back before it left: it keeps its state, as if never removed.

Pools. Each engine serves one model; the engines of one model and role form a
*pool*, and every rule that counts peers counts within the pool: last-engine
protection, probe partners, ``capacity_problem`` per model. The fleet as a
whole can serve while any model can (``capacity_problem`` without a model).

Last-engine protection. Performance-drift and failure-quarantine holds never
take away the last eligible engine of a pool (a model's role): such a hold is
recorded *deferred* (not pausing), and applied as soon as another engine of the
pool is eligible again. The check runs on every ``eligible`` call that finds the state
changed or a deadline passed and after every mutation, and it works both ways:
if a peer is later ejected, drained or paused and only protected holds keep the
pool empty, the most recently held engine gets its protected holds deferred
again. Ejections, inference-verification holds, drains and maintenance are not
protected: a confirmed failure (or the operator) can empty a pool, and
``capacity_problem`` then names it while probes continue.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Collection, Mapping, Sequence

import msgspec

from narwhal.errors import FailureClass, SuccessKind
from narwhal.fleet.model import (
    PROBE_OUTCOMES,
    ROLES,
    Action,
    ActionKind,
    Cause,
    EjectionCause,
    EngineCounters,
    EngineRecord,
    EngineState,
    EngineView,
    FleetEvent,
    FleetEventKind,
    Hold,
    HoldKind,
    HoldRecord,
    ProbeOutcome,
    state_name,
)
from narwhal.fleet.tables import (
    EVIDENCE_CLEARED,
    FAILURE_ACTIONS,
    INFERENCE_FAILURES,
    LIVENESS,
    PROBE_PARTNER_HOLDS,
    PROTECTED_HOLDS,
    QUARANTINE_CLEARED_BY_HEALTH,
    READMISSION_CLEARS,
)

__all__ = ["Fleet"]

# Events wait here until the shell drains them (every monitor pass); the bound
# keeps a shell that never drains from growing memory without limit.
EVENT_BACKLOG = 10_000
PROBE_LEGS = (None, "prefill", "decode")
# Holds are listed in HoldKind's order; iterating the enum class itself costs a generator step per member.
_HOLD_ORDER = tuple(HoldKind)


def _cause(name: str | None) -> Cause | None:
    """A saved hold's cause, None when absent or unknown (the cautious reading)."""
    if name == LIVENESS:
        return LIVENESS
    known = {cls.value: cls for cls in FailureClass}
    return known.get(name) if name is not None else None


class _Engine:
    """One engine's mutable state; only ``Fleet`` touches it."""

    __slots__ = ("name", "role", "model", "pool", "index", "streaks", "any_streak", "liveness_misses", "ejected",
                 "ejected_reason", "ejected_cause", "ejected_at", "holds", "next_probe_at",
                 "probe_in_flight", "ejections", "probes", "failures", "removing")

    def __init__(self, name: str, role: str, index: int, model: str = "") -> None:
        self.name = name
        self.role = role
        # The model the engine serves: engines of one model and role form a pool, and every rule
        # that counts peers (last-engine protection, probe partners) counts within the pool.
        self.model = model
        self.pool = (model, role)
        # Position in the configured fleet: the deterministic tie-breaker.
        self.index = index
        # Removed by a config reload and waiting for its requests to finish: never placeable again.
        self.removing = False
        self.reset()

    def reset(self) -> None:
        self.streaks: dict[FailureClass, int] = dict.fromkeys(FailureClass, 0)
        # False only when every streak is 0: lets traffic successes return at once.
        self.any_streak = False
        self.liveness_misses = 0
        self.ejected = False
        self.ejected_reason: str | None = None
        self.ejected_cause: EjectionCause | None = None
        self.ejected_at: float | None = None
        self.holds: dict[HoldKind, Hold] = {}
        self.next_probe_at: float | None = None
        self.probe_in_flight = False
        self.ejections = 0
        self.probes: dict[str, int] = dict.fromkeys(PROBE_OUTCOMES, 0)
        self.failures: dict[FailureClass, int] = dict.fromkeys(FailureClass, 0)

    def protected_hold_active(self) -> bool:
        return any(kind in PROTECTED_HOLDS and not hold.deferred
                   for kind, hold in self.holds.items())

    def placeable_but_for_protected_holds(self) -> bool:
        return not self.ejected and not self.removing and all(kind in PROTECTED_HOLDS for kind in self.holds)


def _success_may_clear(engine: _Engine, kind: SuccessKind) -> bool:
    """A success can clear evidence only on an engine with a failure streak, or as a health answer (its row
    also resets liveness misses and may lift a quarantine)."""
    return engine.any_streak or kind is SuccessKind.HEALTH_200


class Fleet:
    """The engine state machine: evidence, holds, ejection, eligibility per role."""

    def __init__(self, engines: Sequence[tuple[str, str] | tuple[str, str, str]], *, eject_after: int,
                 liveness_misses: int, failure_quarantine_s: float | None,
                 probe_interval_s: float) -> None:
        """Track ``engines``, given as (name, role) or (name, role, model), all eligible at first."""
        self._eject_after = eject_after
        self._liveness_limit = liveness_misses
        self._quarantine_s = failure_quarantine_s
        self._probe_interval_s = probe_interval_s
        self.reconfigure(eject_after=eject_after, liveness_misses=liveness_misses,
                         failure_quarantine_s=failure_quarantine_s, probe_interval_s=probe_interval_s)
        self._engines: dict[str, _Engine] = {}
        # Engines by pool, (model, role); a model's pools appear together, in order of first mention.
        self._pools: dict[tuple[str, str], list[_Engine]] = {}
        for index, entry in enumerate(engines):
            name, role = entry[0], entry[1]
            model = entry[2] if len(entry) > 2 else ""
            if name in self._engines:
                raise ValueError(f"duplicate engine name {name!r}")
            if role not in ROLES:
                raise ValueError(f"engine {name!r} has role {role!r}, expected one of {ROLES}")
            engine = _Engine(name, role, index, model)
            self._engines[name] = engine
            self._pool(model, role).append(engine)
        self._next_index = len(self._engines)
        # Eligible names per pool, and per role over every model.
        self._eligible_pool: dict[tuple[str, str], list[str]] = {pool: [] for pool in self._pools}
        self._eligible: dict[str, list[str]] = {role: [] for role in ROLES}
        self._eligible_names: frozenset[str] = frozenset()
        # The cache of eligibility is stale when _dirty is set or at
        # _next_deadline, the earliest hold deadline.
        self._dirty = True
        # Counts the changes that marked it stale (``_changed``): a reader that saw the same count and
        # reads before ``next_deadline`` knows the eligibility version has not moved, without asking.
        self.mutations = 0
        self._next_deadline = math.inf
        # Bumped whenever the eligible sets change: snapshots for workers are republished on it.
        self._eligibility_version = 0
        self._events: collections.deque[FleetEvent] = collections.deque(maxlen=EVENT_BACKLOG)
        self._events_dropped = 0

    def reconfigure(self, *, eject_after: int, liveness_misses: int, failure_quarantine_s: float | None,
                    probe_interval_s: float) -> None:
        """Use new ``[recovery]`` values from now on (a config reload); streaks, holds, deadlines set stay."""
        if eject_after < 1 or liveness_misses < 1:
            raise ValueError("eject_after and liveness_misses must be >= 1")
        if probe_interval_s <= 0 or (failure_quarantine_s is not None and failure_quarantine_s <= 0):
            raise ValueError("probe_interval_s and failure_quarantine_s must be > 0")
        self._eject_after = eject_after
        self._liveness_limit = liveness_misses
        self._quarantine_s = failure_quarantine_s
        self._probe_interval_s = probe_interval_s

    def __contains__(self, name: object) -> bool:
        return name in self._engines

    def _pool(self, model: str, role: str) -> list[_Engine]:
        members = self._pools.get((model, role))
        if members is None:
            # Both roles of a model are made together, so a model's pools stay side by side.
            for each in ROLES:
                self._pools.setdefault((model, each), [])
            members = self._pools[(model, role)]
        return members

    def models(self) -> list[str]:
        """The models of the engines tracked, in order of first mention."""
        return list(dict.fromkeys(model for model, _ in self._pools))

    def model_of(self, name: str) -> str:
        """The model engine ``name`` serves."""
        return self._engines[name].model

    # ----- the engine set (a config reload) -----

    def add_engine(self, name: str, role: str, now: float, reason: str, model: str = "") -> None:
        """Track a new engine, fresh (no evidence) and held out as ejected until a readmission verifies it."""
        if name in self._engines:
            raise ValueError(f"engine {name!r} is already in the fleet")
        if role not in ROLES:
            raise ValueError(f"engine {name!r} has role {role!r}, expected one of {ROLES}")
        engine = _Engine(name, role, self._next_index, model)
        self._next_index += 1
        engine.ejected = True
        engine.ejected_reason = reason
        engine.ejected_cause = EjectionCause.ADDED
        engine.ejected_at = now
        self._engines[name] = engine
        self._pool(model, role).append(engine)
        self._changed()
        self._emit(FleetEventKind.ADDED, engine, now, reason)
        self._refresh_if_stale(now)

    def start_removal(self, name: str, now: float, reason: str) -> None:
        """Take ``name`` out of placement for good; its evidence still counts until ``remove_engine``."""
        engine = self._engines[name]
        if engine.removing:
            return
        engine.removing = True
        engine.next_probe_at = None
        self._changed()
        self._emit(FleetEventKind.REMOVING, engine, now, reason)
        self._refresh_if_stale(now)

    def cancel_removal(self, name: str, now: float, reason: str) -> None:
        """Undo ``start_removal``: ``name`` is placed again as its state allows (evidence, holds and ejection kept)."""
        engine = self._engines[name]
        if not engine.removing:
            return
        engine.removing = False
        if (HoldKind.INFERENCE_VERIFICATION in engine.holds and not engine.ejected
                and not engine.probe_in_flight and engine.next_probe_at is None):
            engine.next_probe_at = now  # the re-probe start_removal called off is due again
        self._changed()
        self._emit(FleetEventKind.REMOVAL_CANCELLED, engine, now, reason)
        self._refresh_if_stale(now)

    def remove_engine(self, name: str, now: float, reason: str) -> None:
        """Forget ``name`` and all it had (evidence, holds, counters); a later ``add_engine`` starts fresh."""
        engine = self._engines.pop(name)
        members = self._pools[engine.pool]
        members.remove(engine)
        if not members and not any(self._pools[(engine.model, role)] for role in ROLES):
            # The model's last engine left: so does the model.
            for role in ROLES:
                del self._pools[(engine.model, role)]
                self._eligible_pool.pop((engine.model, role), None)
            self._eligibility_version += 1  # the model left the pools workers place by
        self._changed()
        self._emit(FleetEventKind.REMOVED, engine, now, reason)
        self._refresh(now)

    def __repr__(self) -> str:
        counts = " | ".join(f"{model + ' ' if model else ''}{role}: "
                            f"{len(self._eligible_pool.get((model, role), ()))}/{len(members)} eligible"
                            for (model, role), members in self._pools.items())
        return f"<Fleet [{counts}]>"

    # ----- placement (hot path) -----

    def eligible(self, role: str, now: float, model: str | None = None) -> list[str]:
        """Names of the engines of ``role`` (of ``model``; None: of every model) that may take new requests."""
        if self._dirty or now >= self._next_deadline:
            self._refresh(now)
        if model is None:
            return list(self._eligible[role])
        return list(self._eligible_pool.get((model, role), ()))

    def eligible_pools(self, now: float) -> dict[str, dict[str, list[str]]]:
        """Eligible names by model, then role (every model tracked, empty lists included)."""
        if self._dirty or now >= self._next_deadline:
            self._refresh(now)
        pools: dict[str, dict[str, list[str]]] = {}
        for (model, role), names in self._eligible_pool.items():
            pools.setdefault(model, {})[role] = list(names)
        return pools

    def is_eligible(self, name: str, now: float) -> bool:
        """Whether engine ``name`` may take new requests at ``now``."""
        if self._dirty or now >= self._next_deadline:
            self._refresh(now)
        return name in self._eligible_names

    def eligibility_version(self, now: float) -> int:
        """A number that changes whenever the eligible engines of any role change (as of ``now``)."""
        if self._dirty or now >= self._next_deadline:
            self._refresh(now)
        return self._eligibility_version

    def next_deadline(self, now: float) -> float | None:
        """The earliest hold deadline after ``now``, when eligibility may change by itself; None if none."""
        if self._dirty or now >= self._next_deadline:
            self._refresh(now)
        return None if math.isinf(self._next_deadline) else self._next_deadline

    def capacity_problem(self, now: float, model: str | None = None) -> str | None:
        """Why serving capacity is exhausted, or None: for ``model`` (a role of it with no eligible engine),
        else for the whole fleet (no model can serve)."""
        problems = self.capacity_problems(now)
        if model is not None:
            return problems.get(model) if model in self._models_seen() else \
                f"serving capacity exhausted: model {model!r} has no engines"
        if not problems or len(problems) < len(self._models_seen()):
            return None
        return next(iter(problems.values())) if len(problems) == 1 else \
            "serving capacity exhausted: no model can serve (" + "; ".join(
                f"{model}: {problem.removeprefix('serving capacity exhausted: ')}"
                for model, problem in problems.items()) + ")"

    def capacity_problems(self, now: float) -> dict[str, str]:
        """Each model that cannot serve now (a role with no eligible engine), with the reason."""
        if self._dirty or now >= self._next_deadline:
            self._refresh(now)
        problems: dict[str, str] = {}
        named = len(self._models_seen()) > 1
        for model in self._models_seen():
            missing = [role for role in ROLES if not self._eligible_pool.get((model, role))]
            if missing:
                of = f" of model {model!r}" if named else ""
                problems[model] = f"serving capacity exhausted: no eligible {' or '.join(missing)} engine{of}"
        return problems

    def _models_seen(self) -> list[str]:
        # A fleet that tracks no engine still has its one unnamed model: it cannot serve.
        return self.models() or [""]

    # ----- evidence -----

    def record_failure(self, name: str, failure_class: FailureClass, now: float) -> list[Action]:
        """Count one failure of ``failure_class``; the table's action when the streak reaches eject_after."""
        engine = self._engines[name]
        streak = engine.streaks[failure_class] + 1
        engine.streaks[failure_class] = streak
        engine.any_streak = True
        engine.failures[failure_class] += 1
        if streak % self._eject_after or engine.ejected:
            return []
        reason = f"{failure_class} streak reached {streak} (eject_after {self._eject_after})"
        actions = self._respond(engine, failure_class, reason, now)
        self._refresh_if_stale(now)
        return actions

    def success_clears(self, name: str, kind: SuccessKind) -> bool:
        """Whether ``record_success(name, kind, ...)`` may change anything: an engine with a failure streak,
        or a health answer. The request path asks first and skips the call (and the clock) when it cannot."""
        engine = self._engines.get(name)
        return engine is not None and _success_may_clear(engine, kind)

    def record_success(self, name: str, kind: SuccessKind, now: float) -> list[Action]:
        """Clear exactly the evidence that ``kind``'s row of the clearing table names."""
        engine = self._engines[name]
        if not _success_may_clear(engine, kind):
            return []  # the common case on the request path: nothing to clear
        for evidence in EVIDENCE_CLEARED[kind]:
            if isinstance(evidence, FailureClass):
                if engine.streaks[evidence]:
                    self._clear_streak(engine, evidence, f"{kind} response", now)
            elif engine.liveness_misses:
                self._emit(FleetEventKind.EVIDENCE_CLEARED, engine, now,
                           f"{kind} response reset {engine.liveness_misses} liveness misses")
                engine.liveness_misses = 0
        # "A successful health ... check clears the [quarantine] hold first", but
        # only a quarantine whose cause is evidence the health row clears.
        quarantine = engine.holds.get(HoldKind.FAILURE_QUARANTINE)
        if (kind is SuccessKind.HEALTH_200 and quarantine is not None
                and quarantine.cause in QUARANTINE_CLEARED_BY_HEALTH):
            self._remove_hold(engine, HoldKind.FAILURE_QUARANTINE, "health check succeeded", now)
            self._refresh_if_stale(now)
        return []

    def record_health_sweep(self, results: Mapping[str, bool], now: float, *,
                            unchecked: Collection[str] = (),
                            answered: Collection[str] = ()) -> list[Action]:
        """Apply one health sweep: True is a health 200, False or absent is a liveness miss.

        Engines in ``unchecked`` were not asked (the router's own pool was full):
        their counters are left as they are, since the silence was not theirs.
        Engines in ``answered`` gave an HTTP answer that was not a success: not
        silent, so no miss (the answer was evidence of its class), and no reset.
        """
        unknown = (results.keys() | set(unchecked) | set(answered)) - self._engines.keys()
        if unknown:
            raise KeyError(f"health sweep names unknown engines: {sorted(unknown)}")
        actions: list[Action] = []
        for engine in self._engines.values():
            if engine.name in unchecked or (engine.name in answered and not results.get(engine.name)):
                continue
            if results.get(engine.name, False):
                self.record_success(engine.name, SuccessKind.HEALTH_200, now)
                continue
            engine.liveness_misses += 1
            if engine.liveness_misses >= self._liveness_limit and not engine.ejected:
                actions += self._eject(engine, f"{engine.liveness_misses} consecutive silent health "
                                       f"sweeps (liveness_misses {self._liveness_limit})", now,
                                       EjectionCause.LIVENESS, cause=LIVENESS)
        self._refresh_if_stale(now)
        return actions

    # ----- inference probes -----

    def record_probe(self, name: str, outcome: ProbeOutcome, now: float, *,
                     leg: str | None = None, reason: str = "",
                     failure_class: FailureClass | None = None) -> list[Action]:
        """Record an inference probe's result; ``leg`` names the leg that decided it.

        ``failure_class`` is what a failed leg saw; it becomes the cause of the
        ejection's quarantine (None: no health 200 may clear it).
        """
        if outcome not in PROBE_OUTCOMES:
            raise ValueError(f"probe outcome must be one of {PROBE_OUTCOMES}, got {outcome!r}")
        if leg not in PROBE_LEGS:
            raise ValueError(f"probe leg must be one of {PROBE_LEGS}, got {leg!r}")
        engine = self._engines[name]
        engine.probes[outcome] += 1
        engine.probe_in_flight = False
        what = f"{leg} probe leg {outcome}" if leg else f"inference probe {outcome}"
        if reason:
            what = f"{what}: {reason}"
        self._emit(FleetEventKind.PROBE_RESULT, engine, now, what, outcome=outcome, leg=leg)
        actions: list[Action] = []
        if outcome == "success":
            for failure_class in INFERENCE_FAILURES:
                if engine.streaks[failure_class]:
                    self._clear_streak(engine, failure_class, "inference probe succeeded", now)
            for kind in (HoldKind.INFERENCE_VERIFICATION, HoldKind.FAILURE_QUARANTINE):
                if kind in engine.holds:
                    self._remove_hold(engine, kind, "inference probe succeeded", now)
        elif outcome == "failed":
            actions = self._eject(engine, what, now, EjectionCause.PROBE, cause=failure_class)
        elif HoldKind.INFERENCE_VERIFICATION in engine.holds and not engine.ejected:
            # Inconclusive: the hold stays and the monitor probes again later.
            engine.next_probe_at = now + self._probe_interval_s
        self._refresh_if_stale(now)
        return actions

    def probes_due(self, now: float) -> list[str]:
        """Engines whose inference re-probe is due; each is marked in flight, so probe each once."""
        due: list[str] = []
        for engine in self._engines.values():
            if engine.next_probe_at is not None and engine.next_probe_at <= now:
                engine.next_probe_at = None
                engine.probe_in_flight = True
                due.append(engine.name)
        return due

    def probe_partners(self, role: str, now: float, *, exclude: str) -> list[str]:
        """Engines of ``role`` an inference probe of ``exclude`` may pair with, best first.

        Eligible engines first; then, so that a role held all at once still
        recovers by itself, engines held only by ``PROBE_PARTNER_HOLDS``, those
        held longest first (configured order among equals).
        """
        model = self._engines[exclude].model if exclude in self._engines else ""
        eligible = [name for name in self.eligible(role, now, model) if name != exclude]
        held = [engine for engine in self._pools.get((model, role), ())
                if engine.name != exclude and engine.name not in eligible and not engine.ejected
                and not engine.removing
                and engine.holds and all(kind in PROBE_PARTNER_HOLDS for kind in engine.holds)]
        held.sort(key=lambda engine: (min(hold.since for hold in engine.holds.values()), engine.index))
        return eligible + [engine.name for engine in held]

    # ----- holds, ejection, readmission -----

    def add_hold(self, name: str, kind: HoldKind, reason: str, now: float,
                 deadline: float | None = None, *, wall: float | None = None) -> list[Action]:
        """Hold ``name`` out of placement; an inference-verification hold also asks for a probe.

        ``wall``: the wall clock read with ``now``, kept as the start of a hold that begins now."""
        engine = self._engines[name]
        self._put_hold(engine, kind, reason, now, deadline, wall=wall)
        actions: list[Action] = []
        if (kind is HoldKind.INFERENCE_VERIFICATION and not engine.ejected
                and not engine.probe_in_flight and engine.next_probe_at is None):
            actions = self._start_probe(engine, None, reason)
        self._refresh_if_stale(now)
        return actions

    def clear_hold(self, name: str, kind: HoldKind, now: float) -> bool:
        """Remove ``name``'s hold of ``kind``; False when there was none."""
        engine = self._engines[name]
        if kind not in engine.holds:
            return False
        self._remove_hold(engine, kind, "cleared by request", now)
        self._refresh_if_stale(now)
        return True

    def eject(self, name: str, reason: str, now: float,
              failure_class: FailureClass | None = None, *, label: EjectionCause | None = None) -> list[Action]:
        """Eject ``name`` as a confirmed failure; no-op when already ejected.

        ``label`` is the ejection's bounded cause; by default the failure class, else ``other``.
        """
        if label is None:
            label = EjectionCause.OTHER if failure_class is None else EjectionCause.of(failure_class)
        actions = self._eject(self._engines[name], reason, now, label, failure_class)
        self._refresh_if_stale(now)
        return actions

    def readmit(self, name: str, now: float, *, health_to_eligible_s: float | None = None) -> None:
        """After a successful readmission chain: end the ejection, clear its holds and evidence.

        ``health_to_eligible_s`` (how long since its health returned) goes on the event as is.
        """
        engine = self._engines[name]
        for kind in READMISSION_CLEARS:
            if kind in engine.holds:
                self._remove_hold(engine, kind, "readmitted", now)
        engine.ejected = False
        engine.ejected_reason = None
        engine.ejected_cause = None
        engine.ejected_at = None
        engine.streaks = dict.fromkeys(FailureClass, 0)
        engine.any_streak = False
        engine.liveness_misses = 0
        engine.next_probe_at = None
        engine.probe_in_flight = False
        self._emit(FleetEventKind.READMITTED, engine, now, "readmission verified",
                   health_to_eligible_s=None if health_to_eligible_s is None else round(health_to_eligible_s, 6))
        self._changed()
        self._refresh_if_stale(now)

    def readmission_allowed(self, name: str, now: float) -> bool:
        """False while a failure-quarantine hold on ``name`` is unexpired."""
        hold = self._engines[name].holds.get(HoldKind.FAILURE_QUARANTINE)
        return hold is None or (hold.deadline is not None and hold.deadline <= now)

    def quarantine_needs_inference_check(self, name: str, now: float) -> bool:
        """True while an unexpired quarantine on ``name`` can end early only by an inference probe."""
        hold = self._engines[name].holds.get(HoldKind.FAILURE_QUARANTINE)
        return (hold is not None and not self.readmission_allowed(name, now)
                and hold.cause not in QUARANTINE_CLEARED_BY_HEALTH)

    # ----- visibility -----

    def view(self, name: str, now: float) -> EngineView:
        """A frozen picture of one engine at ``now``."""
        if self._dirty or now >= self._next_deadline:
            self._refresh(now)
        engine = self._engines[name]
        return EngineView(
            name=engine.name, role=engine.role, model=engine.model, eligible=name in self._eligible_names,
            ejected=engine.ejected, ejected_reason=engine.ejected_reason,
            ejected_cause=engine.ejected_cause, ejected_at=engine.ejected_at,
            holds=[engine.holds[kind] for kind in _HOLD_ORDER if kind in engine.holds] if engine.holds else [],
            evidence=dict(engine.streaks), liveness_misses=engine.liveness_misses,
            next_probe_at=engine.next_probe_at, probe_in_flight=engine.probe_in_flight,
            readmission_allowed=self.readmission_allowed(name, now),
            counters=self._counters(engine), removing=engine.removing)

    def views(self, now: float) -> list[EngineView]:
        """``view`` of every engine, in configured order."""
        return [self.view(name, now) for name in self._engines]

    def views_of_unsettled(self, now: float) -> list[EngineView]:
        """``view`` of every engine that is ejected, held (deferred holds too) or being removed, in configured
        order: what a pass may act on (a healthy fleet has none, so its pass builds no view)."""
        if self._dirty or now >= self._next_deadline:
            self._refresh(now)  # a hold that lapses now is gone before the engines are picked
        return [self.view(name, now) for name, engine in self._engines.items()
                if engine.ejected or engine.holds or engine.removing]

    def states(self, now: float) -> dict[str, EngineState]:
        """Each engine's ``state_name`` at ``now``, without building its view."""
        if self._dirty or now >= self._next_deadline:
            self._refresh(now)
        eligible = self._eligible_names
        return {name: state_name(engine.ejected, name in eligible) for name, engine in self._engines.items()}

    def drain_events(self) -> list[FleetEvent]:
        """What happened since the last call, oldest first."""
        events = list(self._events)
        self._events.clear()
        return events

    @property
    def has_events(self) -> bool:
        """Whether ``drain_events`` would return anything (cheap: the request path asks)."""
        return bool(self._events)

    @property
    def events_dropped(self) -> int:
        """Events lost because the backlog was full (the shell drained too rarely)."""
        return self._events_dropped

    # ----- durable handoff -----

    def snapshot(self, now: float, wall_now: float) -> list[EngineRecord]:
        """Every engine's durable state, monotonic times converted to wall-clock; engines being removed left out."""
        if self._dirty or now >= self._next_deadline:
            self._refresh(now)

        def wall(t: float | None) -> float | None:
            return None if t is None else wall_now + (t - now)

        return [EngineRecord(
            name=engine.name, role=engine.role, model=engine.model, ejected=engine.ejected,
            ejected_reason=engine.ejected_reason, ejected_cause=engine.ejected_cause,
            ejected_at_wall=wall(engine.ejected_at),
            holds=[HoldRecord(kind=hold.kind, reason=hold.reason,
                              since_wall=wall_now + (hold.since - now) if hold.since_wall is None else hold.since_wall,
                              deadline_wall=wall(hold.deadline), deferred=hold.deferred, cause=hold.cause)
                   for kind in _HOLD_ORDER if (hold := engine.holds.get(kind)) is not None],
            streaks=dict(engine.streaks), liveness_misses=engine.liveness_misses,
            next_probe_at_wall=wall(engine.next_probe_at), counters=self._counters(engine),
        ) for engine in self._engines.values() if not engine.removing]

    def restore(self, records: Sequence[EngineRecord], now: float, wall_now: float) -> None:
        """Inverse of ``snapshot``; deadlines already past come back expired.

        Raises ValueError, changing nothing, when a record names an engine that
        is not configured or gives it another role. A verification hold whose
        probe was in flight in the old process is probed again at once.
        """
        seen: set[str] = set()
        for record in records:
            engine = self._engines.get(record.name)
            if engine is None or record.name in seen:
                raise ValueError(f"handoff engine {record.name!r} is unknown or repeated")
            if record.role != engine.role:
                raise ValueError(f"handoff gives engine {record.name!r} role {record.role!r}, "
                                 f"configured {engine.role!r}")
            # A handoff written before models were named ("") fits any; a named one must match.
            if record.model and record.model != engine.model:
                raise ValueError(f"handoff gives engine {record.name!r} model {record.model!r}, "
                                 f"configured {engine.model!r}")
            seen.add(record.name)

        def mono(t: float | None) -> float | None:
            return None if t is None else now + (t - wall_now)

        for record in records:
            engine = self._engines[record.name]
            engine.reset()
            engine.ejected = record.ejected
            if record.ejected:
                engine.ejected_reason = record.ejected_reason or "restored from handoff"
                engine.ejected_cause = record.ejected_cause or EjectionCause.OTHER
                engine.ejected_at = mono(record.ejected_at_wall)
                if engine.ejected_at is None:
                    engine.ejected_at = now
            engine.holds = {h.kind: Hold(h.kind, h.reason, now + (h.since_wall - wall_now),
                                         mono(h.deadline_wall), h.deferred, _cause(h.cause), h.since_wall)
                            for h in record.holds}
            engine.streaks.update(record.streaks)
            engine.any_streak = any(engine.streaks.values())
            engine.liveness_misses = record.liveness_misses
            if HoldKind.INFERENCE_VERIFICATION in engine.holds and not engine.ejected:
                next_probe_at = mono(record.next_probe_at_wall)
                engine.next_probe_at = now if next_probe_at is None else next_probe_at
            engine.ejections = record.counters.ejections
            engine.probes.update(record.counters.probes)
            engine.failures.update(record.counters.failures)
        self._refresh(now)

    # ----- transitions -----

    def _respond(self, engine: _Engine, failure_class: FailureClass, reason: str,
                 now: float) -> list[Action]:
        action = FAILURE_ACTIONS[failure_class]
        if action is ActionKind.EJECT:
            return self._eject(engine, reason, now, EjectionCause.of(failure_class), failure_class)
        if action is ActionKind.HEALTH_PROBE:
            if self._quarantine_s is not None:
                self._put_hold(engine, HoldKind.FAILURE_QUARANTINE, f"temporary, until health "
                               f"verified: {reason}", now, now + self._quarantine_s, cause=failure_class)
            return [Action(ActionKind.HEALTH_PROBE, engine.name, failure_class, reason)]
        # Pause new requests first, then probe prefill/decode.
        if HoldKind.INFERENCE_VERIFICATION not in engine.holds:
            self._put_hold(engine, HoldKind.INFERENCE_VERIFICATION, reason, now, None)
        elif engine.probe_in_flight or engine.next_probe_at is not None:
            return []  # already paused, and its probe is running or scheduled
        return self._start_probe(engine, failure_class, reason)

    def _start_probe(self, engine: _Engine, failure_class: FailureClass | None,
                     reason: str) -> list[Action]:
        engine.probe_in_flight = True
        engine.next_probe_at = None
        return [Action(ActionKind.INFERENCE_PROBE, engine.name, failure_class, reason)]

    def _eject(self, engine: _Engine, reason: str, now: float, label: EjectionCause,
               failure_class: FailureClass | None = None, *, cause: Cause | None = None) -> list[Action]:
        if engine.ejected:
            return []
        engine.ejected = True
        engine.ejected_reason = reason
        engine.ejected_cause = label
        engine.ejected_at = now
        engine.ejections += 1
        # Ejected engines come back through readmission, not probes.
        engine.next_probe_at = None
        engine.probe_in_flight = False
        self._changed()
        self._emit(FleetEventKind.EJECTED, engine, now, reason, failure_class=failure_class,
                   ejection_cause=label)
        if self._quarantine_s is not None:
            self._put_hold(engine, HoldKind.FAILURE_QUARANTINE, f"ejected: {reason}", now,
                           now + self._quarantine_s, cause=cause if cause is not None else failure_class)
        return [Action(ActionKind.EJECT, engine.name, failure_class, reason)]

    def _put_hold(self, engine: _Engine, kind: HoldKind, reason: str, now: float,
                  deadline: float | None, *, cause: Cause | None = None, wall: float | None = None) -> None:
        if self._dirty or now >= self._next_deadline:
            self._refresh(now)
        # Last-engine protection decides at the moment the hold would bite.
        deferred = (kind in PROTECTED_HOLDS and not engine.ejected
                    and self._eligible_pool.get(engine.pool) == [engine.name])
        previous = engine.holds.get(kind)
        if previous is not None and previous.deferred == deferred:
            since, since_wall = previous.since, previous.since_wall
        else:
            since, since_wall = now, wall
        engine.holds[kind] = Hold(kind, reason, since, deadline, deferred, cause, since_wall)
        self._changed()
        if deferred:
            self._emit(FleetEventKind.HOLD_DEFERRED, engine, now,
                       f"{reason} (deferred: last eligible {self._pool_name(engine.pool)} engine)", hold_kind=kind)
        else:
            self._emit(FleetEventKind.HOLD_ADDED, engine, now, reason, hold_kind=kind)

    def _remove_hold(self, engine: _Engine, kind: HoldKind, why: str, now: float) -> None:
        hold = engine.holds.pop(kind)
        if kind is HoldKind.INFERENCE_VERIFICATION:
            engine.next_probe_at = None  # nothing left to verify
        self._changed()
        self._emit(FleetEventKind.HOLD_CLEARED, engine, now, f"{why} (was: {hold.reason})",
                   hold_kind=kind)

    def _clear_streak(self, engine: _Engine, failure_class: FailureClass, why: str,
                      now: float) -> None:
        self._emit(FleetEventKind.EVIDENCE_CLEARED, engine, now,
                   f"{why} cleared the {failure_class} streak of {engine.streaks[failure_class]}",
                   failure_class=failure_class)
        engine.streaks[failure_class] = 0
        engine.any_streak = any(engine.streaks.values())

    def _changed(self) -> None:
        """Something eligibility is built from changed: the cache is stale, and ``mutations`` counts it."""
        self._dirty = True
        self.mutations += 1

    def _refresh_if_stale(self, now: float) -> None:
        if self._dirty or now >= self._next_deadline:
            self._refresh(now)

    def _refresh(self, now: float) -> None:
        """Expire holds, apply last-engine protection, and rebuild the eligibility cache."""
        self._dirty = False
        for engine in self._engines.values():
            for kind, hold in list(engine.holds.items()):
                if hold.deadline is not None and hold.deadline <= now:
                    self._remove_hold(engine, kind, "deadline passed", now)
        eligible_names: set[str] = set()
        by_role: dict[str, list[str]] = {role: [] for role in ROLES}
        for pool, members in self._pools.items():
            self._protect_last_engine(pool, members, now)
            eligible = [engine.name for engine in members if not engine.ejected and not engine.removing
                        and all(hold.deferred for hold in engine.holds.values())]
            if eligible != self._eligible_pool.get(pool):
                self._eligibility_version += 1
            self._eligible_pool[pool] = eligible
            by_role[pool[1]].extend(eligible)
            eligible_names.update(eligible)
        self._eligible = by_role
        self._eligible_names = frozenset(eligible_names)
        self._next_deadline = min((hold.deadline for engine in self._engines.values()
                                   for hold in engine.holds.values() if hold.deadline is not None),
                                  default=math.inf)
        # Removing expired holds above marked the state changed; it is now current.
        self._dirty = False

    def _pool_name(self, pool: tuple[str, str]) -> str:
        """``decode``, or ``decode (model 'm')`` when the fleet serves more than one model."""
        model, role = pool
        return f"{role} (model {model!r})" if len(self._pools) > len(ROLES) else role

    def _protect_last_engine(self, pool: tuple[str, str], members: list[_Engine], now: float) -> None:
        # Candidates: engines that only protected holds (if any) keep out of placement.
        candidates = [engine for engine in members if engine.placeable_but_for_protected_holds()]
        for engine in candidates:
            if not any(hold.deferred for hold in engine.holds.values()):
                continue
            peer_eligible = any(not peer.protected_hold_active()
                                for peer in candidates if peer is not engine)
            if peer_eligible or engine.protected_hold_active():
                for kind, hold in list(engine.holds.items()):
                    if hold.deferred:
                        # Applied now: it begins now (no wall time read here; converted when written).
                        engine.holds[kind] = msgspec.structs.replace(hold, since=now, deferred=False, since_wall=None)
                        self._emit(FleetEventKind.HOLD_ADDED, engine, now,
                                   f"{hold.reason} (applied: a peer is eligible again)", hold_kind=kind)
        if not candidates or any(not engine.protected_hold_active() for engine in candidates):
            return
        # Only protected holds empty this role: keep the engine held most recently,
        # i.e. the one that was eligible last.
        keep = max(candidates, key=lambda engine: (
            max(hold.since for hold in engine.holds.values() if not hold.deferred), -engine.index))
        for kind, hold in list(keep.holds.items()):
            if not hold.deferred:
                keep.holds[kind] = msgspec.structs.replace(hold, deferred=True)
                self._emit(FleetEventKind.HOLD_DEFERRED, keep, now,
                           f"{hold.reason} (deferred: last eligible {self._pool_name(pool)} engine)",
                           hold_kind=kind)

    def _counters(self, engine: _Engine) -> EngineCounters:
        return EngineCounters(ejections=engine.ejections, probes=dict(engine.probes),
                              failures=dict(engine.failures))

    def _emit(self, kind: FleetEventKind, engine: _Engine, now: float, reason: str, *,
              failure_class: FailureClass | None = None, hold_kind: HoldKind | None = None,
              outcome: str | None = None, leg: str | None = None,
              ejection_cause: EjectionCause | None = None, health_to_eligible_s: float | None = None) -> None:
        if len(self._events) == self._events.maxlen:
            self._events_dropped += 1
        self._events.append(FleetEvent(kind=kind, engine=engine.name, reason=reason, at=now,
                                       failure_class=failure_class, ejection_cause=ejection_cause, hold_kind=hold_kind,
                                       outcome=outcome, leg=leg, health_to_eligible_s=health_to_eligible_s,
                                       model=engine.model))
