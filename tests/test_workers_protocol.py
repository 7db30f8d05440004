"""The worker message protocol: framing, links, the worker's view, the controller's hub."""

from __future__ import annotations

import functools
import operator
import random
import socket
from collections.abc import Callable

import pytest
import trio
import trio.testing

from narwhal.errors import FailureClass, SuccessKind
from narwhal.fleet import Fleet
from narwhal.obs.metrics import Registry
from narwhal.workers.hub import WorkerHub
from narwhal.workers.link import LinkClosed, StreamLink
from narwhal.workers.metrics_sum import MetricsSum, export_state
from narwhal.workers.protocol import (
    ControllerMessage,
    Evidence,
    FrameDecoder,
    FrameError,
    MetricsState,
    Report,
    RequestSample,
    Snapshot,
    WorkerMessage,
    encode_frame,
)
from narwhal.workers.view import TelemetryRelay, WorkerView
from narwhal.workers.worker import others_in_flight
from tests.test_fleet import ENGINES, QUARANTINE_S, RANDOM_OPERATIONS, make_fleet, random_operation

# -- framing -------------------------------------------------------------------------------


def test_frames_round_trip_split_at_every_byte() -> None:
    messages = [Evidence(engine="d1", failure_class="stream"),
                Report(snapshot_seq=3, in_flight={"p1": 2}, requests_in_flight=2, metrics=MetricsState(),
                       samples=[RequestSample("p1", "d1", 0.01, None, None)])]
    wire = b"".join(encode_frame(m) for m in messages)
    decoder = FrameDecoder(WorkerMessage)
    got = []
    for i in range(len(wire)):
        got.extend(decoder.feed(wire[i:i + 1]))
    assert got == messages


def test_an_oversized_frame_is_a_protocol_error_not_a_buffer() -> None:
    decoder = FrameDecoder(WorkerMessage, max_frame_bytes=100)
    with pytest.raises(FrameError):
        decoder.feed((101).to_bytes(4, "big"))


def test_an_undecodable_frame_is_a_protocol_error() -> None:
    decoder = FrameDecoder(ControllerMessage)
    with pytest.raises(FrameError):
        decoder.feed((3).to_bytes(4, "big") + b"\xc1\xc1\xc1")


# -- the link ------------------------------------------------------------------------------


async def test_link_carries_messages_both_ways_over_a_socket_pair() -> None:
    a, b = socket.socketpair()
    left = StreamLink(trio.SocketStream(trio.socket.from_stdlib_socket(a)), WorkerMessage)
    right = StreamLink(trio.SocketStream(trio.socket.from_stdlib_socket(b)), ControllerMessage)
    got_left: list[object] = []
    got_right: list[object] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(left.run, got_left.append)
        await nursery.start(right.run, got_right.append)
        for i in range(100):
            right.send(Evidence(engine=f"e{i}", success_kind="decode_terminal"))
        left.send(Snapshot(seq=1, eligible={"prefill": ["p1"], "decode": []}))
        with trio.fail_after(5):
            while len(got_left) < 100 or not got_right:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert [m.engine for m in got_left] == [f"e{i}" for i in range(100)]  # type: ignore[attr-defined]
    assert got_right == [Snapshot(seq=1, eligible={"prefill": ["p1"], "decode": []})]


async def test_link_reports_the_peer_gone_and_refuses_to_send() -> None:
    a, b = socket.socketpair()
    link = StreamLink(trio.SocketStream(trio.socket.from_stdlib_socket(a)), WorkerMessage)
    b.shutdown(socket.SHUT_RDWR)
    b.close()
    with trio.fail_after(5):
        await link.run(lambda m: None)
    assert link.closed and link.close_reason == "peer closed the link"
    with pytest.raises(LinkClosed):
        link.send(Evidence(engine="d1", failure_class="stream"))


async def test_a_peer_that_never_reads_closes_the_link_at_the_bound() -> None:
    left, _right = trio.testing.memory_stream_pair()
    link = StreamLink(left, WorkerMessage, max_pending_bytes=1000)
    with pytest.raises(LinkClosed):
        for _ in range(1000):
            link.send(Evidence(engine="d1", failure_class="stream"))
    assert "unread" in (link.close_reason or "")


