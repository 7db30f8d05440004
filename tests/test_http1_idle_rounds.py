"""The pump set served from trio's own waits (``idle_rounds.py``): pumped sockets outside the hub's set."""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import trio

from narwhal.config import EngineConfig
from narwhal.http1 import idle_rounds
from narwhal.http1.idle_rounds import IdleRounds, TrioRun
from narwhal.http1.readiness import ROUNDS_NATIVE, Readiness, Watch
from narwhal.pools.data import DataPool
from tests.test_http1_readiness import close_sockets, pair  # noqa: F401  (close_sockets: an autouse fixture)


def echo(sock: socket.socket, seen: list[bytes]) -> Callable[[int], None]:
    """A pump-like handler: read what is there and write it back to the peer."""
    def handler(events: int) -> None:
        if events < 0:
            return
        try:
            data = sock.recv(4096)
        except BlockingIOError:
            return
        seen.append(data)
        sock.send(data)
    return handler


def pumped(hub: Readiness, sock: socket.socket, handler: Callable[[int], None]) -> Watch:
    """A socket a handler reads, moved into the pump set as the pump moves a stream's (no-op without one)."""
    watch = hub.watch_handled(sock.fileno(), handler)
    hub.pump_in(watch)
    return watch


# -- in a running trio loop ---------------------------------------------------------------------


@pytest.fixture
def start_hub(nursery: trio.Nursery):
    """A running hub, its rounds run from trio's idle wait when ``inline``, as the data pool wires it."""
    attached: list[IdleRounds] = []

    async def start(inline: bool) -> Readiness:
        hub = Readiness()
        await nursery.start(hub.run)
        if inline:
            rounds, unavailable = IdleRounds.attach(hub)
            assert unavailable is None and rounds is not None
            attached.append(rounds)
        return hub
    yield start
    for rounds in attached:
        rounds.detach()


async def test_trio_as_installed_lets_the_hub_run_rounds_from_its_idle_wait(nursery: trio.Nursery) -> None:
    # A trio upgrade that moves what the idle rounds use fails here, not silently in the benchmarks.
    assert isinstance(idle_rounds.trio_run(), TrioRun)
    pool = DataPool(max_connections=4, engine_config=EngineConfig())
    await nursery.start(pool.run)
    assert pool.idle_rounds is not None
    await pool.aclose()


@pytest.mark.parametrize("inline", [True, False])
async def test_handler_reads_run_from_the_idle_wait_and_trios_own_waits_still_wake(start_hub,
                                                                                    inline: bool) -> None:
    hub = await start_hub(inline)
    ours, peer = pair()
    seen: list[bytes] = []
    watch = pumped(hub, ours, echo(ours, seen))
    # Out of the hub's set with a pump set; served by the hub task, in its set, without one.
    assert watch.pumped is inline and hub.pump_sockets == int(inline)
    for i in range(20):
        message = b"token %d" % i
        peer.send(message)
        # trio's own wait on the peer: it wakes when the handler has written back, whoever ran it.
        with trio.fail_after(5):
            await trio.lowlevel.wait_readable(peer)
        assert peer.recv(100) == message
    assert seen == [b"token %d" % i for i in range(20)]
    if inline:
        assert hub.pump_rounds >= 20
    else:
        assert hub.pump_rounds == 0


async def test_a_task_a_round_wakes_runs_at_once_not_after_trios_timeout(start_hub) -> None:
    hub = await start_hub(True)
    ours, peer = pair()
    woken = trio.Event()

    def handler(events: int) -> None:
        if events >= 0:
            ours.recv(100)
            woken.set()
    pumped(hub, ours, handler)
    peer.send(b"x")
    # Without trio's wake-up after the round, trio would sleep until this scope's deadline and fail.
    with trio.fail_after(30):
        await woken.wait()
    assert hub.pump_rounds >= 1


async def test_a_task_waiting_on_a_hub_socket_is_woken_while_trio_sleeps_in_the_pump_set(
        start_hub, nursery: trio.Nursery) -> None:
    hub = await start_hub(True)
    pumped_side, pumped_peer = pair()
    pumped(hub, pumped_side, echo(pumped_side, []))
    ours, peer = pair()
    watch = hub.watch(ours.fileno())
    assert watch is not None and not watch.pumped

    async def later() -> None:
        await trio.testing.wait_all_tasks_blocked()
        peer.send(b"answer")
    nursery.start_soon(later)
    # The hub's set is in trio's, and trio's in the pump set: the sleep there ends, the hub task wakes.
    with trio.fail_after(30):
        await hub.wait(watch)
    assert ours.recv(100) == b"answer"


