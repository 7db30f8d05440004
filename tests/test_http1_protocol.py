"""The HTTP/1.1 protocol object with bytes in and bytes out: no sockets, no trio, a fake clock.

``narwhal.http1.protocol.HTTP1Protocol`` is the whole of the parsing, limits,
deadlines and framing rules; the socket loop in ``narwhal/http1/connection.py``
only moves bytes. These tests feed it bytes (split anywhere) and read what it
decided, and check the response bytes it builds.
"""

from __future__ import annotations

import json

import httptools
import pytest
from hypothesis import given
from hypothesis import strategies as st

from narwhal.http1.protocol import (
    CONTINUE,
    HTTP1Protocol,
    Limits,
    Request,
    error_response,
    response_head,
)

COMMON = b"server: narwhal\r\ndate: Tue, 01 Dec 2026 16:00:00 GMT\r\n"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def protocol(clock: Clock | None = None, **limits: float) -> tuple[HTTP1Protocol, Clock]:
    clock = clock or Clock()
    return HTTP1Protocol(Limits(**limits), clock), clock  # type: ignore[arg-type]


def get(path: bytes, extra: bytes = b"") -> bytes:
    return b"GET " + path + b" HTTP/1.1\r\nhost: x\r\n" + extra + b"\r\n"


# ---- bytes in: requests ----


@given(st.lists(st.integers(1, 200), max_size=6))
def test_pipelined_requests_come_out_in_order_however_the_bytes_are_split(cuts: list[int]) -> None:
    data = (get(b"/1") + b"POST /2?q=1 HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nhello"
            + get(b"http://x:80/3"))
    proto, _ = protocol()
    pos = 0
    for cut in cuts:
        proto.receive_data(data[pos:pos + cut])
        pos += cut
    proto.receive_data(data[pos:])
    assert proto.error is None
    requests = list(proto.requests)
    assert [(r.method, r.target, r.path, r.query, r.body) for r in requests] == [
        (b"GET", b"/1", "/1", b"", b""), (b"POST", b"/2?q=1", "/2", b"q=1", b"hello"), (b"GET", b"/3", "/3", b"", b"")]
    assert requests[1].get_header(b"content-length") == b"5" and requests[0].keep_alive
    assert not proto.in_message


@pytest.mark.parametrize(("data", "status", "code"), [
    (b"GET /" + b"t" * 899 + b" HTTP/1.1\r\nx-pad: " + b"h" * 193 + b"\r\n\r\n", 431,
     "request_header_fields_too_large"),  # the target counts (issue 26 break 6)
    (b"GET / HTTP/1.1\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n" + get(b"/admin"), 400,
     "upgrade_not_supported"),
    (b"CONNECT x:1 HTTP/1.1\r\n\r\n" + get(b"/admin"), 400, "method_not_supported"),
    (b"GET / HTTP/2.0\r\n\r\n", 505, "http_version_not_supported"),
    (b"POST / HTTP/1.1\r\nexpect: bribe\r\ncontent-length: 1\r\n\r\nx", 417, "expectation_failed"),
    (b"POST / HTTP/1.1\r\ncontent-length: 1001\r\n\r\n", 413, "request_too_large"),
    (b"POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n3e9\r\n" + b"x" * 1001, 413, "request_too_large"),
    (b"GET ftp://x/admin HTTP/1.1\r\n\r\n", 400, "invalid_request_target"),
    (b"GET / HTTP/1.1\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n", 400, "malformed_request"),
])
def test_protocol_errors_are_recorded_and_nothing_after_them_is_parsed(data: bytes, status: int, code: str) -> None:
    proto, _ = protocol(max_header_bytes=1000, max_body_bytes=1000)
    proto.receive_data(data)
    proto.receive_data(get(b"/later"))
    assert proto.error is not None and proto.error[:1] == (status,) and proto.error[2] == code
    assert not proto.requests


def test_one_endless_header_line_is_bounded_across_reads() -> None:
    proto, _ = protocol(max_header_bytes=1024)
    proto.receive_data(b"GET / HTTP/1.1\r\nx-long: ")
    for _ in range(3):
        proto.receive_data(b"v" * 512)
    assert proto.error == (431, "request header fields too large", "request_header_fields_too_large")


# ---- deadlines, on the injected clock ----


