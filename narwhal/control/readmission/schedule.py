"""When an engine that is out may next be tried for readmission: pure rules, times passed in.

Two ways to be due (``ReadmissionSchedule``):

- **On health.** The engine answered a health check with a success since its
  ejection (``health``), and its backoff has run out (``not_before``). The
  readmitter asks at the moment the answer arrives, so the chain starts in the
  same monitor pass, or the same recheck, that saw the engine come back. For an
  engine ejected for evidence a health answer says nothing about (failed
  inference: ``health_decides`` False), the success must follow a failed or
  silent check since the ejection, i.e. the engine went away and came back;
  one whose health never stopped answering waits for the tick.
- **On the tick.** ``probe_interval_s`` after the ejection and then after each
  attempt began, whatever health said: the fallback that never gives up.

Backoff. A *setback* raises the engine's level by one and sets
``not_before = now + min(probe_interval_s, base_s * 2 ** (level - 1))``, so an
engine that answers health but keeps failing the chain (wrong generation, a bad
key) is tried at base, then 2 x base, ... and at most once per
``probe_interval_s``. Setbacks are:

- a refused automatic attempt, except one the tick started that failed its
  first ``health`` check (the engine is still down: nothing was hammered, and
  counting it would delay the restart it is waiting for);
- a *flap*: the engine is ejected again less than ``probe_interval_s`` after it
  was readmitted (the readmission did not last). An ejection after a readmission
  that lasted at least that long starts again at level 0.

Health to eligible. ``health_since`` is the first success of the current run
of successes after the ejection (a failed or silent check ends the run), the
start of the "engine answered health" to "back in placement" figure that
``readmitted`` returns; None for an engine ejected for failed inference whose
health never went away (its health did not "return": it was tried on the tick).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import msgspec

__all__ = ["EngineSchedule", "ReadmissionSchedule"]

# Removed engines remembered for a quick return (each a few hundred bytes).
_MAX_DEPARTED = 4096


class EngineSchedule(msgspec.Struct, kw_only=True):
    """One engine's schedule state (mutable; only ``ReadmissionSchedule`` writes it)."""

    # The ejection (its monotonic time) these fields belong to; None: never seen ejected.
    ejection: float | None = None
    # Start of the latest attempt: the tick's anchor.
    last_started: float | None = None
    # Consecutive setbacks, and the earliest time a health answer may start an attempt.
    level: int = 0
    not_before: float = -math.inf
    # First success of the current run of health successes since the ejection.
    health_since: float | None = None
    # A failed or silent health check was seen since the ejection.
    seen_down: bool = False
    # The ejection's cause is evidence a health success answers (not failed inference).
    health_decides: bool = True
    readmitted_at: float | None = None
    # Brought back from before a removal: the next ejection (its re-addition) keeps the backoff.
    carried: bool = False


