"""Polling with a deadline, for end-to-end tests that watch a live router."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio


async def wait_until(predicate: Callable[[], Awaitable[bool]], timeout_s: float = 10.0,
                     what: str = "condition") -> None:
    """Poll ``predicate`` every 50 ms until it is true; fail after ``timeout_s``."""
    with trio.move_on_after(timeout_s):
        while not await predicate():
            await trio.sleep(0.05)
        return
    raise AssertionError(f"timed out waiting for {what}")
