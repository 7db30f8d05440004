"""A collector double: takes OTLP/HTTP protobuf on ``POST /v1/traces`` and decodes it with opentelemetry-proto.

Runs in the test's trio loop (``await nursery.start(collector.serve)``); ``mode`` makes it answer, fail (503)
or hang, so the exporter's drops can be shown. Spans are kept decoded, with events to wait on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan

from narwhal.http1.server import HTTPServer, Request, Responder


def attributes(kvs: Any) -> dict[str, Any]:
    """A protobuf KeyValue list as a dict of plain values."""
    out: dict[str, Any] = {}
    for kv in kvs:
        kind = kv.value.WhichOneof("value")
        out[kv.key] = getattr(kv.value, kind) if kind else None
    return out


class Collector:
    """Records every exported span; ``mode``: "ok", "fail" (503) or "hang" (never answers)."""

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.requests: list[ExportTraceServiceRequest] = []
        self.headers: list[dict[bytes, bytes]] = []
        self.spans: list[ProtoSpan] = []
        self.service_names: list[str] = []
        self.port = 0
        self._changed = trio.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        server = HTTPServer(self._handle)
        async with trio.open_nursery() as nursery:
            self.port = await nursery.start(server.serve, "127.0.0.1", 0)
            task_status.started(self.port)

    async def _handle(self, request: Request, responder: Responder) -> None:
        if request.path != "/v1/traces" or request.method != b"POST":
            await responder.respond(404, [], b"")
            return
        self.headers.append({name.lower(): value for name, value in request.headers})
        if self.mode == "hang":
            await trio.sleep_forever()
        if self.mode == "fail":
            await responder.respond(503, [], b"")
            return
        message = ExportTraceServiceRequest.FromString(request.body)
        self.requests.append(message)
        for resource_spans in message.resource_spans:
            service = attributes(resource_spans.resource.attributes).get("service.name")
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append(span)
                    self.service_names.append(service)
        self._changed.set()
        self._changed = trio.Event()
        await responder.respond(200, [(b"content-type", b"application/x-protobuf")], b"")

    def named(self, name: str, trace_id: bytes | None = None) -> list[ProtoSpan]:
        return [span for span in self.spans if span.name == name and (trace_id is None or span.trace_id == trace_id)]

    def trace(self, trace_id: bytes) -> list[ProtoSpan]:
        return [span for span in self.spans if span.trace_id == trace_id]

    async def wait_for(self, ready: Callable[[], bool]) -> None:
        """Until ``ready()`` holds after some export (the caller bounds the wait)."""
        while not ready():
            await self._changed.wait()
