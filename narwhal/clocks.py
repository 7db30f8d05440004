"""The router's two clocks, and the one conversion between them.

trio's clock (``trio.current_time``) times deadlines and sleeps and is the
fleet's time base; under test it is virtual. Its instants mean nothing to
another process or thread, so what leaves the trio run (a lease deadline for
the handoff writer's thread, a snapshot deadline for a worker process, the
``*_mono`` fields of log lines) is expressed on CLOCK_MONOTONIC
(``time.monotonic``), which every process on the host shares.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["to_monotonic"]


def to_monotonic(at: float, *, clock: Callable[[], float],
                 monotonic: Callable[[], float] = time.monotonic) -> float:
    """The instant ``at`` of ``clock`` (trio's) as the same instant on ``monotonic``, read now."""
    return at - clock() + monotonic()