# -- the worker's view -----------------------------------------------------------------------


def test_view_refuses_at_the_lease_deadline_on_its_own_clock() -> None:
    now = [100.0]
    view = WorkerView(lambda m: None, clock=lambda: now[0])
    assert view.reason() is not None  # no snapshot yet: nothing is admitted
    view.apply(Snapshot(seq=1, eligible={"prefill": ["p1"], "decode": ["d1"]}, admit_until=105.0))
    assert view.reason() is None
    now[0] = 104.999
    assert view.reason() is None
    now[0] = 105.0
    assert view.reason() == "fenced: lease not renewed"
    assert view.readiness() == "fenced: lease not renewed"


def test_view_ignores_older_snapshots_and_turns_outcomes_into_evidence() -> None:
    sent: list[object] = []
    view = WorkerView(sent.append, clock=lambda: 0.0)
    view.apply(Snapshot(seq=2, eligible={"decode": ["d2"]}))
    view.apply(Snapshot(seq=1, eligible={"decode": ["d1"]}))
    assert view.eligible("decode") == ["d2"]
    view.record_failure("d2", FailureClass.STREAM)
    view.record_success("p1", SuccessKind.PREFILL_HANDOFF)
    assert sent == [Evidence(engine="d2", failure_class="stream"),
                    Evidence(engine="p1", success_kind="prefill_handoff")]


def test_telemetry_relay_is_bounded() -> None:
    relay = TelemetryRelay(max_samples=2)
    for _ in range(3):
        relay.record_request(prefill="p", decode="d", ttft_s=0.1, inter_token_s=None, error_engine=None)
    assert len(relay.take()) == 2 and relay.dropped == 1
    assert relay.take() == []


# -- the hub ---------------------------------------------------------------------------------


class _Admission:
    def __init__(self) -> None:
        self.closed: str | None = None

    def reason(self) -> str | None:
        return self.closed


class _Control:
    """The supervisor's face, over a real Fleet and a settable clock."""

    def __init__(self, fleet: Fleet, now: list[float]) -> None:
        self.fleet = fleet
        self.now = now

    def eligible(self, role: str, model: str | None = None) -> list[str]:
        return self.fleet.eligible(role, self.now[0], model)

    def capacity_problem(self, model: str | None = None) -> str | None:
        return self.fleet.capacity_problem(self.now[0], model)

    def capacity_problems(self) -> dict[str, str]:
        return self.fleet.capacity_problems(self.now[0])

    def eligible_pools(self) -> dict[str, dict[str, list[str]]]:
        return self.fleet.eligible_pools(self.now[0])

    def record_failure(self, engine: str, failure_class: FailureClass) -> None:
        self.fleet.record_failure(engine, failure_class, self.now[0])

    def record_success(self, engine: str, kind: SuccessKind) -> None:
        self.fleet.record_success(engine, kind, self.now[0])

    def state_version(self) -> int:
        return self.fleet.eligibility_version(self.now[0])

    def valid_until(self) -> float | None:
        return self.fleet.next_deadline(self.now[0])


def _hub(eject_after: int = 3, admit_until: Callable[[], float | None] | None = None,
         ) -> tuple[WorkerHub, _Admission, list[float]]:
    now = [0.0]
    fleet = Fleet([("p1", "prefill"), ("d1", "decode"), ("d2", "decode")], eject_after=eject_after,
                  liveness_misses=3, failure_quarantine_s=None, probe_interval_s=5.0)
    admission = _Admission()
    hub = WorkerHub(_Control(fleet, now), admission, engines=["p1", "d1", "d2"], clock=lambda: now[0],
                    admit_until=admit_until)
    return hub, admission, now