class ReadmissionSchedule:
    """Per engine: due on a health success after its backoff, or on the ``probe_interval_s`` tick."""

    def __init__(self, names: Iterable[str], *, probe_interval_s: float, backoff_base_s: float) -> None:
        if probe_interval_s <= 0 or backoff_base_s <= 0:
            raise ValueError("probe_interval_s and backoff_base_s must be > 0")
        self.probe_interval_s = probe_interval_s
        self.backoff_base_s = min(backoff_base_s, probe_interval_s)
        self._engines = {name: EngineSchedule() for name in names}
        # Engines removed lately, with their state and when: one added back within probe_interval_s
        # (discovery: a key that comes and goes) keeps its backoff instead of starting fresh.
        self._departed: dict[str, tuple[EngineSchedule, float]] = {}

    def __repr__(self) -> str:
        out = ", ".join(f"{name} level {state.level}" for name, state in self._engines.items() if state.level)
        return f"<ReadmissionSchedule [{out or 'no backoff'}]>"

    def add(self, name: str, now: float | None = None) -> None:
        """Track an engine added to the set: fresh, or, back within probe_interval_s of its removal, as it was.

        An engine back that soon is a flap: its ejection on arrival is judged
        as any other (a readmission that did not last is a setback) and a
        backoff it had stays, so coming and going never readmits it faster.
        """
        departed = self._departed.pop(name, None)
        if departed is not None and now is not None and now - departed[1] < self.probe_interval_s:
            state = departed[0]
            state.ejection = None
            state.health_since = None
            state.seen_down = False
            state.carried = state.readmitted_at is None
            self._engines[name] = state
            return
        self._engines[name] = EngineSchedule()

    def remove(self, name: str, now: float | None = None) -> None:
        """Stop tracking an engine removed from the set (kept a while, ``add``, when ``now`` is given)."""
        state = self._engines.pop(name, None)
        if state is None or now is None:
            return
        self._departed[name] = (state, now)
        while len(self._departed) > _MAX_DEPARTED:
            del self._departed[next(iter(self._departed))]

    def state(self, name: str) -> EngineSchedule:
        """The engine's state (read it, do not change it)."""
        return self._engines[name]

    def backoff_s(self, level: int) -> float:
        """The wait after ``level`` consecutive setbacks: 0, then base doubling, capped at probe_interval_s."""
        if level <= 0:
            return 0.0
        return min(self.probe_interval_s, self.backoff_base_s * 2.0 ** min(level - 1, 62))

    # ----- what happened -----------------------------------------------------------------

    def ejected(self, name: str, ejected_at: float, *, health_decides: bool = True) -> None:
        """The engine is out since ``ejected_at``; a new ejection resets the run and judges the last readmission."""
        state = self._engines[name]
        if state.ejection == ejected_at:
            return
        state.ejection = ejected_at
        state.health_since = None
        state.seen_down = False
        state.health_decides = health_decides
        readmitted_at = state.readmitted_at
        state.readmitted_at = None
        if state.carried:
            state.carried = False  # out before its removal, out again on its return: its backoff stands
        elif readmitted_at is not None and ejected_at - readmitted_at < self.probe_interval_s:
            self._setback(state, ejected_at)  # a flap: the readmission did not last
        else:
            state.level = 0
            state.not_before = -math.inf

    def health(self, name: str, ok: bool, now: float) -> None:
        """A health answer: a success starts (or continues) the run, anything else ends it."""
        state = self._engines[name]
        if not ok:
            state.health_since = None
            state.seen_down = True
        elif state.health_since is None:
            state.health_since = now

    def started(self, name: str, now: float) -> None:
        """An attempt began (the tick's anchor)."""
        self._engines[name].last_started = now

    def refused(self, name: str, now: float, *, check: str | None, on_health: bool) -> None:
        """An automatic attempt was refused at ``check``; a tick attempt that found the engine down is no setback."""
        if check == "health" and not on_health:
            return
        self._setback(self._engines[name], now)

    def readmitted(self, name: str, now: float) -> float | None:
        """The engine is back in placement: seconds since its health returned, or None when not seen."""
        state = self._engines[name]
        # An engine whose health never went away (ejected for failed inference) has no "health returned".
        since = state.health_since if state.health_decides or state.seen_down else None
        state.health_since = None
        state.readmitted_at = now
        state.ejection = None
        return None if since is None else max(0.0, now - since)

    # ----- when -----------------------------------------------------------------------------

    def due_on_health(self, name: str, now: float) -> bool:
        """A health success was seen since the ejection (after a down, when health does not decide), backoff over."""
        state = self._engines[name]
        return (state.health_since is not None and (state.health_decides or state.seen_down)
                and state.not_before <= now)

    def tick_at(self, name: str, ejected_at: float | None) -> float:
        """When the ``probe_interval_s`` tick next falls due for an engine ejected at ``ejected_at``."""
        ejected = ejected_at if ejected_at is not None else -math.inf
        last = self._engines[name].last_started
        anchor = last if last is not None and last >= ejected else ejected
        return anchor + self.probe_interval_s

    def _setback(self, state: EngineSchedule, now: float) -> None:
        state.level += 1
        state.not_before = now + self.backoff_s(state.level)
