"""The log lines of discovery, one place for every store: engines discovered and vanished, bad entries, outages.

``log_update(update, source="etcd", default_model=...)`` writes what one watcher
update means: ``engine_vanished`` for each removed or changed engine (as it
was), ``engine_discovered`` for each added or changed one (as it is now),
``discovery_entry_invalid`` per bad key, ``discovery_degraded`` /
``discovery_recovered`` when the store is lost and back.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol

from narwhal.config import EngineSpec
from narwhal.discovery.view import ViewChange
from narwhal.obs.logs import log_event

__all__ = ["Update", "log_update"]


class _Status(Protocol):
    @property
    def degraded(self) -> str | None: ...


class Update(Protocol):
    """What a watcher reports: etcd's ViewUpdate has these fields."""

    @property
    def reason(self) -> str: ...
    @property
    def engines(self) -> Mapping[str, EngineSpec]: ...
    @property
    def change(self) -> ViewChange: ...
    @property
    def status(self) -> _Status: ...


def _engine_fields(spec: EngineSpec, source: str, default_model: str) -> dict[str, Any]:
    model = spec.model if spec.model is not None else default_model
    return {"engine": spec.name, "url": spec.url, "role": spec.role, "model": model, "source": source}


def log_update(update: Update, *, source: str, default_model: str) -> None:
    """Log what ``update`` says; ``default_model`` names the model of an engine registered without one."""
    change = update.change
    for name in (*change.removed, *change.changed):
        log_event("engine_vanished", **_engine_fields(change.previous[name], source, default_model))
    for name in (*change.added, *change.changed):
        log_event("engine_discovered", **_engine_fields(update.engines[name], source, default_model))
    for problem in change.problems:
        log_event("discovery_entry_invalid", level=logging.WARNING, source=source, key=problem.key,
                  problem=problem.problem)
    if update.reason == "degraded":
        log_event("discovery_degraded", level=logging.WARNING, source=source, error=update.status.degraded)
    elif update.reason == "recovered":
        log_event("discovery_recovered", source=source)
