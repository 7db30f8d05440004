"""Fencing: when a term ends without our consent, stop admitting and writing, say so, hand the record back.

A timer fences at the term's deadline, so the log and ``/ready`` say "fenced"
on time; admission does not depend on it, because ``Admission.refusal``
compares the same deadline on every request. The term keeper fences at once
when a renewal finds the lease lost or answers too late.

Events (JSON lines): ``fenced`` (with ``serving_until_mono``, on time.monotonic()).
"""

from __future__ import annotations

import logging
import math

import trio

from narwhal.lease.context import LeaseContext
from narwhal.lease.handover import Handover
from narwhal.lease.rules import Role
from narwhal.obs.logs import flush_logs, log_event

__all__ = ["Fence"]


class Fence:
    """Fences this router at its term's deadline, or when told the term is over."""

    def __init__(self, ctx: LeaseContext, handover: Handover) -> None:
        self.ctx = ctx
        self.handover = handover

    async def run(self) -> None:
        """Sleep until the deadline (re-read whenever it changes); fence once it has passed."""
        ctx = self.ctx
        holding = ctx.holding
        while True:
            changed = ctx.deadline_changed
            deadline = holding.admission_deadline if holding.role is Role.ACTIVE else math.inf
            with trio.move_on_at(deadline):
                await changed.wait()
            if holding.deadline_passed():
                self.fenced()

    def fenced(self) -> None:
        """The term ended without our consent: stop admitting and writing, say so, hand the record back."""
        ctx = self.ctx
        holding = ctx.holding
        term = holding.term
        now = ctx.clocks.clock()
        ctx.serving.persistence.paused = True
        ctx.fenced_text()
        deadline = term.deadline if term is not None else now
        until = min(now, deadline)
        ctx.publish_deadline()
        log_event("fenced", level=logging.WARNING, holder=ctx.router_id, epoch=holding.epoch,
                  reason=holding.fenced_reason,
                  serving_until_mono=ctx.clocks.mono(until),
                  last_renew_sent_mono=ctx.clocks.mono(term.last_renew_sent) if term is not None else None,
                  mono=ctx.clocks.monotonic())
        flush_logs()
        record = ctx.record
        if record is not None and record.holder == ctx.router_id and term is not None:
            # Hand the lease back early when the backend still knows us as holder; by the
            # backend's expiry there is nothing left to hand back.
            self.handover.queue(record, term.last_renew_sent + ctx.ttl_s, "fenced")
