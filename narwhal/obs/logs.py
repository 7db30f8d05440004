"""Operator-facing logs: one JSON object per line on stderr, with a stable ``event``.

``log_event("stage_error", stage="health", ...)`` writes
``{"event": "stage_error", "ts": "...", "stage": "health", ...}``.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

import msgspec
import trio

__all__ = ["configure_logging", "flush_logs", "log_event", "log_fields", "run_log_flusher", "set_log_fields"]

_encoder = msgspec.json.Encoder()
_logger = logging.getLogger("narwhal.events")
# Fields every line of this process carries (the worker's index with serving.workers > 1).
_process_fields: dict[str, Any] = {}
_LEVEL_NAMES = {level: logging.getLevelName(level).lower()
                for level in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL)}


# The same fields as JSON members after a comma (',"worker":1'), for lines written from a struct.
_process_members = ""


def set_log_fields(**fields: Any) -> None:
    """Add ``fields`` to every event this process logs from now on."""
    global _process_members
    _process_fields.update(fields)
    _process_members = "," + _encoder.encode(_process_fields).decode()[1:-1] if _process_fields else ""


# The formatted second of the last timestamp: most events of a busy router fall in the same second.
_ts_second = -1
_ts_prefix = ""


def _now_iso() -> str:
    """The current UTC time as ``2026-12-01T19:58:14.123Z`` (what ``datetime.isoformat`` gives, cheaper)."""
    global _ts_second, _ts_prefix
    now_ns = time.time_ns()
    second, rest = divmod(now_ns, 1_000_000_000)
    if second != _ts_second:
        _ts_prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        _ts_second = second
    return f"{_ts_prefix}.{rest // 1_000_000:03d}Z"


def log_event(event: str, /, *, level: int = logging.INFO, **fields: Any) -> None:
    """Write one operator event as a JSON line."""
    if not _logger.isEnabledFor(level):
        return
    name = _LEVEL_NAMES.get(level)
    if name is None:
        name = logging.getLevelName(level).lower()
    record = {"event": event, "ts": _now_iso(), "level": name}
    if _process_fields:
        record.update(_process_fields)
    record.update(fields)
    _emit(_encoder.encode(record).decode(), level)


def log_fields(event: str, fields: msgspec.Struct, /, *, level: int = logging.INFO) -> None:
    """``log_event`` with the fields of a struct, in its field order: the same line, at about a third of
    the cost (no keyword dicts; the struct's members are encoded in C and joined to the line's head).

    The struct's field names must not repeat the line's head (event, ts, level) or the process's fields.
    """
    if not _logger.isEnabledFor(level):
        return
    name = _LEVEL_NAMES.get(level)
    if name is None:
        name = logging.getLevelName(level).lower()
    members = _encoder.encode(fields).decode()
    _emit(f'{{"event":{_encoder.encode(event).decode()},"ts":"{_now_iso()}","level":"{name}"{_process_members}'
          f'{"," if len(members) > 2 else ""}{members[1:]}', level)


def _emit(line: str, level: int) -> None:
    handler = _batching
    if handler is not None and level < logging.WARNING and handler.sole_destination(level):
        # The usual case: configure_logging's handler is the only place lines go. Straight to its
        # batch, skipping the LogRecord and the handler chain (about half of this call's cost).
        handler.add_line(line)
    else:
        _logger.log(level, line)


class _JSONLineFormatter(logging.Formatter):
    """Events are already JSON; anything else (library warnings) is wrapped as one."""

    def format(self, record: logging.LogRecord) -> str:
        if record.name == _logger.name:
            return record.getMessage()
        fields = {
            "event": "library_log",
            "ts": _now_iso(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info and record.exc_info[0] is not None:
            fields["class"] = record.exc_info[0].__name__
        return _encoder.encode(fields).decode()


class _BatchingHandler(logging.StreamHandler):
    """Writes lines in batches: at most ``max_delay_s`` late, warnings and worse at once.

    One ``request`` line per request made two write(2) calls per request; the
    router's hot path does not need them. ``flush_if_due`` (called periodically
    by the router) and ``flush`` (at exit) make sure no line waits long.
    """

    def __init__(self, stream: TextIO, max_delay_s: float = 0.05) -> None:
        super().__init__(stream)
        self._pending: list[str] = []
        self._max_delay_s = max_delay_s
        self._last_flush = time.monotonic()
        # Called (from the logging thread) when a line is left waiting and none was before.
        self.on_pending: Callable[[], None] | None = None

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def emit(self, record: logging.LogRecord) -> None:
        was_empty = not self._pending
        try:
            self._pending.append(self.format(record))
        except Exception:
            self.handleError(record)
            return
        if record.levelno >= logging.WARNING or time.monotonic() - self._last_flush >= self._max_delay_s:
            self.flush()
        elif was_empty and self.on_pending is not None:
            self.on_pending()

    def sole_destination(self, level: int) -> bool:
        """True when a ``narwhal.events`` record at ``level`` would reach this handler and no other."""
        logger = _logger
        if logger.handlers or logger.filters or not logger.propagate:
            return False
        root = logger.parent
        if root is not logging.root or root.filters or self.filters or level < self.level:
            return False
        handlers = root.handlers
        return len(handlers) == 1 and handlers[0] is self

    def add_line(self, line: str) -> None:
        """Batch one already formatted line below WARNING, as ``emit`` would."""
        self.acquire()
        try:
            was_empty = not self._pending
            self._pending.append(line)
        finally:
            self.release()
        if time.monotonic() - self._last_flush >= self._max_delay_s:
            self.flush()
        elif was_empty and self.on_pending is not None:
            self.on_pending()

    def flush(self) -> None:
        self.acquire()
        try:
            self._last_flush = time.monotonic()
            if self._pending:
                lines, self._pending = self._pending, []
                self.stream.write("\n".join(lines) + "\n")
            self.stream.flush()
        finally:
            self.release()

    def flush_if_due(self) -> None:
        if self._pending and time.monotonic() - self._last_flush >= self._max_delay_s:
            self.flush()


_batching: _BatchingHandler | None = None


def configure_logging(level: str = "info") -> None:
    """Send every log record to stderr as JSON lines (batched; see ``flush_logs``)."""
    global _batching
    # Process, thread and multiprocessing names are never logged: skip their lookups per record.
    logging.logProcesses = logging.logThreads = logging.logMultiprocessing = False
    handler = _batching = _BatchingHandler(sys.stderr)
    handler.setFormatter(_JSONLineFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    _logger.setLevel(getattr(logging, level.upper(), logging.INFO))
    atexit.register(handler.flush)


def flush_logs(*, only_if_due: bool = False) -> None:
    """Write out batched log lines (all of them, or only once they are due)."""
    if _batching is not None:
        if only_if_due:
            _batching.flush_if_due()
        else:
            _batching.flush()


async def run_log_flusher(max_delay_s: float = 0.1) -> None:
    """Write batched lines out within about ``max_delay_s``; asleep while none waits.

    The router's task for the batching handler: it used to wake every 0.1 s,
    lines or not; now the first line left waiting wakes it (from any thread).
    """
    handler = _batching
    if handler is None:
        await trio.sleep_forever()
        return
    token = trio.lowlevel.current_trio_token()
    trio_thread = threading.get_ident()
    wake = trio.Event()

    def pending() -> None:
        if threading.get_ident() == trio_thread:
            wake.set()
            return
        try:
            token.run_sync_soon(wake.set)
        except trio.RunFinishedError:
            pass  # the router has stopped: atexit flushes

    handler.on_pending = pending
    try:
        while True:
            wake = trio.Event()
            if not handler.pending:
                await wake.wait()
            await trio.sleep(max_delay_s)
            handler.flush_if_due()
    finally:
        handler.on_pending = None
