"""The monitor pass, one test (or more) per sentence of the spec's "Monitoring and readiness".

Stages are fakes that sleep, raise or hang on chosen passes; time is trio's
MockClock with autojump, so every time asserted here is exact.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable

import pytest
import trio
from trio.testing import MockClock

from narwhal.control.monitor import RUNS_AFTER, STAGE_NAMES, STAGE_TIMEOUT_CLASS, Monitor, StageError
from narwhal.fleet.admission import Admission
from narwhal.obs.router_metrics import RouterMetrics
from tests.test_request_core import SSE, Sink, make_core
from tests.test_request_core import body as request_body

STAGE_TIMEOUT_S = 2.0
INTERVAL_S = 1.0
LIMIT = 3


class FakeStage:
    """A stage that takes ``duration_s``, raises on ``fail_on`` passes and hangs on ``hang_on`` passes."""

    def __init__(self, name: str, *, duration_s: float = 0.0, fail_on: Iterable[int] = (),
                 hang_on: Iterable[int] = (), error: type[Exception] = RuntimeError,
                 durations: dict[int, float] | None = None) -> None:
        self.name = name
        self.duration_s = duration_s
        self.durations = durations or {}
        self.fail_on = set(fail_on)
        self.hang_on = set(hang_on)
        self.error = error
        self.started: dict[int, float] = {}
        self.finished: dict[int, float] = {}

    async def run(self, pass_number: int) -> None:
        self.started[pass_number] = trio.current_time()
        if pass_number in self.hang_on:
            await trio.sleep_forever()
        await trio.sleep(self.durations.get(pass_number, self.duration_s))
        if pass_number in self.fail_on:
            raise self.error(f"{self.name} broke in pass {pass_number}")
        self.finished[pass_number] = trio.current_time()


def make_monitor(stages: list[FakeStage], *, limit: int = LIMIT, admission: Admission | None = None,
                 metrics: RouterMetrics | None = None) -> Monitor:
    return Monitor(stages, interval_s=INTERVAL_S, stage_timeout_s=STAGE_TIMEOUT_S, failure_limit=limit,
                   admission=admission or Admission(), metrics=metrics or RouterMetrics())


def all_stages(**overrides: FakeStage) -> list[FakeStage]:
    return [overrides.get(name) or FakeStage(name) for name in STAGE_NAMES]


def events(caplog: pytest.LogCaptureFixture, event: str) -> list[dict]:
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "narwhal.events"]
    return [line for line in lines if line["event"] == event]


@pytest.fixture(autouse=True)
def _capture_events(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")


# -- "A monitor pass executes several operational stages independently" ----------------


def test_stage_names_are_the_spec_list_in_order() -> None:
    assert STAGE_NAMES == ("controller", "health", "drain", "rollover", "readmission",
                           "liveness", "telemetry", "persistence")


async def test_a_failing_stage_does_not_stop_its_siblings(autojump_clock: MockClock) -> None:
    stages = all_stages(health=FakeStage("health", duration_s=0.1, fail_on={1}))
    for stage in stages:
        if stage.name != "health":
            stage.duration_s = 0.5
    monitor = make_monitor(stages)
    result = await monitor.run_pass()
    assert [(e.stage, e.error_class, e.message) for e in result.errors] == [
        ("health", "RuntimeError", "health broke in pass 1")]
    # Every other stage ran to its end, including those that wait for health.
    assert {s.name for s in stages if 1 in s.finished} == set(STAGE_NAMES) - {"health"}


async def test_stages_start_after_the_stages_they_read(autojump_clock: MockClock) -> None:
    durations = {"health": 0.4, "rollover": 0.2, "drain": 0.7, "readmission": 0.1,
                 "controller": 0.3, "liveness": 0.5, "telemetry": 0.05, "persistence": 0.1}
    stages = [FakeStage(name, duration_s=durations[name]) for name in STAGE_NAMES]
    by_name = {s.name: s for s in stages}
    await make_monitor(stages).run_pass()
    starts = {name: by_name[name].started[1] for name in STAGE_NAMES}
    assert starts == {"health": 0.0, "drain": 0.0, "rollover": 0.0, "readmission": 0.0,
                      "controller": 0.4,           # after rollover (0.2) and health (0.4)
                      "liveness": 0.4,             # after health
                      "telemetry": 0.2,            # after rollover
                      "persistence": 0.9}          # after all seven; liveness ends last at 0.9
    assert RUNS_AFTER["persistence"] == tuple(n for n in STAGE_NAMES if n != "persistence")
    assert trio.current_time() == 1.0


async def test_a_failed_predecessor_still_lets_its_dependents_run(autojump_clock: MockClock) -> None:
    stages = all_stages(health=FakeStage("health", fail_on={1}))
    await make_monitor(stages).run_pass()
    by_name = {s.name: s for s in stages}
    assert 1 in by_name["liveness"].finished and 1 in by_name["persistence"].finished


async def test_any_subset_of_stages_runs_and_unknown_names_have_no_order(autojump_clock: MockClock) -> None:
    stages = [FakeStage("persistence", duration_s=0.1), FakeStage("extra", duration_s=0.3)]
    result = await make_monitor(stages).run_pass()
    assert result.ok and stages[0].started[1] == 0.0 and stages[1].started[1] == 0.0


class FakeNowStage(FakeStage):
    """A stage that never waits: the pass calls ``run_now``; ``run`` must not be used."""

    def __init__(self, name: str, *, fail_on: Iterable[int] = ()) -> None:
        super().__init__(name, fail_on=fail_on)

    async def run(self, pass_number: int) -> None:
        raise AssertionError("a stage with run_now is called, not run in a task")

    def run_now(self, pass_number: int) -> None:
        self.started[pass_number] = trio.current_time()
        if pass_number in self.fail_on:
            raise self.error(f"{self.name} broke in pass {pass_number}")
        self.finished[pass_number] = trio.current_time()


NEVER_WAIT = ("controller", "drain", "rollover", "liveness", "telemetry")


def mixed_stages(durations: dict[str, float], fail_on: dict[str, set[int]] | None = None) -> list[FakeStage]:
    """The shipped mix: the stages that never wait as plain calls, the others as tasks taking ``durations``."""
    fail_on = fail_on or {}
    return [FakeNowStage(name, fail_on=fail_on.get(name, ())) if name in NEVER_WAIT
            else FakeStage(name, duration_s=durations.get(name, 0.0), fail_on=fail_on.get(name, ()))
            for name in STAGE_NAMES]


async def test_plain_call_stages_start_after_the_stages_they_read(autojump_clock: MockClock) -> None:
    stages = mixed_stages({"health": 0.4, "readmission": 0.7, "persistence": 0.1})
    by_name = {s.name: s for s in stages}
    await make_monitor(stages).run_pass()
    starts = {name: by_name[name].started[1] for name in STAGE_NAMES}
    assert starts == {"health": 0.0, "drain": 0.0, "rollover": 0.0, "readmission": 0.0,
                      "controller": 0.4,           # after rollover (called at once) and health (0.4)
                      "liveness": 0.4,             # after health
                      "telemetry": 0.0,            # after rollover, called before it in the list's order
                      "persistence": 0.7}          # after all seven; readmission ends last at 0.7
    assert trio.current_time() == pytest.approx(0.8)


async def test_a_plain_call_stage_that_raises_is_recorded_and_stops_nothing(
        autojump_clock: MockClock, caplog: pytest.LogCaptureFixture) -> None:
    stages = mixed_stages({"health": 0.2}, fail_on={"rollover": {1}, "liveness": {1}})
    metrics = RouterMetrics()
    monitor = make_monitor(stages, metrics=metrics)
    result = await monitor.run_pass()
    # Counted, logged and streaked as a task's error is.
    assert metrics.stage_errors.values == {("rollover", "RuntimeError"): 1, ("liveness", "RuntimeError"): 1}
    assert [(line["stage"], line["class"], line["pass"]) for line in events(caplog, "stage_error")] == [
        ("rollover", "RuntimeError", 1), ("liveness", "RuntimeError", 1)]
    assert monitor.failure_streak == 1
    assert [(e.stage, e.error_class, e.message) for e in result.errors] == [
        ("rollover", "RuntimeError", "rollover broke in pass 1"),
        ("liveness", "RuntimeError", "liveness broke in pass 1")]
    assert {s.name for s in stages if 1 in s.finished} == set(STAGE_NAMES) - {"rollover", "liveness"}
    assert {s.name for s in stages if 1 in s.started} == set(STAGE_NAMES)


class SpawnCount(trio.abc.Instrument):
    def __init__(self) -> None:
        self.names: list[str] = []

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self.names.append(task.name)


async def test_a_pass_starts_a_task_only_for_stages_that_wait_and_not_for_its_last(autojump_clock: MockClock) -> None:
    # The pass's own task calls the plain stages and runs persistence, the last, itself.
    stages = mixed_stages({"health": 0.1, "readmission": 0.1, "persistence": 0.1})
    spawned = SpawnCount()
    trio.lowlevel.add_instrument(spawned)
    try:
        result = await make_monitor(stages).run_pass()
    finally:
        trio.lowlevel.remove_instrument(spawned)
    assert result.ok
    assert sorted(spawned.names) == ["monitor stage health", "monitor stage readmission"]


async def test_stages_that_wait_for_each_other_are_a_defect_not_a_hang(autojump_clock: MockClock) -> None:
    monitor = make_monitor([FakeStage("a"), FakeStage("b")])
    monitor._after = {"a": ("b",), "b": ("a",)}
    with pytest.RaisesGroup(pytest.RaisesExc(RuntimeError, match="wait for each other")):
        await monitor.run_pass()


def test_duplicate_stage_names_are_refused() -> None:
    with pytest.raises(ValueError, match="unique"):
        make_monitor([FakeStage("health"), FakeStage("health")])


# -- "Narwhal records a stage error, increments the relevant counters, and continues" ----


async def test_each_stage_error_is_counted_and_logged_as_one_json_line(
        autojump_clock: MockClock, caplog: pytest.LogCaptureFixture) -> None:
    metrics = RouterMetrics()
    stages = all_stages(persistence=FakeStage("persistence", fail_on={1, 2}, error=OSError),
                        drain=FakeStage("drain", fail_on={2}, error=ValueError))
    monitor = make_monitor(stages, metrics=metrics)
    await monitor.run_pass()
    second = await monitor.run_pass()
    # Errors of one pass come in stage order, whatever order they happened in.
    assert [(e.stage, e.error_class, e.pass_number) for e in second.errors] == [
        ("drain", "ValueError", 2), ("persistence", "OSError", 2)]
    assert monitor.last_errors == second.errors
    assert metrics.stage_errors.get("persistence", "OSError") == 2
    assert metrics.stage_errors.get("drain", "ValueError") == 1
    assert metrics.stage_errors.values == {("persistence", "OSError"): 2, ("drain", "ValueError"): 1}
    rendered = metrics.render()
    assert 'narwhal_monitor_stage_errors_total{stage="persistence",class="OSError"} 2' in rendered
    assert 'narwhal_monitor_stage_errors_total{stage="drain",class="ValueError"} 1' in rendered

    lines = events(caplog, "stage_error")
    assert [(line["stage"], line["class"], line["pass"], line["message"]) for line in lines] == [
        ("persistence", "OSError", 1, "persistence broke in pass 1"),
        ("drain", "ValueError", 2, "drain broke in pass 2"),
        ("persistence", "OSError", 2, "persistence broke in pass 2"),
    ]
    required = {"event", "stage", "class", "pass", "message", "ts"}
    for line in lines:
        # log_event adds the level; nothing else rides along.
        assert required <= line.keys() and line.keys() - required <= {"level"}
        assert line["ts"].endswith("Z")


async def test_an_exception_group_from_a_stage_nursery_reports_its_one_exception(
        autojump_clock: MockClock) -> None:
    class NurseryStage:
        name = "health"

        async def run(self, pass_number: int) -> None:
            async def check() -> None:
                raise ConnectionResetError("engine went away")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(check)

    result = await make_monitor([NurseryStage()]).run_pass()
    assert [(e.stage, e.error_class, e.message) for e in result.errors] == [
        ("health", "ConnectionResetError", "engine went away")]


async def test_a_hanging_stage_is_cut_at_stage_timeout_and_counted_as_its_timeout(
        autojump_clock: MockClock, caplog: pytest.LogCaptureFixture) -> None:
    metrics = RouterMetrics()
    stages = all_stages(health=FakeStage("health", hang_on={1}),
                        drain=FakeStage("drain", duration_s=0.5))
    monitor = make_monitor(stages, metrics=metrics)
    result = await monitor.run_pass()
    assert result.errors == [StageError(stage="health", error_class=STAGE_TIMEOUT_CLASS,
                                        message="stage did not finish within stage_timeout_s (2 s)",
                                        pass_number=1, at=2.0)]
    assert STAGE_TIMEOUT_CLASS == "TimeoutError"
    by_name = {s.name: s for s in stages}
    assert by_name["drain"].finished[1] == 0.5          # a sibling is not held up
    assert by_name["liveness"].started[1] == 2.0        # dependents start once health is cut
    assert result.finished_at == 2.0 and trio.current_time() == 2.0
    assert metrics.stage_errors.get("health", "TimeoutError") == 1
    assert [(line["stage"], line["class"]) for line in events(caplog, "stage_error")] == [
        ("health", "TimeoutError")]


async def test_a_stage_timeout_starts_when_the_stage_starts(autojump_clock: MockClock) -> None:
    # Persistence waits 1.5 s for its predecessors, then may use its own full 2 s.
    stages = all_stages(drain=FakeStage("drain", duration_s=1.5),
                        persistence=FakeStage("persistence", duration_s=1.9))
    result = await make_monitor(stages).run_pass()
    assert result.ok and result.finished_at == 3.4


# -- "Any pass containing at least one stage exception increments the streak" ------------
# -- "When that streak reaches controller.monitor_failure_limit, ... stops admissions" ---


async def test_the_streak_reaching_the_limit_closes_admission_with_the_ready_text(
        autojump_clock: MockClock, caplog: pytest.LogCaptureFixture) -> None:
    admission = Admission()
    stages = all_stages(health=FakeStage("health", fail_on={1, 2}),
                        drain=FakeStage("drain", fail_on={3}, error=ValueError),
                        persistence=FakeStage("persistence", fail_on={3, 4}, error=PermissionError))
    monitor = make_monitor(stages, admission=admission)
    await monitor.run_pass()
    await monitor.run_pass()
    assert monitor.failure_streak == 2 and admission.reason() is None
    assert monitor.degraded_reason is None and not events(caplog, "monitor_degraded")

    await monitor.run_pass()
    # The latest failing pass had drain and persistence errors: the first in stage order.
    assert monitor.failure_streak == 3
    assert admission.reason() == "monitoring degraded: drain ValueError"
    assert admission.held_by("monitor") == "monitoring degraded: drain ValueError"
    assert monitor.degraded_reason == "monitoring degraded: drain ValueError"

    await monitor.run_pass()
    # Still degraded: the text follows the latest failing pass, logged as degraded only once.
    assert admission.reason() == "monitoring degraded: persistence PermissionError"
    degraded = events(caplog, "monitor_degraded")
    assert [(d["reason"], d["stage"], d["class"], d["pass"], d["streak"]) for d in degraded] == [
        ("monitoring degraded: drain ValueError", "drain", "ValueError", 3, 3)]


async def test_the_ready_text_names_the_first_failing_stage_in_stage_order_not_in_time(
        autojump_clock: MockClock) -> None:
    admission = Admission()
    stages = all_stages(rollover=FakeStage("rollover", fail_on={1}, error=KeyError),
                        controller=FakeStage("controller", duration_s=0.5, fail_on={1}, error=ValueError))
    result = await make_monitor(stages, limit=1, admission=admission).run_pass()
    assert [(e.stage, e.at) for e in result.errors] == [("controller", 0.5), ("rollover", 0.0)]
    assert admission.reason() == "monitoring degraded: controller ValueError"


async def test_a_hang_reads_as_a_timeout_on_ready(autojump_clock: MockClock) -> None:
    admission = Admission()
    monitor = make_monitor(all_stages(health=FakeStage("health", hang_on={1})), limit=1, admission=admission)
    await monitor.run_pass()
    assert admission.reason() == "monitoring degraded: health TimeoutError"


async def test_a_clean_pass_before_the_limit_resets_the_streak(autojump_clock: MockClock) -> None:
    admission = Admission()
    monitor = make_monitor(all_stages(health=FakeStage("health", fail_on={1, 2, 4, 5})), admission=admission)
    streaks = []
    for _ in range(5):
        await monitor.run_pass()
        streaks.append(monitor.failure_streak)
    assert streaks == [1, 2, 0, 1, 2]
    assert admission.reason() is None


async def test_other_owners_closures_are_left_alone(autojump_clock: MockClock) -> None:
    admission = Admission()
    admission.close("lease", "standby: lease held by r1")
    monitor = make_monitor(all_stages(health=FakeStage("health", fail_on={1})), limit=1, admission=admission)
    await monitor.run_pass()
    await monitor.run_pass()
    assert admission.held_by("monitor") is None
    assert admission.reason() == "standby: lease held by r1"


# -- "Monitoring remains active while the router is degraded. One fully successful pass
#     clears the failure streak and reopens admission." ---------------------------------


async def test_monitoring_stays_active_while_degraded_and_one_clean_pass_reopens(
        autojump_clock: MockClock, caplog: pytest.LogCaptureFixture) -> None:
    admission = Admission()
    metrics = RouterMetrics()
    health = FakeStage("health", fail_on={1, 2, 3, 4})
    monitor = make_monitor(all_stages(health=health), admission=admission, metrics=metrics)
    reasons: list[str | None] = []
    with trio.move_on_at(5.5):
        async with trio.open_nursery() as nursery:
            await nursery.start(monitor.run)
            for at in (0.5, 1.5, 2.5, 3.5, 4.5):
                await trio.sleep_until(at)
                reasons.append(admission.reason())
    degraded = "monitoring degraded: health RuntimeError"
    assert reasons == [None, None, degraded, degraded, None]
    # Passes kept running on schedule while admission was closed.
    assert sorted(health.started.items()) == [(1, 0.0), (2, 1.0), (3, 2.0), (4, 3.0), (5, 4.0), (6, 5.0)]
    assert monitor.failure_streak == 0 and monitor.degraded_reason is None
    recovered = events(caplog, "monitor_recovered")
    assert [(r["pass"], r["failed_passes"], r["admission_reopened"]) for r in recovered] == [(5, 4, True)]
    assert "narwhal_monitor_failure_streak 0" in metrics.render()
    assert "narwhal_monitor_degraded 0" in metrics.render()


async def test_recovery_before_the_limit_is_logged_without_reopening(
        autojump_clock: MockClock, caplog: pytest.LogCaptureFixture) -> None:
    monitor = make_monitor(all_stages(health=FakeStage("health", fail_on={1})))
    await monitor.run_pass()
    await monitor.run_pass()
    assert [(r["pass"], r["failed_passes"], r["admission_reopened"])
            for r in events(caplog, "monitor_recovered")] == [(2, 1, False)]
    await monitor.run_pass()
    assert len(events(caplog, "monitor_recovered")) == 1


async def test_work_admitted_before_degrading_runs_to_completion(autojump_clock: MockClock) -> None:
    # "Existing requests continue to completion": a real request core shares the
    # monitor's admission. A stream admitted before the monitor degrades keeps
    # streaming to its end; a request arriving after gets 503. If degrading cut
    # admitted work (or the core re-checked admission mid-request), the first
    # stream would end early or without [DONE].
    core, _, pool, admission = make_core()
    monitor = make_monitor(all_stages(health=FakeStage("health", fail_on={1})), limit=1, admission=admission)
    resume = trio.Event()
    pool.decode.append([SSE[0], resume, SSE[1]])
    admitted, late = Sink(), Sink()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(core.handle, "/v1/completions", request_body(stream=True), None, admitted)
        await trio.sleep(1.0)
        assert admitted.started and admitted.writes == [SSE[0]]     # mid-stream
        await monitor.run_pass()
        assert admission.reason() == "monitoring degraded: health RuntimeError"
        await core.handle("/v1/completions", request_body(stream=True), None, late)
        assert late.status == 503 and "monitoring degraded" in late.json()["error"]["message"]
        await trio.sleep(2.0)
        resume.set()
    assert admitted.status == 200 and admitted.ended
    assert b"".join(admitted.writes) == b"".join(SSE)
    assert core.in_flight.total() == 0


# -- "Restarting the router starts with fresh monitor-failure counters." -----------------


async def test_a_new_monitor_starts_with_a_zero_streak(autojump_clock: MockClock) -> None:
    failing = {1, 2, 3, 4, 5}
    old = make_monitor(all_stages(health=FakeStage("health", fail_on=failing)))
    for _ in range(3):
        await old.run_pass()
    assert old.failure_streak == 3 and old.degraded_reason is not None

    admission = Admission()
    new = make_monitor(all_stages(health=FakeStage("health", fail_on=failing)), admission=admission)
    assert (new.failure_streak, new.degraded_reason, new.passes, new.last_errors) == (0, None, 0, [])
    await new.run_pass()
    assert new.failure_streak == 1 and admission.reason() is None


# -- schedule and cancellation -----------------------------------------------------------


async def test_passes_stay_on_their_absolute_grid_after_an_overrun(autojump_clock: MockClock) -> None:
    # Pass 2 (due at 1.0) takes 2.5 s: pass 3 starts at once at 3.5, skipping the
    # missed slots 2.0 and 3.0, and pass 4 is back on the grid at 4.0.
    health = FakeStage("health", duration_s=0.3, durations={2: 2.5, 3: 0.2})
    monitor = Monitor([health], interval_s=INTERVAL_S, stage_timeout_s=10.0, failure_limit=LIMIT,
                      admission=Admission(), metrics=RouterMetrics())
    with trio.move_on_at(6.5):
        await monitor.run()
    assert health.started == {1: 0.0, 2: 1.0, 3: 3.5, 4: 4.0, 5: 5.0, 6: 6.0}
    assert monitor.passes == 6


async def test_the_grid_is_anchored_at_start_and_short_passes_wait_for_their_slot(
        autojump_clock: MockClock) -> None:
    autojump_clock.jump(10.25)
    health = FakeStage("health", duration_s=0.1)
    monitor = Monitor([health], interval_s=0.5, stage_timeout_s=1.0, failure_limit=LIMIT,
                      admission=Admission(), metrics=RouterMetrics())
    with trio.move_on_at(11.5):
        await monitor.run()
    assert sorted(health.started.values()) == [10.25, 10.75, 11.25]


async def test_cancelling_the_monitor_propagates_through_a_running_pass(
        autojump_clock: MockClock, caplog: pytest.LogCaptureFixture) -> None:
    metrics = RouterMetrics()
    stages = all_stages(health=FakeStage("health", hang_on={1}), drain=FakeStage("drain", hang_on={1}))
    monitor = make_monitor(stages, metrics=metrics)
    returned = False
    with trio.move_on_after(0.5) as scope:
        await monitor.run_pass()
        returned = True
    assert scope.cancelled_caught and not returned
    assert trio.current_time() == 0.5
    # The cancellation was not mistaken for stage errors.
    assert metrics.stage_errors.values == {}
    assert monitor.failure_streak == 0 and not events(caplog, "stage_error")


async def test_cancelling_a_running_monitor_loop_ends_it(autojump_clock: MockClock) -> None:
    monitor = make_monitor(all_stages())
    async with trio.open_nursery() as nursery:
        await nursery.start(monitor.run)
        await trio.sleep(2.5)
        nursery.cancel_scope.cancel()
    assert monitor.passes == 3 and trio.current_time() == 2.5


async def test_monitor_gauges_render(autojump_clock: MockClock) -> None:
    metrics = RouterMetrics()
    monitor = make_monitor(all_stages(health=FakeStage("health", fail_on={1}, duration_s=0.25)),
                           metrics=metrics, limit=1)
    await monitor.run_pass()
    text = metrics.render()
    assert "narwhal_monitor_failure_streak 1" in text
    assert "narwhal_monitor_degraded 1" in text
    assert "narwhal_monitor_passes 1" in text
    assert "narwhal_monitor_last_pass_seconds 0.25" in text
    assert repr(monitor) == ("<Monitor [8 stages | pass 1 | streak 1/1 | "
                             "degraded: monitoring degraded: health RuntimeError]>")


async def test_a_reloaded_interval_starts_a_new_grid_at_the_pass_just_run(autojump_clock: MockClock) -> None:
    # A reload during pass 2 (at 1.0) sets 0.25 s: pass 3 is due 0.25 after pass 2's slot.
    health = FakeStage("health", duration_s=0.1)
    monitor = Monitor([health], interval_s=INTERVAL_S, stage_timeout_s=1.0, failure_limit=LIMIT,
                      admission=Admission(), metrics=RouterMetrics())

    async def reload_at(at: float) -> None:
        await trio.sleep_until(at)
        monitor.interval_s = 0.25

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reload_at, 1.05)
        with trio.move_on_at(1.8):
            await monitor.run()
    assert sorted(health.started.values()) == [0.0, 1.0, 1.25, 1.5, 1.75]
