"""The span exporter: a bounded queue the request path appends to, and one trio task that POSTs it as OTLP/HTTP.

``submit_all`` (a request's spans, held together and encoded by the export task) never waits: spans that
would take the queue past ``max_queue`` are dropped (counted). ``run`` sends a batch every ``interval_s``, or
as soon as ``batch`` spans are queued, one POST at a time bounded by ``timeout_s``; a POST that fails or
times out drops its batch (counted) and is never retried, so a slow or absent collector costs a bounded
queue and a counter, never a backlog or a client's latency. Not the OpenTelemetry SDK's BatchSpanProcessor:
it runs a thread and its exporter blocks on ``requests``, neither of which belongs in a trio process.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
import trio

from narwhal.obs.logs import log_event
from narwhal.obs.metrics import Counter
from narwhal.tracing.otlp import encode_encoded, encode_request
from narwhal.tracing.spans import Span

__all__ = ["DROP_EXPORT_FAILED", "DROP_QUEUE_FULL", "SpanExporter", "traces_url"]

# The reasons a span is dropped: the label of narwhal_trace_spans_dropped_total.
DROP_QUEUE_FULL = "queue_full"
DROP_EXPORT_FAILED = "export_failed"

_PROTOBUF = "application/x-protobuf"
# Requests' spans encoded between two checkpoints of the export task (about 1 ms of work).
_ENCODE_CHUNK = 128
# A failing collector is logged once per this many seconds, not once per batch.
_LOG_EVERY_S = 60.0


def traces_url(endpoint: str) -> str:
    """Where OTLP/HTTP takes traces: ``<endpoint>/v1/traces``."""
    return endpoint.rstrip("/") + "/v1/traces"


def _scope_version() -> str:
    try:
        from importlib.metadata import version
        return version("narwhal")
    except Exception:  # noqa: BLE001 -- an uninstalled tree still exports
        return "0"


class SpanExporter:
    """Ended spans in, OTLP/HTTP protobuf out, off the request path; drops what it cannot send in time."""

    def __init__(self, *, endpoint: str, headers: Mapping[str, str], service_name: str, max_queue: int = 8192,
                 batch: int = 2048, interval_s: float = 1.0, timeout_s: float = 5.0,
                 client: httpx.AsyncClient | None = None, dropped_counter: Counter | None = None) -> None:
        # A request's spans as its root ends them (one list, spans the garbage collector does not scan), with how
        # many they are; encoded by the export task, a batch at a time: in a loaded router the request path's
        # code runs cold, and the encoder run there cost about four times what it costs in the batch's loop.
        # The bounds (max_queue, batch) count spans.
        self._queue: deque[tuple[Sequence[Span], int]] = deque()
        self._queued = 0
        self._max_queue = max_queue
        self._batch = batch
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._client = client
        self._counter = dropped_counter
        self._wake = trio.Event()
        self._version = _scope_version()
        self._url = ""
        self._headers: dict[str, str] = {}
        self._service_name = service_name
        self._last_logged = -_LOG_EVERY_S
        self.configure(endpoint=endpoint, headers=headers, service_name=service_name)
        if dropped_counter is not None:
            # Both series exist from the start, at 0: a dashboard sees tracing on before anything dropped.
            for reason in (DROP_QUEUE_FULL, DROP_EXPORT_FAILED):
                dropped_counter.inc(reason, amount=0)
        self.dropped = 0
        self.exported = 0

    def configure(self, *, endpoint: str, headers: Mapping[str, str], service_name: str) -> None:
        """A reload: later exports go to ``endpoint`` with these headers and service name."""
        self._url = traces_url(endpoint)
        self._headers = {**headers, "content-type": _PROTOBUF}
        self._service_name = service_name

    def submit(self, span: Span) -> None:
        """Queue one ended span; never waits (a full queue drops it)."""
        self.submit_all((span,))

    def submit_all(self, spans: Sequence[Span]) -> None:
        """Queue ended spans (a request's) as one entry; never waits: if they do not all fit, all are dropped."""
        count = len(spans)
        queued = self._queued + count
        if queued > self._max_queue:
            self._drop(DROP_QUEUE_FULL, count)
            return
        self._queue.append((spans, count))
        self._queued = queued
        if queued >= self._batch:
            self._wake.set()

    @property
    def queued(self) -> int:
        """Spans waiting to be sent."""
        return self._queued

    def _drop(self, reason: str, count: int) -> None:
        self.dropped += count
        if self._counter is not None:
            self._counter.inc(reason, amount=count)

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Export until cancelled; the client is this task's (closed with it) unless one was given."""
        if self._client is not None:
            task_status.started()
            await self._loop(self._client)
            return
        # No retries: one POST at a time, each bounded by timeout_s.
        async with httpx.AsyncClient(timeout=self._timeout_s, trust_env=False) as client:
            self._client = client
            try:
                task_status.started()
                await self._loop(client)
            finally:
                self._client = None

    async def flush(self) -> None:
        """Export what is queued now (a clean shutdown), one bounded POST a batch; nothing when not running."""
        client = self._client
        while self._queue and client is not None:
            await self.export_batch(client)

    async def _loop(self, client: httpx.AsyncClient) -> None:
        while True:
            with trio.move_on_after(self._interval_s):
                await self._wake.wait()
            self._wake = trio.Event()
            while self._queue:
                await self.export_batch(client)
                if self._queued < self._batch:
                    break

    async def export_batch(self, client: httpx.AsyncClient) -> None:
        """POST the queued spans once, about ``batch`` at most (whole requests' entries: up to ``batch`` plus
        one request's spans less one); a failure or timeout drops them (counted)."""
        queue = self._queue
        if not queue:
            return
        if self._queued <= self._batch:
            taken = list(queue)
            queue.clear()
            take = self._queued
        else:
            taken, take = [], 0
            while queue and take < self._batch:
                entry = queue.popleft()
                taken.append(entry)
                take += entry[1]
        self._queued -= take
        encoded: list[bytes] = []
        for start in range(0, len(taken), _ENCODE_CHUNK):
            if start:
                # A batch is hundreds of requests: the data plane runs between chunks.
                await trio.lowlevel.checkpoint()
            encoded += [encode_request(spans) for spans, _ in taken[start:start + _ENCODE_CHUNK]]
        body = encode_encoded(encoded, service_name=self._service_name, scope_version=self._version)
        problem: str | None = None
        with trio.move_on_after(self._timeout_s) as scope:
            try:
                response = await client.post(self._url, content=body, headers=self._headers)
                if not 200 <= response.status_code < 300:
                    problem = f"HTTP {response.status_code}"
            except httpx.HTTPError as exc:
                problem = f"{type(exc).__name__}: {exc}"
        if scope.cancelled_caught:
            problem = f"no answer within {self._timeout_s:g} s"
        if problem is None:
            self.exported += take
            return
        self._drop(DROP_EXPORT_FAILED, take)
        now = trio.current_time()
        if now - self._last_logged >= _LOG_EVERY_S:
            self._last_logged = now
            log_event("trace_export_failed", level=logging.WARNING, url=self._url, spans=take, problem=problem,
                      dropped_total=self.dropped)
