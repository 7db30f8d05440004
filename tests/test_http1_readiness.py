"""The readiness set: one task, an edge-triggered epoll set, and the tasks waiting on its sockets."""

from __future__ import annotations

import socket

import pytest
import trio

from narwhal.http1.alarm import Alarm
from narwhal.http1.readiness import Readiness, WaitExpired, Watch

_open: list[socket.socket] = []


def pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    _open.extend((a, b))
    return a, b


@pytest.fixture(autouse=True)
def close_sockets():
    yield
    while _open:
        _open.pop().close()


async def test_a_waiter_is_woken_when_bytes_arrive(nursery: trio.Nursery) -> None:
    hub = Readiness()
    await nursery.start(hub.run)
    ours, peer = pair()
    watch = hub.watch(ours.fileno())
    assert watch is not None
    woken = trio.Event()

    async def waiter() -> None:
        await hub.wait(watch)
        woken.set()
    nursery.start_soon(waiter)
    await trio.testing.wait_all_tasks_blocked()
    assert not woken.is_set()
    peer.send(b"x")
    with trio.fail_after(5):
        await woken.wait()
    assert ours.recv(10) == b"x"


async def test_an_edge_while_nobody_waits_is_not_lost(nursery: trio.Nursery) -> None:
    hub = Readiness()
    await nursery.start(hub.run)
    ours, peer = pair()
    watch = hub.watch(ours.fileno())
    assert watch is not None
    peer.send(b"early")
    # Let the hub see the edge with no task waiting; the next wait must then return at once.
    with trio.fail_after(5):
        while not watch.ready:
            await trio.sleep(0.001)
    with trio.fail_after(5):
        await hub.wait(watch)
    assert ours.recv(10) == b"early"


async def test_the_peer_closing_calls_on_gone_and_wakes_the_waiter(nursery: trio.Nursery) -> None:
    hub = Readiness()
    await nursery.start(hub.run)
    ours, peer = pair()
    gone: list[bool] = []
    watch = hub.watch(ours.fileno(), lambda: gone.append(True))
    assert watch is not None
    peer.send(b"last words")
    peer.close()
    with trio.fail_after(5):
        await hub.wait(watch)
    assert gone == [True]
    # Data and EOF came in one edge: every later wait returns at once, so the EOF is read, not waited for.
    assert ours.recv(100) == b"last words"
    with trio.fail_after(5):
        await hub.wait(watch)
    assert ours.recv(100) == b""


async def test_forgetting_a_socket_wakes_its_waiter_with_closed_resource(nursery: trio.Nursery) -> None:
    hub = Readiness()
    await nursery.start(hub.run)
    ours, _peer = pair()
    watch = hub.watch(ours.fileno())
    assert watch is not None
    raised = trio.Event()

    async def waiter() -> None:
        with pytest.raises(trio.ClosedResourceError):
            await hub.wait(watch)
        raised.set()
    nursery.start_soon(waiter)
    await trio.testing.wait_all_tasks_blocked()
    hub.forget(watch)
    ours.close()
    with trio.fail_after(5):
        await raised.wait()


# timed waits: kept by whoever calls expire, with no cancel scope -------------------------

async def watched_pair(nursery: trio.Nursery, alarm: Alarm | None = None,
                       ) -> tuple[Readiness, Watch, socket.socket, socket.socket]:
    """A running hub (the alarm of whoever keeps its deadlines set), and one socket of a pair in its set."""
    hub = Readiness()
    hub.alarm = alarm
    await nursery.start(hub.run)
    ours, peer = pair()
    watch = hub.watch(ours.fileno())
    assert watch is not None
    return hub, watch, ours, peer


async def sleeping_alarm(nursery: trio.Nursery, until: float) -> tuple[Alarm, list[float]]:
    """An alarm whose keeper sleeps until ``until``; the list gets the time of each wake-up."""
    alarm = Alarm()
    woken: list[float] = []

    async def keeper() -> None:
        await alarm.sleep_until(until)
        woken.append(trio.current_time())
    nursery.start_soon(keeper)
    await trio.testing.wait_all_tasks_blocked()
    assert alarm.sleeping
    return alarm, woken


async def test_a_timed_wait_fails_only_once_expire_finds_its_deadline_passed(nursery: trio.Nursery) -> None:
    alarm, woken = await sleeping_alarm(nursery, float("inf"))
    hub, watch, _ours, _peer = await watched_pair(nursery, alarm)
    outcome: list[str] = []

    async def waiter() -> None:
        try:
            await hub.wait(watch, deadline=100.0)
        except WaitExpired:
            outcome.append("expired")
    nursery.start_soon(waiter)
    await trio.testing.wait_all_tasks_blocked()
    # A deadline before the keeper's wake-up wakes it; the wait is pending in the set.
    assert len(woken) == 1 and hub.timed_waits
    # Not yet due: the keeper learns when it is.
    assert hub.expire(99.9) == 100.0
    await trio.testing.wait_all_tasks_blocked()
    assert outcome == []
    assert hub.expire(100.0) == float("inf")
    await trio.testing.wait_all_tasks_blocked()
    assert outcome == ["expired"]
    assert not hub.timed_waits


