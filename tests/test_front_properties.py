"""Property tests of the data-plane front: hostile bytes never crash it.

Random byte streams, random request heads and random JSON bodies go into the
real Router's front (its handler, request core and quart app) over in-process
memory streams, with a fleet nobody listens for (127.0.0.1:9). Whatever comes
in: every answer is a well-formed HTTP response, every 4xx/5xx carries an
OpenAI-style JSON error, the server never fails a connection or a handler, no
connection or request is left behind, and memory stays bounded.
"""

from __future__ import annotations

import gc
import json
import logging
import tracemalloc
from typing import Any

import httptools
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from narwhal.config import parse_config
from narwhal.http1.asgi import ASGILifespan
from narwhal.router import Router

CONFIG = """
[serving]
max_body_bytes = 65536
max_header_bytes = 4096
[[engines]]
name = "p1"
url = "http://127.0.0.1:9"
role = "prefill"
[[engines]]
name = "d1"
url = "http://127.0.0.1:9"
role = "decode"
"""

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                    derandomize=False)

PATHS = ["/v1/completions", "/v1/chat/completions", "/health", "/ready", "/v1/models", "/metrics",
         "/admin/engines", "/admin/engines/p1", "/admin/engines/p1/drain", "/admin/engines/nope/readmit",
         "/nope", "/", "/v1/completions?x=%zz", "/admin/engines/%ff%fe"]
# HEAD is left out: a response to it has no body, which a byte-level check cannot pair up.
METHODS = ["GET", "POST", "PUT", "DELETE", "OPTIONS", "PATCH", "CONNECT", "TRACE", "BREW", "get"]
VERSIONS = ["HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "HTTP/0.9", "HTTP/1.2", "HTTP/9", "HTTX/1.1", ""]
HEADER_NAMES = ["host", "content-length", "transfer-encoding", "connection", "expect", "upgrade",
                "content-type", "x-request-id", "authorization", "te", "trailer", "x-a b", ""]
HEADER_VALUES = ["chunked", "close", "keep-alive", "Upgrade", "100-continue", "websocket", "0", "5", "-1",
                 "99999999999999999999", "application/json", "gzip, chunked", "\x00", "a\rb", " ", ""]

_printable = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7e), max_size=40)
header_lines = st.lists(st.tuples(st.sampled_from(HEADER_NAMES) | _printable,
                                  st.sampled_from(HEADER_VALUES) | _printable), max_size=8)


@st.composite
def request_heads(draw: st.DrawFn) -> bytes:
    """A plausible request, mangled: random method, target, version, headers and body."""
    method = draw(st.sampled_from(METHODS) | _printable)
    target = draw(st.sampled_from(PATHS) | _printable)
    version = draw(st.sampled_from(VERSIONS))
    lines = [f"{method} {target} {version}".encode("latin-1")]
    lines += [f"{name}: {value}".encode("latin-1") for name, value in draw(header_lines)]
    separator = draw(st.sampled_from([b"\r\n", b"\n", b"\r"]))
    body = draw(st.binary(max_size=512))
    return separator.join(lines) + separator + separator + body


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20)
completion_fields = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from(["mock-model", "other"]) | json_values,
    "prompt": st.text(max_size=20) | json_values,
    "messages": st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=10)}),
                         max_size=2) | json_values,
    "stream": st.booleans() | json_values,
    "max_tokens": st.integers(-2, 10) | json_values,
    "kv_transfer_params": json_values,
})


@st.composite
def json_requests(draw: st.DrawFn) -> bytes:
    """A well-framed POST of a random JSON document (often a completion request) to a random route."""
    path = draw(st.sampled_from(PATHS))
    document = draw(completion_fields | json_values)
    body = json.dumps(document).encode()
    if draw(st.booleans()):
        nested = draw(st.integers(1, 3000))
        body = b'{"prompt": "x", "n": ' + b"[" * nested + b"]" * nested + b"}"
    return (b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (path.encode(), len(body), body))


