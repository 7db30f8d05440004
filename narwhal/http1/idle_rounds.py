"""The relay pump's sockets served from trio's waits: one ``epoll_wait`` a wake-up, no task woken.

A paced stream's token costs the pump's read and write (about 24,000
instructions of Python) and its wake-up: with the engine socket in the
readiness hub's set, trio's ``epoll_wait`` returns the hub's set, trio
re-arms it and steps the hub task, whose round polls the set again (about
55,000 instructions more than the read and write). Here, while the data pool
runs, a pumped stream's engine socket sits in a set of its own, the pump set
(``Readiness.pump_in``), which also holds trio's set, and a trio instrument
serves it from trio's own waits:

- trio is about to sleep (``before_io_wait`` with a timeout: nothing is
  runnable): the instrument sleeps instead, in the pump set, and runs its
  rounds (the pump's handlers read and write) as its sockets become ready;
- trio has tasks to run (no timeout): one look at the pump set and one at the
  hub's own set, no sleep, so a busy loop serves the pumped sockets once a
  batch, and a task a socket of the hub's set wakes runs in this batch,
  without trio waking the hub task first (a request's engine answer, a
  client's next request).

Without a pumped stream trio's waits are its own: at one request at a time a
look at the sets would mostly find nothing, a syscall each.

It gives the loop back to trio as soon as trio has work, so nothing waits
longer than under trio's own sleep:

- trio's set is ready (a request's socket in the hub's set, a new
  connection, a worker thread's result, a signal): it shows in the pump set,
  and trio's ``epoll_wait`` returns at once;
- a round made a task runnable (a stream ended) or trio's deadline came: trio
  would otherwise sleep its timeout again, so its own wake-up is called
  (``force_wakeup``: a byte on its wake-up socket, drained inside its I/O
  manager, no task step).

A round that stopped short (a socket not drained, a full batch) goes on at
trio's next wait, before anything else sleeps. An exception in a round is
handed to the hub task through an event fd in the hub's set; the hub task
raises it as if its own round had (so a defect ends the router as it did
before).

Where the optional ``_relay_native`` module was built, the loop of rounds in
an idle wait is C (``Readiness.pump_until``): no Python runs per wake-up but
the handlers' own (none for the C relay's usual read).

This reaches into trio's run: its I/O manager's epoll object and
``force_wakeup``, and its run queue. None is public API; ``IdleRounds.attach``
checks they are there and otherwise says why, and the pumped sockets stay in
the hub's set (the data pool logs ``relay_inline_unavailable``).
"""

from __future__ import annotations

import contextlib
import os
import select
import time
from collections.abc import Callable, Sized

import trio

from narwhal.http1.readiness import HUB_STOPPED, Readiness

__all__ = ["IdleRounds", "TrioRun", "trio_run"]

# Readiness.pump_until's outcome: trio's set is ready (its epoll_wait returns at once by itself).
_TRIO_READY = 1


class TrioRun:
    """What the idle rounds need of the running trio loop: its set's descriptor, its wake-up and its run queue."""

    __slots__ = ("epoll_fd", "force_wakeup", "runq")

    def __init__(self, epoll_fd: int, force_wakeup: Callable[[], None], runq: Sized) -> None:
        self.epoll_fd = epoll_fd
        self.force_wakeup = force_wakeup
        self.runq = runq


def trio_run() -> TrioRun | str:
    """The running trio loop's internals, or why they cannot be used (another trio, another I/O backend)."""
    try:
        from trio._core._run import GLOBAL_RUN_CONTEXT
        runner = GLOBAL_RUN_CONTEXT.runner
        io_manager = runner.io_manager
        epoll = io_manager._epoll
        force_wakeup = io_manager.force_wakeup
        runq = runner.runq
        guest = runner.is_guest
    except (ImportError, AttributeError) as exc:
        return f"trio {trio.__version__}'s run has changed: {exc}"
    if not isinstance(epoll, select.epoll):
        return f"trio {trio.__version__}'s I/O manager is not epoll"
    if guest:
        return "trio runs in guest mode"
    return TrioRun(epoll.fileno(), force_wakeup, runq)


