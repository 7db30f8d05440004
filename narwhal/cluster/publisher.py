"""The controller's writer of ``<key>/fleet/<engine>``: each engine's entry when it changed, never on a timer.

Poked by every change of the fleet (the fleet writer's, the engine set's, a
newer process); it builds the entries, compares each with what it last wrote
in this term and writes only those that differ, and deletes engines that left.
Writes are guarded by the lease (a controller whose lease is gone writes
nothing). A new term starts by listing what is there, so engines an earlier
controller published and that are no longer in the fleet are deleted too.
A failed write is retried with a backoff (``retry_s`` doubling to 5 s);
``retry_now()`` (the router reached etcd again) ends it at once.

Events (JSON lines): ``cluster_fleet_published`` (debug), ``cluster_fleet_write_failed``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence

import msgspec
import trio

from narwhal.cluster.records import FleetEntry
from narwhal.discovery.etcd_http import EtcdUnavailable
from narwhal.fleet.model import EngineRecord
from narwhal.fleet.registry import EngineEntry
from narwhal.lease.backend import LeaseBackendError
from narwhal.obs.logs import log_event

__all__ = ["FleetPublisher", "stable_entry"]

_encode = msgspec.json.Encoder().encode


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def stable_entry(entry: FleetEntry) -> FleetEntry:
    """``entry`` without what changes by itself: its write time, and wall times past a tenth of a second
    (they are computed from the monotonic clock at each build and differ in their last digits)."""
    record = entry.record
    stable_record = msgspec.structs.replace(
        record, ejected_at_wall=_round(record.ejected_at_wall), next_probe_at_wall=_round(record.next_probe_at_wall),
        holds=[msgspec.structs.replace(hold, since_wall=round(hold.since_wall, 1),
                                       deadline_wall=_round(hold.deadline_wall)) for hold in record.holds])
    return msgspec.structs.replace(entry, record=stable_record, written_at=0.0)


class FleetPublisher:
    """Writes the fleet's entries when they change, while this router is the controller."""

    def __init__(self, *, prefix: str, entries: Callable[[], Sequence[FleetEntry]],
                 write: Callable[[Sequence[tuple[str, bytes]], Sequence[str]], Awaitable[bool]],
                 published_names: Callable[[], Awaitable[list[str]]], acting: Callable[[], bool],
                 wall_clock: Callable[[], float] = time.time, retry_s: float = 0.5) -> None:
        """``write(puts, deletes)`` is False when the lease is no longer ours; ``published_names()`` lists
        the engines under ``prefix``."""
        self.prefix = prefix
        self._entries = entries
        self._write = write
        self._published_names = published_names
        self._acting = acting
        self._wall_clock = wall_clock
        self.retry_s = retry_s
        self._changed = trio.Event()
        # Set by retry_now(): the current backoff, or the next one, ends at once (cleared by a write).
        self._retry = trio.Event()
        # What this term wrote (stable form); None: nothing yet (list first).
        self._written: dict[str, FleetEntry] | None = None
        self.writes = 0
        self.last_problem: str | None = None

    def poke(self) -> None:
        """The fleet may have changed: look (cheap; the run loop does the work)."""
        self._changed.set()

    def retry_now(self) -> None:
        """etcd answered another caller again (an outage is over): retry a failed write now rather than at the
        end of its backoff (up to 5 s). One call ends at most one backoff."""
        self._retry.set()

    def new_term(self) -> None:
        """This router became the controller: publish everything against what the store holds."""
        self._written = None
        self.poke()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        delay = self.retry_s
        while True:
            await self._changed.wait()
            # A change during the write sets the new event: it is published next.
            self._changed = trio.Event()
            if not self._acting():
                continue
            try:
                await self.publish_once()
                delay = self.retry_s
            except (EtcdUnavailable, LeaseBackendError) as exc:
                if self.last_problem != str(exc):
                    log_event("cluster_fleet_write_failed", level=logging.WARNING, **{"class": type(exc).__name__},
                              message=str(exc))
                self.last_problem = str(exc)
                self.poke()
                with trio.move_on_after(delay):
                    await self._retry.wait()
                if self._retry.is_set():
                    self._retry = trio.Event()
                delay = min(delay * 2, 5.0)

    async def publish_once(self) -> bool:
        """Write what changed since the last write of this term; False when the lease is not ours."""
        current = {entry.entry.name: entry for entry in self._entries()}
        written = self._written
        if written is None:
            written = dict.fromkeys(await self._published_names(), _GONE)
        now = self._wall_clock()
        stable = {name: stable_entry(entry) for name, entry in current.items()}
        puts = [(self.prefix + name, _encode(msgspec.structs.replace(entry, written_at=now)))
                for name, entry in current.items() if written.get(name) != stable[name]]
        deletes = [self.prefix + name for name in written if name not in current]
        if puts or deletes:
            if not await self._write(puts, deletes):
                return False
            self.writes += 1
            log_event("cluster_fleet_published", level=logging.DEBUG, changed=len(puts), removed=len(deletes))
        self._written = stable
        self.last_problem = None
        if self._retry.is_set():
            self._retry = trio.Event()  # written: a wake-up asked for meanwhile has nothing left to end
        return True


# What stands for an engine found in the store and not yet written in this term: equal to no real entry.
_GONE = FleetEntry(entry=EngineEntry(name="", url="", role="prefill", model=""),
                   record=EngineRecord(name="", role="prefill"))
