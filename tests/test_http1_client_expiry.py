"""The engine client's idle pool expires connections by age, whatever the number of engines.

Expiry reads one queue of releases in time order instead of every engine's
stack; these tests hold it to the per-stack rule it replaced, step by step.
"""

from __future__ import annotations

import random
from typing import Any

import trio
import trio.testing

from narwhal.http1.client import EngineConnections


class FakeConnection:
    def __init__(self, key: tuple[str, int], number: int) -> None:
        self.key = key
        self.number = number
        self.idle_since = 0.0
        self.idle_seq = 0
        self.closed = False
        self.reusable = True
        self.closed_by_engine = False

    def close(self) -> None:
        self.closed = True

    def dropped_while_idle(self) -> bool:
        return False


class Reference:
    """The rule as it was: at each release every stack drops its expired front; a take pops the newest."""

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self.stacks: dict[tuple[str, int], list[tuple[float, int]]] = {}
        self.closed: set[int] = set()

    def release(self, key: tuple[str, int], number: int, now: float) -> None:
        self.stacks.setdefault(key, []).append((now, number))
        for stack in self.stacks.values():
            while stack and stack[0][0] <= now - self.idle_s:
                self.closed.add(stack.pop(0)[1])

    def take(self, key: tuple[str, int], now: float) -> int | None:
        stack = self.stacks.get(key, [])
        while stack:
            since, number = stack.pop()
            if since <= now - self.idle_s:
                self.closed.add(number)
                self.closed.update(n for _, n in stack)
                stack.clear()
                return None
            return number
        return None


async def test_expiry_matches_the_per_stack_rule_over_many_engines(mock_clock: trio.testing.MockClock) -> None:
    rng = random.Random(34)
    pool = EngineConnections(idle_s=4.0)
    reference = Reference(4.0)
    keys = [("127.0.0.1", 9000 + i) for i in range(40)]
    conns: dict[int, Any] = {}
    in_use: list[Any] = []
    for step in range(3000):
        mock_clock.jump(rng.choice((0.0, 0.0, 0.01, 0.3, 1.0, 2.5)))
        now = trio.current_time()
        if in_use and rng.random() < 0.55:
            conn = in_use.pop(rng.randrange(len(in_use)))
            pool.release(conn)
            reference.release(conn.key, conn.number, now)
        else:
            key = rng.choice(keys)
            taken = pool._take_idle(key)
            expected = reference.take(key, now)
            assert (taken.number if taken is not None else None) == expected, step
            if taken is None:
                taken = conns[step] = FakeConnection(key, step)
            in_use.append(taken)
        assert {n for n, c in conns.items() if c.closed} == reference.closed, step
        assert pool.idle_connections == sum(len(stack) for stack in reference.stacks.values()), step
    # Stale entries (taken since) never close a connection in use.
    assert not any(conn.closed for conn in in_use)


async def test_one_release_closes_an_expired_connection_of_another_engine(mock_clock: trio.testing.MockClock) -> None:
    pool = EngineConnections(idle_s=4.0)
    old, fresh = FakeConnection(("h", 1), 1), FakeConnection(("h", 2), 2)
    pool.release(old)  # type: ignore[arg-type]
    mock_clock.jump(4.0)
    pool.release(fresh)  # type: ignore[arg-type]
    assert old.closed and not fresh.closed and pool.idle_connections == 1
    # Released, taken and released again at the same instant: the first entry is stale, the second counts.
    again = FakeConnection(("h", 3), 3)
    pool.release(again)  # type: ignore[arg-type]
    assert pool._take_idle(("h", 3)) is again
    pool.release(again)  # type: ignore[arg-type]
    mock_clock.jump(3.9)
    pool.release(FakeConnection(("h", 4), 4))  # type: ignore[arg-type]
    assert not again.closed
    mock_clock.jump(0.1)
    pool.release(FakeConnection(("h", 5), 5))  # type: ignore[arg-type]
    assert again.closed and fresh.closed and pool.idle_connections == 2
