"""Hostile engines (issue 13, items 1-4): bounded answers, the prefill's handoff, early 4xx, local errors.

Each engine is a small trio server on 127.0.0.1 writing hand-made bytes; the
router side is the real data pool, control pool and request core.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import pytest
import trio

from narwhal.config import EngineConfig, EngineSpec, parse_config
from narwhal.errors import (
    EngineFailure,
    FailureClass,
    SuccessKind,
    UpstreamClientError,
)
from narwhal.fleet.admission import Admission
from narwhal.fleet.placement import InFlight
from narwhal.obs.router_metrics import RouterMetrics
from narwhal.pools.control import ControlPool
from narwhal.pools.data import DataPool
from narwhal.serving.request_core import RequestCore
from narwhal.stages.health import HealthStage
from narwhal.wire import read_handoff

LIMIT = 64 * 1024
FAST = EngineConfig(connect_timeout_s=1.0, request_timeout_s=2.0, first_token_deadline_s=2.0,
                    stream_silence_s=2.0, health_timeout_s=2.0, max_response_bytes=LIMIT,
                    max_response_header_bytes=8 * 1024)
# Endless answers are cut off far below this; reaching it means the bound did not hold.
ENDLESS_BYTES = 64 * 1024 * 1024

Handler = Callable[[trio.SocketStream, bytes], Awaitable[None]]


class HostileEngine:
    """Reads each request's head, then lets ``handler`` answer; counts what it managed to send."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.port = 0
        self.sent = 0
        self.heads: list[bytes] = []
        self.cut_off = trio.Event()

    def spec(self, name: str = "e1", role: str = "prefill") -> EngineSpec:
        return EngineSpec(name=name, url=f"http://127.0.0.1:{self.port}", role=role)

    async def send(self, stream: trio.SocketStream, data: bytes) -> None:
        await stream.send_all(data)
        self.sent += len(data)

    async def handle(self, stream: trio.SocketStream) -> None:
        buf = b""
        answering[stream] = self
        try:
            while b"\r\n\r\n" not in buf:
                data = await stream.receive_some(65536)
                if not data:
                    return
                buf += data
            head = buf.partition(b"\r\n\r\n")[0]
            self.heads.append(head)
            await self.handler(stream, head)
        except trio.BrokenResourceError:
            self.cut_off.set()
        finally:
            del answering[stream]
            await trio.aclose_forcefully(stream)


# Which engine a connection belongs to, so that handlers stay plain functions of the stream.
answering: dict[trio.SocketStream, HostileEngine] = {}


@pytest.fixture
async def hostile(nursery: trio.Nursery) -> Callable[[Handler], Awaitable[HostileEngine]]:
    async def start(handler: Handler) -> HostileEngine:
        engine = HostileEngine(handler)
        listeners = await nursery.start(functools.partial(trio.serve_tcp, engine.handle, 0, host="127.0.0.1"))
        engine.port = listeners[0].socket.getsockname()[1]
        return engine
    return start


@pytest.fixture
async def data_pool(nursery: trio.Nursery):
    pool = DataPool(max_connections=8, engine_config=FAST)
    await nursery.start(pool.run)
    yield pool
    await pool.aclose()


def endless(first: bytes, repeat: bytes) -> Handler:
    """An answer that starts with ``first`` and then repeats ``repeat`` until the router hangs up."""
    async def handler(stream: trio.SocketStream, _: bytes) -> None:
        engine = answering[stream]
        await engine.send(stream, first)
        while engine.sent < ENDLESS_BYTES:
            await engine.send(stream, repeat)
    return handler


def chunked_forever(status: int = 200) -> Handler:
    return endless(b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n" % status,
                   b"%x\r\n%s\r\n" % (4096, b"y" * 4096) * 16)


HEADERS_FOREVER = endless(b"HTTP/1.1 200 OK\r\n", b"x-junk: " + b"j" * 1000 + b"\r\n")
TRAILERS_FOREVER = endless(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n",
                           b"x-trailer: " + b"t" * 1000 + b"\r\n")
DECLARED_10GB = endless(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 10000000000\r\n\r\n",
                        b"z" * 65536)


# -- 1. bounded engine answers: data pool ---------------------------------------------------------