def test_a_streak_counts_across_workers_and_every_worker_gets_the_ejection() -> None:
    hub, _, _ = _hub()
    inbox: dict[int, list[Snapshot]] = {0: [], 1: []}
    hub.attach(0, inbox[0].append)
    hub.attach(1, inbox[1].append)
    hub.publish()
    assert inbox[0][-1].eligible["decode"] == ["d1", "d2"]
    hub.receive(0, Evidence(engine="d1", failure_class="connection"))
    hub.receive(1, Evidence(engine="d1", failure_class="connection"))
    assert inbox[1][-1].eligible["decode"] == ["d1", "d2"]
    hub.receive(0, Evidence(engine="d1", failure_class="connection"))
    for worker in (0, 1):
        assert inbox[worker][-1].eligible["decode"] == ["d2"]
    assert inbox[0][-1].seq == inbox[1][-1].seq


def test_unchanged_state_publishes_nothing_and_admission_changes_publish() -> None:
    hub, admission, _ = _hub()
    inbox: list[Snapshot] = []
    hub.attach(0, inbox.append)
    hub.publish(force_to=0)
    hub.receive(0, Evidence(engine="d1", success_kind="decode_terminal"))
    assert len(inbox) == 1
    admission.closed = "monitoring degraded: health TimeoutError"
    hub.publish()
    assert inbox[-1].admission_reason == "monitoring degraded: health TimeoutError"


def test_in_flight_sums_workers_and_a_stale_count_cannot_settle_a_drain() -> None:
    hub, _, _ = _hub()
    hub.attach(0, lambda s: None)
    hub.attach(1, lambda s: None)
    seq = hub.seq
    hub.receive(0, Report(snapshot_seq=seq, in_flight={"d1": 1}, requests_in_flight=1, metrics=MetricsState()))
    hub.receive(1, Report(snapshot_seq=seq, in_flight={"d1": 2}, requests_in_flight=2, metrics=MetricsState()))
    assert hub.in_flight["d1"] == 3 and hub.in_flight.total() == 3
    # d1 ejected: until each worker reports from the new snapshot on, d1 is not idle.
    for _ in range(3):
        hub.receive(0, Evidence(engine="d1", failure_class="connection"))
    ejected_seq = hub.seq
    hub.receive(0, Report(snapshot_seq=ejected_seq, in_flight={}, requests_in_flight=0, metrics=MetricsState()))
    hub.receive(1, Report(snapshot_seq=seq, in_flight={}, requests_in_flight=0, metrics=MetricsState()))
    assert hub.in_flight["d1"] == 1
    hub.receive(1, Report(snapshot_seq=ejected_seq, in_flight={}, requests_in_flight=0, metrics=MetricsState()))
    assert hub.in_flight["d1"] == 0
    hub.detach(1)
    assert list(hub.workers) == [0]


def test_quarantine_expiry_is_published_at_its_deadline() -> None:
    now = [0.0]
    fleet = Fleet([("p1", "prefill"), ("d1", "decode"), ("d2", "decode")], eject_after=1,
                  liveness_misses=3, failure_quarantine_s=10.0, probe_interval_s=5.0)
    hub = WorkerHub(_Control(fleet, now), _Admission(), engines=["p1", "d1", "d2"], clock=lambda: now[0])
    inbox: list[Snapshot] = []
    hub.attach(0, inbox.append)
    hub.receive(0, Evidence(engine="d1", failure_class="connection"))
    assert inbox[-1].eligible["decode"] == ["d2"]
    # The snapshot says until when it is exact: the quarantine's end.
    assert inbox[-1].valid_until == 10.0
    sent = len(inbox)
    now[0] = 9.999
    hub.publish()
    assert len(inbox) == sent
    now[0] = 10.0
    hub.publish()
    # At the deadline a new snapshot goes out: the quarantine is over (d1 may be readmitted).
    assert len(inbox) == sent + 1 and inbox[-1].valid_until is None
    assert inbox[-1].eligible["decode"] == ["d2"]
    fleet.readmit("d1", now[0])
    hub.publish()
    assert inbox[-1].eligible["decode"] == ["d1", "d2"]


