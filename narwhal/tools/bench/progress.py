"""The live progress line: requests done, rate, tokens/s, errors.

On a terminal it rewrites one line (``\\r``) twice a second; otherwise (CI, a
pipe) it prints a plain line every few seconds, so logs stay readable.
"""

from __future__ import annotations

import sys
from typing import TextIO

import trio

from narwhal.tools.bench.load import LoadState

__all__ = ["progress_line", "show_progress"]


def progress_line(state: LoadState, *, label: str, elapsed_s: float, total: int | None) -> str:
    """One line describing ``state``; ``total`` None when the load is bounded by time only."""
    rate = state.done / elapsed_s if elapsed_s > 0 else 0.0
    tokens_per_s = state.tokens / elapsed_s if elapsed_s > 0 else 0.0
    done = f"{state.done}/{total}" if total is not None else str(state.done)
    errors = f"errors {state.errors}"
    if state.errors_by_kind:
        errors += " (" + ", ".join(f"{k} {v}" for k, v in sorted(state.errors_by_kind.items())) + ")"
    return f"[{label}] {elapsed_s:5.1f} s  done {done}  {rate:7.1f} req/s  {tokens_per_s:8.0f} tok/s  {errors}"


async def show_progress(state: LoadState, *, label: str, total: int | None, stream: TextIO | None = None,
                        tty_interval_s: float = 0.5, plain_interval_s: float = 5.0) -> None:
    """Write the progress line until cancelled; the caller cancels it when the load ends."""
    out = stream if stream is not None else sys.stderr
    tty = out.isatty()
    interval = tty_interval_s if tty else plain_interval_s
    started = trio.current_time()
    next_at = started + interval
    try:
        while True:
            await trio.sleep_until(next_at)
            next_at += interval
            line = progress_line(state, label=label, elapsed_s=trio.current_time() - started, total=total)
            if tty:
                out.write("\r\x1b[2K" + line)
            else:
                out.write(line + "\n")
            out.flush()
    finally:
        if tty:
            out.write("\r\x1b[2K")
            out.flush()
