"""One task that owns an edge-triggered epoll set of sockets and wakes the tasks waiting on them.

trio's own ``wait_readable`` re-arms a one-shot epoll registration with an
``epoll_ctl`` on every wait, and each wait is its own trip through trio's I/O
manager. On the data plane a task waits once per token and once or twice per
request leg, so that is most of the scheduler's cost (docs/benchmarks.md). Here
each socket is registered once, edge-triggered, for its whole life; the hub
task is woken by trio once per batch of ready sockets (its epoll fd is
readable), and hands each ready socket to the task waiting for it with a plain
``reschedule``, or remembers the edge when no task is waiting yet so that the
next wait returns at once. The peer closing or resetting (``EPOLLRDHUP``,
``EPOLLHUP``, ``EPOLLERR``) also calls the watch's ``on_gone``: the front uses
it to cancel a request whose client went away, with no task per connection.

A watch may instead carry a ``handler``: the hub then calls it with the events
(no task is woken at all). The relay pump (``narwhal/http1/pump.py``) uses this
to read and write every live decode stream from inside the hub; a handler that
stopped before its socket was drained asks for another call with ``later`` (on
the next round, after the hub has yielded to the scheduler once).

With a pump set (``open_pump_set``: ``narwhal/http1/idle_rounds.py``), a
pumped stream's engine socket leaves the hub's set for a second set of the
hub's (``pump_in``, ``pump_out`` when the stream ends), which also holds
trio's own set: trio's idle wait then sleeps in it and runs its rounds
(``pump_round``), one ``epoll_wait`` a wake-up, and no task is woken for a
pumped socket at all. While streams are pumped, trio's busy loop also polls
the hub's own set once a batch (``busy_round``).

A wait may carry a deadline (``wait(watch, deadline)``). No cancel scope is
opened for it (a scope with a deadline costs about 7 µs of trio's Python, as
much as a request leg's other bookkeeping): the watchdog that keeps the set's
deadlines (its ``alarm``; the data pool's, the front's) calls ``expire``, which
fails each wait whose deadline has passed with ``WaitExpired`` and tells it
the earliest deadline still pending, to sleep until; a wait whose deadline
comes before that wakes it (``Alarm.due``).

A round's poll and hand-out (and idle_rounds.py's loop of rounds) run in C
where the optional ``_relay_native`` module was built: the same steps, without
the Python frames a wake-up otherwise costs (``ROUNDS_NATIVE``).

Only for plain sockets on Linux; anything else uses trio's waits.
"""

from __future__ import annotations

import contextlib
import select
from collections.abc import Callable, Sequence, Sized
from typing import Any

import outcome
import trio

from narwhal.compiled import optional_module
from narwhal.errors import NarwhalError
from narwhal.http1.alarm import Alarm
from narwhal.http1.early_rounds import EarlyRounds

__all__ = ["ROUNDS_NATIVE", "Readiness", "WaitExpired", "Watch"]

_INF = float("inf")

_EVENTS = select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLET
# The peer shut down its side (FIN) or the connection is gone: no edge will come again.
_CLOSED = select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR
# What calls ``on_gone`` unless the watch says otherwise.
GONE_EVENTS = _CLOSED
# A socket watched for room to write (``watch_writable``): edge-triggered, never ``on_gone``.
_WRITABLE = select.EPOLLOUT | select.EPOLLET
# What a handler is called with when the hub stops: no more events will come.
HUB_STOPPED = -1
# Ready sockets taken per round. The hub yields to the scheduler between rounds, so a burst of
# ready sockets cannot hold up the tasks it wakes (a new request's first bytes) for all of it;
# the rest stay on the kernel's ready list for the next round (no edge is lost).
_BATCH = 64
# The handlers to call again this round, when none asked.
_NO_WATCHES: tuple[Watch, ...] = ()


# The round's poll and hand-out in C, or None: the Python rounds, which behave the same.
_native: Any = optional_module("narwhal.http1._relay_native")
# Whether a round's poll and hand-out run in C.
ROUNDS_NATIVE = _native is not None


