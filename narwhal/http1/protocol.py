"""One HTTP/1.1 server connection as a state machine: bytes in, requests out; responses in, bytes out.

No I/O and no trio here (h11's ``Connection``, hypercorn's protocol/socket
split): ``narwhal/http1/connection.py`` runs the socket loop that feeds received
bytes to ``HTTP1Protocol.receive_data``, takes ``Request`` objects off
``requests``, sends the bytes this module builds, and waits until
``deadline()``. The clock is injected, so the head, body and pipelining rules
are tested with bytes and a fake clock (``tests/test_http1_protocol.py``).

What the protocol decides:

- Parsing (httptools, llhttp underneath) into ``Request`` objects; pipelined
  requests queue up in order. The request target is reduced to the origin
  form by ``split_target`` before any route decision.
- Limits: the head (request line and headers, the target included) within
  ``max_header_bytes``, also for one endless line the parser's callbacks never
  see; the body within ``max_body_bytes`` (a declared length over it at once).
  A violation records ``error`` (status, message, code); nothing after it is
  parsed.
- Refusals so that bytes after a head are never parsed as another request:
  ``Upgrade``, ``CONNECT``, other HTTP versions (505), ``Expect`` other than
  ``100-continue`` (417).
- Deadlines: a head must arrive within ``header_timeout_s`` of its first byte
  (the connection's first head: of the accept), a body within
  ``body_timeout_s`` of its head; ``deadline()`` says when, and
  ``timeout_error()`` what to answer.
- The interim ``100 Continue``: due when a request asked for it, its body has
  not arrived, and no response is ahead of it (``interim_response()``).
- Response heads, chunks and error responses as bytes.
"""

from __future__ import annotations

import http
import math
from collections import deque
from collections.abc import Callable
from typing import Protocol

import httptools

from narwhal.errors import NarwhalError
from narwhal.http1.target import InvalidTarget, split_target
from narwhal.wire import error_json

__all__ = [
    "CHUNKED_HEADER",
    "CHUNK_TERMINATOR",
    "CONTINUE",
    "HTTP1Protocol",
    "Limits",
    "ProtocolError",
    "Request",
    "STATUS_LINES",
    "error_response",
    "response_head",
]

STATUS_LINES = {
    status.value: b"HTTP/1.1 %d %b\r\n" % (status.value, status.phrase.encode("latin-1"))
    for status in http.HTTPStatus
}
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
CLOSE_HEADER = b"connection: close\r\n"
_KEEP_ALIVE_HEADER = b"connection: keep-alive\r\n"
CHUNKED_HEADER = b"transfer-encoding: chunked\r\n"
CHUNK_TERMINATOR = b"0\r\n\r\n"
_INF = math.inf

# (status, message, code): a protocol error's answer.
ProtocolError = tuple[int, str, str]


class _Peer(Protocol):
    # What the handler keeps between the requests of one connection (``Request.memo``).
    memo: object

    def peer(self) -> tuple[str, int] | None: ...


class Request:
    """One parsed request with its complete body.

    ``target`` is in origin form (an absolute-form target is reduced to its path
    by ``split_target``, the one function every route decision reads); ``raw_path``
    is its path, percent-encoded as sent, and ``path`` the same decoded as latin-1.
    """

    __slots__ = (
        "_client",
        "_conn",
        "body",
        "headers",
        "http_version",
        "keep_alive",
        "method",
        "path",
        "query",
        "raw_path",
        "target",
    )

    def __init__(
        self,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]] | None = None,
        body: bytes = b"",
        http_version: str = "1.1",
        keep_alive: bool = True,
        client: tuple[str, int] | None = None,
        conn: _Peer | None = None,
    ) -> None:
        self.method = method
        self.target, self.raw_path, self.query = split_target(target)
        self.path = self.raw_path.decode("latin-1")
        self.headers = headers if headers is not None else []
        self.body = body
        self.http_version = http_version
        self.keep_alive = keep_alive
        self._client = client
        self._conn = conn

    @property
    def client(self) -> tuple[str, int] | None:
        """The peer's (host, port); looked up only when asked for (a syscall the data path never needs)."""
        if self._client is None and self._conn is not None:
            self._client = self._conn.peer()
        return self._client

    def get_header(self, name: bytes) -> bytes | None:
        """The value of the first header called ``name`` (lower-case), or None."""
        for key, value in self.headers:
            if key == name:
                return value
        return None

    @property
    def memo(self) -> object:
        """What the handler keeps between the requests of this request's connection: None until it sets one
        (and for a request with no connection, whose memo is never kept)."""
        conn = self._conn
        return None if conn is None else conn.memo

    @memo.setter
    def memo(self, value: object) -> None:
        if self._conn is not None:
            self._conn.memo = value

    def __repr__(self) -> str:
        return f"<Request {self.method.decode()} {self.target.decode('latin-1')} HTTP/{self.http_version}>"