@pytest.mark.parametrize("inline", [True, False])
async def test_a_handler_that_does_not_drain_is_called_again_only_after_trios_io_is_served(
        start_hub, inline: bool) -> None:
    # A handler that asks ``later`` is called again in the next round, never in the same one: otherwise a
    # stream whose engine never runs dry would hold the loop in one round while everything else waits.
    hub = await start_hub(inline)
    ours, peer = pair()
    calls = 0
    watch_box: list = []

    def handler(events: int) -> None:
        nonlocal calls
        if events < 0:
            return
        calls += 1
        if calls < 1000:
            hub.later(watch_box[0])
    watch_box.append(pumped(hub, ours, handler))
    other, other_peer = pair()
    peer.send(b"x")
    other_peer.send(b"y")
    with trio.fail_after(30):
        await trio.lowlevel.wait_readable(other)
    calls_when_served = calls
    with trio.fail_after(30):
        while calls < 1000:
            await trio.sleep(0)
    assert other.recv(10) == b"y"
    assert calls_when_served < 100


async def test_a_failure_in_an_idle_round_is_raised_by_the_hub_task() -> None:
    class Defect(Exception):
        pass

    hub = Readiness()
    ours, peer = pair()

    def handler(events: int) -> None:
        if events >= 0:
            raise Defect("a handler's defect")

    rounds = None
    with pytest.raises(BaseExceptionGroup) as caught:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                await nursery.start(hub.run)
                rounds, _ = IdleRounds.attach(hub)
                pumped(hub, ours, handler)
                peer.send(b"x")
                await trio.sleep_forever()
    assert caught.group_contains(Defect)
    assert rounds is not None and rounds.failure is not None
    rounds.detach()


async def test_the_data_pool_logs_when_trio_cannot_run_the_rounds(nursery: trio.Nursery, caplog,
                                                                  monkeypatch) -> None:
    monkeypatch.setattr(idle_rounds, "trio_run", lambda: "trio 9.9's run has changed: no runq")
    pool = DataPool(max_connections=4, engine_config=EngineConfig())
    with caplog.at_level(logging.INFO):
        await nursery.start(pool.run)
    lines = [line for line in (json.loads(record.getMessage()) for record in caplog.records
                               if record.name == "narwhal.events") if line["event"] == "relay_inline_unavailable"]
    assert lines and lines[0]["reason"] == "trio 9.9's run has changed: no runq"
    assert lines[0]["level"] == "warning"
    await pool.aclose()


async def test_a_data_pool_told_not_to_never_runs_rounds_inline(nursery: trio.Nursery) -> None:
    pool = DataPool(max_connections=4, engine_config=EngineConfig(), relay_inline=False)
    await nursery.start(pool.run)
    assert pool.idle_rounds is None
    await pool.aclose()


# -- the instrument alone, with trio's side played by the test ----------------------------------------------


class FakeRun:
    """trio's set (an epoll the test fills), its wake-up (counted) and its run queue (a list)."""

    def __init__(self) -> None:
        self.epoll = select.epoll()
        self.forced = 0
        self.runq: list[object] = []

    def run(self) -> TrioRun:
        return TrioRun(self.epoll.fileno(), self.force, self.runq)

    def force(self) -> None:
        self.forced += 1


@pytest.fixture
def fake():
    made: list[tuple[FakeRun, IdleRounds, Readiness]] = []

    def make(hub: Readiness) -> tuple[FakeRun, IdleRounds]:
        run = FakeRun()
        rounds = IdleRounds(hub, run.run())
        made.append((run, rounds, hub))
        return run, rounds
    yield make
    for run, rounds, hub in made:
        hub.close_pump_set()
        os.close(rounds._wake_fd)
        run.epoll.close()


def wake_pending(rounds: IdleRounds) -> bool:
    try:
        os.eventfd_read(rounds._wake_fd)
    except BlockingIOError:
        return False
    return True


