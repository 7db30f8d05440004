"""One process's tracing: the tracer the request path reads (None when off) and its exporter task.

Owned by the process's data plane (``LocalDataPlane``), which runs ``run`` in its nursery: in the one
serving process, and in every worker process. A reload may turn tracing on or off or change where
spans go; ``configure`` applies it and the task starts or stops the exporter.
"""

from __future__ import annotations

from typing import Any

import trio

from narwhal.config import TracingConfig
from narwhal.obs.metrics import Counter
from narwhal.tracing.exporter import SpanExporter
from narwhal.tracing.tracer import Tracer

__all__ = ["TracingService"]


class TracingService:
    """The tracer and exporter that ``[tracing]`` asks for, following reloads."""

    def __init__(self, config: TracingConfig, dropped_counter: Counter | None = None) -> None:
        self._counter = dropped_counter
        self.tracer: Tracer | None = None
        self.exporter: SpanExporter | None = None
        self._changed = trio.Event()
        self._scope: trio.CancelScope | None = None
        self.configure(config)

    def configure(self, config: TracingConfig) -> None:
        """Use ``config`` from now on: new requests see the tracer (or None), the next export the endpoint."""
        endpoint = config.otlp_endpoint
        if endpoint is None:
            self.tracer = self.exporter = None
            if self._scope is not None:
                # Spans still queued go with the exporter: tracing was turned off.
                self._scope.cancel()
            return
        if self.exporter is None:
            self.exporter = SpanExporter(endpoint=endpoint, headers=config.headers,
                                         service_name=config.service_name, dropped_counter=self._counter)
            self.tracer = Tracer(config, self.exporter.submit_all)
            self._changed.set()
            return
        self.exporter.configure(endpoint=endpoint, headers=config.headers, service_name=config.service_name)
        assert self.tracer is not None
        self.tracer.configure(config)

    async def flush(self, timeout_s: float) -> None:
        """Send the spans still queued, for at most ``timeout_s`` (the process is stopping)."""
        exporter = self.exporter
        if exporter is not None:
            with trio.move_on_after(timeout_s):
                await exporter.flush()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Run the exporter while tracing is on; wait for a reload that turns it on while it is off."""
        task_status.started()
        while True:
            exporter = self.exporter
            if exporter is None:
                await self._changed.wait()
                self._changed = trio.Event()
                continue
            with trio.CancelScope() as self._scope:
                await exporter.run()
            self._scope = None
