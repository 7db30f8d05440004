"""The readiness hub's rounds run from trio's idle wait, while relay-pump streams are live.

A paced stream's token costs the pump's read and write (about 28,000
instructions of Python) and, when it arrives alone, trio's wake-up of the hub
task: trio's ``epoll_wait``, the one-shot re-arm of the hub's set, the
scheduler's loop and the task's step, about 55,000 more. Here a trio
instrument takes trio's place when it is about to sleep (``before_io_wait``
with a timeout, so no task is runnable) while pumped streams are live and the
hub task is parked on its set: it sleeps instead, in an epoll set of its own
that holds the hub's set and trio's, and runs the hub's rounds itself as the
hub's sockets become ready; the pump's handlers read and write from here
exactly as from the hub task.

It gives the loop back to trio as soon as trio has work, so nothing waits
longer than under trio's own sleep:

- trio's set is ready (a new connection, a control-pool socket, a worker
  thread's result, a signal): trio's ``epoll_wait`` returns at once;
- a round made a task runnable (a stream ended, a request's socket became
  ready) or trio's deadline came: trio would otherwise sleep its timeout
  again, so its own wake-up is called (``force_wakeup``: a byte on its
  wake-up socket, drained inside its I/O manager, no task step);
- a round stopped short (a socket not drained, a full batch) and trio has
  I/O: the hub task is woken through an event fd in its set, and goes on with
  its own yields.

An exception in a round is handed to the hub task the same way, which raises
it as if its own round had (so a defect ends the router as it did before).

This reaches into trio's run: its I/O manager's epoll object and
``force_wakeup``, and its run queue. None is public API; ``IdleRounds.attach``
checks they are there and otherwise says why, and the hub task goes on waking
per batch (the data pool logs ``relay_inline_unavailable``).
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
    """The instrument: ``before_io_wait`` runs the hub's rounds until trio has work (see the module)."""

    def __init__(self, hub: Readiness, run: TrioRun, *, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._hub = hub
        self._run = run
        self._monotonic = monotonic
        self._hub_fd = hub.epoll_fd
        # Trio's set and the hub's, watched together: this sleeps where trio would.
        self._both = select.epoll()
        # Written to make the hub's set readable, so the parked hub task runs (``_wake_hub``).
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        try:
            self._both.register(self._hub_fd, select.EPOLLIN)
            self._both.register(run.epoll_fd, select.EPOLLIN)
            self._wake = hub.watch_handled(self._wake_fd, self._on_wake)
        except OSError:
            self._both.close()
            os.close(self._wake_fd)
            raise
        self.failure: BaseException | None = None

    @classmethod
    def attach(cls, hub: Readiness) -> tuple[IdleRounds | None, str | None]:
        """Start running ``hub``'s rounds from the current trio loop's idle wait; (None, why) when it cannot."""
        run = trio_run()
        if isinstance(run, str):
            return None, run
        try:
            rounds = cls(hub, run)
        except OSError as exc:
            return None, f"the idle wait's epoll set could not be made: {exc}"
        trio.lowlevel.add_instrument(rounds)
        return rounds, None

    def detach(self) -> None:
        """Stop (the hub task is ending): no more rounds from the idle wait."""
        # KeyError: trio removed it already (it raised).
        with contextlib.suppress(KeyError):
            trio.lowlevel.remove_instrument(self)
        self._hub.forget(self._wake)
        self._both.close()
        os.close(self._wake_fd)

    def before_io_wait(self, timeout: float) -> None:
        """trio is about to sleep up to ``timeout`` s: sleep here instead, running rounds, while streams are live."""
        hub = self._hub
        if timeout <= 0 or not hub.pumped or not hub.parked or self.failure is not None:
            return
        try:
            self._rounds(timeout)
        except BaseException as exc:
            # The hub task raises it (``_on_wake``), as a failure of its own round.
            self.failure = exc
            self._wake_hub()

    def _rounds(self, timeout: float) -> None:
        hub = self._hub
        run = self._run
        runq = run.runq
        poll = self._both.poll
        hub_fd = self._hub_fd
        monotonic = self._monotonic
        end = monotonic() + timeout
        # The last round stopped short: poll again at once.
        short = False
        while True:
            wait = end - monotonic()
            if wait <= 0:
                # trio's deadline: its own epoll_wait would sleep the whole timeout again.
                if short:
                    self._wake_hub()
                else:
                    run.force_wakeup()
                return
            ready = poll(0.0 if short else wait, 2)
            hubs = trios = False
            for fd, _ in ready:
                if fd == hub_fd:
                    hubs = True
                else:
                    trios = True
            if not hubs:
                if trios:
                    # trio's own I/O: its epoll_wait returns at once. A round left short goes on in the hub task.
                    if short:
                        self._wake_hub()
                    return
                if not short:
                    continue  # timed out (epoll's milliseconds may end a hair early): the clock decides
            short = hub.inline_round()
            if runq:
                # A task is runnable: trio runs it now (and the hub task, if the round stopped short).
                if short:
                    self._wake_hub()
                else:
                    run.force_wakeup()
                return

    def _wake_hub(self) -> None:
        os.eventfd_write(self._wake_fd, 1)

    def _on_wake(self, events: int) -> None:
        """The hub task's round saw the wake-up: drain it, and raise a failure of an idle round."""
        # BlockingIOError: nothing to drain (the hub stopping calls this without an edge).
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self._wake_fd)
        failure = self.failure
        if failure is not None and events != HUB_STOPPED:
            raise failure