@pytest.mark.parametrize("handler", [chunked_forever(), HEADERS_FOREVER, TRAILERS_FOREVER, DECLARED_10GB],
                         ids=["endless-chunked-body", "endless-headers", "endless-trailers", "declared-10GB"])
async def test_a_buffered_answer_past_its_bound_is_inference_status_and_the_connection_dropped(
        hostile, data_pool, handler):
    engine = await hostile(handler)
    with trio.fail_after(10):
        with pytest.raises(EngineFailure) as caught:
            await data_pool.post_json(engine.spec(), "/v1/completions", b"{}", request_id="r1")
    assert caught.value.failure_class is FailureClass.INFERENCE_STATUS
    assert caught.value.cause == "ResponseTooLarge"
    assert "bound" in caught.value.message
    # The router hung up: the engine's endless answer stopped far short of its goal.
    with trio.fail_after(10):
        await engine.cut_off.wait()
    assert engine.sent < ENDLESS_BYTES
    assert data_pool.statistics().idle_connections == 0


async def test_an_endless_error_body_on_a_stream_is_bounded_too(hostile, data_pool):
    engine = await hostile(chunked_forever(500))
    with trio.fail_after(10), pytest.raises(EngineFailure) as caught:
        async with data_pool.stream(engine.spec(role="decode"), "/v1/completions", b"{}", request_id="r1"):
            pass
    assert caught.value.failure_class is FailureClass.INFERENCE_STATUS
    assert caught.value.cause == "ResponseTooLarge"


async def test_an_answer_just_under_the_bound_is_accepted(hostile, data_pool):
    body = b'"' + b"a" * (LIMIT - 2) + b'"'

    async def handler(stream: trio.SocketStream, _: bytes) -> None:
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))

    engine = await hostile(handler)
    status, got = await data_pool.post_json(engine.spec(), "/tokenize", b"{}", request_id="r1")
    assert (status, got) == (200, body)


async def test_a_streamed_decode_is_relayed_past_the_buffer_bound(hostile, data_pool):
    # Streams are relayed read by read, never held: 16x the buffered bound goes through.
    event = b"data: " + b"z" * 1000 + b"\n\n"

    async def handler(stream: trio.SocketStream, _: bytes) -> None:
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                              b"transfer-encoding: chunked\r\n\r\n")
        for _ in range(16 * LIMIT // len(event)):
            await stream.send_all(b"%x\r\n%s\r\n" % (len(event), event))
        done = b"data: [DONE]\n\n"
        await stream.send_all(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))

    engine = await hostile(handler)
    relayed = 0
    with trio.fail_after(10):
        async with data_pool.stream(engine.spec(role="decode"), "/v1/completions", b"{}",
                                    request_id="r1") as upstream:
            async for data in upstream:
                assert len(data) <= 2 * 65536
                relayed += len(data)
    assert relayed > 16 * LIMIT - len(event)
    assert upstream.saw_terminal


# -- 1. bounded engine answers: control pool and health ---------------------------------------------


async def test_an_endless_health_body_is_a_failed_check_not_held_until_the_timeout(hostile):
    engine = await hostile(chunked_forever())
    pool = ControlPool(control_connections=2, engine_config=FAST)
    recorded: list[tuple[str, Any]] = []

    class Supervisor:
        def record_failure(self, name: str, failure_class: FailureClass) -> None:
            recorded.append((name, failure_class))

        def record_success(self, name: str, kind: SuccessKind) -> None:
            recorded.append((name, kind))

    stage = HealthStage(supervisor=Supervisor(), control_pool=pool, engines=[engine.spec()],
                        check_timeout_s=FAST.health_timeout_s)
    try:
        with trio.fail_after(10):
            with pytest.raises(EngineFailure) as caught:
                await pool.get(engine.spec(), "/health")
            assert caught.value.failure_class is FailureClass.INFERENCE_STATUS
            assert caught.value.cause == "ResponseTooLarge"
            await stage.run(1)
    finally:
        await pool.aclose()
    assert stage.sweep is not None and stage.sweep.results == {"e1": False}
    assert recorded == [("e1", FailureClass.INFERENCE_STATUS)]
    assert engine.sent < ENDLESS_BYTES