def quiet_stream(fake) -> tuple[Readiness, FakeRun, IdleRounds]:
    """A hub, trio played by the test, and one pumped socket that stays quiet (so the rounds run)."""
    hub = Readiness()
    run, rounds = fake(hub)
    ours, _ = pair()
    pumped(hub, ours, lambda events: None)
    return hub, run, rounds


def trios_socket(run: FakeRun) -> socket.socket:
    """A socket in trio's own set; its peer (returned) makes trio's set ready."""
    trio_side, trio_peer = pair()
    run.epoll.register(trio_side.fileno(), select.EPOLLIN)
    return trio_peer


def test_trios_deadline_ends_the_wait_with_trios_wake_up(fake) -> None:
    hub, run, rounds = quiet_stream(fake)
    rounds.before_io_wait(0.01)
    assert run.forced == 1


def test_trios_own_io_ends_the_wait_at_once_without_its_wake_up(fake) -> None:
    hub, run, rounds = quiet_stream(fake)
    trio_peer = trios_socket(run)
    trio_peer.send(b"x")
    rounds.before_io_wait(3600)
    # trio's epoll_wait returns at once by itself: no wake-up needed; one round saw trio's set ready.
    assert run.forced == 0
    assert hub.pump_rounds == 1
    assert not wake_pending(rounds)


class ReadsThenATask:
    """A pumped socket's handler: each read brings the next edge, until the last makes a task runnable."""

    def __init__(self, hub: Readiness, run: FakeRun, wake_ups: int) -> None:
        self.ours, self.peer = pair()
        self.run = run
        self.wake_ups = wake_ups
        self.reads = 0
        pumped(hub, self.ours, self.handler)
        self.peer.send(b"x")

    def handler(self, events: int) -> None:
        self.ours.recv(100)
        self.reads += 1
        if self.reads < self.wake_ups:
            self.peer.send(b"more")  # the next edge: another round, still in the idle wait
        else:
            self.run.runq.append("a task")  # as a stream's end reschedules its request task


def test_rounds_run_until_one_makes_a_task_runnable(fake) -> None:
    hub = Readiness()
    run, rounds = fake(hub)
    reads = ReadsThenATask(hub, run, 3)
    rounds.before_io_wait(3600)
    assert reads.reads == 3
    assert hub.pump_rounds == 3
    assert run.forced == 1


def test_a_round_left_short_when_trio_has_io_goes_on_at_trios_next_wait(fake) -> None:
    hub = Readiness()
    run, rounds = fake(hub)
    ours, peer = pair()
    trio_peer = trios_socket(run)
    box: list = []
    calls: list[int] = []

    def handler(events: int) -> None:
        # Never drained: called again each round.
        calls.append(events)
        hub.later(box[0])
        if len(calls) == 1:
            trio_peer.send(b"trio has work")
    box.append(pumped(hub, ours, handler))
    peer.send(b"x")
    rounds.before_io_wait(3600)
    # The second round saw trio's I/O: trio gets the loop, its epoll_wait returning at once (no wake-up).
    assert calls == [1, 0] and hub.pump_rounds == 2 and run.forced == 0
    # The handler's next call is the first thing trio's next wait does, busy or not.
    run.runq.append("trio's task")
    rounds.before_io_wait(0)
    assert calls == [1, 0, 0] and hub.pump_rounds == 3
    # Never through the hub task: its set is not involved.
    assert not wake_pending(rounds)


def test_a_busy_trio_gets_one_look_at_the_pump_set_and_no_sleep(fake) -> None:
    hub = Readiness()
    run, rounds = fake(hub)
    ours, peer = pair()
    seen: list[bytes] = []
    pumped(hub, ours, echo(ours, seen))
    run.runq.append("trio's task")
    rounds.before_io_wait(0)
    assert hub.pump_rounds == 1 and seen == []
    peer.send(b"x")
    rounds.before_io_wait(0)
    assert seen == [b"x"] and peer.recv(10) == b"x"
    # A task is runnable: trio's epoll_wait does not sleep, so its wake-up would be a wasted syscall.
    assert run.forced == 0