def test_the_fleets_change_count_lets_a_check_skip_asking_and_misses_no_change() -> None:
    """A hub that trusts ``Fleet.mutations`` and the next hold deadline publishes exactly what one that asks
    the fleet at every check publishes, through random changes and the clock passing hold deadlines."""
    names = [name for name, _ in ENGINES]
    for seed in range(20):
        rng = random.Random(seed)
        fleet = make_fleet(quarantine_s=QUARANTINE_S)
        now = [0.0]
        inboxes: tuple[list[Snapshot], list[Snapshot]] = ([], [])
        asks: list[int] = [0]
        control = _Control(fleet, now)
        counted = _CountingControl(fleet, now, asks)
        clock = functools.partial(operator.getitem, now, 0)
        plain = WorkerHub(control, _Admission(), engines=names, clock=clock)
        trusting = WorkerHub(counted, _Admission(), engines=names, clock=clock,
                             fleet_mutations=functools.partial(operator.attrgetter("mutations"), fleet))
        plain.attach(0, inboxes[0].append)
        trusting.attach(0, inboxes[1].append)
        skipped = 0
        for _ in range(300):
            now[0] += rng.choice([0.0, 0.0, 0.5, 3.0, 11.0])
            if rng.random() < 0.4:
                random_operation(fleet, rng, now[0], RANDOM_OPERATIONS)
            before = asks[0]
            # The trusting hub first: the plain one's reads would refresh the fleet for it.
            trusting.refresh_if_fleet_changed()
            skipped += asks[0] == before
            plain.refresh_if_fleet_changed()
            assert [snapshot.eligible for snapshot in inboxes[1]] == [
                snapshot.eligible for snapshot in inboxes[0]], seed
        assert skipped > 100  # most checks asked nothing


@pytest.mark.parametrize("asks_the_fleet_first", [False, True])
def test_in_one_process_a_success_reaches_the_hub_as_a_call_and_clears_the_streak(asks_the_fleet_first: bool) -> None:
    hub, _, now = _hub(eject_after=2)
    sent: list[Evidence] = []
    fleet = hub._control.fleet  # type: ignore[attr-defined]
    view = WorkerView(sent.append, clock=lambda: now[0], refresh=hub.refresh_if_fleet_changed,
                      record_success=hub.record_success,
                      success_clears=fleet.success_clears if asks_the_fleet_first else None)
    hub.attach(0, view.apply)
    hub.receive(0, Evidence(engine="d1", failure_class="connection"))
    view.record_success("d1", SuccessKind.DECODE_TERMINAL)
    # The streak was cleared: one more failure is the first of a new streak, not the second.
    hub.receive(0, Evidence(engine="d1", failure_class="connection"))
    assert view.eligible("decode") == ["d1", "d2"]
    hub.receive(0, Evidence(engine="d1", failure_class="connection"))
    assert view.eligible("decode") == ["d2"]
    assert sent == []  # no message was built for the success


def test_a_success_that_clears_nothing_never_reaches_the_hub() -> None:
    hub, _, now = _hub(eject_after=3)
    fleet = hub._control.fleet  # type: ignore[attr-defined]
    recorded: list[tuple[str, SuccessKind]] = []

    def record(engine: str, kind: SuccessKind) -> None:
        recorded.append((engine, kind))
        hub.record_success(engine, kind)

    view = WorkerView(lambda message: hub.receive(0, message), clock=lambda: now[0],
                      refresh=hub.refresh_if_fleet_changed, record_success=record, success_clears=fleet.success_clears)
    hub.attach(0, view.apply)
    # No evidence against d1 (nor anything for an engine the fleet does not have): no call at all.
    view.record_success("d1", SuccessKind.DECODE_TERMINAL)
    view.record_success("gone", SuccessKind.DECODE_TERMINAL)
    assert recorded == []
    view.record_failure("d1", FailureClass.CONNECTION)
    view.record_success("d2", SuccessKind.DECODE_TERMINAL)
    assert recorded == []
    # Evidence against d1: its success goes through, and clears it (two more failures do not eject it).
    view.record_success("d1", SuccessKind.DECODE_TERMINAL)
    assert recorded == [("d1", SuccessKind.DECODE_TERMINAL)]
    view.record_failure("d1", FailureClass.CONNECTION)
    view.record_failure("d1", FailureClass.CONNECTION)
    assert view.eligible("decode") == ["d1", "d2"]


