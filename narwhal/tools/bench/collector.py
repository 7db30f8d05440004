"""A collector for ``narwhal bench --tracing-ratio``: takes OTLP/HTTP exports and counts them, decoding nothing.

It runs in the bench's own process (its CPU is not the router's), answers every ``POST /v1/traces`` 200 at
once, and reports how many exports and bytes came: what the router's tracing cost is measured against.
"""

from __future__ import annotations

from typing import Any

import trio

from narwhal.http1.server import HTTPServer, Request, Responder

__all__ = ["CountingCollector"]

_PROTOBUF = [(b"content-type", b"application/x-protobuf")]


class CountingCollector:
    """An OTLP/HTTP endpoint that accepts every export and counts it."""

    def __init__(self) -> None:
        self.exports = 0
        self.bytes = 0
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; ``started(port)``."""
        # Exports are batches of up to 512 spans: a few hundred KiB at most.
        server = HTTPServer(self._handle, max_body_bytes=64 * 1024 * 1024)
        async with trio.open_nursery() as nursery:
            self.port = await nursery.start(server.serve, "127.0.0.1", 0)
            task_status.started(self.port)

    async def _handle(self, request: Request, responder: Responder) -> None:
        if request.method == b"POST" and request.path == "/v1/traces":
            self.exports += 1
            self.bytes += len(request.body)
            await responder.respond(200, _PROTOBUF, b"")
        else:
            await responder.respond(404, [], b"")

    def report(self) -> dict[str, int]:
        return {"exports": self.exports, "bytes": self.bytes}
