"""The file lease: an exclusive fcntl lock around a record file rewritten atomically.

``lease.path`` holds the JSON ``LeaseRecord``; ``lease.path + ".lock"`` is the
lock file (the record itself is replaced by rename, so it cannot carry the
lock). Every change reads the record, writes the new one beside it (fsynced),
then, holding the lock, renames it into place only if the record is still the
one it read (else it starts over): two routers can never both see the lease
free and both take it. The lock is held for a read and a rename, never for a
write or an fsync, so a holder frozen mid-change (SIGSTOP, a stalled disk)
almost never holds it; a freeze inside those microseconds still blocks the
others until it wakes. The record's
expiry is wall-clock time, which is sound for routers sharing one host (or a
filesystem whose clients keep their clocks within ``fence_margin_s``).

The handoff stays where the persistence stage writes it (``[handoff] path``);
this backend reads it for a standby and never writes it.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import msgspec
import trio

from narwhal.files import FileRefused, read_regular_file
from narwhal.lease.backend import Acquisition, LeaseBackendError, Renewal
from narwhal.lease.rules import LeaseRecord, TakeoverRequest
from narwhal.state.handoff import MAX_DOCUMENT_BYTES, discard_prepared, fsync_directory, prepare_atomic

__all__ = ["MAX_LEASE_RECORD_BYTES", "FileLeaseBackend"]

# A record is a few hundred bytes; anything far larger is not one, and is not read.
MAX_LEASE_RECORD_BYTES = 64 * 1024

_T = TypeVar("_T")
# Changes that found the record changed under them before they could rename: then the lease is contended.
_CHANGE_ATTEMPTS = 8
_decode_record = msgspec.json.Decoder(LeaseRecord)
_encoder = msgspec.json.Encoder()


class FileLeaseBackend:
    """The lease record in a file, changed only under an exclusive lock."""

    name = "file"

    def __init__(self, *, path: str | os.PathLike[str], handoff_path: str | os.PathLike[str], ttl_s: float,
                 lock_timeout_s: float = 1.0, wall_clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.lock_path = Path(f"{os.fspath(path)}.lock")
        self.handoff_path = Path(handoff_path)
        self.ttl_s = ttl_s
        self.lock_timeout_s = lock_timeout_s
        self.wall_clock = wall_clock
        # Per thread: the event that says the caller stopped waiting for this thread's write.
        self._abandoned = threading.local()
        # Changes running in threads: a release (the last change before a router exits) waits for the others, so
        # an abandoned renewal removes its prepared file before the process is gone.
        self._changes = 0
        self._idle = threading.Condition()

    def __repr__(self) -> str:
        return f"<FileLeaseBackend {os.fspath(self.path)!r}>"

    # -- in a worker thread ----------------------------------------------------------

    def _read_record(self) -> LeaseRecord | None:
        # A FIFO, a device or an oversize file is refused without blocking: an unreadable
        # lease (LeaseBackendError), never a missing one, so it is no evidence the lease is free.
        try:
            data = read_regular_file(self.path, MAX_LEASE_RECORD_BYTES)
        except FileNotFoundError:
            return None
        except FileRefused as exc:
            raise LeaseBackendError(f"cannot read {self.path}: {exc}") from None
        except (OSError, ValueError) as exc:  # ValueError: a path the OS cannot take (NUL byte)
            raise LeaseBackendError(f"cannot read {self.path}: {getattr(exc, 'strerror', None) or exc}") from None
        try:
            return _decode_record.decode(data)
        except msgspec.DecodeError as exc:
            raise LeaseBackendError(f"{self.path} is not a lease record: {exc}") from None

    def _change(self, decide: Callable[[LeaseRecord | None], tuple[LeaseRecord | None, _T]]) -> _T:
        """Apply ``decide`` (the record as read -> the record to write, or None, and the result) as one atomic
        change: the new record is written and fsynced unlocked; the lock covers the check and the rename."""
        with self._idle:
            self._changes += 1
        try:
            return self._change_once_current(decide)
        finally:
            with self._idle:
                self._changes -= 1
                self._idle.notify_all()

    def _settle(self) -> None:
        """Wait (at most ``lock_timeout_s``) until no change of this backend is running."""
        with self._idle:
            self._idle.wait_for(lambda: self._changes == 0, timeout=self.lock_timeout_s)

    def _change_once_current(self, decide: Callable[[LeaseRecord | None], tuple[LeaseRecord | None, _T]]) -> _T:
        for _ in range(_CHANGE_ATTEMPTS):
            current = self._read_record()
            record, result = decide(current)
            if record is None:
                return result
            # Early as well as under the lock: an abandoned change writes no file at all.
            self._raise_if_abandoned()
            try:
                temporary = prepare_atomic(self.path, _encoder.encode(record) + b"\n")
            except OSError as exc:
                raise LeaseBackendError(f"cannot write {self.path}: {exc.strerror or exc}") from None
            renamed = False
            try:
                renamed = self._locked(functools.partial(self._rename_if_unchanged, current, temporary))
            finally:
                if not renamed:
                    discard_prepared(temporary)
            if renamed:
                try:
                    fsync_directory(self.path.parent)
                except OSError as exc:
                    raise LeaseBackendError(f"cannot sync {self.path.parent}: {exc.strerror or exc}") from None
                return result
        raise LeaseBackendError(f"{self.path} changed under each of {_CHANGE_ATTEMPTS} attempts to change it")

    def _raise_if_abandoned(self) -> None:
        """This thread's caller stopped waiting (``_run``): its change must not land."""
        abandoned: threading.Event | None = getattr(self._abandoned, "event", None)
        if abandoned is not None and abandoned.is_set():
            raise LeaseBackendError(f"a write of {self.path} was abandoned by its caller; not applied")

    def _rename_if_unchanged(self, read: LeaseRecord | None, temporary: Path) -> bool:
        """Under the lock: put ``temporary`` in place if the record is still ``read`` (False: it changed)."""
        if self._read_record() != read:
            return False
        self._raise_if_abandoned()
        try:
            os.replace(temporary, self.path)
        except OSError as exc:
            raise LeaseBackendError(f"cannot write {self.path}: {exc.strerror or exc}") from None
        return True

    def _locked(self, change: Callable[[], _T]) -> _T:
        """Run ``change`` holding the exclusive lock; give up after ``lock_timeout_s``."""
        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise LeaseBackendError(f"cannot open {self.lock_path}: {exc.strerror or exc}") from None
        try:
            give_up_at = time.monotonic() + self.lock_timeout_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() >= give_up_at:
                        raise LeaseBackendError(
                            f"cannot lock {self.lock_path}: {exc.strerror or exc}") from None
                    time.sleep(0.005)
            try:
                return change()
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    async def _run(self, decide: Callable[[LeaseRecord | None], tuple[LeaseRecord | None, _T]]) -> _T:
        """Apply ``decide`` (``_change``) in a thread; if the caller stops waiting, its write never lands.

        A stalled filesystem can hold the thread past the caller's deadline; the
        abandoned write is then not renamed into place (checked under the lock,
        just before the rename), so no record appears later naming a router that gave up.
        """
        abandoned = threading.Event()

        def in_thread() -> _T:
            self._abandoned.event = abandoned
            try:
                return self._change(decide)
            finally:
                self._abandoned.event = None

        try:
            return await trio.to_thread.run_sync(in_thread, abandon_on_cancel=True)
        except BaseException:
            abandoned.set()
            raise

    # -- the backend -------------------------------------------------------------------

    async def read(self) -> LeaseRecord | None:
        # The record is replaced by rename: a reader without the lock still sees a whole one.
        return await trio.to_thread.run_sync(self._read_record, abandon_on_cancel=True)

    async def acquire(self, router_id: str, advertise_url: str, *, after_epoch: int = 0,
                      take_missing: bool = True) -> Acquisition:
        def decide(current: LeaseRecord | None) -> tuple[LeaseRecord | None, Acquisition]:
            now = self.wall_clock()
            if current is not None and not current.free_at(now) or current is None and not take_missing:
                return None, Acquisition(acquired=False, record=current)
            # Epochs identify terms: never reuse one, even after the file was deleted.
            epoch = max(current.epoch if current else 0, after_epoch) + 1
            record = LeaseRecord(holder=router_id, epoch=epoch,
                                 advertise_url=advertise_url, acquired_at=now, expires_at=now + self.ttl_s)
            return record, Acquisition(acquired=True, record=record)

        return await self._run(decide)

    async def renew(self, record: LeaseRecord) -> Renewal:
        def decide(current: LeaseRecord | None) -> tuple[LeaseRecord | None, Renewal]:
            if current is None or current.holder != record.holder or current.epoch != record.epoch:
                holder = current.holder if current is not None else ""
                return None, Renewal(ok=False, lost=True,
                                     reason=f"record now held by {holder or 'nobody'} "
                                            f"(epoch {current.epoch if current else 0})")
            renewed = msgspec.structs.replace(current, expires_at=self.wall_clock() + self.ttl_s)
            return renewed, Renewal(ok=True, takeover=current.takeover)

        return await self._run(decide)

    async def release(self, record: LeaseRecord) -> bool:
        # A router releases as it exits: a renewal it abandoned finishes (and tidies) first.
        await trio.to_thread.run_sync(self._settle, abandon_on_cancel=True)

        def decide(current: LeaseRecord | None) -> tuple[LeaseRecord | None, bool]:
            if current is None or current.holder != record.holder or current.epoch != record.epoch:
                return None, False
            # The epoch stays: the next holder's is one more.
            return LeaseRecord(epoch=current.epoch, advertise_url=current.advertise_url), True

        return await self._run(decide)

    async def term_over(self, record: LeaseRecord) -> bool:
        # A released or expired record stays in the file: a missing one was deleted, which proves nothing.
        return False

    async def request_takeover(self, request: TakeoverRequest) -> bool:
        def decide(current: LeaseRecord | None) -> tuple[LeaseRecord | None, bool]:
            if current is None or not current.holder or current.epoch != request.epoch:
                return None, False
            return msgspec.structs.replace(current, takeover=request), True

        return await self._run(decide)

    async def clear_takeover(self, record: LeaseRecord) -> None:
        def decide(current: LeaseRecord | None) -> tuple[LeaseRecord | None, None]:
            if current is not None and current.epoch == record.epoch and current.takeover is not None:
                return msgspec.structs.replace(current, takeover=None), None
            return None, None

        await self._run(decide)

    async def read_handoff(self) -> bytes | None:
        def read() -> bytes | None:
            try:
                # The bound and the checks of ``--resume`` (``read_document``).
                return read_regular_file(self.handoff_path, MAX_DOCUMENT_BYTES)
            except FileNotFoundError:
                return None
            except FileRefused as exc:
                raise LeaseBackendError(f"cannot read the handoff {self.handoff_path}: {exc}") from None
            except (OSError, ValueError) as exc:
                raise LeaseBackendError(
                    f"cannot read the handoff {self.handoff_path}: {getattr(exc, 'strerror', None) or exc}"
                ) from None

        return await trio.to_thread.run_sync(read, abandon_on_cancel=True)

    async def aclose(self) -> None:
        return None
