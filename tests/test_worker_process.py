"""A worker's parts (``workers/worker.py``) and the controller's side of forwarding (``workers/process.py``).

Built in this process with a fake control link: what a worker reports and
subtracts, what it does with evidence once its controller is gone, how it
forwards routes to the controller and how long each side waits.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import trio
import trio.testing

from narwhal.config import Config, EngineConfig, EngineSpec, PlacementConfig
from narwhal.errors import FailureClass
from narwhal.http1.server import Request
from narwhal.workers.link import LinkClosed
from narwhal.workers.process import WorkerSet
from narwhal.workers.protocol import (
    CONTROL_APP_TIMEOUT_S,
    FORWARD_TIMEOUT_S,
    Evidence,
    Forward,
    ForwardReply,
    Report,
    Snapshot,
    Welcome,
)
from narwhal.workers.worker import Worker

CONFIG = Config(engines=[EngineSpec(name="p1", url="http://127.0.0.1:9001", role="prefill"),
                         EngineSpec(name="d1", url="http://127.0.0.1:9002", role="decode"),
                         EngineSpec(name="d2", url="http://127.0.0.1:9003", role="decode")])


class FakeLink:
    """The control link: keeps what is sent; once closed, sending raises LinkClosed."""

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.closed = False
        self.close_reason = "controller exited"

    def send(self, message: Any) -> None:
        if self.closed:
            raise LinkClosed(self.close_reason)
        self.sent.append(message)


class Answer:
    """A responder that keeps the one response."""

    secure = False

    def __init__(self) -> None:
        self.status = 0
        self.body = b""

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.status, self.body = status, body


def worker(link: FakeLink) -> Worker:
    return Worker(1, Welcome(worker=1, config=CONFIG, config_dir=None, via_token="narwhal-test"), link)  # type: ignore[arg-type]


def snapshot(seq: int, **fields: Any) -> Snapshot:
    return Snapshot(seq=seq, eligible={"prefill": ["p1"], "decode": ["d1", "d2"]}, **fields)


async def test_a_worker_counts_the_others_in_flight_without_its_own_twice() -> None:
    link = FakeLink()
    w = worker(link)
    w.plane.in_flight.acquire("d1")
    w.plane.in_flight.acquire("d1")
    w.send_report()
    report = link.sent[-1]
    assert isinstance(report, Report) and report.in_flight == {"d1": 2}
    # The controller's totals include these two: the others have 3 on d1 and 1 on d2.
    w.on_message(snapshot(1, in_flight={"d1": 5, "d2": 1}))
    assert w.plane.in_flight.elsewhere == {"d1": 3, "d2": 1}
    # So d1 carries 5 router-wide and d2 1: placement picks d2 (issue 26, break 5).
    placement = w.plane.core.placement
    assert all(placement.choose("decode", ["d1", "d2"], "/v1/completions", {}, w.plane.in_flight).engine == "d2"
               for _ in range(20))


async def test_a_count_that_fell_to_zero_is_reported_at_the_busy_cadence_not_a_second_later(
        autojump_clock: trio.testing.MockClock) -> None:
    # The request was counted done (its metric moved) while its engine was still counted in flight:
    # the next look sees no new request and nothing in flight, yet the report it sent still says 1.
    link = FakeLink()
    w = worker(link)
    w.plane.in_flight.acquire("d1")
    w.metrics.requests.inc("/v1/completions", "200", "")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(w.report_loop)
        await trio.sleep(0.15)
        reports = [m for m in link.sent if isinstance(m, Report)]
        assert reports[-1].in_flight == {"d1": 1}
        w.plane.in_flight.release("d1")
        sent = len(link.sent)
        await trio.sleep(0.1)
        reports = [m for m in link.sent[sent:] if isinstance(m, Report)]
        assert [r.in_flight for r in reports] == [{}]
        # Then quiet: nothing changed, so the idle cadence (a report a second) holds.
        sent = len(link.sent)
        await trio.sleep(0.85)
        assert not [m for m in link.sent[sent:] if isinstance(m, Report)]
        nursery.cancel_scope.cancel()


async def test_a_snapshot_carries_reloaded_placement_and_engine_timeouts_into_the_worker() -> None:
    w = worker(FakeLink())
    w.on_message(snapshot(1, placement=CONFIG.placement, engine_config=CONFIG.engine))
    placement, pool = w.plane.core.placement, w.plane.data_pool
    w.prefix_index.index.record("p1", [1, 2], 1.0)
    assert placement.placer.cache_aware
    w.on_message(snapshot(2, placement=PlacementConfig(policy="least_outstanding", balance_abs=3, max_index_mb=2,
                                                       block_tokens=8),
                          engine_config=EngineConfig(first_token_deadline_s=1.5, connect_timeout_s=0.25)))
    assert (placement.placer.cache_aware, placement.placer.balance_abs) == (False, 3)
    assert placement.config.block_tokens == 8
    assert w.prefix_index.index.max_bytes == 2 * 1024 * 1024 and w.prefix_index.index.entries("p1") == 0
    assert pool._config.first_token_deadline_s == 1.5 and pool._connections.connect_timeout_s == 0.25
    # An older snapshot (reordered) changes nothing back.
    w.on_message(snapshot(1, placement=CONFIG.placement, engine_config=CONFIG.engine))
    assert not placement.placer.cache_aware


async def test_evidence_after_the_controller_left_is_counted_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    link = FakeLink()
    w = worker(link)
    w.view.record_failure("d1", FailureClass.CONNECTION)
    assert link.sent == [Evidence(engine="d1", failure_class="connection")]
    link.closed = True
    w.view.record_failure("d1", FailureClass.CONNECTION)
    w.view.record_failure("d2", FailureClass.TIMEOUT)
    assert w.evidence_dropped == 2
    lines = [json.loads(r.getMessage()) for r in caplog.records if "worker_evidence_dropped" in r.getMessage()]
    assert len(lines) == 1 and lines[0]["engine"] == "d1"
    assert lines[0]["reason"] == "controller link closed: controller exited"


async def test_a_worker_answers_ready_from_its_snapshot_and_forwards_the_rest() -> None:
    link = FakeLink()
    w = worker(link)
    w.on_message(snapshot(1, admission_reason="standby: lease held by ra"))
    ready = Answer()
    await w._serve_rest(Request(b"GET", b"/ready"), ready)  # type: ignore[arg-type]
    assert (ready.status, ready.body) == (503, b"standby: lease held by ra\n")
    answer = Answer()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(w._serve_rest, Request(b"GET", b"/admin/lease"), answer)
        await trio.testing.wait_all_tasks_blocked()
        forward = link.sent[-1]
        assert isinstance(forward, Forward) and forward.target == b"/admin/lease"
        w.on_message(ForwardReply(id=forward.id, status=200, headers=[], body=b'{"role":"standby"}'))
    assert (answer.status, answer.body) == (200, b'{"role":"standby"}')


async def test_a_worker_gives_up_on_a_forward_only_after_the_controller_would_have(
        autojump_clock: trio.testing.MockClock) -> None:
    # The controller bounds the control app by CONTROL_APP_TIMEOUT_S; a worker waits longer,
    # so a slow answer still arrives rather than a 503 racing it.
    assert FORWARD_TIMEOUT_S > CONTROL_APP_TIMEOUT_S
    w = worker(FakeLink())
    answer = Answer()
    started = trio.current_time()
    await w._serve_rest(Request(b"GET", b"/admin/lease"), answer)  # type: ignore[arg-type]
    assert trio.current_time() - started == pytest.approx(FORWARD_TIMEOUT_S)
    assert answer.status == 503 and b"controller_unavailable" in answer.body


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["path"] == "/slow":
        await trio.sleep_forever()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": scope["path"].encode()})


def worker_set() -> WorkerSet:
    return WorkerSet(count=1, config=CONFIG, config_dir=None, hub=None, app=_app,  # type: ignore[arg-type]
                     via_token="narwhal-test")


async def test_the_controller_answers_a_forward_through_its_control_app() -> None:
    link = FakeLink()
    await worker_set()._answer_forward(link, Forward(id=7, method=b"GET", target=b"/admin/engines",  # type: ignore[arg-type]
                                                     headers=[(b"host", b"x")], body=b""))
    reply, = link.sent
    assert (reply.id, reply.status, reply.body) == (7, 200, b"/admin/engines")


async def test_the_controller_bounds_a_forward_by_the_control_app_timeout(
        autojump_clock: trio.testing.MockClock) -> None:
    link = FakeLink()
    started = trio.current_time()
    await worker_set()._answer_forward(link, Forward(id=8, method=b"GET", target=b"/slow",  # type: ignore[arg-type]
                                                     headers=[(b"host", b"x")], body=b""))
    assert trio.current_time() - started == pytest.approx(CONTROL_APP_TIMEOUT_S)
    reply, = link.sent
    assert reply.id == 8 and reply.status == 500