@pytest.mark.parametrize("streams", [0, 1])
def test_a_busy_trio_looks_at_the_hubs_own_set_too_while_streams_are_pumped(fake, streams: int) -> None:
    hub = Readiness()
    run, rounds = fake(hub)
    if streams:
        stream_side, _ = pair()
        pumped(hub, stream_side, lambda events: None)
    ours, peer = pair()
    calls: list[int] = []
    # A socket of the hub's own set (a request's engine read, say).
    hub.watch_handled(ours.fileno(), calls.append)
    peer.send(b"x")
    # trio's deadline: the hub's set is in trio's, and trio wakes the hub task for it (no look at it here).
    rounds.before_io_wait(0.001)
    assert calls == [] and hub.busy_rounds == 0
    # trio is busy: one look at the hub's set while streams are pumped, so what it wakes runs in this batch, not
    # after the hub task's wake-up; none without (at one request at a time it would mostly find nothing).
    run.runq.append("trio's task")
    rounds.before_io_wait(0)
    if streams:
        assert len(calls) == 1 and calls[0] & select.EPOLLIN and hub.busy_rounds == 1
    else:
        assert calls == [] and hub.busy_rounds == 0


async def test_a_task_waiting_on_a_hub_socket_is_woken_from_trios_busy_loop(start_hub,
                                                                            nursery: trio.Nursery) -> None:
    hub = await start_hub(True)
    stream_side, _ = pair()
    pumped(hub, stream_side, lambda events: None)
    ours, peer = pair()
    watch = hub.watch(ours.fileno())
    assert watch is not None
    stop = False

    async def busy() -> None:
        # Keeps trio busy, so its waits have no timeout.
        while not stop:
            await trio.sleep(0)
    nursery.start_soon(busy)
    await trio.sleep(0)
    peer.send(b"answer")
    before = hub.busy_rounds
    with trio.fail_after(30):
        await hub.wait(watch)
    stop = True
    assert ours.recv(100) == b"answer"
    assert hub.busy_rounds > before


def test_reads_left_when_trio_sees_no_work_call_trios_wake_up(fake) -> None:
    # A timeout of 0 with nothing runnable: a deadline passed, or a test clock about to jump. Reads left over
    # must not let trio take itself for idle.
    hub = Readiness()
    run, rounds = fake(hub)
    ours, peer = pair()
    box: list = []
    box.append(pumped(hub, ours, lambda events: hub.later(box[0])))
    peer.send(b"x")
    rounds.before_io_wait(0)
    assert run.forced == 1


@pytest.mark.parametrize("state", ["no pumped socket", "the hub's own socket"])
def test_trios_waits_are_its_own_without_a_pumped_socket(fake, state: str) -> None:
    hub = Readiness()
    run, rounds = fake(hub)
    ours, peer = pair()
    if state == "the hub's own socket":
        # A handled socket never moved into the pump set: the hub task serves it.
        hub.watch_handled(ours.fileno(), lambda events: None)
    peer.send(b"x")
    rounds.before_io_wait(3600)
    rounds.before_io_wait(0)
    assert hub.pump_rounds == 0
    assert run.forced == 0


def test_a_socket_moves_between_the_sets_without_losing_an_edge(fake) -> None:
    hub = Readiness()
    hub.running = True  # as when the hub task runs: ``watch`` registers
    run, rounds = fake(hub)
    ours, peer = pair()
    watch = hub.watch(ours.fileno())
    assert watch is not None
    # Bytes that came while the socket was in the hub's set, its edge not yet taken: the pump set reports them.
    peer.send(b"before the move")
    calls: list[int] = []
    watch.handler = calls.append
    hub.pump_in(watch)
    assert watch.pumped and hub.pump_sockets == 1
    assert hub._round() is False and calls == []  # the hub's set no longer has it
    run.runq.append("trio's task")
    rounds.before_io_wait(0)
    assert calls and calls[0] & select.EPOLLIN
    ours.recv(100)
    # Bytes that come while it is in the pump set, not yet polled, then the stream ends: the hub's set has them.
    peer.send(b"after the stream")
    watch.handler = None
    hub.pump_out(watch)
    assert not watch.pumped and hub.pump_sockets == 0
    hub._round()
    assert watch.ready
    # A socket forgotten while pumped leaves the pump set too.
    watch.ready = False
    watch.handler = calls.append
    hub.pump_in(watch)
    hub.forget(watch)
    assert hub.pump_sockets == 0 and not watch.pumped
    hub.running = False


