"""Persistence stage: write the durable handoff once per monitor pass.

It decides nothing; it snapshots the fleet (as the pass's other stages left it)
plus what the controller and lease report, and replaces ``handoff.path``
atomically in a worker thread, so a slow disk never blocks the event loop.
A failed write raises, and the monitor records it as this stage's error.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import msgspec
import trio

from narwhal.config import Config
from narwhal.errors import NarwhalError
from narwhal.fleet import EngineRecord
from narwhal.state.handoff import (
    HANDOFF_SCHEMA,
    ConsolidationRisk,
    EngineSetEntry,
    HandoffDocument,
    LeaseOwnership,
    encode_document,
    write_atomic,
)

__all__ = ["HandoffExtra", "HandoffWriteInProgress", "PersistenceStage"]


class HandoffWriteInProgress(NarwhalError):
    """The previous pass's write has not finished (a stuck disk): this pass writes nothing."""


class _Snapshotting(Protocol):
    def snapshot(self, now: float, wall_now: float) -> list[EngineRecord]: ...


class HandoffExtra(msgspec.Struct, frozen=True, kw_only=True):
    """What the router reports beside the fleet (``extra()``); validated before it is written."""

    consolidation_risk: dict[str, ConsolidationRisk] = {}
    drained: list[str] = []
    lease: LeaseOwnership = LeaseOwnership()


class PersistenceStage:
    """The monitor stage that writes the handoff on every pass while ``paused`` is False."""

    name = "persistence"

    def __init__(self, *, path: str | os.PathLike[str], router_id: str, fleet: _Snapshotting,
                 config: Config, extra: Callable[[], HandoffExtra] | None = None,
                 lease_valid: Callable[[], bool] | None = None,
                 publish: Callable[[bytes], Awaitable[bool]] | None = None,
                 clock: Callable[[], float] = trio.current_time,
                 wall_clock: Callable[[], float] = time.time,
                 on_written: Callable[[int, float], None] | None = None) -> None:
        """``extra()`` reports consolidation risk, settled drains and the lease at each pass.

        With a lease: ``lease_valid()`` says whether the term is still valid, asked from
        the worker thread just before the rename (so it must be thread-safe), and
        ``publish(data)`` is the etcd write guarded by the writer's lease, which runs
        before the local file's (False: the lease is no longer ours, nothing is written).
        ``on_written(bytes, seconds)`` hears of each file that replaced the last, in trio's thread.
        """
        self.path = os.fspath(path)
        self.router_id = router_id
        self.fleet = fleet
        self.engine_set = [EngineSetEntry(name=spec.name, url=spec.base_url, role=spec.role,
                                          model=config.model_of(spec)) for spec in config.engines]
        self.extra = extra
        self.clock = clock
        self.wall_clock = wall_clock
        # The lease code sets this when fenced or standing by: only the active router writes.
        self.paused = False
        self.lease_valid = lease_valid
        self.publish = publish
        # The pass number of the last document that replaced the file, if any.
        self.last_written_pass: int | None = None
        # One write at a time, newest last. The lock is taken and released by the
        # worker thread itself, so a write abandoned by the stage timeout keeps it
        # while it runs; sequence numbers stop an older document from landing
        # after a newer one if two workers ever reach the lock out of order.
        self._writing = threading.Lock()
        self._sequence = 0
        self._sequence_written = 0
        self.on_written = on_written
        # The state (pass number and time zeroed) of the last document whose rename was fsynced.
        self._durable_state: HandoffDocument | None = None
        self.directory_syncs_skipped = 0
        # The last document that replaced the file: its size, and the seconds write_atomic took (fsyncs included).
        self.last_written_bytes: int | None = None
        self.last_write_seconds: float | None = None
        self._write_seconds = 0.0

    def __repr__(self) -> str:
        state = "paused" if self.paused else "active"
        return f"<PersistenceStage {self.path!r} [{state} | last pass written: {self.last_written_pass}]>"

    @property
    def write_in_progress(self) -> bool:
        """True while a worker thread is writing (possibly one a stage timeout abandoned)."""
        return self._writing.locked()

    def document(self, pass_number: int) -> HandoffDocument:
        """The handoff for this pass, from the fleet's state now and ``extra()``."""
        # Checked field by field (a risk outside the schema's words must not reach the file).
        reported = self.extra() if self.extra is not None else HandoffExtra()
        extra = msgspec.convert(msgspec.to_builtins(reported), HandoffExtra)
        # One instant for the snapshot and the stamp, on both clocks.
        now, wall_now = self.clock(), self.wall_clock()
        return HandoffDocument(
            schema=HANDOFF_SCHEMA,
            router_id=self.router_id,
            pid=os.getpid(),
            pass_number=pass_number,
            written_at=wall_now,
            engine_set=list(self.engine_set),
            engines=self.fleet.snapshot(now, wall_now),
            consolidation_risk=extra.consolidation_risk,
            lease=extra.lease,
            drained=extra.drained,
        )

    async def run(self, pass_number: int) -> None:
        """Write this pass's handoff; raise if it could not be written.

        Every pass writes the whole document (fsynced, then renamed). The
        directory fsync, which makes the rename itself durable, is left out when
        the document's state (all but its pass number and time) equals that of
        the last one made durable: a power loss could then only bring back that
        earlier document, whose state is the same.
        """
        if self.paused:
            return
        document = self.document(pass_number)
        state = msgspec.structs.replace(document, pass_number=0, written_at=0.0)
        sync_directory = state != self._durable_state
        data = encode_document(document)
        if self.publish is not None and not await self.publish(data):
            # The lease is no longer ours: the renewal loop fences; the successor's state stands.
            return
        self._sequence += 1
        written = await trio.to_thread.run_sync(self._write, data, self._sequence, sync_directory,
                                                abandon_on_cancel=True)
        if written:
            if sync_directory:
                self._durable_state = state
            self.directory_syncs_skipped += not sync_directory
            self.last_written_pass = pass_number
            self.last_written_bytes, self.last_write_seconds = len(data), self._write_seconds
            if self.on_written is not None:
                self.on_written(len(data), self._write_seconds)

    def _may_replace(self) -> bool:
        lease_valid = self.lease_valid
        return not self.paused and (lease_valid is None or lease_valid())

    def _write(self, data: bytes, sequence: int, sync_directory: bool = True) -> bool:
        """In the worker thread: write unless busy, superseded, or fenced meanwhile."""
        if not self._writing.acquire(blocking=False):
            raise HandoffWriteInProgress(f"the write to {self.path} from an earlier pass is still running")
        try:
            if sequence < self._sequence_written:
                return False
            # Re-checked just before the rename: a write that outlives a fencing
            # must not overwrite the next holder's handoff.
            started = time.perf_counter()
            written = write_atomic(self.path, data, proceed=self._may_replace, sync_directory=sync_directory)
            if written:
                self._sequence_written = sequence
                # Read by run() once this thread has returned (under the lock meanwhile).
                self._write_seconds = time.perf_counter() - started
            return written
        finally:
            self._writing.release()