# -- the request core over a real data pool ------------------------------------------------------

CORE_CONFIG = """
[serving]
count_tokens = false
request_deadline_s = 20.0
[engine]
request_timeout_s = 5.0
max_response_bytes = {limit}
max_handoff_bytes = {handoff}
[[engines]]
name = "p1"
url = "http://127.0.0.1:{prefill_port}"
role = "prefill"
[[engines]]
name = "d1"
url = "http://127.0.0.1:{decode_port}"
role = "decode"
"""

KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p1",
      "remote_block_ids": [1, 2, 3], "remote_host": "127.0.0.1", "remote_port": 9001}


class RecordingSupervisor:
    def __init__(self) -> None:
        self.failures: list[tuple[str, FailureClass]] = []
        self.successes: list[tuple[str, SuccessKind]] = []

    def eligible(self, role: str, model: str | None = None) -> list[str]:
        return ["p1"] if role == "prefill" else ["d1"]

    def capacity_problem(self, model: str | None = None) -> str | None:
        return None

    def record_failure(self, engine: str, failure_class: FailureClass) -> None:
        self.failures.append((engine, failure_class))

    def record_success(self, engine: str, kind: SuccessKind) -> None:
        self.successes.append((engine, kind))


class Sink:
    def __init__(self) -> None:
        self.started = False
        self.finished = False
        self.status = 0
        self.body = b""

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.status, self.body, self.finished = status, body, True

    async def start_stream(self, status: int, headers: list[tuple[bytes, bytes]], first: bytes = b"") -> None:
        self.started, self.status = True, status

    async def write(self, data: bytes) -> None:
        pass

    async def end_stream(self, last: bytes = b"") -> None:
        self.finished = True

    def direct(self) -> None:
        """No client socket under this sink: the relay pump never takes its stream."""
        return None


def json_answer(payload: bytes) -> Handler:
    async def handler(stream: trio.SocketStream, _: bytes) -> None:
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                              b"content-length: %d\r\n\r\n%s" % (len(payload), payload))
    return handler


DECODE_ANSWER = json_answer(b'{"choices": [{"text": "ok"}], "usage": {"completion_tokens": 1}}')


@pytest.fixture
async def core_over(hostile, nursery: trio.Nursery):
    pools: list[DataPool] = []

    async def build(prefill: Handler, decode: Handler = DECODE_ANSWER, *, limit: int = 8 * 1024 * 1024,
                    handoff: int = 1024 * 1024) -> tuple[RequestCore, RecordingSupervisor, HostileEngine,
                                                        HostileEngine]:
        p, d = await hostile(prefill), await hostile(decode)
        config = parse_config(CORE_CONFIG.format(limit=limit, handoff=handoff, prefill_port=p.port,
                                                 decode_port=d.port))
        pool = DataPool(max_connections=8, engine_config=config.engine)
        await nursery.start(pool.run)
        pools.append(pool)
        supervisor = RecordingSupervisor()
        core = RequestCore(config=config, supervisor=supervisor, data_pool=pool,
                           in_flight=InFlight(["p1", "d1"]), admission=Admission(), metrics=RouterMetrics())
        return core, supervisor, p, d

    yield build
    for pool in pools:
        await pool.aclose()


REQUEST = b'{"model": "mock-model", "prompt": "hi", "max_tokens": 2}'


PREFILL_ANSWER = json_answer(msgspec.json.encode({"kv_transfer_params": KV}))
REQUEST_WHOLE = b'{"model": "mock-model", "prompt": "hi", "max_tokens": 2, "stream": false}'


async def test_a_decode_answering_without_end_gets_the_client_a_502_json_and_blames_the_decode(core_over):
    core, supervisor, p, d = await core_over(PREFILL_ANSWER, chunked_forever(), limit=LIMIT)
    sink = Sink()
    with trio.fail_after(10):
        await core.handle("/v1/completions", REQUEST_WHOLE, None, sink)
    assert sink.status == 502
    error = json.loads(sink.body)["error"]
    assert error["code"] == "inference_status" and "bound" in error["message"]
    assert supervisor.failures == [("d1", FailureClass.INFERENCE_STATUS)]


