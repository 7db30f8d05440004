"""The load generator: a small HTTP/1.1 client on trio sockets, parsed with httptools.

It must cost far less than the router it measures (docs/stack.md: httpx alone
costs more per request than the whole data plane), so each connection sends
one pre-encoded request at a time and the response is only watched, never
decoded: SSE events are counted with ``bytes.count`` across read boundaries,
and the stream's end is checked for ``data: [DONE]`` or an SSE error event.

A load is ``concurrency`` workers taking tickets until ``requests`` have been
issued or ``duration_s`` has passed; requests in flight then finish (each is
bounded by ``timeout_s``). Each request yields one ``RequestRecord`` whose
``kind`` is ``"ok"`` or one of ``ERROR_KINDS``.

With ``rate`` the load is open: ticket n is due at the n-th arrival of a seeded
Poisson process of that rate, whatever the earlier requests are doing, and
``concurrency`` only bounds the requests in flight. A request due while all of
them are busy starts late and its latencies count from when it was due, so a
slow router cannot hide its queue by slowing the clients (coordinated omission).
"""

from __future__ import annotations

import random
import socket
import ssl
import time
from array import array
from collections.abc import Callable

import httptools
import msgspec
import trio

from narwhal.errors import NarwhalError
from narwhal.tools.bench.report import LoadSummary, summarize_load

__all__ = [
    "ERROR_KINDS",
    "LoadResult",
    "LoadSpec",
    "LoadState",
    "RequestRecord",
    "bearer_header",
    "build_request",
    "completion_body",
    "run_load",
]

# What can go wrong with one request, as the client sees it.
ERROR_KINDS = {
    "refused": "the connection was refused",
    "connect_error": "the connection could not be opened (other than refused)",
    "reset": "the connection closed or reset before a response head",
    "malformed": "the response is not HTTP/1.1",
    "status": "a response status other than 200 (see errors by status)",
    "sse_error": "a 200 stream that ended with an SSE error event",
    "truncated": "a 200 response whose connection closed before its body ended, no [DONE]",
    "no_done": "a 200 stream that ended cleanly without data: [DONE]",
    "timeout": "no complete response within the request timeout",
    "wrong_length": "a whole stream with more or fewer token events than max_tokens (a mock fleet only)",
}

_READ_SIZE = 65536
_DONE = b"data: [DONE]"
_ERROR_EVENT = b'data: {"error"'
# Longer than every pattern, so counting in (tail + body) minus tail finds the ones across reads.
_TAIL = 32


class LoadSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One bounded load against one HTTP/1.1 endpoint."""

    host: str
    port: int
    path: str = "/v1/completions"
    body: bytes
    concurrency: int = 16
    requests: int | None = 2000
    duration_s: float | None = 20.0
    keep_alive: bool = True
    stream: bool = True
    timeout_s: float = 60.0
    # Streamed answers must carry exactly this many token events (a mock fleet always sends
    # max_tokens): more or fewer is "wrong_length", e.g. a join that repeated or lost tokens.
    expect_tokens: int | None = None
    # A prefill/decode pair with no router (bench --baseline pair): each request first sends ``prefill_body``
    # to this prefill engine, then ``body`` plus the prefill's kv_transfer_params to host:port (the decode).
    prefill_host: str | None = None
    prefill_port: int = 0
    prefill_body: bytes = b""
    # Several models (bench --models N): one body per model, each naming its model; request n sends
    # model_bodies[n % N], round robin by request. Empty: every request sends ``body``.
    model_bodies: tuple[bytes, ...] = ()
    # Several routers on this host (bench --routers N): worker i sends to ports[i % N] instead of ``port``,
    # so the load splits evenly between them. Empty: every worker sends to ``port``.
    ports: tuple[int, ...] = ()
    # More header lines, each ending in CRLF (bench --auth: ``authorization: Bearer KEY``): part of the
    # request bytes encoded once, so a header costs the load generator nothing per request.
    headers: bytes = b""
    # Open loop (bench --rate): requests arrive at this mean rate per second (Poisson, from ``rate_seed``) instead
    # of each worker sending its next one when the last ends. None: closed loop.
    rate: float | None = None
    rate_seed: int = 0
    # A request taken by a client more than this after it was due counts as late (all ``concurrency`` were busy).
    late_after_s: float = 0.001

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if self.rate is not None and not self.rate > 0:
            raise ValueError("rate must be positive")
        if self.requests is None and self.duration_s is None:
            raise ValueError("a load needs a request count, a duration, or both")
        if self.requests is not None and self.requests < 1:
            raise ValueError("requests must be at least 1")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError("duration_s must be positive")
        if self.headers and not self.headers.endswith(b"\r\n"):
            raise ValueError("headers must be header lines, each ending in CRLF")


def completion_body(*, prompt_words: int, max_tokens: int, stream: bool, model: str = "mock-model",
                    kv_transfer_params: dict[str, object] | None = None) -> bytes:
    """A ``/v1/completions`` body; ``kv_transfer_params`` makes it decode-shaped for a direct baseline."""
    body: dict[str, object] = {"model": model, "prompt": " ".join(f"w{i}" for i in range(prompt_words)),
                               "max_tokens": max_tokens, "stream": stream}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    return msgspec.json.encode(body)


def bearer_header(key: str) -> bytes:
    """The ``authorization`` header line a client with ``key`` sends, for ``LoadSpec.headers``."""
    return b"authorization: Bearer " + key.encode("ascii") + b"\r\n"


def build_request(spec: LoadSpec, body: bytes | None = None) -> bytes:
    """The request bytes every worker sends (``spec.body`` unless ``body`` is given), encoded once."""
    connection = b"keep-alive" if spec.keep_alive else b"close"
    accept = b"text/event-stream" if spec.stream else b"application/json"
    body = spec.body if body is None else body
    return b"".join((
        b"POST ", spec.path.encode("ascii"), b" HTTP/1.1\r\nhost: ", f"{spec.host}:{spec.port}".encode(),
        b"\r\ncontent-type: application/json\r\naccept: ", accept, b"\r\nconnection: ", connection,
        b"\r\ncontent-length: ", str(len(body)).encode(), b"\r\n", spec.headers, b"\r\n", body,
    ))


class _Handoff(msgspec.Struct):
    # Raw: forwarded to decode byte for byte, as a router forwards it.  (Raw cannot be in a union: an
    # absent or null handoff is the empty Raw or b"null".)
    kv_transfer_params: msgspec.Raw = msgspec.Raw(b"")


_decode_handoff = msgspec.json.Decoder(_Handoff).decode


class RequestRecord:
    """What one request did; times in seconds, ``started_at`` from the start of the load."""

    __slots__ = ("started_at", "status", "kind", "ttft_s", "total_s", "tokens", "model_index", "target")

    def __init__(self, started_at: float) -> None:
        self.started_at = started_at
        self.status = 0
        self.kind = "ok"
        self.ttft_s: float | None = None
        self.total_s = 0.0
        self.tokens = 0
        # Which of the spec's model_bodies the request sent (0 with one model).
        self.model_index = 0
        # Which of the spec's ports it went to (0 without ``ports``): requests per router with --routers N.
        self.target = 0

    def as_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.__slots__}


class LoadState:
    """Running counts, read by the progress line and the fault scenario while the load goes on."""

    def __init__(self) -> None:
        self.issued = 0
        self.done = 0
        self.errors = 0
        self.tokens = 0
        self.started_at = 0.0
        self.errors_by_kind: dict[str, int] = {}


class _Usage(msgspec.Struct):
    completion_tokens: int = 0


class _UsageOnly(msgspec.Struct):
    usage: _Usage | None = None


_decode_usage = msgspec.json.Decoder(_UsageOnly).decode


class _Exchange:
    """The httptools callbacks for one response, and what they saw.

    ``now`` is set before each ``feed_data``, so every event parsed from one
    socket read carries that read's arrival time.
    """

    __slots__ = ("parser", "stream", "now", "status", "complete", "keep_alive", "tail", "ends", "dones",
                 "error_events", "counted", "arrivals", "body")

    def __init__(self, stream: bool) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.stream = stream
        self.now = 0.0
        self.status = 0
        self.complete = False
        self.keep_alive = False
        self.tail = b""
        # Running totals: event ends (blank lines), [DONE] markers, error events, token events counted.
        self.ends = 0
        self.dones = 0
        self.error_events = 0
        self.counted = 0
        # (arrival time, token events) per read that completed any.
        self.arrivals: list[tuple[float, int]] = []
        self.body: list[bytes] = []

    @property
    def done(self) -> bool:
        return self.dones > 0

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if not self.stream or self.status != 200:
            self.body.append(body)
            return
        tail = self.tail
        joined = tail + body
        # An event is counted when its blank line arrives; its [DONE] or error marker always came first,
        # so a token is never counted for an event that turns out to be one of those.
        self.dones += joined.count(_DONE) - tail.count(_DONE)
        self.error_events += joined.count(_ERROR_EVENT) - tail.count(_ERROR_EVENT)
        ends = joined.count(b"\n\n") - tail.count(b"\n\n") + joined.count(b"\r\n\r\n") - tail.count(b"\r\n\r\n")
        if ends:
            self.ends += ends
            tokens = self.ends - self.dones - self.error_events
            if tokens > self.counted:
                self.arrivals.append((self.now, tokens - self.counted))
                self.counted = tokens
        self.tail = joined[-_TAIL:]

    def on_message_complete(self) -> None:
        self.complete = True
        # should_keep_alive() is valid only inside this callback (docs/stack.md, "Traps").
        self.keep_alive = self.parser.should_keep_alive()


class LoadResult:
    """Every request's record, every inter-token gap, and the connections the load used."""

    def __init__(self, records: list[RequestRecord], gaps_s: array, *, duration_s: float,
                 wall_started_at: float, connections_opened: int, stale_connection_retries: int,
                 offered_rate: float | None = None, late_starts: int = 0, late_max_s: float = 0.0) -> None:
        self.records = records
        # Open loop only: the arrival rate asked for, and the requests that started late (all workers busy).
        self.offered_rate = offered_rate
        self.late_starts = late_starts
        self.late_max_s = late_max_s
        self.gaps_s = gaps_s
        self.duration_s = duration_s
        self.wall_started_at = wall_started_at
        self.connections_opened = connections_opened
        self.stale_connection_retries = stale_connection_retries

    @property
    def ok(self) -> int:
        return sum(1 for record in self.records if record.kind == "ok")

    @property
    def tokens(self) -> int:
        return sum(record.tokens for record in self.records if record.kind == "ok")

    def ok_by_target(self, targets: int) -> list[int]:
        """Requests that succeeded, per index of the spec's ``ports`` (``targets`` of them)."""
        counts = [0] * targets
        for record in self.records:
            if record.kind == "ok":
                counts[record.target] += 1
        return counts

    def summary(self, model_index: int | None = None) -> LoadSummary:
        """Every request's figures, or (``model_index``) only those one model's requests saw.

        A model's summary has no inter-token gaps nor connection counts: those are kept for the whole load.
        """
        if model_index is None:
            records = self.records
        else:
            records = [record for record in self.records if record.model_index == model_index]
        ok = [record for record in records if record.kind == "ok"]
        whole = model_index is None
        return summarize_load(
            kinds=[record.kind for record in records],
            statuses=[record.status for record in records],
            ttft_s=[record.ttft_s for record in ok if record.ttft_s is not None],
            total_s=[record.total_s for record in ok],
            gaps_s=self.gaps_s if whole else (), tokens=sum(record.tokens for record in ok),
            duration_s=self.duration_s, connections_opened=self.connections_opened if whole else 0,
            stale_connection_retries=self.stale_connection_retries if whole else 0,
            offered_rate=self.offered_rate, late_starts=self.late_starts if whole else 0,
            late_max_s=self.late_max_s if whole else 0.0)


