"""The C relay (``narwhal.http1._relay_native``) relays as the pump's Python path (``_Stream.on_engine``) does.

The pump's suites run whichever the install built; here the same engine answers go through the real data
pool and pump once with the C relay and once without it, and must reach the client the same, end the same
and leave the same bookkeeping; and the pump's suites run once more in a process that has only Python.
"""

from __future__ import annotations

import functools
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import pytest
import trio

from narwhal.http1 import pump as pump_module
from narwhal.http1 import readiness as readiness_module
from narwhal.http1.pump import RelayBook
from narwhal.pools import classify as classify_module
from narwhal.pools.data import DataPool
from narwhal.serving.client_view import KV_KEY, strip_kv_from_events
from tests.python_twins import pass_with_only_python
from tests.test_http1_pump import SLOW_DEADLINES, Client
from tests.test_pools_data import LAST_CHUNK, SSE_HEAD, FakeEngine, FakeRequest, chunk

native = pytest.importorskip("narwhal.http1._relay_native", reason="the C relay was not built")

DONE = b"data: [DONE]\n\n"


def event(text: str, *, kv: bool = False) -> bytes:
    extra = b', "kv_transfer_params": {"remote_block_ids": [1, 2]}' if kv else b""
    return b'data: {"choices": [{"text": "%s"}]%s}\n\n' % (text.encode(), extra)


class Raw(bytes):
    """A piece sent as it is, not as a chunk of its own."""


def test_ci_builds_and_runs_the_c_relay() -> None:
    if os.environ.get("CI"):
        assert pump_module.RELAY_NATIVE and readiness_module.ROUNDS_NATIVE
    assert pump_module.RELAY_NATIVE == (pump_module._Step is native.Step)
    assert readiness_module.ROUNDS_NATIVE == (readiness_module._native is native)
    assert classify_module._whole_data_events is native.whole_data_events


def test_the_pump_suites_pass_with_only_the_python_path() -> None:
    pass_with_only_python(["tests/test_http1_pump.py", "tests/test_pools_data.py", "tests/test_hostile_engines.py",
                           "tests/test_http1_readiness.py", "tests/test_http1_idle_rounds.py",
                           "tests/test_http1_early_rounds.py", "tests/test_classify.py"],
                          "from narwhal.http1 import pump, readiness; from narwhal.pools import classify; "
                          "assert not pump.RELAY_NATIVE and not readiness.ROUNDS_NATIVE "
                          "and classify._whole_data_events is None", timeout_s=400)


def answer(pieces: list[bytes], end: str = "last") -> Callable[[FakeRequest, trio.SocketStream, int],
                                                                Awaitable[bool]]:
    """An engine that writes each piece as its own chunk (a ``Raw`` one as it is), a moment apart, then
    ends its body (``last``), closes (``close``), resets (``reset``) or keeps the stream open (``open``)."""
    async def respond(request: FakeRequest, stream: trio.SocketStream, index: int) -> bool:
        await stream.send_all(SSE_HEAD + chunk(event("first")))
        for piece in pieces:
            await trio.sleep(0.005)
            await stream.send_all(piece if isinstance(piece, Raw) else chunk(piece))
        if end == "last":
            await stream.send_all(LAST_CHUNK)
            return True
        if end == "reset":
            stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        if end == "open":
            await trio.sleep_forever()
        await stream.aclose()
        return False
    return respond


class Outcome(msgspec.Struct):
    """What a relay did. How the engine's pieces fall into reads is the kernel's: compared are what does not
    depend on it (what the client gets in all, the end, the counts)."""

    stream: bytes  # what the client received (its chunk framing taken off), then the held read the caller sends
    error: str | None
    data_events: int
    saw_terminal: bool
    handler_calls: int  # calls of the Python path
    reads_counted: int  # the book's observations


def unchunk(data: bytes) -> bytes:
    body = bytearray()
    while data:
        size_line, _, rest = data.partition(b"\r\n")
        size = int(size_line, 16)
        body += rest[:size]
        data = rest[size + 2:]
    return bytes(body)


async def relay_once(pool: DataPool, engine: FakeEngine, client: Client, chunked: bool,
                     monkeypatch: pytest.MonkeyPatch) -> Outcome:
    calls = 0
    python_path = pump_module._Stream.on_engine

    def counted(self: Any, events: int) -> None:
        nonlocal calls
        calls += 1
        python_path(self, events)

    monkeypatch.setattr(pump_module._Stream, "on_engine", counted)
    error = declined = None
    async with pool.stream(engine.spec, "/v1/completions", b"{}", request_id="r1") as upstream:
        await upstream.read()
        book = RelayBook(upstream, (0.001, 0.1), [0, 0, 0], [0.0], last_at=trio.current_time(), marker=KV_KEY,
                         strip=strip_kv_from_events)
        try:
            declined = await pool.pump.relay(upstream, client, chunked, book)
        except Exception as exc:  # noqa: BLE001 -- compared by class and message
            error = f"{type(exc).__name__}: {exc}"
        received = bytearray()
        while True:
            try:
                data = client.peer.recv(1 << 20)
            except BlockingIOError:
                break
            if not data:
                break
            received += data
        body = unchunk(bytes(received)) if chunked else bytes(received)
        if declined is not None:
            # The read handed back is the one the book held, its KV field stripped.
            assert strip_kv_from_events(declined) == book.held
        outcome = Outcome(body + book.held, error, upstream.data_events, upstream.saw_terminal, calls,
                          sum(book.counts))
    monkeypatch.setattr(pump_module._Stream, "on_engine", python_path)
    return outcome