async def test_a_decode_error_body_without_end_is_inference_status(core_over):
    core, supervisor, p, d = await core_over(PREFILL_ANSWER, chunked_forever(500), limit=LIMIT)
    sink = Sink()
    with trio.fail_after(10):
        await core.handle("/v1/completions", REQUEST, None, sink)
    assert sink.status == 502
    assert supervisor.failures == [("d1", FailureClass.INFERENCE_STATUS)]


async def test_a_prefill_200_too_large_to_read_is_an_unreadable_handoff_on_the_prefill(core_over):
    core, supervisor, p, d = await core_over(chunked_forever(), limit=LIMIT)
    sink = Sink()
    with trio.fail_after(10):
        await core.handle("/v1/completions", REQUEST, None, sink)
    assert sink.status == 502
    error = json.loads(sink.body)["error"]
    assert error["code"] == "kv_handoff" and "too large" in error["message"]
    assert supervisor.failures == [("p1", FailureClass.KV_HANDOFF)]
    assert d.heads == []


# -- 2. the prefill's handoff, bounded at the prefill leg ---------------------------------------------


@pytest.mark.parametrize("junk", ["30MB-nested", "big", "deep-document", "deep-handoff"])
async def test_a_hostile_handoff_is_kv_handoff_on_the_prefill_and_never_reaches_decode(core_over, junk):
    if junk == "30MB-nested":
        # The case: 30 MB of nested junk, over every bound, with the default bounds.
        junk_value: Any = [[{"k": ["v" * 64] * 8}] * 8] * 7500
        answer = msgspec.json.encode({"kv_transfer_params": {**KV, "junk": junk_value}})
        assert len(answer) > 30_000_000
    elif junk == "big":
        # 2 MB of junk: under the response bound (8 MiB), over the handoff bound (1 MiB).
        kv = {**KV, "junk": [{"k": "v" * 100}] * 20000}
        answer = msgspec.json.encode({"kv_transfer_params": kv})
    elif junk == "deep-document":
        answer = b'{"kv_transfer_params": ' + msgspec.json.encode(KV)[:-1] + b', "x": ' + b"[" * 100_000 \
            + b"]" * 100_000 + b"}}"
    else:
        nested: Any = 1
        for _ in range(40):
            nested = {"n": nested}
        answer = msgspec.json.encode({"kv_transfer_params": {**KV, "extra": nested}})
    core, supervisor, p, d = await core_over(json_answer(answer))
    sink = Sink()
    with trio.fail_after(10):
        await core.handle("/v1/completions", REQUEST, None, sink)
    assert sink.status == 502
    assert json.loads(sink.body)["error"]["code"] == "kv_handoff"
    assert supervisor.failures == [("p1", FailureClass.KV_HANDOFF)]
    assert d.heads == []


def test_the_handoff_bound_counts_the_forwarded_json():
    kv = {**KV, "pad": "p" * 5000}
    raw = msgspec.json.encode({"kv_transfer_params": kv, "other": "o" * 10000})
    assert msgspec.json.decode(read_handoff(raw, max_bytes=6000)) == kv
    with pytest.raises(ValueError, match="over the 4000 byte bound"):
        read_handoff(raw, max_bytes=4000)


# -- 3. an engine that refuses the body while we are still sending it ------------------------------


def refuse_early(status: int = 413) -> Handler:
    async def handler(stream: trio.SocketStream, _: bytes) -> None:
        body = b'{"error": {"message": "request body too large for this engine", "type": "invalid_request_error"}}'
        await stream.send_all(b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\nconnection: close\r\n"
                              b"content-length: %d\r\n\r\n%s" % (status, len(body), body))
        # Closing with the unread body in the socket makes the kernel send a reset.
    return handler


async def test_an_engine_413_sent_while_the_body_is_still_going_out_is_its_answer(hostile, data_pool):
    engine = await hostile(refuse_early())
    with trio.fail_after(10), pytest.raises(UpstreamClientError) as caught:
        await data_pool.post_json(engine.spec(), "/v1/completions", b"x" * (16 * 1024 * 1024), request_id="r1")
    assert caught.value.status == 413
    assert b"too large" in caught.value.body