class IdleRounds(trio.abc.Instrument):
    """The instrument: serves the hub's pump set from ``before_io_wait`` (see the module)."""

    def __init__(self, hub: Readiness, run: TrioRun, *, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._hub = hub
        self._run = run
        self._monotonic = monotonic
        # Written to make the hub's set readable, so the hub task runs and raises a round's failure.
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        try:
            hub.open_pump_set(run.epoll_fd)
            try:
                self._wake = hub.watch_handled(self._wake_fd, self._on_wake)
            except OSError:
                hub.close_pump_set()
                raise
        except OSError:
            os.close(self._wake_fd)
            raise
        # The last round stopped short: the next wait polls at once.
        self._short = False
        # The rounds' loop in C (``Readiness.pump_until``): only with the clock it reads.
        self._native = hub.rounds_native and monotonic is time.monotonic
        self.failure: BaseException | None = None

    @classmethod
    def attach(cls, hub: Readiness) -> tuple[IdleRounds | None, str | None]:
        """Serve ``hub``'s pump set from the current trio loop's waits; (None, why) when it cannot."""
        run = trio_run()
        if isinstance(run, str):
            return None, run
        try:
            rounds = cls(hub, run)
        except OSError as exc:
            return None, f"the pump's epoll set could not be made: {exc}"
        trio.lowlevel.add_instrument(rounds)
        return rounds, None

    def detach(self) -> None:
        """Stop (the hub task is ending): pumped sockets go back to the hub's set."""
        # KeyError: trio removed it already (it raised).
        with contextlib.suppress(KeyError):
            trio.lowlevel.remove_instrument(self)
        self._hub.close_pump_set()
        self._hub.forget(self._wake)
        os.close(self._wake_fd)

    def before_io_wait(self, timeout: float) -> None:
        """trio is about to wait up to ``timeout`` s for I/O: serve the pump set (sleeping in it if trio would)."""
        hub = self._hub
        if self.failure is not None or not (hub.pump_sockets or self._short or hub.has_later):
            # No stream pumped: trio's waits are its own (at one request at a time a look at the sets would
            # mostly find nothing, a syscall each).
            return
        try:
            if timeout <= 0:
                # trio has tasks to run (or a deadline passed): one look at each set, no sleep. A task a round wakes
                # runs in this batch, without the hub task's wake-up.
                hub.busy_round()
                self._short = short = hub.pump_round(0.0)[1]
                if short and not self._run.runq:
                    # Reads are left and trio sees no work: it would take itself for idle (a deadline that passed,
                    # a test's clock jumping). Its wake-up says otherwise.
                    self._run.force_wakeup()
            else:
                self._rounds(timeout)
        except BaseException as exc:
            # The hub task raises it (``_on_wake``), as a failure of its own round.
            self.failure = exc
            self._short = False
            self._wake_hub()

    def _rounds(self, timeout: float) -> None:
        hub = self._hub
        run = self._run
        runq = run.runq
        monotonic = self._monotonic
        end = monotonic() + timeout
        short = self._short
        if self._native:
            # The loop below in C: one call a sleep rather than Python frames a wake-up.
            self._short = False
            outcome, self._short = hub.pump_until(end, short, runq)
            if outcome != _TRIO_READY:
                run.force_wakeup()
            return
        try:
            while True:
                wait = end - monotonic()
                if wait <= 0:
                    # trio's deadline: its own epoll_wait would sleep the whole timeout again.
                    run.force_wakeup()
                    return
                trio_ready, short = hub.pump_round(0.0 if short else wait)
                if trio_ready:
                    # trio's own I/O: its epoll_wait returns at once (a short round goes on at its next wait).
                    return
                if runq:
                    # A task is runnable: trio runs it now.
                    run.force_wakeup()
                    return
                # Nothing for trio (or epoll's milliseconds ended a hair early): the clock decides.
        finally:
            self._short = short

    def _wake_hub(self) -> None:
        os.eventfd_write(self._wake_fd, 1)

    def _on_wake(self, events: int) -> None:
        """The hub task's round saw the wake-up: drain it, and raise a failure of a round run here."""
        # BlockingIOError: nothing to drain (the hub stopping calls this without an edge).
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self._wake_fd)
        failure = self.failure
        if failure is not None and events != HUB_STOPPED:
            raise failure
