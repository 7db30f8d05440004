"""A test-only ASGI middleware for the tier's vLLM engines: records the W3C trace context each request carried.

Loaded by ``--middleware narwhal_trace_recorder.TraceRecorder`` (this directory is first on the engines'
PYTHONPATH); ``GET /narwhal-test/trace-headers`` answers the last requests' path, ``x-request-id``,
``traceparent`` and ``tracestate`` as JSON. It shows the router passes trace context to real vLLM whether or not
vLLM's own OpenTelemetry extras are installed. Everything else goes straight through.
"""

from __future__ import annotations

import collections
import json
from typing import Any

_PATH = "/narwhal-test/trace-headers"
_KEPT = 64


class TraceRecorder:
    """Starlette builds it as ``cls(app)``."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.seen: collections.deque[dict[str, str | None]] = collections.deque(maxlen=_KEPT)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        if scope.get("path") == _PATH:
            body = json.dumps(list(self.seen)).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
            return
        headers = dict(scope.get("headers") or [])
        traceparent = headers.get(b"traceparent")
        if traceparent is not None:
            state = headers.get(b"tracestate")
            request_id = headers.get(b"x-request-id")
            self.seen.append({"path": scope.get("path"), "traceparent": traceparent.decode("latin-1"),
                              "tracestate": None if state is None else state.decode("latin-1"),
                              "request_id": None if request_id is None else request_id.decode("latin-1")})
        await self.app(scope, receive, send)