class Limits:
    """The bounds one connection's protocol enforces."""

    __slots__ = ("body_timeout_s", "header_timeout_s", "max_body_bytes", "max_header_bytes")

    def __init__(self, *, max_header_bytes: int = 16384, max_body_bytes: int = 4 * 1024 * 1024,
                 header_timeout_s: float = 10.0, body_timeout_s: float = 30.0) -> None:
        self.max_header_bytes = max_header_bytes
        self.max_body_bytes = max_body_bytes
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s


class _Violation(NarwhalError):
    """Raised inside a parser callback to stop parsing; the answer is in ``HTTP1Protocol.error``."""


class HTTP1Protocol:
    """The parsing and framing state of one server connection (no I/O)."""

    __slots__ = (
        "_body_parts",
        "_body_size",
        "_clock",
        "_content_length",
        "_continue_wanted",
        "_expect",
        "_head_bytes",
        "_head_fed",
        "_headers",
        "_limits",
        "_messages_begun",
        "_owner",
        "_parser",
        "_phase_deadline",
        "_upgrade",
        "_url",
        "error",
        "in_head",
        "in_message",
        "requests",
    )

    def __init__(self, limits: Limits, clock: Callable[[], float], *, started_at: float | None = None,
                 owner: _Peer | None = None) -> None:
        """``started_at`` (the accept, by ``clock``) times the first head; ``owner`` answers ``Request.client``."""
        self._limits = limits
        self._clock = clock
        self._owner = owner
        self._parser = httptools.HttpRequestParser(self)
        # Complete requests not yet taken, in order.
        self.requests: deque[Request] = deque()
        # The protocol error to answer before closing; nothing more is parsed after one.
        self.error: ProtocolError | None = None
        self.in_message = False
        self.in_head = False
        # The head's deadline while a head arrives, the body's while a body does, +inf between requests.
        self._phase_deadline = (clock() if started_at is None else started_at) + limits.header_timeout_s
        self._messages_begun = 0
        self._head_bytes = 0
        self._head_fed = 0
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body_parts: list[bytes] = []
        self._body_size = 0
        self._content_length: bytes | None = None
        self._expect: bytes | None = None
        self._continue_wanted = False
        self._upgrade = False

    # ---- bytes in ----

    def receive_data(self, data: bytes) -> None:
        """Parse ``data``; complete requests go to ``requests``, a protocol error to ``error``."""
        if self.error is not None:
            return
        begun = self._messages_begun
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # on_headers_complete refuses upgrades; this is the parser's own view
            # of one. Nothing after it is ever parsed as a request.
            if self.error is None:
                self.error = (400, "protocol upgrades are not supported", "upgrade_not_supported")
            return
        except httptools.HttpParserError as exc:
            if self.error is None:
                if "HTTP version" in str(exc):
                    self.error = (505, "HTTP version not supported; use HTTP/1.1", "http_version_not_supported")
                else:
                    self.error = (400, f"malformed HTTP request: {exc}", "malformed_request")
            return
        if self.in_head and self._messages_begun == begun:
            # The whole chunk belonged to one unfinished head; this also bounds a
            # single endless header line, which the callbacks never see.
            self._head_fed += len(data)
            if self._head_fed > self._limits.max_header_bytes:
                self.error = (431, "request header fields too large", "request_header_fields_too_large")

    def deadline(self) -> float:
        """When the head or body being received must be complete; +inf between requests."""
        return self._phase_deadline

    def timeout_error(self) -> ProtocolError:
        """The answer to a head or body that missed ``deadline()``."""
        limits = self._limits
        if self.in_head:
            return (408, f"request head not received within {limits.header_timeout_s:g} s", "header_timeout")
        return (408, f"request body not received within {limits.body_timeout_s:g} s", "body_timeout")

    def response_sent(self) -> None:
        """A response went out: a pipelined request begun meanwhile gets a whole window from now.

        Nothing was read while the response was made, so the bytes it is waiting
        for may be in the socket already.
        """
        if self.in_message:
            limits = self._limits
            self._phase_deadline = self._clock() + (limits.header_timeout_s if self.in_head
                                                     else limits.body_timeout_s)

    def interim_response(self) -> bytes | None:
        """``100 Continue`` when it is due now: asked for, the body not yet sent, no response ahead of it."""
        if self._continue_wanted and not self.requests and self.in_message and self.error is None:
            self._continue_wanted = False
            return CONTINUE
        return None

    # ---- httptools callbacks: synchronous, called from feed_data ----

    def on_message_begin(self) -> None:
        self.in_message = True
        self.in_head = True
        self._messages_begun += 1
        self._head_bytes = 0
        self._head_fed = 0
        self._url = b""
        self._headers = []
        self._body_parts = []
        self._body_size = 0
        self._content_length = None
        self._expect = None
        self._continue_wanted = False
        self._upgrade = False
        if self._messages_begun > 1:
            # The first request's head is timed from the accept; later ones from their first byte.
            self._phase_deadline = self._clock() + self._limits.header_timeout_s

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_bytes += len(url)
        if self._head_bytes > self._limits.max_header_bytes:
            self._violation(431, "request header fields too large", "request_header_fields_too_large")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > self._limits.max_header_bytes:
            self._violation(431, "request header fields too large", "request_header_fields_too_large")
        name = name.lower()
        self._headers.append((name, value))
        if name == b"content-length":
            self._content_length = value
        elif name == b"expect":
            self._expect = value.lower()
        elif name == b"upgrade":
            self._upgrade = True

    def on_headers_complete(self) -> None:
        self.in_head = False
        parser = self._parser
        version = parser.get_http_version()
        if not version.startswith("1."):
            self._violation(505, f"HTTP version {version} is not supported; use HTTP/1.1",
                            "http_version_not_supported")
        # httptools stops at the head of an upgrade or CONNECT and would leave the
        # bytes after it to be parsed as the next request: refuse both outright.
        if self._upgrade:
            self._violation(400, "protocol upgrades are not supported", "upgrade_not_supported")
        if parser.get_method() == b"CONNECT":
            self._violation(400, "CONNECT is not supported", "method_not_supported")
        url = self._url
        if url[:1] != b"/" or b"#" in url:
            # Absolute form to origin form now, before any route decision reads the path.
            try:
                self._url = split_target(url)[0]
            except InvalidTarget as exc:
                self._violation(400, str(exc), "invalid_request_target")
        if self._expect is not None:
            if self._expect != b"100-continue":
                self._violation(417, "only 'Expect: 100-continue' is supported", "expectation_failed")
            # HTTP/1.0 clients never get an interim response.
            self._continue_wanted = version == "1.1"
        # llhttp has already rejected a malformed or duplicated content-length.
        if self._content_length is not None and int(self._content_length) > self._limits.max_body_bytes:
            self._violation(413, f"request body larger than {self._limits.max_body_bytes} bytes", "request_too_large")
        self._phase_deadline = self._clock() + self._limits.body_timeout_s

    def on_body(self, body: bytes) -> None:
        self._body_size += len(body)
        if self._body_size > self._limits.max_body_bytes:
            self._violation(413, f"request body larger than {self._limits.max_body_bytes} bytes", "request_too_large")
        self._body_parts.append(body)

    def on_message_complete(self) -> None:
        parser = self._parser
        parts = self._body_parts
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        # should_keep_alive() is only valid inside this callback.
        self.requests.append(
            Request(
                parser.get_method(),
                self._url,
                self._headers,
                body,
                parser.get_http_version(),
                parser.should_keep_alive(),
                None,
                self._owner,
            )
        )
        self.in_message = False
        self.in_head = False
        self._phase_deadline = _INF
        # The client sent the body without waiting: no interim response is due.
        self._continue_wanted = False

    def _violation(self, status: int, message: str, code: str) -> None:
        self.error = (status, message, code)
        raise _Violation(message)


