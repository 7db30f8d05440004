"""The controller's side of the shared prefix index: apply each worker's placements, relay them to the others.

Reports carry the prompts a worker placed since its previous report; the
controller applies them to its own index (the one ``/metrics`` and
``/admin/engines`` show) and sends them on to every other worker in an
``IndexUpdate``. Forgetting an engine (ejection, maintenance) bumps its epoch
here and goes to every worker at once. A worker that has not yet seen the
current epochs gets them with the answer to its next report.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from narwhal.fleet.placement import SharedIndex
from narwhal.fleet.placement.shared_index import IndexRecord
from narwhal.obs.logs import log_event
from narwhal.workers.protocol import IndexUpdate, Report

__all__ = ["IndexRelay"]


class _Worker(Protocol):
    send: Callable[[Any], None]


class IndexRelay:
    """Relays placements between workers through the controller's ``SharedIndex``."""

    def __init__(self, shared: SharedIndex, workers: Mapping[int, _Worker], *,
                 on_applied: Callable[[list[IndexRecord]], None] | None = None) -> None:
        """``on_applied``: told of every worker's placements applied here (other routers get them too)."""
        self.shared = shared
        self._on_applied = on_applied
        self._workers = workers
        # The epochs each worker (its link, so a restarted worker counts as new) was last sent.
        self._sent: dict[int, tuple[object, dict[str, int]]] = {}

    def on_report(self, worker: int, report: Report) -> None:
        """Apply a worker's placements and send them to the other workers."""
        applied = self.shared.apply(report.placements) if report.placements else []
        if applied and self._on_applied is not None:
            self._on_applied(applied)
        epochs = self.shared.epochs
        for index, state in list(self._workers.items()):
            stale = self._sent.get(index) != (state, epochs)
            if (applied and index != worker) or (stale and index == worker):
                self._send(index, state, IndexUpdate(records=applied if index != worker else [],
                                                     epochs=dict(epochs)))

    def apply_external(self, records: list[IndexRecord]) -> None:
        """Placements another router made: apply them here and send them to every worker."""
        applied = self.shared.apply(records)
        if not applied:
            return
        update = IndexUpdate(records=applied, epochs=dict(self.shared.epochs))
        for index, state in list(self._workers.items()):
            self._send(index, state, update)

    def forget(self, engine: str) -> None:
        """The engine's cache is gone: drop it here and in every worker."""
        self.shared.forget(engine)
        update = IndexUpdate(records=[], epochs=dict(self.shared.epochs))
        for index, state in list(self._workers.items()):
            self._send(index, state, update)

    def _send(self, index: int, state: _Worker, update: IndexUpdate) -> None:
        try:
            state.send(update)
        except Exception as exc:  # a dead link is noticed and handled by the process layer
            log_event("worker_index_update_failed", level=logging.WARNING, worker=index,
                      **{"class": type(exc).__name__}, message=str(exc))
            return
        self._sent[index] = (state, dict(update.epochs))