def test_the_first_head_is_timed_from_the_start_and_later_ones_from_their_first_byte() -> None:
    clock = Clock()
    proto = HTTP1Protocol(Limits(header_timeout_s=10.0, body_timeout_s=30.0), clock, started_at=95.0)
    assert proto.deadline() == 105.0  # the accept was at 95 (a TLS handshake took 5 s)
    proto.receive_data(b"POST / HTTP/1.1\r\ncontent-length: 3\r\n")
    assert proto.deadline() == 105.0 and proto.in_head  # bytes do not push it back
    clock.now = 101.0
    proto.receive_data(b"\r\n")
    assert proto.deadline() == 131.0 and not proto.in_head  # the body's window, from the head
    proto.receive_data(b"abc")
    assert proto.deadline() == float("inf")
    clock.now = 200.0
    proto.receive_data(b"GET /2 HTTP/1.1\r\n")
    assert proto.deadline() == 210.0
    assert proto.timeout_error() == (408, "request head not received within 10 s", "header_timeout")


def test_a_pipelined_head_gets_a_whole_window_after_the_response_ahead_of_it() -> None:
    proto, clock = protocol(header_timeout_s=10.0)
    proto.receive_data(get(b"/1") + b"GET /2 HTTP/1.1\r\n")
    proto.requests.popleft()
    clock.now = 150.0  # the response to /1 took 50 s; nothing was read meanwhile
    proto.response_sent()
    assert proto.deadline() == 160.0


# ---- the interim response ----


def test_100_continue_is_due_only_with_no_response_ahead_and_no_body_yet() -> None:
    expect = b"POST /u HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\nexpect: 100-continue\r\n\r\n"
    proto, _ = protocol()
    proto.receive_data(get(b"/slow") + expect)
    assert proto.interim_response() is None  # /slow's response is due first
    proto.requests.popleft()
    proto.response_sent()
    assert proto.interim_response() == CONTINUE == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert proto.interim_response() is None  # once
    proto.receive_data(b"abc")
    assert proto.requests[0].body == b"abc"

    eager, _ = protocol()
    eager.receive_data(expect + b"abc")  # the body came without waiting: no interim response
    assert eager.interim_response() is None and eager.requests[0].body == b"abc"

    old, _ = protocol()
    old.receive_data(expect.replace(b"HTTP/1.1", b"HTTP/1.0"))
    assert old.interim_response() is None  # HTTP/1.0 clients never get one


# ---- responses out ----


def _parsed(raw: bytes) -> dict[str, object]:
    class Callbacks:
        status = 0
        headers: dict[bytes, bytes] = {}
        body = b""

        def on_header(self, name: bytes, value: bytes) -> None:
            self.headers[name] = value

        def on_body(self, body: bytes) -> None:
            self.body += body

    callbacks = Callbacks()
    callbacks.headers = {}
    parser = httptools.HttpResponseParser(callbacks)
    parser.feed_data(raw)
    return {"status": parser.get_status_code(), "headers": callbacks.headers, "body": callbacks.body}


@pytest.mark.parametrize(("version", "closes", "connection"), [
    ("1.1", False, None), ("1.1", True, b"close"), ("1.0", False, b"keep-alive"), ("1.0", True, b"close")])
def test_response_heads_say_what_happens_to_the_connection(version: str, closes: bool,
                                                           connection: bytes | None) -> None:
    request = Request(b"GET", b"/", http_version=version)
    raw = response_head(request, 200, [(b"content-type", b"text/plain")], COMMON, b"content-length: 2\r\n",
                        b"ok", closes=closes)
    assert raw.startswith(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nserver: narwhal\r\n")
    parsed = _parsed(raw)
    assert parsed["body"] == b"ok" and parsed["headers"].get(b"connection") == connection  # type: ignore[union-attr]


def test_an_unknown_status_still_gets_a_status_line() -> None:
    raw = response_head(Request(b"GET", b"/"), 599, [], COMMON, b"content-length: 0\r\n", b"", closes=False)
    assert raw.startswith(b"HTTP/1.1 599 Unknown\r\n")


def test_an_error_response_is_json_and_closes() -> None:
    raw = error_response((431, "request header fields too large", "request_header_fields_too_large"), COMMON)
    parsed = _parsed(raw)
    assert parsed["status"] == 431
    assert parsed["headers"][b"connection"] == b"close"  # type: ignore[index]
    assert json.loads(parsed["body"])["error"] == {  # type: ignore[arg-type]
        "message": "request header fields too large", "type": "invalid_request_error",
        "code": "request_header_fields_too_large"}
