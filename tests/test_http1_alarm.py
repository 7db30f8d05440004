"""The watchdogs' alarm: asleep until a time, woken sooner only by a deadline before it."""

from __future__ import annotations

import math

import trio
import trio.testing

from narwhal.http1.alarm import Alarm


async def test_the_alarm_sleeps_until_its_time(autojump_clock: trio.testing.MockClock) -> None:
    alarm = Alarm()
    assert not alarm.sleeping
    started = trio.current_time()
    await alarm.sleep_until(started + 7.5)
    assert trio.current_time() - started == 7.5
    # Awake: a deadline set now is read before it sleeps again, so nothing wakes it.
    assert alarm.at == -math.inf


async def test_a_time_already_past_still_sleeps_a_millisecond_so_a_watchdog_cannot_spin(
        autojump_clock: trio.testing.MockClock) -> None:
    alarm = Alarm()
    await trio.sleep(10.0)
    await alarm.sleep_until(5.0)
    assert trio.current_time() == 10.001 and alarm.wakeups == 1


async def test_a_deadline_before_its_time_wakes_it_then_and_a_later_one_does_not(
        nursery: trio.Nursery, autojump_clock: trio.testing.MockClock) -> None:
    alarm = Alarm()
    woken: list[float] = []

    async def keeper() -> None:
        await alarm.sleep_until(100.0)
        woken.append(trio.current_time())
    nursery.start_soon(keeper)
    await trio.sleep(10.0)
    assert alarm.at == 100.0
    alarm.due(100.0)
    alarm.due(250.0)
    await trio.sleep(1.0)
    assert woken == []
    alarm.due(60.0)
    await trio.testing.wait_all_tasks_blocked()
    assert woken == [11.0]


async def test_with_nothing_due_it_sleeps_until_woken(nursery: trio.Nursery,
                                                     autojump_clock: trio.testing.MockClock) -> None:
    alarm = Alarm()
    woken: list[float] = []

    async def keeper() -> None:
        await alarm.sleep_until(math.inf)
        woken.append(trio.current_time())
    nursery.start_soon(keeper)
    await trio.sleep(3600.0)
    assert woken == [] and alarm.sleeping
    alarm.due(1e12)
    await trio.testing.wait_all_tasks_blocked()
    assert woken == [3600.0] and not alarm.sleeping
