from collections.abc import Callable

def bind(book_type: type, parse_errors: tuple[type[BaseException], ...], /) -> None: ...

class Step:
    """A pumped stream's per-read path (pump._Stream.on_engine's usual read); called by the hub with the events."""

    def __init__(self, stream: object, upstream: object, conn: object, feed: Callable[[bytes], object],
                 body: list[bytes], sse: object, watch: object, client: object,
                 on_chunk: Callable[[bytes, float], bytes | None], clock: Callable[[], float] | None,
                 trio_now: Callable[[], float], offset: float | None, later: Callable[[object], None],
                 read_size: int, engine_fd: int, client_fd: int, chunked: bool) -> None: ...
    def __call__(self, events: int, /) -> None: ...