class WaitExpired(NarwhalError):
    """A wait's deadline passed before its socket was ready (raised in the waiting task)."""


class Watch:
    """One socket in the set: who waits for it, and what the hub saw while nobody did."""

    __slots__ = ("closed", "deadline", "fd", "gone", "gone_events", "handler", "on_gone", "pumped", "ready", "task")

    def __init__(self, fd: int, on_gone: Callable[[], None] | None, gone_events: int) -> None:
        self.fd = fd
        self.on_gone = on_gone
        self.gone_events = gone_events
        # An edge arrived while no task was waiting: the next wait returns at once.
        self.ready = False
        # The peer shut down its side or the connection broke: every later wait returns at once.
        self.closed = False
        # One of ``gone_events`` happened (and on_gone was called).
        self.gone = False
        self.task: trio.lowlevel.Task | None = None
        # The deadline of the current wait (inf: none).
        self.deadline = _INF
        # Called by the hub with the events instead of waking a task (the relay pump).
        self.handler: Callable[[int], None] | None = None
        # In the pump set rather than the hub's (``Readiness.pump_in``).
        self.pumped = False


class Readiness:
    """The set and its task (``run``); ``watch`` a socket once, ``wait`` on it any number of times."""

    def __init__(self, *, early_rounds: bool = True) -> None:
        """``early_rounds``: trio's loop runs the hub task's round before its step where it can (early_rounds.py)."""
        self._epoll = select.epoll()
        self._early_wanted = early_rounds
        self._watches: dict[int, Watch] = {}
        # Watches whose handler asked to be called again on the next round (``later``).
        self._later: list[Watch] = []
        # Watches whose wait had a deadline; a woken or aborted one leaves at the next ``expire``.
        self._timed: set[Watch] = set()
        # The alarm of the watchdog that calls ``expire`` (None: nobody keeps deadlines; waits use scopes).
        self.alarm: Alarm | None = None
        self.running = False
        # Live streams whose reads a handler does (the relay pump's).
        self.pumped = 0
        # The pump set (``open_pump_set``): pumped sockets and trio's own set, polled from trio's idle wait.
        self._pump_set: select.epoll | None = None
        self._pump_fd = -1
        self._trio_fd = -1
        # Sockets in the pump set now.
        self.pump_sockets = 0
        # Rounds of the pump set run (from trio's waits: ``idle_rounds.py``).
        self.pump_rounds = 0
        # Rounds of the hub's set run from trio's busy loop (``busy_round``).
        self.busy_rounds = 0
        # The hub task, while it runs (``early_rounds.py`` looks whether trio has scheduled it).
        self.task: trio.lowlevel.Task | None = None
        # A round run for the hub task before its step (``early_round``), not yet taken by it: whether it stopped
        # short, or what it raised.
        self.early_pending = False
        self._early_short = False
        self._early_error: BaseException | None = None
        # Rounds run that way.
        self.early_rounds = 0

    @property
    def has_later(self) -> bool:
        """Some handler asked to be called again (``later``)."""
        return bool(self._later)

    @property
    def expires_waits(self) -> bool:
        """A wait's deadline is kept (someone calls ``expire``): callers need no scope of their own."""
        return self.alarm is not None

    @property
    def timed_waits(self) -> bool:
        """Some wait with a deadline may still be pending (``expire`` has work)."""
        return bool(self._timed)

    def expire(self, now: float) -> float:
        """Fail with ``WaitExpired`` each wait whose deadline is ``now`` or earlier; the earliest deadline of
        the waits still pending (inf: none)."""
        timed = self._timed
        earliest = _INF
        for watch in list(timed):
            task = watch.task
            deadline = watch.deadline
            if task is None or deadline == _INF:
                # Woken, aborted, or waiting again with no deadline since.
                timed.discard(watch)
            elif now >= deadline:
                timed.discard(watch)
                self.interrupt(watch, WaitExpired())
            elif deadline < earliest:
                earliest = deadline
        return earliest

    def interrupt(self, watch: Watch, error: BaseException) -> bool:
        """Raise ``error`` in the task waiting on ``watch`` now; False when no task waits on it."""
        task = watch.task
        if task is None:
            return False
        watch.task = None
        trio.lowlevel.reschedule(task, outcome.Error(error))
        return True

    def watch(self, fd: int, on_gone: Callable[[], None] | None = None,
              gone_events: int = GONE_EVENTS) -> Watch | None:
        """Add a socket; None when the hub is not running (the caller then uses trio's waits).

        ``on_gone`` is called once, by the hub, at the first of ``gone_events``
        (default: the peer's FIN, a hang-up or an error; a server that reads a FIN
        as a half-close passes ``EPOLLHUP | EPOLLERR``).
        """
        if not self.running:
            return None
        try:
            self._epoll.register(fd, _EVENTS)
        except OSError:
            return None
        watch = self._watches[fd] = Watch(fd, on_gone, gone_events)
        return watch

    def watch_writable(self, fd: int, handler: Callable[[int], None]) -> Watch:
        """Add a socket for room to write; the hub calls ``handler`` at each edge. OSError if it cannot."""
        return self.watch_handled(fd, handler, _WRITABLE)

    def watch_handled(self, fd: int, handler: Callable[[int], None], events: int = _EVENTS) -> Watch:
        """Add a descriptor whose edges (readable by default) call ``handler``; no task waits on it, and
        ``on_gone`` is never called. OSError if it cannot."""
        self._epoll.register(fd, events)
        watch = self._watches[fd] = Watch(fd, None, 0)
        watch.handler = handler
        return watch

    def later(self, watch: Watch) -> None:
        """Call ``watch``'s handler (with events 0) on the hub's next round, edge or not."""
        self._later.append(watch)

    def forget(self, watch: Watch) -> None:
        """Remove a socket; call before closing it, so a reused fd number is never confused with it."""
        if self._watches.get(watch.fd) is watch:
            del self._watches[watch.fd]
            epoll = self._epoll
            if watch.pumped:
                watch.pumped = False
                self.pump_sockets -= 1
                epoll = self._pump_set  # type: ignore[assignment]
            try:
                epoll.unregister(watch.fd)
            except (OSError, ValueError):
                pass
        # Not kept until the next ``expire``, which may be many seconds away.
        self._timed.discard(watch)
        task, watch.task = watch.task, None
        if task is not None:
            trio.lowlevel.reschedule(task, outcome.Error(trio.ClosedResourceError("the socket was closed")))

    def open_pump_set(self, trio_fd: int) -> None:
        """Start the pump set, which holds trio's set (``trio_fd``) as well: ``pump_in`` moves sockets into it and
        ``pump_round`` polls it. OSError if it cannot be made."""
        pump_set = select.epoll()
        try:
            # Level-triggered: readable for as long as trio has I/O to take.
            pump_set.register(trio_fd, select.EPOLLIN)
        except OSError:
            pump_set.close()
            raise
        self._pump_set, self._pump_fd, self._trio_fd = pump_set, pump_set.fileno(), trio_fd

    def close_pump_set(self) -> None:
        """Back to the hub's set alone: sockets still pumped return to it."""
        pump_set, self._pump_set, self._pump_fd = self._pump_set, None, -1
        if pump_set is None:
            return
        for watch in list(self._watches.values()):
            if watch.pumped:
                self._move_out(watch, pump_set)
        pump_set.close()

    def pump_in(self, watch: Watch) -> None:
        """Move a socket whose handler reads it (a pumped stream's) into the pump set, if there is one.

        Adding a socket to a set reports it at once if it is ready, so no edge is lost between the sets."""
        pump_set = self._pump_set
        if pump_set is None or watch.pumped or self._watches.get(watch.fd) is not watch:
            return
        fd = watch.fd
        try:
            pump_set.register(fd, _EVENTS)
        except OSError:
            # Left in the hub's set: the hub task serves it as without a pump set.
            return
        # OSError: not in the hub's set after all (closed under us); the pump set's edge, or its read, says so.
        with contextlib.suppress(OSError):
            self._epoll.unregister(fd)
        watch.pumped = True
        self.pump_sockets += 1

    def pump_out(self, watch: Watch) -> None:
        """Back to the hub's set (the stream ended: its connection's next wait is a task's)."""
        if watch.pumped and self._pump_set is not None:
            self._move_out(watch, self._pump_set)

    def _move_out(self, watch: Watch, pump_set: select.epoll) -> None:
        watch.pumped = False
        self.pump_sockets -= 1
        fd = watch.fd
        try:
            pump_set.unregister(fd)
            self._epoll.register(fd, _EVENTS)
        except OSError:
            # The socket is broken or closed under us: its next wait returns at once and the read says why.
            watch.closed = True

    def pump_round(self, timeout: float) -> tuple[bool, bool]:
        """Poll the pump set up to ``timeout`` s and hand each ready socket on, then call the handlers that asked
        ``later``: (trio's set is ready, the round stopped short)."""
        pump_set = self._pump_set
        assert pump_set is not None
        self.pump_rounds += 1
        return self._poll_round(pump_set, timeout, self._trio_fd, True)

    @property
    def rounds_native(self) -> bool:
        """``pump_until`` runs its loop in C (the Python rounds otherwise)."""
        return _native is not None

    def pump_until(self, end: float, short: bool, runq: Sized) -> tuple[int, bool]:
        """``pump_round`` after ``pump_round`` (the first at once if ``short``) until trio's set is ready (1), ``runq``
        holds a task (2) or ``time.monotonic()`` reaches ``end`` (0, before any round): (that, the last round stopped
        short). In C; only when ``rounds_native``."""
        assert _native is not None and self._pump_set is not None
        outcome: tuple[int, bool] = _native.pump_rounds(self, self._pump_fd, self._trio_fd, self._watches,
                                                         self._saw_closed, trio.lowlevel.reschedule, runq, end,
                                                         short, _BATCH)
        return outcome

    async def wait(self, watch: Watch, deadline: float = _INF) -> None:
        """Until the socket has something to read (or its peer went away); at once if an edge is pending.

        With a ``deadline`` (trio time) it raises ``WaitExpired`` once ``expire`` finds it passed.
        """
        if watch.ready or watch.closed:
            # After the peer's close no edge comes again: the EOF (or error) waits to be read.
            watch.ready = False
            return
        alarm = self.alarm
        if not self.running or (deadline < _INF and alarm is None):
            # The hub has stopped (shutdown), or nobody keeps deadlines: trio's own wait, under a scope.
            with trio.move_on_at(deadline) as scope:
                await trio.lowlevel.wait_readable(watch.fd)
            if scope.cancelled_caught:
                raise WaitExpired
            return
        if watch.task is not None:
            raise trio.BusyResourceError("another task is already waiting on this socket")
        watch.task = trio.lowlevel.current_task()
        # Every wait sets it: a stale deadline must not expire a later wait that has none.
        watch.deadline = deadline
        if deadline < _INF:
            assert alarm is not None
            if deadline < alarm.at:
                alarm.wake()
            self._timed.add(watch)

        def abort(_: Any) -> trio.lowlevel.Abort:
            watch.task = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """The hub: wake the waiting tasks (or call the handlers) of every ready socket, once per batch."""
        epoll_fd = self._epoll.fileno()
        watches = self._watches
        self.running = True
        self.task = trio.lowlevel.current_task()
        early = self._early_wanted and EarlyRounds.join(self)
        try:
            task_status.started()
            short = False
            while True:
                if short or (self._later and self._pump_set is None):
                    # Handlers that stopped short of draining their socket, or more sockets ready
                    # than a round takes: yield once, then go on with whatever is ready by now.
                    # (With a pump set, its rounds call the handlers that asked ``later``.)
                    await trio.lowlevel.checkpoint()
                else:
                    await trio.lowlevel.wait_readable(epoll_fd)
                if self.early_pending:
                    # trio's loop ran this round before the step (early_rounds.py).
                    self.early_pending = False
                    error, self._early_error = self._early_error, None
                    if error is not None:
                        raise error
                    short = self._early_short
                else:
                    short = self._round()
        finally:
            if early:
                EarlyRounds.leave(self)
            self.task = None
            self.early_pending = False
            self._early_error = None
            self.running = False
            self._later.clear()
            self._timed.clear()
            for watch in list(watches.values()):
                handler, watch.handler = watch.handler, None
                if handler is not None:
                    handler(HUB_STOPPED)
                self.forget(watch)

    def early_round(self) -> None:
        """The hub task's next round, run from trio's loop after its I/O wait and before the batch the task steps
        in (``early_rounds.py``): the tasks it wakes run in that batch; the task takes the outcome."""
        self.early_rounds += 1
        self.early_pending = True
        try:
            self._early_short = self._round()
        except BaseException as exc:
            # Raised by the hub task, as from its own round.
            self._early_error = exc

    def busy_round(self) -> None:
        """The hub's set polled once from trio's busy loop (``idle_rounds.py``): ready sockets' tasks are woken (or
        handlers called) without the hub task's own wake-up. What a full batch leaves stays ready: trio wakes the
        hub task for it."""
        self.busy_rounds += 1
        self._poll_round(self._epoll, 0.0, -1, False)

    def _round(self) -> bool:
        """The hub task's round of its set; True when it stopped short (poll again after a yield). With a pump set,
        the pump set's rounds call the handlers that asked ``later``."""
        return self._poll_round(self._epoll, 0.0, -1, self._pump_set is None)[1]

    def _poll_round(self, epoll: select.epoll, timeout: float, other_fd: int, with_later: bool) -> tuple[bool, bool]:
        """Poll ``epoll`` (up to ``timeout`` s), hand each ready socket (a batch at most) to its handler or its
        waiting task, then, ``with_later``, call the handlers that asked ``later``: (``other_fd`` was ready, the
        round stopped short: a handler asked again, or a full batch)."""
        again: Sequence[Watch] = _NO_WATCHES
        if with_later and self._later:
            # Not the live list: a handler's ``later`` in this round is for the next one.
            again, self._later = self._later, []
        if _native is not None:
            other, taken = _native.poll_round(epoll.fileno(), timeout, _BATCH, self._watches, other_fd,
                                              self._saw_closed, trio.lowlevel.reschedule)
        else:
            ready = epoll.poll(timeout, _BATCH)
            other = self._dispatch(ready, other_fd)
            taken = len(ready)
        for watch in again:
            handler = watch.handler
            if handler is not None:
                handler(0)
        return other, (with_later and bool(self._later)) or taken == _BATCH

    def _dispatch(self, ready: list[tuple[int, int]], other_fd: int) -> bool:
        """Hand each ready socket to its handler or its waiting task; True when ``other_fd`` was among them."""
        watches = self._watches
        reschedule = trio.lowlevel.reschedule
        other = False
        for fd, events in ready:
            watch = watches.get(fd)
            if watch is None:
                if fd == other_fd:
                    other = True
                continue
            if events & _CLOSED:
                self._saw_closed(watch, events)
            handler = watch.handler
            if handler is not None:
                handler(events)
                continue
            task = watch.task
            if task is not None:
                watch.task = None
                reschedule(task)
            else:
                watch.ready = True
        return other

    @staticmethod
    def _saw_closed(watch: Watch, events: int) -> None:
        """The peer shut down its side or the connection broke: no edge comes again (``on_gone`` at the first of its
        events)."""
        watch.closed = True
        if events & watch.gone_events and not watch.gone:
            watch.gone = True
            if watch.on_gone is not None:
                watch.on_gone()
