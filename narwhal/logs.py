"""Operator-facing logs: one JSON object per line on stderr, with a stable ``event``.

``log_event("stage_error", stage="health", ...)`` writes
``{"event": "stage_error", "ts": "...", "stage": "health", ...}``.
"""

from __future__ import annotations

import datetime
import logging
import sys
from typing import Any

import msgspec

__all__ = ["configure_logging", "log_event"]

_encoder = msgspec.json.Encoder()
_logger = logging.getLogger("narwhal.events")


def _now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def log_event(event: str, /, *, level: int = logging.INFO, **fields: Any) -> None:
    """Write one operator event as a JSON line."""
    if not _logger.isEnabledFor(level):
        return
    record = {"event": event, "ts": _now_iso(), "level": logging.getLevelName(level).lower()}
    record.update(fields)
    _logger.log(level, _encoder.encode(record).decode())


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


def configure_logging(level: str = "info") -> None:
    """Send every log record to stderr as JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JSONLineFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    _logger.setLevel(getattr(logging, level.upper(), logging.INFO))