async def both_ways(pieces: list[bytes], monkeypatch: pytest.MonkeyPatch, *, end: str = "last",
                    chunked: bool = True) -> tuple[Outcome, Outcome]:
    """The same answer relayed with the C relay and with the Python path alone."""
    outcomes = []
    for step in (native.Step, None):
        monkeypatch.setattr(pump_module, "_Step", step)
        async with trio.open_nursery() as nursery:
            engine = FakeEngine(answer(pieces, end))
            listeners = await nursery.start(functools.partial(trio.serve_tcp, engine.handle, 0, host="127.0.0.1"))
            engine.port = listeners[0].socket.getsockname()[1]
            pool = DataPool(max_connections=8, engine_config=SLOW_DEADLINES, relay_inline=True)
            await nursery.start(pool.run)
            client = Client()
            try:
                outcomes.append(await relay_once(pool, engine, client, chunked, monkeypatch))
            finally:
                client.close()
                await pool.aclose()
            nursery.cancel_scope.cancel()
    return outcomes[0], outcomes[1]


def same_but_calls(ours: Outcome, theirs: Outcome) -> None:
    assert (msgspec.structs.replace(ours, handler_calls=0, reads_counted=0)
            == msgspec.structs.replace(theirs, handler_calls=0, reads_counted=0))


WHOLE = {
    "one event a chunk": [event(str(i)) for i in range(20)] + [DONE],
    "the KV field mid-stream and beside [DONE]": [event("a", kv=True), event("b")] + [Raw(chunk(event("c", kv=True)
                                                                                             + DONE))],
    "two events a chunk": [event("a") + event("b"), DONE],
    "an event split over two chunks": [event("split")[:9], event("split")[9:], DONE],
    "CRLF line ends": [b'data: {"text": "a"}\r\n\r\n', b"data: [DONE]\r\n\r\n"],
    "a comment between events": [b": ping\n\n", event("a"), DONE],
    "more after [DONE] in its chunk": [event("a"), DONE + event("after")],
    "[DONE] alone after events in one read": [Raw(chunk(event("a")) + chunk(event("b")) + chunk(DONE))],
    "an event over the read size": [b'data: {"text": "' + b"x" * 150_000 + b'"}\n\n', DONE],
    "text that says data: [DONE]": [b'data: {"text": "data: [DONE]\\n\\n"}\n\n', DONE],
}


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "http-1.0"])
@pytest.mark.parametrize("case", list(WHOLE))
async def test_a_whole_answer_reaches_the_client_as_the_python_path_relays_it(case: str, chunked: bool,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    ours, theirs = await both_ways(WHOLE[case], monkeypatch, chunked=chunked)
    same_but_calls(ours, theirs)
    assert ours.error is None and ours.saw_terminal
    # No KV field reaches the client, in what the pump wrote or in the read it handed back.
    assert KV_KEY not in ours.stream
    assert ours.stream.replace(b"\r", b"").endswith(DONE)


async def test_the_c_relay_takes_the_usual_reads_without_the_python_path(monkeypatch: pytest.MonkeyPatch) -> None:
    ours, theirs = await both_ways(WHOLE["one event a chunk"], monkeypatch)
    # The Python path takes every read; the C relay none of the usual ones (at most an end).
    assert theirs.handler_calls >= theirs.reads_counted >= 2
    assert ours.handler_calls <= 1
    assert ours.stream == b"".join(event(str(i)) for i in range(20)) + DONE


FAILING = {
    "malformed chunk framing": ([event("a"), Raw(b"zz\r\nnot a chunk\r\n")], "open"),
    "a close mid-body": ([event("a"), event("b")], "close"),
    "a reset mid-body": ([event("a"), event("b")], "reset"),
    "a body that is not SSE": ([event("a"), b"garbage here\n\n"], "open"),
    "the body's end without [DONE]": ([event("a")], "last"),
}


@pytest.mark.parametrize("case", list(FAILING))
async def test_a_failing_answer_fails_as_on_the_python_path(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pieces, end = FAILING[case]
    ours, theirs = await both_ways(pieces, monkeypatch, end=end)
    same_but_calls(ours, theirs)
    assert ours.error is not None and not ours.saw_terminal
    assert ours.stream.startswith(event("a"))


async def test_junk_after_a_whole_answer_is_no_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    ours, theirs = await both_ways([event("a"), Raw(chunk(DONE) + LAST_CHUNK + b"junk that is no response\r\n")],
                                   monkeypatch, end="open")
    same_but_calls(ours, theirs)
    assert ours.error is None and ours.saw_terminal


def test_the_router_says_which_compiled_parts_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from narwhal.native_parts import native_parts
    from narwhal.tracing import otlp, spans

    monkeypatch.setattr(pump_module, "RELAY_NATIVE", True)
    monkeypatch.setattr(otlp, "NATIVE", False)
    monkeypatch.setattr(spans, "NATIVE", True)
    monkeypatch.setattr(readiness_module, "ROUNDS_NATIVE", False)
    assert native_parts() == ["relay", "request_trace"]
    monkeypatch.setattr(readiness_module, "ROUNDS_NATIVE", True)
    assert native_parts() == ["relay", "request_trace", "hub_round"]
    monkeypatch.setattr(pump_module, "RELAY_NATIVE", False)
    monkeypatch.setattr(spans, "NATIVE", False)
    monkeypatch.setattr(readiness_module, "ROUNDS_NATIVE", False)
    assert native_parts() == []
