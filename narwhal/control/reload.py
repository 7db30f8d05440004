"""A config reload's outcome (SIGHUP, ``POST /admin/reload``) and the split of a load error into key and problem."""

from __future__ import annotations

import re
from typing import Literal

import msgspec

from narwhal.config_diff import ConfigDiff

__all__ = ["ReloadError", "ReloadOutcome", "split_config_error"]

# A ConfigError reads "<file>: <key>: <problem>" when a key is at fault ("serving.listen",
# "engines[2].url", 'engine "d2".url', "lease"); "<file>: <problem>" when the file as a whole
# is ("not valid TOML: ...").
_KEY = re.compile(r'(engine "(?:[^"\\]|\\.)*"|[A-Za-z_][A-Za-z0-9_]*(\[\d+\])?)(\.[A-Za-z_][A-Za-z0-9_]*(\[\d+\])?)*')


class ReloadError(msgspec.Struct, frozen=True, kw_only=True):
    """Why a reload changed nothing: the file, the key at fault (None: the whole file) and the problem."""

    file: str
    key: str | None
    problem: str


class ReloadOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """What one reload did: the changes applied and asked for, or the error that stopped it."""

    file: str
    reloaded: bool
    changes: ConfigDiff | None = None
    error: ReloadError | None = None
    # The TLS files re-read (SIGHUP's older job): skipped when no TLS is configured or the config failed.
    tls: Literal["reloaded", "failed", "skipped"] = "skipped"
    # Why the TLS files failed (the key and the problem, as ``tls_reload_failed`` says); None otherwise.
    tls_error: str | None = None


def split_config_error(message: str, file: str) -> ReloadError:
    """``ConfigError`` text as file, key and problem (the key None when no single key is at fault)."""
    text = message.removeprefix(f"{file}: ")
    head, sep, rest = text.partition(": ")
    if sep and _KEY.fullmatch(head):
        return ReloadError(file=file, key=head, problem=rest)
    return ReloadError(file=file, key=None, problem=text)
