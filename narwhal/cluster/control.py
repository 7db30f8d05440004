"""A replica's request path: the controller's eligibility, less the engines this router cannot reach.

``ClusterControl`` stands where the hub expects the supervisor. On the
controller (and in standby mode) it is the supervisor. On a replica the fleet
is the controller's (restored from its records) and decides nothing here;
evidence goes to the controller (``report``), and a connection failure also
takes the engine out of this router's placement at once (``LocalExclusions``),
until the controller's record for it changes or ``hold_s`` passes (then it is
tried again), as a worker stops placing on an engine the controller ejected.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from narwhal.cluster.records import EvidenceItem
from narwhal.errors import FailureClass, SuccessKind
from narwhal.workers.hub import ControlPlane

__all__ = ["ClusterControl", "LocalExclusions"]

_NONE: frozenset[str] = frozenset()


class LocalExclusions:
    """Engines this replica stopped placing on by its own evidence, each until a deadline (pure)."""

    def __init__(self) -> None:
        self._until: dict[str, float] = {}
        # Bumped on every change, expiries included: the hub republishes on it.
        self.version = 0

    def exclude(self, engine: str, until: float) -> None:
        if self._until.get(engine) != until:
            self._until[engine] = until
            self.version += 1

    def clear(self, engine: str) -> None:
        if self._until.pop(engine, None) is not None:
            self.version += 1

    def active(self, now: float) -> frozenset[str]:
        """The engines excluded at ``now`` (expired ones are dropped)."""
        expired = [name for name, until in self._until.items() if until <= now]
        for name in expired:
            del self._until[name]
        if expired:
            self.version += 1
        return frozenset(self._until)

    def next_expiry(self) -> float | None:
        return min(self._until.values(), default=None)

    def __bool__(self) -> bool:
        return bool(self._until)


class ClusterControl:
    """The hub's control plane: the supervisor's, filtered and reported on a replica."""

    def __init__(self, supervisor: ControlPlane, *, replica: Callable[[], bool],
                 report: Callable[[EvidenceItem], None], clock: Callable[[], float],
                 hold_s: Callable[[], float]) -> None:
        self._supervisor = supervisor
        self._replica = replica
        self._report = report
        self._clock = clock
        self._hold_s = hold_s
        self.exclusions = LocalExclusions()
        # Engines with a failure reported since their last reported success: only their successes go to the
        # controller (a success clears a streak; a request that succeeds on a clean engine changes nothing
        # there, and would be one message per request).
        self._reported_failing: set[str] = set()

    def _excluded(self) -> frozenset[str]:
        # The common case (nothing excluded: always on the controller) is one test: these are read per request.
        if not self.exclusions or not self._replica():
            return _NONE
        return self.exclusions.active(self._clock())

    def eligible(self, role: str, model: str | None = None) -> list[str]:
        names = self._supervisor.eligible(role, model)
        excluded = self._excluded()
        return [name for name in names if name not in excluded] if excluded else names

    def eligible_pools(self) -> dict[str, dict[str, list[str]]]:
        pools = self._supervisor.eligible_pools()
        excluded = self._excluded()
        if not excluded:
            return pools
        return {model: {role: [name for name in names if name not in excluded] for role, names in roles.items()}
                for model, roles in pools.items()}

    def capacity_problem(self, model: str | None = None) -> str | None:
        problem = self._supervisor.capacity_problem(model)
        if problem is not None or not self._excluded():
            return problem
        for role in ("prefill", "decode"):
            if self._supervisor.eligible(role, model) and not self.eligible(role, model):
                return f"serving capacity exhausted: every eligible {role} engine is unreachable from this replica"
        return None

    def capacity_problems(self) -> dict[str, str]:
        return self._supervisor.capacity_problems()

    def state_version(self) -> int:
        exclusions = self.exclusions
        if exclusions:
            exclusions.active(self._clock())  # drops expired exclusions, which bumps their version
        return self._supervisor.state_version() + (exclusions.version << 40)

    def valid_until(self) -> float | None:
        deadline = self._supervisor.valid_until()
        if not self._replica():
            return deadline
        expiry = self.exclusions.next_expiry()
        if expiry is None:
            return deadline
        return expiry if deadline is None else min(deadline, expiry)

    def record_failure(self, engine: str, failure_class: FailureClass) -> None:
        # The supervisor counts it (metrics); on a replica its fleet decides nothing (the writer is gated).
        self._supervisor.record_failure(engine, failure_class)
        if self._replica():
            if failure_class is FailureClass.CONNECTION:
                hold_s = self._hold_s()
                self.exclusions.exclude(engine, self._clock() + (hold_s if math.isfinite(hold_s) else 5.0))
            self._reported_failing.add(engine)
            self._report(EvidenceItem(engine, failure_class=failure_class.value))

    def record_success(self, engine: str, kind: SuccessKind) -> None:
        self._supervisor.record_success(engine, kind)
        if self._reported_failing and engine in self._reported_failing and self._replica():
            self._reported_failing.discard(engine)
            self._report(EvidenceItem(engine, success_kind=kind.value))