class _Events(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.events.append(json.loads(record.getMessage()))


class _Responses:
    """httptools callbacks collecting every response in a byte stream."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.parser = httptools.HttpResponseParser(self)

    def on_message_begin(self) -> None:
        self.items.append({"status": 0, "headers": {}, "body": b"", "complete": False})

    def on_header(self, name: bytes, value: bytes) -> None:
        self.items[-1]["headers"][name.lower()] = value

    def on_headers_complete(self) -> None:
        self.items[-1]["status"] = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.items[-1]["body"] += body

    def on_message_complete(self) -> None:
        self.items[-1]["complete"] = True


def check_responses(raw: bytes) -> list[int]:
    """Assert ``raw`` is a sequence of complete, well-formed responses; return their statuses."""
    responses = _Responses()
    responses.parser.feed_data(raw)  # raises on anything malformed
    statuses = []
    for item in responses.items:
        assert item["complete"], f"cut response: {raw[:300]!r}"
        status = item["status"]
        statuses.append(status)
        if status >= 400:
            assert item["headers"].get(b"content-type", b"").startswith(b"application/json"), raw[:300]
            error = json.loads(item["body"])["error"]
            assert isinstance(error["message"], str) and isinstance(error["type"], str)
        assert status not in (500, 499), f"an internal error: {raw[:400]!r}"
    return statuses


async def _serve_one(data: bytes) -> tuple[bytes, list[dict[str, Any]], Any]:
    router = Router(parse_config(CONFIG))
    events = _Events()
    logger = logging.getLogger("narwhal.events")
    logger.addHandler(events)
    try:
        async with ASGILifespan(router.app), trio.open_nursery() as nursery:
            client, server_side = trio.testing.memory_stream_pair()
            nursery.start_soon(router.data_plane.server.serve_stream, server_side)
            await client.send_all(data)
            await client.send_eof()
            raw = b""
            with trio.fail_after(20):
                while chunk := await client.receive_some(65536):
                    raw += chunk
                while router.data_plane.server.statistics().connections_open:
                    await trio.sleep(0.001)
            stats = router.data_plane.server.statistics()
    finally:
        logger.removeHandler(events)
    return raw, events.events, stats


class _RequestCount:
    """An independent reading of the client's bytes (httptools, as the front uses): complete requests, or an error."""

    def __init__(self, data: bytes) -> None:
        self.complete = 0
        self.malformed = False
        parser = httptools.HttpRequestParser(self)
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.complete += 1  # an upgrade head is complete (the front refuses it with 400)
        except httptools.HttpParserError:
            self.malformed = True

    def on_headers_complete(self) -> None:
        # A complete head is answered even when its body never arrives whole (the body bounds may refuse it).
        self.complete += 1

    def on_message_complete(self) -> None:
        pass


def run_front(data: bytes) -> list[int]:
    raw, events, stats = trio.run(_serve_one, data)
    failures = [e for e in events if e["event"] in ("http_connection_error", "http_handler_error")]
    assert not failures, failures
    assert stats.connections_open == 0 and stats.requests_in_flight == 0
    statuses = check_responses(raw)
    # Not closed unanswered: a malformed stream gets its error, and a complete head gets an answer
    # (only a stream that is the unfinished start of a request may end without one).
    sent = _RequestCount(data)
    if sent.malformed or sent.complete:
        assert statuses, f"closed unanswered: {data[:300]!r}"
    return statuses


@SETTINGS
@given(st.binary(max_size=4096))
def test_random_bytes_never_break_the_front(data: bytes) -> None:
    run_front(data)


@SETTINGS
@given(st.lists(request_heads(), min_size=1, max_size=3))
def test_random_request_heads_get_well_formed_answers(requests: list[bytes]) -> None:
    run_front(b"".join(requests))


@SETTINGS
@given(st.lists(json_requests(), min_size=1, max_size=3))
def test_random_json_bodies_get_well_formed_answers(requests: list[bytes]) -> None:
    statuses = run_front(b"".join(requests))
    # Well framed: each request gets its answer, nothing is dropped.
    assert len(statuses) == len(requests)


def test_memory_stays_bounded_under_a_flood_of_hostile_input() -> None:
    """Many connections of oversized heads and bodies: Python's allocations stay flat."""
    flood = [b"GET / HTTP/1.1\r\nx-pad: " + b"a" * 100_000,  # an endless header line
             b"POST /v1/completions HTTP/1.1\r\ncontent-length: 60000\r\n\r\n" + b"{" * 60_000,
             b"POST /v1/completions HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n" + b"ffff\r\n" + b"x" * 70_000]

    async def main() -> None:
        for _ in range(3):
            for data in flood:
                raw, _events, stats = await _serve_one(data)
                check_responses(raw)
                assert stats.connections_open == 0

    # tracemalloc, not ru_maxrss: the process's high-water mark says nothing once an earlier test raised it.
    tracemalloc.start()
    try:
        trio.run(main)  # a first round: caches, imports and lazy allocations settle
        gc.collect()
        settled, _peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        trio.run(main)
        gc.collect()
        after, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Each connection's buffers are bounded (the head, the body and the drain) ...
    assert peak - settled < 32 * 1024 * 1024
    # ... and nothing of a flood stays behind.
    assert after - settled < 512 * 1024, after - settled
