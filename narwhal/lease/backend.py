"""What a lease backend does for the service, and the one error it raises.

Every operation that changes the shared record is the backend's atomic
operation (etcd: a txn on revisions; file: an exclusive lock around a record
rewritten atomically). A backend never decides from a local timer that a
holder is gone: ``acquire`` succeeds only when the shared state says the lease
is free. Errors::

    LeaseBackendError        the backend could not be asked (unreachable, refused, garbled)
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from narwhal.errors import NarwhalError
from narwhal.lease.rules import LeaseRecord, TakeoverRequest

__all__ = ["Acquisition", "LeaseBackend", "LeaseBackendError", "Renewal"]


class LeaseBackendError(NarwhalError):
    """The backend could not answer; the message names where and why."""


class Acquisition(msgspec.Struct, frozen=True, kw_only=True):
    """The outcome of one acquisition attempt: our new record, or the holder's."""

    acquired: bool
    record: LeaseRecord | None


class Renewal(msgspec.Struct, frozen=True, kw_only=True):
    """The outcome of one renewal: ``ok``; or ``lost`` (the record is no longer ours) with why."""

    ok: bool
    lost: bool = False
    reason: str = ""
    takeover: TakeoverRequest | None = None


class LeaseBackend(Protocol):
    """The shared record's store: a file beside the handoff, or etcd."""

    name: str

    async def read(self) -> LeaseRecord | None:
        """The current record, or None when there is none."""
        ...

    async def acquire(self, router_id: str, advertise_url: str, *, after_epoch: int = 0,
                      take_missing: bool = True) -> Acquisition:
        """Take the lease if it is free, with an epoch above both the last one and ``after_epoch``.

        With ``take_missing`` False a missing record (deleted, or never written) is not taken.
        """
        ...

    async def term_over(self, record: LeaseRecord) -> bool:
        """True when the backend proves the term of ``record`` (now missing) over; False when it cannot."""
        ...

    async def renew(self, record: LeaseRecord) -> Renewal:
        """Extend our term; report a pending takeover request."""
        ...

    async def release(self, record: LeaseRecord) -> bool:
        """Give the lease up if ``record`` is still the holding one; True when released."""
        ...

    async def request_takeover(self, request: TakeoverRequest) -> bool:
        """Ask the holder of ``request.epoch`` to yield; False when that holder is gone."""
        ...

    async def clear_takeover(self, record: LeaseRecord) -> None:
        """The holder refused a takeover request: forget it."""
        ...

    async def read_handoff(self) -> bytes | None:
        """The handoff the holder last wrote, or None when there is none."""
        ...

    async def aclose(self) -> None:
        ...
