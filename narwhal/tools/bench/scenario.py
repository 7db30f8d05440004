"""The fault scenario: during the load, kill a decode engine and restart it, then make another answer 5xx.

Timeline (seconds from the start of the load): at 2 s ``d1`` is killed with
SIGKILL (streams in flight on it are cut); after ``downtime_s`` it is started
again on the same port as a new process; one second later ``d2`` starts
answering every decode with ``status`` until ``fault_5xx_s`` later. The two
faults do not overlap, so a client-visible failure can be told apart by when
it happened, whatever the router.

What is watched: the mock engines' ``/mock/stats`` (which engines got requests,
for any router), Narwhal's ``/admin/engines`` (eligibility) and its JSON logs
(each ``engine_failure`` names the engine it was attempted on).

The restart is timed from the moment the new process is launched; from then on
the restarted engine's own ``/health`` and (Narwhal) its ``/admin/engines/{name}``
entry are polled every 10 ms, so "eligible after its health returned" (the
router's share of the recovery) is told apart from "eligible after restart"
(which includes the engine's own start-up).
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import httpx
import trio

from narwhal.tools.bench.fleet import BenchFleet, Target
from narwhal.tools.bench.load import LoadResult, LoadState
from narwhal.tools.bench.report import FaultReport, percentile

__all__ = ["FaultScenario"]

_KILL_AT_S = 2.0
_GAP_BEFORE_5XX_S = 1.0
_POLL_S = 0.05


def fault_timeline_s(downtime_s: float, fault_5xx_s: float) -> float:
    """The least load duration that covers the fault timeline: kill, downtime, a gap, the 5xx window.

    The restarted engine's own start-up comes on top; a load shorter than this ends before the 5xx window does.
    """
    return _KILL_AT_S + downtime_s + _GAP_BEFORE_5XX_S + fault_5xx_s


def fault_timeline_problem(duration_s: float, downtime_s: float, fault_5xx_s: float) -> str | None:
    """Why a load of ``duration_s`` cannot show the fault timeline, or None when it is long enough."""
    least = fault_timeline_s(downtime_s, fault_5xx_s)
    if duration_s >= least:
        return None
    return (f"--duration-s {duration_s:g} ends before the fault timeline does (kill at {_KILL_AT_S:g} s, "
            f"--fault-downtime-s {downtime_s:g}, a {_GAP_BEFORE_5XX_S:g} s gap, --fault-5xx-s {fault_5xx_s:g}: "
            f"at least {least:g} s, and a few more to see the recovery)")
# The restarted engine's health and eligibility: finer, and only until each is seen.
_RESTART_POLL_S = 0.01
_COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
_CUT_KINDS = ("sse_error", "truncated", "no_done")
# The report lists at most this many failed requests and router failure lines.
_LISTED = 50


def _since(at: float | None, start: float | None) -> float | None:
    """Seconds from ``start`` to ``at``, rounded to the millisecond; None when either was not seen."""
    if at is None or start is None:
        return None
    return round(at - start, 3)


def _iso_to_epoch(ts: str) -> float | None:
    try:
        return datetime.datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
    except (ValueError, AttributeError):
        return None


class FaultScenario:
    """Runs the fault timeline beside a load (``run``) and reports what happened (``report``)."""

    def __init__(self, *, nursery: trio.Nursery, fleet: BenchFleet, target: Target, client: httpx.AsyncClient,
                 downtime_s: float, fault_5xx_s: float, status: int, load_duration_s: float | None,
                 probe_interval_s: float = 5.0) -> None:
        self.nursery = nursery
        self.fleet = fleet
        self.target = target
        self.client = client
        self.downtime_s = downtime_s
        self.fault_5xx_s = fault_5xx_s
        self.status = status
        self.load_duration_s = load_duration_s
        self.probe_interval_s = probe_interval_s
        decode = fleet.names("decode")
        self.killed, self.failing = decode[0], decode[1]
        self.timeline: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self._t0 = 0.0
        # Times are seconds since the load started (trio clock); wall clock kept to read router logs.
        self.kill_at: float | None = None
        self.kill_wall: float | None = None
        self.restart_at: float | None = None
        self.restart_wall: float | None = None
        self.fault_at: float | None = None
        self.fault_wall: float | None = None
        self.fault_cleared_at: float | None = None
        self.first_served_at: float | None = None
        self.health_returned_at: float | None = None
        self.eligible_again_at: float | None = None
        self.failing_requests: int | None = None
        self.failing_last_request_at: float | None = None
        self.eligibility: dict[str, list[tuple[float, bool]]] = {self.killed: [], self.failing: []}

    def _now(self) -> float:
        return trio.current_time() - self._t0

    def _mark(self, what: str) -> float:
        at = self._now()
        self.timeline.append({"at_s": round(at, 3), "event": what})
        return at

    async def run(self, state: LoadState) -> None:
        """The timeline; started beside the load, cancelled when the load ends."""
        self._t0 = state.started_at or trio.current_time()
        async with trio.open_nursery() as watchers:
            if self.target.is_narwhal:
                watchers.start_soon(self._watch_eligibility)
            await trio.sleep_until(self._t0 + _KILL_AT_S)
            self.fleet.engines[self.killed].kill()
            self.kill_wall = time.time()
            self.kill_at = self._mark(f"{self.killed} killed (SIGKILL)")
            await trio.sleep_until(self._t0 + self.kill_at + self.downtime_s)
            old = self.fleet.engines[self.killed]
            self.restart_wall = time.time()
            self.restart_at = self._mark(f"{self.killed} restarted on port {old.port} (process launched)")
            watchers.start_soon(self._watch_health_returned, old.url)
            if self.target.is_narwhal:
                watchers.start_soon(self._watch_eligible_again)
            engine = await self.fleet.restart(self.nursery, self.killed)
            watchers.start_soon(self._watch_first_served, engine.url)
            await trio.sleep(_GAP_BEFORE_5XX_S)
            failing_url = self.fleet.engines[self.failing].url
            before = await self._completions(failing_url)
            response = await self.client.post(failing_url + "/mock/faults", json={
                "mode": "status_5xx", "status": self.status, "legs": ["decode"]})
            response.raise_for_status()
            self.fault_wall = time.time()
            self.fault_at = self._mark(f"{self.failing} answers {self.status} to every decode")
            await self._watch_failing(failing_url, before, self._t0 + self.fault_at + self.fault_5xx_s)
            await self.client.delete(failing_url + "/mock/faults")
            self.fault_cleared_at = self._mark(f"{self.failing} fault cleared")
            await trio.sleep_forever()

    async def _completions(self, url: str) -> int | None:
        try:
            stats = (await self.client.get(url + "/mock/stats")).json()
        except httpx.HTTPError:
            return None
        return sum(stats["requests"].get(path, 0) for path in _COMPLETION_PATHS)

    async def _watch_failing(self, url: str, before: int | None, until: float) -> None:
        """Count the requests the failing engine gets while it fails, and when the last one came."""
        last = before
        while trio.current_time() < until:
            await trio.sleep(_POLL_S)
            count = await self._completions(url)
            if count is None or last is None:
                continue
            if count > last:
                self.failing_last_request_at = self._now() - (self.fault_at or 0.0)
                last = count
        if before is not None and last is not None:
            self.failing_requests = last - before

    async def _watch_first_served(self, url: str) -> None:
        while True:
            count = await self._completions(url)
            if count:
                self.first_served_at = self._now()
                self._mark(f"{self.killed} served its first request after the restart")
                return
            await trio.sleep(_POLL_S)

    async def _watch_health_returned(self, url: str) -> None:
        """Poll the restarted engine's ``/health`` until it first answers 200."""
        while True:
            try:
                if (await self.client.get(url + "/health")).status_code == 200:
                    self.health_returned_at = self._now()
                    self._mark(f"{self.killed} answered /health 200 after the restart")
                    return
            except httpx.HTTPError:
                pass
            await trio.sleep(_RESTART_POLL_S)

    async def _watch_eligible_again(self) -> None:
        """Poll Narwhal's view of the restarted engine until it is eligible again."""
        while True:
            try:
                engine = (await self.client.get(f"{self.target.url}/admin/engines/{self.killed}")).json()["engine"]
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                engine = {}
            if engine.get("eligible"):
                self.eligible_again_at = self._now()
                self._mark(f"{self.killed} eligible again")
                return
            await trio.sleep(_RESTART_POLL_S)

    async def _watch_eligibility(self) -> None:
        """Poll Narwhal's ``/admin/engines`` and record each change of eligibility of the two engines."""
        while True:
            try:
                engines = (await self.client.get(self.target.url + "/admin/engines")).json()["engines"]
            except (httpx.HTTPError, ValueError, KeyError):
                engines = []
            now = self._now()
            for engine in engines:
                history = self.eligibility.get(engine.get("name"))
                if history is None:
                    continue
                eligible = bool(engine.get("eligible"))
                if not history or history[-1][1] != eligible:
                    history.append((now, eligible))
            await trio.sleep(_POLL_S)

    # ----- the report ---------------------------------------------------------------

    def _first_change(self, name: str, to: bool, after: float | None) -> float | None:
        if after is None:
            return None
        for at, eligible in self.eligibility.get(name, []):
            if at >= after and eligible is to:
                return round(at - after, 3)
        return None

    def _dead_engine_attempts(self) -> tuple[int | None, float | None]:
        """From Narwhal's logs: engine failures on the killed engine between its kill and restart."""
        if not self.target.is_narwhal or self.kill_wall is None:
            return None, None
        end = self.restart_wall or float("inf")
        times = []
        for line in self.target.log_lines:
            if line.get("event") != "engine_failure" or line.get("engine") != self.killed:
                continue
            at = _iso_to_epoch(str(line.get("ts")))
            if at is not None and self.kill_wall - 0.01 <= at <= end:
                times.append(at)
        if not times:
            return 0, None
        return len(times), round(max(times) - self.kill_wall, 3)

    def _router_failures(self) -> list[dict[str, Any]]:
        """Narwhal's log lines for requests that failed and for engine failures, with seconds from the kill."""
        if not self.target.is_narwhal or self.kill_wall is None:
            return []
        found = []
        for line in self.target.log_lines:
            event = line.get("event")
            # A stream completed after a failure (continued_after) is listed too: what the kill did to it.
            failed_request = event == "request" and (line.get("status") != 200 or line.get("error")
                                                     or line.get("continued_after"))
            if not (failed_request or event in ("engine_failure", "engine_ejected", "engine_readmitted",
                                                "engine_hold_added", "engine_hold_cleared")):
                continue
            at = _iso_to_epoch(str(line.get("ts")))
            entry = {"after_kill_s": round(at - self.kill_wall, 3) if at is not None else None}
            entry.update({k: v for k, v in line.items() if k not in ("ts", "level")})
            found.append(entry)
        return found[:_LISTED * 2]

    def report(self, result: LoadResult) -> FaultReport:
        records = result.records
        total = len(records)
        failed = [r for r in records if r.kind != "ok"]
        by_kind: dict[str, int] = {}
        for record in failed:
            by_kind[record.kind] = by_kind.get(record.kind, 0) + 1
        cut = [r for r in failed if r.kind in _CUT_KINDS and r.status == 200]
        attempts, last_attempt = self._dead_engine_attempts()
        notes = list(self.notes)
        if self.kill_at is not None:
            in_flight = [r for r in failed if r.started_at <= self.kill_at <= r.started_at + r.total_s]
            notes.append(f"{len(in_flight)} of the {len(failed)} failed requests were in flight when "
                         f"{self.killed} was killed (any engine)")
        if not self.target.is_narwhal:
            notes.append("eligibility and attempts on the dead engine are read from Narwhal's admin API and "
                         "logs; this router has neither, so only the mocks' view and the client's are shown")
        if self.first_served_at is None and self.restart_at is not None:
            notes.append(f"{self.killed} served no request after its restart before the load ended")
        if self.load_duration_s is not None and self.fault_at is not None:
            margin = self.load_duration_s - (self.fault_at + self.fault_5xx_s)
            if margin < 0:
                notes.append(f"the load ended {-margin:.1f} s before the end of the 5xx window (the restarted "
                             "engine's start-up delayed it): recovery was not measured; give a longer --duration-s")
            elif margin < self.probe_interval_s:
                notes.append(f"the load ended {margin:.1f} s after the 5xx window, less than one probe "
                             f"interval ({self.probe_interval_s:g} s)")
        restart_after = self.restart_at
        first_served = _since(self.first_served_at, restart_after)
        eligible_again = (_since(self.eligible_again_at, restart_after) if self.eligible_again_at is not None
                          else self._first_change(self.killed, True, restart_after))
        return FaultReport(
            killed_engine=self.killed, failing_engine=self.failing, failing_status=self.status,
            timeline=self.timeline,
            goodput=round((total - len(failed)) / total, 5) if total else 0.0,
            requests_lost=len(failed), lost_by_kind=dict(sorted(by_kind.items())),
            streams_cut=len(cut), cut_with_error_event=sum(1 for r in cut if r.kind == "sse_error"),
            cut_silently=sum(1 for r in cut if r.kind != "sse_error"),
            attempts_on_dead_engine=attempts, dead_engine_last_attempt_s=last_attempt,
            dead_engine_ineligible_s=self._first_change(self.killed, False, self.kill_at),
            restarted_engine_eligible_s=eligible_again,
            restarted_engine_first_served_s=first_served,
            restarted_engine_health_s=_since(self.health_returned_at, restart_after),
            restarted_engine_eligible_after_health_s=_since(self.eligible_again_at, self.health_returned_at),
            restarted_engine_first_served_after_health_s=_since(self.first_served_at, self.health_returned_at),
            failing_engine_requests_during_fault=self.failing_requests,
            failing_engine_last_request_s=(round(self.failing_last_request_at, 3)
                                           if self.failing_last_request_at is not None else None),
            failing_engine_ineligible_s=self._first_change(self.failing, False, self.fault_at),
            failing_engine_eligible_again_s=self._first_change(self.failing, True, self.fault_cleared_at),
            failed_requests=[{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.as_dict().items()}
                             for r in failed[:_LISTED]],
            router_failures=self._router_failures(),
            notes=notes, **self._continuations())

    def _continuations(self) -> dict[str, Any]:
        """From Narwhal's request log lines: streams continued, continuations, the join gaps."""
        if not self.target.is_narwhal:
            return {}
        continued = [line for line in self.target.log_lines
                     if line.get("event") == "request" and line.get("continuations")]
        gaps = sorted(line["join_gap_ms"] for line in continued if line.get("join_gap_ms") is not None)
        join_gap = ({"p50": percentile(gaps, 50), "p99": percentile(gaps, 99), "max": gaps[-1]}
                    if gaps else None)
        return {"requests_continued": len(continued),
                "continuations": sum(int(line["continuations"]) for line in continued), "join_gap_ms": join_gap}
