"""A standby's warm copy of the holder's fleet state: the handoff follower.

The holder writes a handoff document on every monitor pass, stamped with its
term (``lease: {holder, epoch}``). The follower applies a document only when
its term is the term it follows: the holder named by the lease record (or,
while the lease is changing hands, the last holder it saw). Terms are compared
by identity, never by order: an epoch counter restored or reset to a lower
number is still the holder's term, and a fenced writer's late document is
someone else's. A document that is not applied is said once
(``handoff_skipped``), never dropped silently.

Events (JSON lines): ``standby_following``, ``handoff_skipped``, ``handoff_not_applied``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import msgspec

from narwhal.config import Config, EngineSpec
from narwhal.fleet import EngineRecord
from narwhal.obs.logs import log_event
from narwhal.state.handoff import HandoffError, decode_document
from narwhal.state.resume import apply_resume, engine_set_difference, plan_document

__all__ = ["HandoffFollower", "Restorable"]


class Restorable(Protocol):
    """The fleet's writer, as far as following a handoff needs it."""

    def restore(self, records: Sequence[EngineRecord], now: float, wall_now: float) -> None: ...
    def __contains__(self, name: object) -> bool: ...


class HandoffFollower:
    """Applies the followed term's handoff documents to this router's fleet."""

    def __init__(self, *, config: Config, fleet: Restorable, router_id: str, where: str,
                 clock: Callable[[], float], wall_clock: Callable[[], float],
                 engines: Callable[[], Sequence[EngineSpec]] | None = None) -> None:
        """``engines()``: the engine set a document is compared with (default: the config's engines;
        with discovery, the file's engines plus those this router sees discovered)."""
        self.config = config
        self._engines = engines
        self.router_id = router_id
        self.fleet = fleet
        self.where = where
        self.clock = clock
        self.wall_clock = wall_clock
        # The term followed: (holder, epoch) of the lease record, kept while the lease changes hands.
        self.term: tuple[str, int] | None = None
        self.applied_epoch = 0
        self.applied_pass: int | None = None
        # Epochs this process held (a restarted router with the same id held none of them).
        self.own_terms: set[int] = set()
        self._last_seen: bytes | None = None
        self._following: tuple[str, int] | None = None
        # How this router's engine set differs from the followed handoff's (None: same, or none read).
        self.engine_set_differs: str | None = None
        # Whether ``_last_seen`` was applied (a new holder reads a skipped one again: it may be the last term's).
        self._last_applied = False

    def use_config(self, config: Config) -> None:
        """A config reload: plan the next documents, and the last one again, against ``config``'s engines."""
        self.config = config
        self._last_seen = None

    def engines_changed(self) -> None:
        """The engine set to compare with changed (discovery): plan the last document again."""
        self._last_seen = None

    def _engine_set(self) -> Sequence[EngineSpec]:
        return self.config.engines if self._engines is None else self._engines()

    def follow(self, holder: str, epoch: int) -> None:
        """The lease record names ``holder`` in ``epoch``: follow that term's documents from now on."""
        if holder and (holder, epoch) != self.term:
            self.term = (holder, epoch)
            # A document skipped for another term may be this term's: look at it again.
            self._last_seen = None

    async def refresh(self, read: Callable[[], Awaitable[bytes | None]], *, acquiring: int | None = None) -> None:
        """Read the handoff (``read`` raises LeaseBackendError) and apply it when it is the followed term's.

        ``acquiring``: this router takes the lease in that epoch; a document of an earlier term is the last
        holder's, applied even when this router never followed that term (it started after a release).
        """
        data = await read()
        if data is None or data == self._last_seen and (acquiring is None or self._last_applied):
            return
        self._last_seen = data
        self._last_applied = False
        try:
            document = decode_document(data)
        except HandoffError as exc:
            log_event("handoff_not_applied", level=logging.WARNING, path=self.where,
                      reason=f"handoff not applied: {exc}")
            return
        written_by = (document.lease.holder, document.lease.epoch)
        if written_by[0] == self.router_id and written_by[1] in self.own_terms:
            return  # written by this process in a term it held: its fleet state is that already
        if acquiring is not None and written_by[1] < acquiring and written_by != self.term:
            # The lease record named nobody (released) or an older term: the last document is the last term's.
            self.term = written_by
        if self.term is None or written_by != self.term:
            followed = "nobody" if self.term is None else f"{self.term[0]} epoch {self.term[1]}"
            log_event("handoff_skipped", level=logging.WARNING, path=self.where, holder=written_by[0],
                      epoch=written_by[1], writer=document.router_id, **{"pass": document.pass_number},
                      reason=f"written in the term of {written_by[0]} epoch {written_by[1]}; "
                             f"the lease record names {followed}")
            return
        engines = self._engine_set()
        difference = engine_set_difference(document.engine_set, engines, self.config.fleet.model)
        if difference != self.engine_set_differs and difference is not None:
            # Said once per difference: the operator edits one file or the other until they match.
            log_event("standby_engine_set_differs", level=logging.WARNING, holder=written_by[0],
                      epoch=written_by[1], difference=difference,
                      reason=f"this router's engine set differs from the active router's handoff: {difference}; "
                             "edit this router's config to match and send it SIGHUP")
        self.engine_set_differs = difference
        plan = plan_document(document, self.config, self.where, engines)
        if not plan.applied:
            log_event("handoff_not_applied", level=logging.WARNING, **plan.event_fields())
            return
        if self._engines is not None and plan.document is not None:
            # With discovery a standby's fleet holds the file's engines only (it adds the discovered ones
            # when it takes over): the holder's records of the others have no engine here to restore.
            records = [record for record in plan.document.engines if record.name in self.fleet]
            plan = msgspec.structs.replace(plan, document=msgspec.structs.replace(plan.document, engines=records))
        apply_resume(plan, self.fleet, self.clock(), self.wall_clock())
        self._last_applied = True
        self.applied_epoch = document.lease.epoch
        self.applied_pass = document.pass_number
        if written_by != self._following:
            self._following = written_by
            log_event("standby_following", holder=written_by[0], epoch=written_by[1],
                      reason="applied the holder's handoff", writer=document.router_id,
                      **{"pass": document.pass_number})
