"""The data plane in worker processes, as the router drives it (``serving.workers > 1``).

The same ``DataPlane`` as one process's: the workers serve, the controller's
hub sums what they report (in-flight counts, data pools), and a TLS reload
counts only once every worker has answered that it reloaded.
"""

from __future__ import annotations

from typing import Any

import trio

from narwhal.serving.data_plane import DataPoolUsage
from narwhal.tls import TLSContexts
from narwhal.workers.hub import AggregateInFlight, WorkerHub
from narwhal.workers.process import WorkerSet

__all__ = ["WorkerDataPlane"]


class WorkerDataPlane:
    """N worker processes serving the completion routes from the hub's snapshots."""

    def __init__(self, workers: WorkerSet, hub: WorkerHub) -> None:
        self.workers = workers
        self.hub = hub

    @property
    def in_flight(self) -> AggregateInFlight:
        """Requests in flight per engine, summed over the workers' reports."""
        return self.hub.in_flight

    async def run(self, listeners: list[trio.SocketListener], *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Start every worker on ``listeners``; ``started(port)``; return once every worker has stopped."""
        await self.workers.run(listeners, task_status=task_status)

    def shutdown(self, grace_s: float) -> None:
        """Workers learn of the closed admission at once, then stop within ``grace_s``."""
        self.hub.publish()
        self.workers.shutdown(grace_s)

    async def reload_tls(self, tls: TLSContexts) -> dict[str, str]:
        """Each worker reads the files itself (its contexts serve its connections); those that did not, with why."""
        failures = await self.workers.reload_tls()
        return {f"worker {index}": reason for index, reason in sorted(failures.items())}

    def pool_usage(self) -> DataPoolUsage:
        """Each worker has its own data pool: the figures are sums over the workers' last reports."""
        workers = self.hub.workers.values()
        return DataPoolUsage(in_use=sum(w.data_in_use for w in workers), waiting=sum(w.data_waiting for w in workers),
                             capacity=self.workers.config.serving.max_connections * self.workers.count)
