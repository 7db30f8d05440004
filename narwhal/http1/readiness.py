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

Only for plain sockets on Linux; anything else uses trio's waits.
"""

from __future__ import annotations

import select
from collections.abc import Callable
from typing import Any

import outcome
import trio

__all__ = ["Readiness", "Watch"]

_EVENTS = select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLET
# The peer shut down its side (FIN) or the connection is gone: no edge will come again.
_CLOSED = select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR
# What calls ``on_gone`` unless the watch says otherwise.
GONE_EVENTS = _CLOSED


class Watch:
    """One socket in the set: who waits for it, and what the hub saw while nobody did."""

    __slots__ = ("closed", "fd", "gone", "gone_events", "on_gone", "ready", "task")

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


class Readiness:
    """The set and its task (``run``); ``watch`` a socket once, ``wait`` on it any number of times."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._watches: dict[int, Watch] = {}
        self.running = False

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

    def forget(self, watch: Watch) -> None:
        """Remove a socket; call before closing it, so a reused fd number is never confused with it."""
        if self._watches.get(watch.fd) is watch:
            del self._watches[watch.fd]
            try:
                self._epoll.unregister(watch.fd)
            except (OSError, ValueError):
                pass
        task, watch.task = watch.task, None
        if task is not None:
            trio.lowlevel.reschedule(task, outcome.Error(trio.ClosedResourceError("the socket was closed")))

    async def wait(self, watch: Watch) -> None:
        """Until the socket has something to read (or its peer went away); at once if an edge is pending."""
        if watch.ready or watch.closed:
            # After the peer's close no edge comes again: the EOF (or error) waits to be read.
            watch.ready = False
            return
        if not self.running:
            # The hub has stopped (shutdown): trio's own wait still works.
            await trio.lowlevel.wait_readable(watch.fd)
            return
        if watch.task is not None:
            raise trio.BusyResourceError("another task is already waiting on this socket")
        watch.task = trio.lowlevel.current_task()

        def abort(_: Any) -> trio.lowlevel.Abort:
            watch.task = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """The hub: wake the waiting tasks of every ready socket, once per batch."""
        epoll = self._epoll
        watches = self._watches
        reschedule = trio.lowlevel.reschedule
        self.running = True
        try:
            task_status.started()
            while True:
                await trio.lowlevel.wait_readable(epoll.fileno())
                for fd, events in epoll.poll(0):
                    watch = watches.get(fd)
                    if watch is None:
                        continue
                    if events & _CLOSED:
                        watch.closed = True
                        if events & watch.gone_events and not watch.gone:
                            watch.gone = True
                            if watch.on_gone is not None:
                                watch.on_gone()
                    task = watch.task
                    if task is not None:
                        watch.task = None
                        reschedule(task)
                    else:
                        watch.ready = True
        finally:
            self.running = False
            for watch in list(watches.values()):
                self.forget(watch)
