from collections.abc import Callable, Sized

def bind(book_type: type, parse_errors: tuple[type[BaseException], ...], /) -> None: ...
def poll_round(epoll_fd: int, timeout: float, batch: int, watches: dict[int, object], other_fd: int,
               saw_closed: Callable[[object, int], None], reschedule: Callable[[object], None], /) -> tuple[bool, int]:
    """readiness.py's poll and dispatch of one round: (other_fd was ready, events taken)."""
def pump_rounds(hub: object, epoll_fd: int, trio_fd: int, watches: dict[int, object],
                saw_closed: Callable[[object, int], None], reschedule: Callable[[object], None], runq: Sized,
                end: float, short: bool, batch: int, /) -> tuple[int, bool]:
    """Pump rounds until trio's set is ready (1), a task is runnable (2) or time.monotonic() reaches end (0)."""

class Step:
    """A pumped stream's per-read path (pump._Stream.on_engine's usual read); called by the hub with the events."""

    def __init__(self, stream: object, upstream: object, conn: object, feed: Callable[[bytes], object],
                 body: list[bytes], sse: object, watch: object, client: object,
                 on_chunk: Callable[[bytes, float], bytes | None], clock: Callable[[], float] | None,
                 trio_now: Callable[[], float], offset: float | None, later: Callable[[object], None],
                 read_size: int, engine_fd: int, client_fd: int, chunked: bool) -> None: ...
    def __call__(self, events: int, /) -> None: ...

def whole_data_events(data: bytes, /) -> int:
    """The events in ``data`` when it is whole one-line `data:` events, else 0."""