def test_closing_the_pump_set_puts_its_sockets_back_in_the_hubs_set(fake) -> None:
    hub = Readiness()
    run, rounds = fake(hub)
    ours, peer = pair()
    calls: list[int] = []
    watch = pumped(hub, ours, calls.append)
    hub.close_pump_set()
    assert not watch.pumped and hub.pump_sockets == 0
    peer.send(b"x")
    hub._round()
    assert calls and calls[0] & select.EPOLLIN


def test_a_failure_is_kept_for_the_hub_task_and_rounds_stop(fake) -> None:
    hub = Readiness()
    run, rounds = fake(hub)
    ours, peer = pair()
    broken = ValueError("defect")

    def handler(events: int) -> None:
        raise broken
    pumped(hub, ours, handler)
    peer.send(b"x")
    rounds.before_io_wait(3600)
    assert rounds.failure is broken
    # The hub task's next round sees its wake-up and raises the failure as its own.
    with pytest.raises(ValueError, match="defect"):
        hub._round()
    peer.send(b"y")
    rounds.before_io_wait(3600)
    assert run.forced == 0


# -- the rounds' waits as select.epoll.poll's: signals, other threads, and (in C) no Python per wake-up ----------


def wait_with_an_alarm(rounds: IdleRounds, timeout: float, on_alarm: Callable[[int, Any], None]) -> tuple[float, float]:
    """``before_io_wait(timeout)`` with SIGALRM's ``on_alarm`` due 20 ms into it: (when it began, how long it took)."""
    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.02)
        started = time.monotonic()
        rounds.before_io_wait(timeout)
        return started, time.monotonic() - started
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_signal_in_the_wait_runs_its_handler_and_the_wait_goes_on_to_trios_deadline(fake) -> None:
    hub, run, rounds = quiet_stream(fake)
    caught: list[float] = []
    started, waited = wait_with_an_alarm(rounds, 1.0, lambda signum, frame: caught.append(time.monotonic()))
    # PEP 475: the handler ran in the wait (not once it ended), which then slept out what was left of it.
    assert len(caught) == 1 and caught[0] - started < 0.8
    assert waited >= 0.99 and run.forced == 1
    assert rounds.failure is None


def test_a_signal_handler_that_raises_ends_the_rounds_as_a_failure(fake) -> None:
    hub, run, rounds = quiet_stream(fake)
    interrupted = KeyboardInterrupt()

    def handler(signum: int, frame: object) -> None:
        raise interrupted
    _, waited = wait_with_an_alarm(rounds, 30, handler)
    # It ends the wait then, and is kept for the hub task, which raises it as its own round's (as a handler's).
    assert waited < 25
    assert rounds.failure is interrupted and wake_pending(rounds)


def test_another_thread_runs_while_the_rounds_sleep(fake) -> None:
    hub, run, rounds = quiet_stream(fake)
    trio_peer = trios_socket(run)
    go_read, go_write = os.pipe()

    def other_thread() -> None:
        # Blocked outside the GIL until the test lets it go, then needs the GIL to send: only a wait that
        # released it lets it in before the wait's own 30 s.
        os.read(go_read, 1)
        trio_peer.send(b"from another thread")
    thread = threading.Thread(target=other_thread)
    thread.start()
    try:
        os.write(go_write, b"x")
        started = time.monotonic()
        rounds.before_io_wait(30)
        waited = time.monotonic() - started
    finally:
        thread.join(35)
        os.close(go_read)
        os.close(go_write)
    assert waited < 25 and run.forced == 0


@pytest.mark.skipif(not ROUNDS_NATIVE, reason="the C rounds were not built")
def test_in_c_a_wake_up_runs_no_python_but_its_handler(fake) -> None:
    def python_calls(wake_ups: int) -> int:
        hub = Readiness()
        run, rounds = fake(hub)
        reads = ReadsThenATask(hub, run, wake_ups)
        calls: list[str] = []

        def profile(frame: Any, event: str, arg: object) -> None:
            if event == "call" and frame.f_code is not ReadsThenATask.handler.__code__:
                calls.append(frame.f_code.co_name)
        sys.setprofile(profile)
        try:
            rounds.before_io_wait(3600)
        finally:
            sys.setprofile(None)
        assert reads.reads == wake_ups and hub.pump_rounds == wake_ups
        return len(calls)
    # Python runs once a sleep (trio's instrument call), not once a wake-up.
    assert python_calls(8) == python_calls(2)