class _CountingControl(_Control):
    """``_Control`` that counts the version reads (a full check)."""

    def __init__(self, fleet: Fleet, now: list[float], asks: list[int]) -> None:
        super().__init__(fleet, now)
        self.asks = asks

    def state_version(self) -> int:
        self.asks[0] += 1
        return super().state_version()


def test_samples_in_reports_reach_the_controllers_telemetry() -> None:
    got: list[dict[str, object]] = []
    now = [0.0]
    fleet = Fleet([("p1", "prefill"), ("d1", "decode")], eject_after=3, liveness_misses=3,
                  failure_quarantine_s=None, probe_interval_s=5.0)
    hub = WorkerHub(_Control(fleet, now), _Admission(), engines=["p1", "d1"], clock=lambda: now[0],
                    record_sample=lambda **kw: got.append(kw))
    hub.attach(0, lambda s: None)
    hub.receive(0, Report(snapshot_seq=1, in_flight={}, requests_in_flight=0, metrics=MetricsState(),
                          samples=[RequestSample("p1", "d1", 0.05, 0.01, None),
                                   RequestSample("p1", "d1", None, None, "d1", 502, "connection", True)]))
    assert got == [{"prefill": "p1", "decode": "d1", "ttft_s": 0.05, "inter_token_s": 0.01, "error_engine": None,
                    "status": 0, "error_class": None, "failed": False},
                   {"prefill": "p1", "decode": "d1", "ttft_s": None, "inter_token_s": None, "error_engine": "d1",
                    "status": 502, "error_class": "connection", "failed": True}]


# -- metrics summed over workers ---------------------------------------------------------------


def _worker_registry(requests: float, ttft: list[float]) -> Registry:
    registry = Registry()
    counter = registry.counter("narwhal_requests", "Requests.", ("route", "status"))
    counter.inc("/v1/completions", "200", amount=requests)
    histogram = registry.histogram("narwhal_ttft_seconds", "TTFT.", ("route",))
    for value in ttft:
        histogram.observe(value, "/v1/completions")
    return registry


def test_metrics_sum_over_workers_and_survive_a_worker_restart() -> None:
    total = MetricsSum()
    total.update(0, export_state(_worker_registry(5, [0.01, 0.2])))
    total.update(1, export_state(_worker_registry(7, [0.01])))
    assert total.counter("narwhal_requests") == {("/v1/completions", "200"): 12.0}
    total.retire(1)
    total.update(1, export_state(_worker_registry(1, [])))  # the restarted worker starts from zero
    assert total.counter("narwhal_requests") == {("/v1/completions", "200"): 13.0}
    counts, total_s = total.histogram("narwhal_ttft_seconds")[("/v1/completions",)]
    assert sum(counts) == 3 and total_s == pytest.approx(0.22)
    controller = _worker_registry(0, [])
    total.attach_to(controller)
    text = controller.render()
    assert 'narwhal_requests_total{route="/v1/completions",status="200"} 13' in text
    assert 'narwhal_ttft_seconds_count{route="/v1/completions"} 3' in text
    assert dict(total.per_worker("narwhal_requests")) == {0: 5.0, 1: 1.0}


