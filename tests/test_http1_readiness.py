"""The readiness set: one task, an edge-triggered epoll set, and the tasks waiting on its sockets."""

from __future__ import annotations

import socket

import pytest
import trio

from narwhal.http1.readiness import Readiness

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