# ---- responses out ----


def response_head(request: Request, status: int, headers: list[tuple[bytes, bytes]], common: bytes,
                  framing: bytes, payload: bytes, *, closes: bool) -> bytes:
    """The response head (status line, ``headers``, ``common`` lines, ``framing``, connection) and ``payload``.

    Joined into one buffer for one write. ``closes``: the connection ends after
    this response (``connection: close``); HTTP/1.0 keep-alive is said explicitly.
    """
    if closes:
        connection = CLOSE_HEADER
    elif request.http_version == "1.0":
        connection = _KEEP_ALIVE_HEADER
    else:
        connection = b""
    status_line = STATUS_LINES.get(status) or b"HTTP/1.1 %d Unknown\r\n" % status
    lines = [status_line]
    for name, value in headers:
        lines.append(b"%b: %b\r\n" % (name, value))
    lines.append(common)
    lines.append(framing)
    lines.append(connection)
    lines.append(b"\r\n")
    lines.append(payload)
    return b"".join(lines)


def error_response(error: ProtocolError, common: bytes) -> bytes:
    """A protocol error's whole response: a JSON body, then the connection closes."""
    status, message, code = error
    body = error_json(message, type_="invalid_request_error", code=code)
    return b"".join([STATUS_LINES[status], b"content-type: application/json\r\n", common,
                     b"content-length: %d\r\n" % len(body), CLOSE_HEADER, b"\r\n", body])