def test_snapshots_carry_router_wide_in_flight_and_placement_balances_on_it() -> None:
    from narwhal.config import Config, EngineSpec
    from narwhal.fleet.placement import InFlight
    from narwhal.obs.router_metrics import RouterMetrics
    from narwhal.serving.placement import RequestPlacement

    config = Config(engines=[EngineSpec(name=name, url=f"http://127.0.0.1:{9001 + i}", role=role)
                             for i, (name, role) in enumerate([("p1", "prefill"), ("d1", "decode"), ("d2", "decode")])])
    placement = RequestPlacement(config, RouterMetrics())

    def decode_on(in_flight: InFlight) -> str | None:
        # The request path's own call: placement balances on what ``in_flight.load`` says.
        choice = placement.choose("decode", ["d1", "d2"], "/v1/completions", {}, in_flight)
        return None if choice is None else choice.engine

    now = [0.0]
    fleet = Fleet([("p1", "prefill"), ("d1", "decode"), ("d2", "decode")], eject_after=3, liveness_misses=3,
                  failure_quarantine_s=None, probe_interval_s=5.0)
    hub = WorkerHub(_Control(fleet, now), _Admission(), engines=["p1", "d1", "d2"], clock=lambda: now[0],
                    share_in_flight=True)
    inbox: list[Snapshot] = []
    hub.attach(0, inbox.append)
    hub.attach(1, lambda s: None)
    hub.receive(1, Report(snapshot_seq=1, in_flight={"d1": 5}, requests_in_flight=5, metrics=MetricsState()))
    hub.publish()
    assert inbox[-1].in_flight == {"d1": 5}
    # Worker 0 has nothing in flight itself, but d1 is busy elsewhere: it places on d2.
    local = InFlight(["d1", "d2"])
    local.elsewhere = others_in_flight(inbox[-1].in_flight, {})
    assert local.elsewhere == {"d1": 5}
    assert all(decode_on(local) == "d2" for _ in range(20))
    # Worker 1 reported those 5 itself: none of them is elsewhere, so its own count decides.
    own = InFlight(["d1", "d2"])
    for _ in range(5):
        own.acquire("d1")
    own.elsewhere = others_in_flight(inbox[-1].in_flight, {"d1": 5})
    assert own.elsewhere == {}
    own.acquire("d2")
    assert decode_on(own) == "d2"


def test_a_lease_renewal_alone_reaches_every_worker() -> None:
    # Issue 26, break 4: an idle router with workers and a lease fenced itself after its first
    # term when the lease deadline was not part of what decides a publish.
    deadline = [8.0]
    hub, _, _ = _hub(admit_until=lambda: deadline[0])
    inbox: dict[int, list[Snapshot]] = {0: [], 1: []}
    hub.attach(0, inbox[0].append)
    hub.attach(1, inbox[1].append)
    hub.publish()
    assert [box[-1].admit_until for box in inbox.values()] == [8.0, 8.0]
    deadline[0] = 11.0  # renewed; nothing else changed
    hub.publish()
    assert [box[-1].admit_until for box in inbox.values()] == [11.0, 11.0]
    hub.publish()
    assert len(inbox[0]) == 2  # no change, nothing sent


async def test_the_publisher_sends_only_on_change_and_wakes_at_the_fleets_deadline(
        autojump_clock: trio.testing.MockClock) -> None:
    fleet = Fleet([("p1", "prefill"), ("d1", "decode"), ("d2", "decode")], eject_after=1,
                  liveness_misses=3, failure_quarantine_s=10.0, probe_interval_s=5.0)

    class TrioNow:
        def __getitem__(self, index: int) -> float:
            return trio.current_time()

    admission = _Admission()
    hub = WorkerHub(_Control(fleet, TrioNow()), admission, engines=["p1", "d1", "d2"],  # type: ignore[arg-type]
                    clock=trio.current_time)
    inbox: list[Snapshot] = []
    hub.attach(0, inbox.append)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hub.run_publisher)
        await trio.sleep(60.0)
        assert len(inbox) == 1  # idle for a minute: nothing republished
        hub.poke()
        await trio.sleep(1.0)
        assert len(inbox) == 1  # poked without a change: nothing sent
        admission.closed = "monitoring degraded: health TimeoutError"
        hub.poke()
        await trio.testing.wait_all_tasks_blocked()
        assert len(inbox) == 2 and inbox[-1].admission_reason == admission.closed
        admission.closed = None
        fleet.record_failure("d1", FailureClass.CONNECTION, trio.current_time())
        ejected_at = trio.current_time()
        hub.poke()
        await trio.testing.wait_all_tasks_blocked()
        assert inbox[-1].eligible["decode"] == ["d2"]
        assert inbox[-1].valid_until == ejected_at + 10.0
        sent = len(inbox)
        # No poke at the quarantine's end: the publisher wakes at the deadline by itself.
        await trio.sleep_until(ejected_at + 10.0)
        await trio.testing.wait_all_tasks_blocked()
        assert len(inbox) == sent + 1 and inbox[-1].valid_until is None
        nursery.cancel_scope.cancel()