async def test_a_timed_wait_due_after_the_keeper_wakes_does_not_wake_it(nursery: trio.Nursery) -> None:
    now = trio.current_time()
    alarm, woken = await sleeping_alarm(nursery, now + 100)
    hub, watch, _ours, _peer = await watched_pair(nursery, alarm)
    with trio.move_on_after(0.01):
        await hub.wait(watch, deadline=now + 150)
    assert woken == [] and alarm.sleeping
    with trio.move_on_after(0.01):
        await hub.wait(watch, deadline=now + 50)
    assert len(woken) == 1 and not alarm.sleeping


async def test_expire_tells_the_earliest_deadline_still_pending(nursery: trio.Nursery) -> None:
    hub, first, _ours, _peer = await watched_pair(nursery, Alarm())
    ours2, _peer2 = pair()
    second = hub.watch(ours2.fileno())
    assert second is not None

    async def waiter(watch: Watch, deadline: float) -> None:
        with pytest.raises(trio.ClosedResourceError):
            await hub.wait(watch, deadline)
    nursery.start_soon(waiter, first, 1_000_000.0)
    nursery.start_soon(waiter, second, 500_000.0)
    await trio.testing.wait_all_tasks_blocked()
    assert hub.expire(0.0) == 500_000.0
    # A closed socket's wait leaves the set at once, not at the next expire.
    hub.forget(second)
    await trio.testing.wait_all_tasks_blocked()
    assert hub.expire(0.0) == 1_000_000.0
    hub.forget(first)
    await trio.testing.wait_all_tasks_blocked()
    assert not hub.timed_waits and hub.expire(0.0) == float("inf")
    ours2.close()


async def test_a_timed_wait_woken_in_time_leaves_the_set_and_a_later_plain_wait_is_never_expired(
        nursery: trio.Nursery) -> None:
    hub, watch, ours, peer = await watched_pair(nursery, Alarm())
    peer.send(b"x")
    with trio.fail_after(5):
        await hub.wait(watch, deadline=trio.current_time() + 100)
    ours.recv(10)
    # The same socket waits again, with no deadline: the earlier one must not fail it.
    done: list[str] = []

    async def waiter() -> None:
        await hub.wait(watch)
        done.append("woken")
    nursery.start_soon(waiter)
    await trio.testing.wait_all_tasks_blocked()
    hub.expire(trio.current_time() + 1000)
    await trio.testing.wait_all_tasks_blocked()
    assert done == [] and not hub.timed_waits
    peer.send(b"y")
    with trio.fail_after(5):
        while not done:
            await trio.sleep(0.001)


async def test_a_cancelled_timed_wait_leaves_the_set(nursery: trio.Nursery) -> None:
    hub, watch, _ours, _peer = await watched_pair(nursery, Alarm())
    with trio.move_on_after(0.01):
        await hub.wait(watch, deadline=trio.current_time() + 100)
    assert watch.task is None
    hub.expire(trio.current_time() + 1000)
    assert not hub.timed_waits


async def test_with_nobody_expiring_a_timed_wait_keeps_its_deadline_itself(
        nursery: trio.Nursery, autojump_clock: trio.testing.MockClock) -> None:
    hub, watch, _ours, _peer = await watched_pair(nursery)
    started = trio.current_time()
    with pytest.raises(WaitExpired):
        await hub.wait(watch, deadline=started + 3.0)
    assert trio.current_time() - started == pytest.approx(3.0)
    assert not hub.timed_waits


async def test_an_interrupt_raises_its_error_in_the_waiting_task_only(nursery: trio.Nursery) -> None:
    hub, watch, _ours, peer = await watched_pair(nursery)
    # Nobody waits: nothing to interrupt, and the next wait is a plain one.
    assert hub.interrupt(watch, RuntimeError("late")) is False
    raised: list[BaseException] = []

    async def waiter() -> None:
        try:
            await hub.wait(watch)
        except RuntimeError as exc:
            raised.append(exc)
    nursery.start_soon(waiter)
    await trio.testing.wait_all_tasks_blocked()
    error = RuntimeError("deadline")
    assert hub.interrupt(watch, error) is True
    await trio.testing.wait_all_tasks_blocked()
    assert raised == [error] and watch.task is None
    # The socket stays in the set: a later wait is woken by its bytes as before.
    peer.send(b"x")
    with trio.fail_after(5):
        await hub.wait(watch)


async def test_nothing_is_watched_while_the_hub_is_not_running() -> None:
    hub = Readiness()
    ours, _peer = pair()
    assert hub.watch(ours.fileno()) is None


async def test_more_ready_sockets_than_a_round_takes_are_all_handled_each_once(nursery: trio.Nursery) -> None:
    from narwhal.http1 import readiness as readiness_module

    hub = Readiness()
    await nursery.start(hub.run)
    count = 3 * readiness_module._BATCH + 5
    seen: dict[int, int] = {}
    all_seen = trio.Event()
    peers = []
    for _ in range(count):
        ours, peer = pair()
        peers.append(peer)
        watch = hub.watch(ours.fileno())
        assert watch is not None

        def handler(events: int, fd: int = ours.fileno()) -> None:
            seen[fd] = seen.get(fd, 0) + 1
            if len(seen) == count:
                all_seen.set()
        watch.handler = handler
    # Every socket turns ready at once: the hub takes them a round at a time and loses none.
    for peer in peers:
        peer.send(b"x")
    with trio.fail_after(5):
        await all_seen.wait()
    await trio.testing.wait_all_tasks_blocked()
    assert sorted(seen.values()) == [1] * count