class _Refused(NarwhalError):
    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


async def _connect(host: str, port: int) -> trio.SocketStream:
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        await sock.connect((host, port))
    except ConnectionRefusedError:
        sock.close()
        raise _Refused("refused") from None
    except OSError:
        sock.close()
        raise _Refused("connect_error") from None
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(sock)


async def _secure(stream: trio.SocketStream, context: ssl.SSLContext,
                  host: str) -> trio.SSLStream[trio.SocketStream]:
    """The TLS stream over ``stream`` after its handshake (its cost counts toward the request)."""
    secure = trio.SSLStream(stream, context, server_hostname=host, https_compatible=True)
    try:
        await secure.do_handshake()
    except trio.BrokenResourceError:
        stream.socket.close()
        raise _Refused("connect_error") from None
    except BaseException:
        stream.socket.close()
        raise
    return secure


def _close(conn: trio.abc.Stream) -> None:
    """Close at once, without a TLS close_notify: synchronous, so release paths need no checkpoint."""
    raw = conn.transport_stream if isinstance(conn, trio.SSLStream) else conn
    assert isinstance(raw, trio.SocketStream)
    raw.socket.close()


class _Load:
    """One run of ``run_load``: the workers and what they share."""

    def __init__(self, spec: LoadSpec, state: LoadState, on_record: Callable[[RequestRecord], None] | None,
                 ssl_context: ssl.SSLContext | None = None, bodies: Callable[[], bytes] | None = None) -> None:
        self.spec = spec
        # A body per request (the prefix scenario), else the spec's one body, encoded once.
        self.bodies = bodies
        self.ssl_context = ssl_context
        self.state = state
        self.on_record = on_record
        # One encoded request per model (one with a single model), built once.
        self.requests = [build_request(spec, body) for body in spec.model_bodies] or [build_request(spec)]
        self.host = socket.gethostbyname(spec.host)
        self.records: list[RequestRecord] = []
        self.gaps_s = array("d")
        self.connections_opened = 0
        self.stale_retries = 0
        self.t0 = 0.0
        self.stop_at = float("inf")
        # Open loop: the arrivals' clock (the last ticket's due time) and their draws.
        self.due = 0.0
        self.arrivals = random.Random(spec.rate_seed)
        self.late_starts = 0
        self.late_max_s = 0.0

    def take_ticket(self) -> float | None:
        """The next request's due time (now, in a closed loop); None when the load has issued all it may."""
        state = self.state
        if self.spec.requests is not None and state.issued >= self.spec.requests:
            return None
        rate = self.spec.rate
        if rate is None:
            due = trio.current_time()
        else:
            # Tickets are taken in order, so due times grow with the issue count.
            due = self.due = self.due + self.arrivals.expovariate(rate)
        if due >= self.stop_at:
            return None
        state.issued += 1
        return due

    async def worker(self, index: int = 0) -> None:
        conn: trio.abc.Stream | None = None
        target = index % len(self.spec.ports) if self.spec.ports else 0
        port = self.spec.ports[target] if self.spec.ports else self.spec.port
        try:
            models = len(self.requests)
            while (due := self.take_ticket()) is not None:
                if self.spec.rate is not None:
                    # Taken after it was due: no client was free (not this process's own wake-up delay).
                    late = trio.current_time() - due
                    if late > self.spec.late_after_s:
                        self.late_starts += 1
                        self.late_max_s = max(self.late_max_s, late)
                    await trio.sleep_until(due)
                record = RequestRecord(due - self.t0)
                record.target = target
                if models > 1:
                    record.model_index = (self.state.issued - 1) % models
                conn = await self.one(conn, record, port, due)
                self.finish(record)
        finally:
            if conn is not None:
                _close(conn)

    def finish(self, record: RequestRecord) -> None:
        self.records.append(record)
        state = self.state
        state.done += 1
        if record.kind == "ok":
            state.tokens += record.tokens
        else:
            state.errors += 1
            state.errors_by_kind[record.kind] = state.errors_by_kind.get(record.kind, 0) + 1
        if self.on_record is not None:
            self.on_record(record)

    async def _prefill(self) -> bytes | str:
        """Pair mode: the prefill leg on a fresh connection; the decode request to send, or what went wrong."""
        spec = self.spec
        assert spec.prefill_host is not None
        try:
            conn: trio.abc.Stream = await _connect(spec.prefill_host, spec.prefill_port)
        except _Refused as exc:
            return exc.kind
        try:
            exchange = _Exchange(False)
            prefill = msgspec.structs.replace(spec, host=spec.prefill_host, port=spec.prefill_port, stream=False,
                                              keep_alive=False)
            _, ended_early, malformed = await self._exchange(conn, exchange, build_request(prefill, spec.prefill_body))
        finally:
            _close(conn)
        if malformed or exchange.status == 0:
            return "malformed" if malformed else "reset"
        if exchange.status != 200 or ended_early:
            return "status" if exchange.status != 200 else "truncated"
        try:
            kv = _decode_handoff(b"".join(exchange.body)).kv_transfer_params
        except msgspec.DecodeError:
            return "malformed"
        if bytes(kv) in (b"", b"null"):
            return "malformed"
        return build_request(spec, spec.body[:-1] + b',"kv_transfer_params":' + bytes(kv) + b"}")

    async def one(self, conn: trio.abc.Stream | None, record: RequestRecord,
                  port: int | None = None, due: float | None = None) -> trio.abc.Stream | None:
        """Send one request on ``conn`` (or a new connection to ``port``, else the spec's); returns it to reuse.

        Latencies count from ``due`` when given (an open loop's late start is part of them), else from now.
        """
        started = trio.current_time() if due is None else due
        exchange: _Exchange | None = None
        ended_early = False
        request = self.requests[record.model_index] if self.bodies is None else build_request(
            msgspec.structs.replace(self.spec, body=self.bodies()))
        with trio.move_on_after(self.spec.timeout_s) as scope:
            if self.spec.prefill_host is not None:
                prepared = await self._prefill()
                if isinstance(prepared, str):
                    record.kind = prepared
                    record.total_s = trio.current_time() - started
                    return conn
                request = prepared
            # At most two tries: a reused connection the server closed while idle gets one fresh retry.
            for _ in range(2):
                reused = conn is not None
                if conn is None:
                    try:
                        conn = await _connect(self.host, self.spec.port if port is None else port)
                        if self.ssl_context is not None:
                            conn = await _secure(conn, self.ssl_context, self.spec.host)
                    except _Refused as exc:
                        record.kind = exc.kind
                        record.total_s = trio.current_time() - started
                        return None
                    self.connections_opened += 1
                exchange = _Exchange(self.spec.stream)
                got_bytes, ended_early, malformed = await self._exchange(conn, exchange, request)
                if malformed:
                    record.kind = "malformed"
                    break
                if reused and not got_bytes and ended_early:
                    _close(conn)
                    conn = None
                    self.stale_retries += 1
                    continue
                break
        record.total_s = trio.current_time() - started
        if scope.cancelled_caught:
            record.kind = "timeout"
        elif exchange is not None and record.kind == "ok":
            self._classify(record, exchange, started, ended_early)
        if conn is not None and (record.kind in ("timeout", "malformed") or exchange is None
                                 or not (exchange.complete and exchange.keep_alive and self.spec.keep_alive)):
            _close(conn)
            conn = None
        return conn

    async def _exchange(self, conn: trio.abc.Stream, exchange: _Exchange,
                        request: bytes) -> tuple[bool, bool, bool]:
        """Send ``request`` and feed the response to the parser; (got bytes, ended early, malformed)."""
        got_bytes = False
        try:
            await conn.send_all(request)
            while not exchange.complete:
                data = await conn.receive_some(_READ_SIZE)
                if not data:
                    return got_bytes, True, False
                got_bytes = True
                exchange.now = trio.current_time()
                exchange.parser.feed_data(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            return got_bytes, True, False
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            return got_bytes, False, True
        return got_bytes, False, False

    def _classify(self, record: RequestRecord, exchange: _Exchange, started: float, ended_early: bool) -> None:
        record.status = exchange.status
        if exchange.status == 0:
            record.kind = "reset"
            return
        if exchange.status != 200:
            record.kind = "status"
            return
        if not self.spec.stream:
            if not exchange.complete:
                record.kind = "truncated"
                return
            record.ttft_s = record.total_s
            try:
                usage = _decode_usage(b"".join(exchange.body)).usage
            except msgspec.DecodeError:
                usage = None
            record.tokens = usage.completion_tokens if usage else 0
            return
        if exchange.error_events:
            record.kind = "sse_error"
        elif not exchange.done:
            record.kind = "truncated" if ended_early or not exchange.complete else "no_done"
        arrivals = exchange.arrivals
        record.tokens = sum(n for _, n in arrivals)
        if arrivals:
            record.ttft_s = arrivals[0][0] - started
        if record.kind == "ok" and self.spec.expect_tokens is not None and record.tokens != self.spec.expect_tokens:
            record.kind = "wrong_length"
        if record.kind != "ok":
            return
        # Client-visible inter-token gaps: events that arrived in one read are 0 apart.
        gaps = self.gaps_s
        previous = None
        for at, n in arrivals:
            if previous is not None:
                gaps.append(at - previous)
            for _ in range(n - 1):
                gaps.append(0.0)
            previous = at


async def run_load(spec: LoadSpec, *, state: LoadState | None = None,
                   on_record: Callable[[RequestRecord], None] | None = None,
                   ssl_context: ssl.SSLContext | None = None, bodies: Callable[[], bytes] | None = None) -> LoadResult:
    """Run one bounded load and return every request's record; over TLS with ``ssl_context``.

    ``bodies`` gives each request its own body (called once per request); else every request sends ``spec.body``.
    """
    load = _Load(spec, state or LoadState(), on_record, ssl_context, bodies)
    load.t0 = load.due = trio.current_time()
    load.state.started_at = load.t0
    wall_started_at = time.time()
    if spec.duration_s is not None:
        load.stop_at = load.t0 + spec.duration_s
    async with trio.open_nursery() as nursery:
        for index in range(spec.concurrency):
            nursery.start_soon(load.worker, index)
    duration_s = trio.current_time() - load.t0
    return LoadResult(load.records, load.gaps_s, duration_s=duration_s, wall_started_at=wall_started_at,
                      connections_opened=load.connections_opened,
                      stale_connection_retries=load.stale_retries, offered_rate=spec.rate,
                      late_starts=load.late_starts, late_max_s=load.late_max_s)