async def test_three_early_413s_are_relayed_and_are_no_evidence_against_the_engine(core_over):
    big_prompt = "p" * (12 * 1024 * 1024)
    core, supervisor, p, d = await core_over(refuse_early())
    for _ in range(3):
        sink = Sink()
        with trio.fail_after(10):
            await core.handle("/v1/completions", msgspec.json.encode({"prompt": big_prompt}), None, sink)
        assert sink.status == 413
        assert "too large" in json.loads(sink.body)["error"]["message"]
    assert supervisor.failures == []
    assert supervisor.successes == [("p1", SuccessKind.CLIENT_4XX)] * 3


# -- 4. our own process out of file descriptors ---------------------------------------------------


@pytest.fixture(autouse=True)
def _capture_events(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")


def events(caplog: pytest.LogCaptureFixture, event: str) -> list[dict[str, Any]]:
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "narwhal.events"]
    return [line for line in lines if line["event"] == event]


async def test_emfile_while_connecting_is_a_503_logged_and_no_evidence(core_over, caplog, monkeypatch):
    core, supervisor, p, d = await core_over(DECODE_ANSWER)

    async def no_fds(host: str, port: int, **kwargs: Any) -> trio.SocketStream:
        # What trio raises when every attempt failed, with the per-address errors beneath.
        inner = OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        outer = OSError(f"all attempts to connect to {host}:{port} failed")
        outer.__cause__ = ExceptionGroup("attempts", [inner])
        raise outer

    monkeypatch.setattr(trio, "open_tcp_stream", no_fds)
    sink = Sink()
    await core.handle("/v1/completions", REQUEST, None, sink)
    assert sink.status == 503
    assert json.loads(sink.body)["error"]["code"] == "local_resource_exhausted"
    assert supervisor.failures == []
    [logged] = events(caplog, "local_resource_exhausted")
    assert logged["errno"] == "EMFILE" and logged["engine"] == "p1" and logged["stage"] == "prefill"
    assert events(caplog, "engine_failure") == []


_AT_THE_FD_LIMIT = textwrap.dedent("""
    import resource, socket, sys, trio
    from narwhal.config import EngineConfig, EngineSpec
    from narwhal.errors import LocalResourceExhausted
    from narwhal.pools.control import ControlPool
    from narwhal.pools.data import DataPool

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    spec = EngineSpec(name="e1", url=f"http://127.0.0.1:{listener.getsockname()[1]}", role="prefill")
    config = EngineConfig(connect_timeout_s=2.0)

    async def main():
        data = DataPool(max_connections=4, engine_config=config)
        control = ControlPool(control_connections=2, engine_config=config)
        # trio's own fds exist by now; lower the limit, then fill every descriptor left.
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        hoard = []
        try:
            while True:
                hoard.append(open("/dev/null"))
        except OSError:
            pass
        results = []
        for call in (lambda: data.post_json(spec, "/v1/completions", b"{}", request_id="r"),
                     lambda: control.get(spec, "/health")):
            try:
                await call()
                results.append("answered")
            except LocalResourceExhausted as exc:
                results.append(exc.errno_name)
            except Exception as exc:
                results.append(type(exc).__name__ + ": " + str(exc))
        for f in hoard:
            f.close()
        await data.aclose()
        await control.aclose()
        print(",".join(results))

    trio.run(main)
""")


def test_at_the_real_fd_limit_both_pools_say_local_resources_not_engine_failure():
    result = subprocess.run([sys.executable, "-c", _AT_THE_FD_LIMIT], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "EMFILE,EMFILE"


async def test_an_engine_that_answers_413_then_neither_reads_nor_closes_is_answered_at_once(hostile, data_pool):
    # Without watching for the answer, the router would wait out the write timeout and call it `timeout`.
    async def handler(stream: trio.SocketStream, _: bytes) -> None:
        await refuse_early()(stream, _)
        await trio.sleep(30)

    engine = await hostile(handler)
    with trio.fail_after(FAST.request_timeout_s / 2), pytest.raises(UpstreamClientError) as caught:
        await data_pool.post_json(engine.spec(), "/v1/completions", b"x" * (64 * 1024 * 1024), request_id="r1")
    assert caught.value.status == 413
