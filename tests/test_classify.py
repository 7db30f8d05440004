"""The classification table, row by row, and the two small machines beside it:
the SSE watch (terminal marker, SSE shape) and the pool-slot wait (saturation)."""

from __future__ import annotations

import httpx
import pytest
import trio

from narwhal.errors import EngineFailure, FailureClass, PoolSaturated, UpstreamClientError
from narwhal.http1.client import (
    ConnectFailed,
    ConnectionClosed,
    ConnectTimeout,
    DeadlineExpired,
    MalformedResponse,
    ReadTimeout,
    WriteTimeout,
)
from narwhal.pools import classify

C = FailureClass


# statuses -------------------------------------------------------------------

@pytest.mark.parametrize(("status", "failure_class"), [
    (408, C.OVERLOAD),
    (429, C.OVERLOAD),
    (500, C.INFERENCE_STATUS),
    (502, C.INFERENCE_STATUS),
    (503, C.INFERENCE_STATUS),
    (504, C.INFERENCE_STATUS),
    (302, C.INFERENCE_STATUS),  # an engine that redirects a completion is misbehaving
])
def test_engine_failure_statuses(status, failure_class):
    failure = classify.status_failure("e1", status, b"oops")
    assert isinstance(failure, EngineFailure)
    assert (failure.engine, failure.failure_class, failure.status) == ("e1", failure_class, status)


@pytest.mark.parametrize("status", [400, 401, 404, 413, 422])
def test_other_4xx_is_the_clients_fault(status):
    failure = classify.status_failure("e1", status, b'{"error": "bad"}')
    assert isinstance(failure, UpstreamClientError)
    assert (failure.engine, failure.status, failure.body) == ("e1", status, b'{"error": "bad"}')


@pytest.mark.parametrize("status", [200, 201, 204, 299])
def test_2xx_is_no_failure(status):
    assert classify.status_failure("e1", status, b"") is None
    classify.raise_for_status("e1", status, b"")


def test_inference_status_message_carries_a_bounded_body_snippet():
    failure = classify.status_failure("e1", 500, b"x" * 1000)
    assert isinstance(failure, EngineFailure)
    assert failure.message == "HTTP 500: " + "x" * 200


def test_raise_for_status_raises_the_failure():
    with pytest.raises(EngineFailure) as caught:
        classify.raise_for_status("e1", 429, b"")
    assert caught.value.failure_class is C.OVERLOAD


# data-pool transport errors ----------------------------------------------------

@pytest.mark.parametrize(("error", "failure_class"), [
    (ConnectFailed("refused", cause="ConnectionRefusedError"), C.CONNECTION),
    (ConnectFailed("dns", cause="gaierror"), C.CONNECTION),
    (ConnectionClosed("closed", cause="EOF", response_started=False), C.CONNECTION),
    (ConnectTimeout("slow connect", cause="ConnectTimeout"), C.TIMEOUT),
    (WriteTimeout("slow write", cause="WriteTimeout"), C.TIMEOUT),
    (ReadTimeout("slow read", cause="ReadTimeout"), C.TIMEOUT),
    (DeadlineExpired("no first token", cause="DeadlineExpired"), C.STREAM),
    (ConnectionClosed("cut off", cause="ConnectionResetError", response_started=True), C.STREAM),
    (MalformedResponse("junk", cause="HttpParserInvalidStatusError"), C.STREAM),
])
def test_transport_errors(error, failure_class):
    failure = classify.transport_failure("e1", error)
    assert (failure.engine, failure.failure_class, failure.cause) == ("e1", failure_class, error.cause)
    assert failure.message == str(error)


# control-pool (httpx) errors -----------------------------------------------------

@pytest.mark.parametrize(("error", "failure_class"), [
    (httpx.ConnectError("refused"), C.CONNECTION),
    (httpx.ReadError("reset"), C.CONNECTION),
    (httpx.WriteError("broken pipe"), C.CONNECTION),
    (httpx.RemoteProtocolError("Server disconnected without sending a response."), C.CONNECTION),
    (httpx.ConnectTimeout("slow"), C.TIMEOUT),
    (httpx.ReadTimeout("slow"), C.TIMEOUT),
    (httpx.WriteTimeout("slow"), C.TIMEOUT),
    (httpx.DecodingError("bad gzip"), C.STREAM),
])
def test_httpx_errors(error, failure_class):
    failure = classify.httpx_failure("e1", error)
    assert isinstance(failure, EngineFailure)
    assert (failure.failure_class, failure.cause) == (failure_class, type(error).__name__)


def test_httpx_pool_timeout_is_our_saturation():
    assert isinstance(classify.httpx_failure("e1", httpx.PoolTimeout("full")), PoolSaturated)


# the SSE watch ----------------------------------------------------------------

CLEAN = b'data: {"t": 1}\n\ndata: {"t": 2}\n\ndata: [DONE]\n\n'


def watch(*reads: bytes) -> classify.SSEWatch:
    w = classify.SSEWatch()
    for data in reads:
        w.feed(data)
    return w


@pytest.mark.parametrize(("reads", "valid", "terminal"), [
    ((CLEAN,), True, True),
    ((CLEAN.replace(b"\n", b"\r\n"),), True, True),
    ((b"data:[DONE]\n\n",), True, True),
    ((b": keep-alive\n\nevent: x\ndata: 1\n\nid: 7\n\nretry: 10\n\ndata: [DONE]\n\n",), True, True),
    ((b"data: [DONE]\n\n: trailing comment\n\n",), True, True),
    ((b"data: [DONE]\n",), True, True),  # unterminated last event, then EOF
    ((b'data: {"t": 1}\n\n',), True, False),
    ((b"data: [DONE]\n\ndata: late\n\n",), True, False),
    ((b"data: [DONE] extra\n\n",), True, False),
    ((b"data: " + b"x" * 100 + b"\n\n",), True, False),
    ((b"hello world\n\n",), False, False),
    ((b'{"choices": []}',), False, False),
    ((b"<html>",), False, False),  # caught before any blank line
    ((b"da", b"ta: 1\n", b"\ndata: [DO", b"NE]\n", b"\n"), True, True),
    ((b"data: 1\n\n\ndata: [DONE]\n\n",), True, True),
    ((b"data: 1\n\n\n\ndata: [DONE]\n\n",), True, True),
    ((b"data: 1\n\ndata:[DONE]\n\n",), True, True),
    ((b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"), True, True),
    ((b"data: 1\n\nnot sse\n\ndata: [DONE]\n\n",), False, False),
])
def test_sse_watch(reads, valid, terminal):
    w = watch(*reads)
    assert w.finish() is terminal
    assert w.valid is valid


def test_sse_watch_survives_every_split_point():
    for cut in range(1, len(CLEAN)):
        w = watch(CLEAN[:cut], CLEAN[cut:])
        assert w.valid and w.finish(), cut
        assert w.data_events == 3, cut


@pytest.mark.parametrize("read", [
    CLEAN, b'data: {"text": "data: x"}\n\ndata: [DONE]\n\n', b"data: a\ndata: b\n\ndata: [DONE]\n\n",
    b"data: 1\n\n\ndata: [DONE]\n\n", b"data: 1\n\n\n\ndata: 2\n\n", b"data: 1\n\nevent: x\ndata: 2\n\n",
    b"data: 1\n\n: c\n\ndata: [DONE]\n\n", b"data:1\n\ndata:[DONE]\n\n", b"data: 1\ndata: [DONE]\n\n",
    b"data: 1\n\ndata: 2\n\n\n", b"data: 1\n\nTraceback\n\n",
])
def test_a_whole_read_is_taken_as_the_same_bytes_fed_one_at_a_time(read):
    # A read of whole events takes feed's counted shortcut; one byte at a time never can.
    whole, each = watch(read), watch(*(read[i:i + 1] for i in range(len(read))))
    assert (whole.valid, whole.saw_terminal, whole.between_events) == (each.valid, each.saw_terminal,
                                                                         each.between_events)
    if whole.valid:  # an invalid stream fails whatever it counted
        assert whole.data_events == each.data_events


def counted_events(data: bytes) -> int:
    """The Python path's count of a read of whole one-line `data:` events (0: not such a read)."""
    if not (data.startswith(b"data:") and data.endswith(b"\n\n")):
        return 0
    ended = data.count(b"\n\ndata:") + 1
    return ended if data.count(b"\n") == 2 * ended else 0


def test_the_compiled_count_of_whole_events_agrees_with_the_python_counts() -> None:
    native = pytest.importorskip("narwhal.http1._relay_native", reason="the C relay was not built")
    pieces = (b"data:", b"data: [DONE]", b"\n", b"\n\n", b"x", b"\r", b"da", b"ta:", b":")
    reads = {b""}
    for _ in range(5):
        reads |= {read + piece for read in reads for piece in pieces}
    assert len(reads) > 10_000
    for read in reads:
        assert native.whole_data_events(read) == counted_events(read), read
    long = b'data: {"choices": [{"text": "a"}]}\n\n' * 500 + b"data: [DONE]\n\n"
    assert native.whole_data_events(long) == 501 == counted_events(long)
    with pytest.raises(TypeError):
        native.whole_data_events(bytearray(long))


def test_sse_watch_byte_by_byte():
    w = watch(*(CLEAN[i:i + 1] for i in range(len(CLEAN))))
    assert w.valid and w.finish()
    assert w.data_events == 3


@pytest.mark.parametrize(("reads", "events"), [
    ((CLEAN,), 3),
    ((CLEAN.replace(b"\n", b"\r\n"),), 3),
    # A token whose text says "data: " is one event, not two; nor is an event of two data lines.
    ((b'data: {"text": "data: x"}\n\ndata: [DONE]\n\n',), 2),
    ((b'data: {"text": "data: x"}\n\n', b"data: [DONE]\n\n"), 2),
    ((b"data: a\ndata: b\n\ndata: [DONE]\n\n",), 2),
    # Comments, id and retry are no data events; an event whose data follows another field is one.
    ((b": keep-alive\n\nevent: x\ndata: 1\n\nid: 7\n\nretry: 10\n\ndata: [DONE]\n\n",), 2),
    # A field name cut between reads, and an event ended only by the end of the body.
    ((b"da", b"ta: 1\n", b"\ndata: [DO", b"NE]\n", b"\n"), 2),
    ((b"data: 1\n\n", b"data: [DONE]\n"), 2),
    ((b"data:1\n\ndata:[DONE]\n\n",), 2),
    # Blank lines beyond the one that ends an event end nothing more.
    ((b"data: 1\n\n\ndata: [DONE]\n\n",), 2),
    ((b"data: 1\n\n\n\ndata: [DONE]\n\n", b"\n"), 2),
])
def test_sse_watch_counts_data_events_by_event(reads, events):
    w = watch(*reads)
    w.finish()
    assert w.data_events == events


def test_sse_watch_tracks_terminal_as_events_arrive():
    w = classify.SSEWatch()
    w.feed(b"data: 1\n\n")
    assert not w.saw_terminal
    w.feed(b"data: [DONE]\n\n")
    assert w.saw_terminal


def test_sse_watch_rejects_garbage_after_good_events():
    w = classify.SSEWatch()
    assert w.feed(b"data: 1\n\n")
    assert not w.feed(b"Traceback (most recent call last):\n\n")


def take(w: classify.SSEWatch, data: bytes) -> bool:
    """As the data pool takes a read: the one-event check first, ``feed`` for anything it declines."""
    return w.one_event(data) or w.feed(data)


# Reads one_event must decline (feed's general path decides them), after a first read that ends an event.
NOT_ONE_EVENT = [
    b'data: {"t": 1}\n\ndata: {"t": 2}\n\n',  # two events
    b'data: {"t": 1}\r\n\r\n',  # CR line ends
    b'data: {"t": 1}\rjunk\n\n',  # a lone CR is a line end: "junk" would start an event
    b"data:[DONE]\n\n",  # no space: feed recognises it
    b'data: {"t": 1}\n',  # not a whole event
    b'data: {"t": 1}',
    b"event: x\ndata: 1\n\n",
    b"\ndata: 1\n\n",
    b'data: {"t": 1}\n\n\n',
]


@pytest.mark.parametrize("data", NOT_ONE_EVENT)
def test_one_event_declines_every_read_that_is_not_one_whole_data_event(data):
    w = watch(b"data: 0\n\n")
    assert not w.one_event(data)
    # Nothing was taken: the watch is as it was.
    assert w.between_events and not w.saw_terminal and w.valid


def test_one_event_takes_the_usual_read_and_sees_done():
    w = classify.SSEWatch()
    assert w.one_event(b'data: {"choices": [{"text": "a"}]}\n\n')
    assert w.valid and w.between_events and not w.saw_terminal
    assert w.one_event(b"data: [DONE]\n\n")
    assert w.saw_terminal and w.finish()


def test_one_event_declines_mid_event_and_after_garbage():
    w = watch(b"data: 1")  # an event begun, not ended
    assert not w.one_event(b"data: 2\n\n")
    bad = classify.SSEWatch()
    assert not bad.feed(b"Traceback\n\n")
    assert not bad.one_event(b"data: 1\n\n")


@pytest.mark.parametrize("reads", [reads for reads, _, _ in [
    ((CLEAN,), 0, 0), ((b"da", b"ta: 1\n", b"\ndata: [DO", b"NE]\n", b"\n"), 0, 0),
    ((b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"), 0, 0),
    ((b"data: 1\n\n", b"\n", b"data: [DONE]\n\n"), 0, 0),
    ((b"data: 1\n\n", b"data: 2\r\r", b"junk\n\n"), 0, 0),
    ((b"data: 1\n\n", b"not sse\n\n", b"data: [DONE]\n\n"), 0, 0),
    ((b"data: [DONE]\n\n", b"data: 1\n\n"), 0, 0),
    ((b"data: 1", b"\n\n", b"data: [DONE]\n\n"), 0, 0),
]])
def test_the_one_event_path_leaves_the_watch_as_feed_alone_would(reads):
    fed, taken = classify.SSEWatch(), classify.SSEWatch()
    for data in reads:
        assert take(taken, data) == fed.feed(data)
        assert (taken.valid, taken.saw_terminal, taken.between_events, taken.data_events) == (
            fed.valid, fed.saw_terminal, fed.between_events, fed.data_events)
    assert taken.finish() == fed.finish()
    assert taken.data_events == fed.data_events


def test_the_one_event_path_survives_every_split_point():
    for cut in range(1, len(CLEAN)):
        w = classify.SSEWatch()
        assert take(w, CLEAN[:cut]) and take(w, CLEAN[cut:])
        assert w.valid and w.finish(), cut


# the pool-slot wait -----------------------------------------------------------

async def test_slot_wait_past_the_callers_deadline_is_pool_saturated(autojump_clock):
    limiter = trio.CapacityLimiter(1)
    await limiter.acquire()
    with trio.move_on_after(5) as caller:
        with pytest.raises(PoolSaturated):
            async with classify.pool_slot(limiter, "data"):
                pytest.fail("got a slot that was taken")
    assert not caller.cancelled_caught
    assert trio.current_time() == pytest.approx(5 - classify.SATURATION_MARGIN_S)
    assert limiter.statistics().tasks_waiting == 0


async def test_slot_wait_without_deadline_waits_for_release(autojump_clock, nursery):
    limiter = trio.CapacityLimiter(1)
    holder = object()
    limiter.acquire_on_behalf_of_nowait(holder)

    async def release_later():
        await trio.sleep(30)
        limiter.release_on_behalf_of(holder)
    nursery.start_soon(release_later)
    async with classify.pool_slot(limiter, "data"):
        assert trio.current_time() == 30
        assert limiter.borrowed_tokens == 1
    assert limiter.borrowed_tokens == 0


async def test_explicit_cancel_while_waiting_is_cancellation_not_saturation(autojump_clock, nursery):
    limiter = trio.CapacityLimiter(1)
    await limiter.acquire()
    with trio.CancelScope() as caller:
        nursery.start_soon(_cancel_after, caller, 1.0)
        async with classify.pool_slot(limiter, "data"):
            pytest.fail("got a slot that was taken")
    assert caller.cancelled_caught
    assert trio.current_time() == 1.0


async def _cancel_after(scope: trio.CancelScope, delay_s: float) -> None:
    await trio.sleep(delay_s)
    scope.cancel()


async def test_one_task_may_hold_several_slots():
    limiter = trio.CapacityLimiter(2)
    async with classify.pool_slot(limiter, "data"), classify.pool_slot(limiter, "data"):
        assert limiter.borrowed_tokens == 2
    assert limiter.borrowed_tokens == 0
