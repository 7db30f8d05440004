"""``narwhal keys add|list --file keys.toml``: make a client key, and show the keys file without any key.

``add`` writes a new ``[[keys]]`` entry with the sha256 of a new key (the file is created 0600 when absent,
written whole and atomically, every other entry kept as written) and prints the key once on stdout. ``list``
shows each entry's tenant, priority, models, limits and the first 12 hex digits of its sha256. A bad keys file,
a duplicate name or a bad value exits 2 with one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from pathlib import Path

from narwhal.auth.keys import (
    MAX_KEYS_FILE_BYTES,
    PRIORITIES,
    KeyEntry,
    KeysFile,
    hash_key,
    new_key,
    parse_keys_file,
    read_keys_file,
)
from narwhal.config import ConfigError
from narwhal.errors import NarwhalError
from narwhal.files import FileRefused, read_regular_file

__all__ = ["add_parser", "format_keys", "render_entry", "run_keys"]

_PROG = "narwhal keys"
_NEW_FILE_MODE = 0o600


class _KeysError(NarwhalError):
    """Why a keys command failed, as the one line to print."""


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number > 0, got {value!r}") from None
    if number <= 0:
        raise argparse.ArgumentTypeError(f"expected a whole number > 0, got {value!r}")
    return number


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``keys`` and its actions on the top-level CLI; sets ``run`` for dispatch."""
    keys = subparsers.add_parser(
        "keys", help="make client keys and list the keys file ([auth] keys_file)",
        description="Edit and show the client keys file: each key's tenant, models, priority and limits.")
    actions = keys.add_subparsers(dest="action", required=True, metavar="ACTION")
    add = actions.add_parser("add", help="add a tenant with a new key, printed once",
                             description="Add a [[keys]] entry with a new key; the key is printed once and only "
                                         "its sha256 is stored.")
    add.add_argument("--file", required=True, type=Path, metavar="FILE",
                     help="the keys file (created, mode 0600, when absent)")
    add.add_argument("name", metavar="NAME", help="the tenant, as logs and metrics name it ([A-Za-z0-9._-], 1-64)")
    add.add_argument("--models", nargs="+", metavar="M", help="the models it may use (default every model)")
    add.add_argument("--priority", choices=PRIORITIES, default="normal", help="its priority class (default normal)")
    add.add_argument("--rpm", type=_positive_int, metavar="N", help="requests per minute (default no limit)")
    add.add_argument("--tpm", type=_positive_int, metavar="N",
                     help="prompt plus completion tokens per minute (default no limit)")
    add.add_argument("--max-concurrent", type=_positive_int, metavar="N",
                     help="requests in flight at once (default no limit)")
    listing = actions.add_parser("list", help="show the entries (never a key)",
                                 description="Show every entry of the keys file; keys are never shown.")
    listing.add_argument("--file", required=True, type=Path, metavar="FILE", help="the keys file")
    keys.set_defaults(run=run_keys)


def run_keys(args: argparse.Namespace) -> int:
    """Run ``keys add`` or ``keys list``; 0, or 2 with one line on stderr."""
    try:
        if args.action == "add":
            _add(args)
        else:
            sys.stdout.write(format_keys(read_keys_file(args.file)))
    except (_KeysError, ConfigError) as exc:
        print(f"{_PROG}: {exc}", file=sys.stderr)
        return 2
    return 0


def _add(args: argparse.Namespace) -> None:
    path: Path = args.file
    exists = os.path.lexists(path)
    current = read_keys_file(path) if exists else KeysFile()
    try:
        # Read again for its text (comments kept); read_keys_file has just checked it.
        old = read_regular_file(path, MAX_KEYS_FILE_BYTES) if exists else b""
    except (OSError, FileRefused) as exc:
        raise _KeysError(f"{path}: cannot read keys file: {getattr(exc, 'strerror', None) or exc}") from None
    if any(entry.name == args.name for entry in current.keys):
        raise _KeysError(f"{path}: a key named {args.name!r} already exists")
    key = new_key()
    try:
        entry = KeyEntry(name=args.name, sha256=hash_key(key), models=args.models, priority=args.priority,
                         requests_per_minute=args.rpm, tokens_per_minute=args.tpm,
                         max_concurrent=args.max_concurrent)
    except ValueError as exc:
        raise _KeysError(str(exc)) from None
    data = _with_entry(old, current, entry)
    mode = stat.S_IMODE(os.stat(path).st_mode) if exists else _NEW_FILE_MODE
    from narwhal.state.handoff import write_atomic

    try:
        write_atomic(path, data, mode=mode)
    except OSError as exc:
        raise _KeysError(f"{path}: cannot write: {exc.strerror or exc}") from None
    print(key)
    print(f"{_PROG}: the key for {args.name!r} is shown once, here; {path} stores only its sha256",
          file=sys.stderr)


def _with_entry(old: bytes, current: KeysFile, entry: KeyEntry) -> bytes:
    """The file with ``entry`` appended: the old text as it is (comments too) when that parses back, else rewritten."""
    block = render_entry(entry).encode()
    if old.strip():
        appended = old.rstrip(b"\n") + b"\n\n" + block
        try:
            if parse_keys_file(appended).keys == [*current.keys, entry]:
                return appended
        except ConfigError:
            pass  # e.g. `keys = [...]` written inline: a [[keys]] table after it is not TOML
    return b"\n".join(render_entry(e).encode() for e in [*current.keys, entry])


def _toml_string(text: str) -> str:
    # A JSON string is a TOML basic string, except that TOML wants DEL escaped too.
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def render_entry(entry: KeyEntry) -> str:
    """One ``[[keys]]`` table, its keys in the struct's order, unset ones left out."""
    lines = ["[[keys]]", f"name = {_toml_string(entry.name)}", f"sha256 = {_toml_string(entry.sha256)}"]
    if entry.models is not None:
        lines.append(f"models = [{', '.join(_toml_string(m) for m in entry.models)}]")
    lines.append(f"priority = {_toml_string(entry.priority)}")
    for field in ("requests_per_minute", "tokens_per_minute", "max_concurrent"):
        value = getattr(entry, field)
        if value is not None:
            lines.append(f"{field} = {value}")
    return "\n".join(lines) + "\n"


def format_keys(keys: KeysFile) -> str:
    """The entries as a table: never a key, only the first 12 hex digits of each sha256."""
    header = ("NAME", "PRIORITY", "MODELS", "RPM", "TPM", "MAX CONCURRENT", "SHA256")

    def limit(value: int | None) -> str:
        return "-" if value is None else str(value)

    rows = [(e.name, e.priority, "all" if e.models is None else ",".join(e.models), limit(e.requests_per_minute),
             limit(e.tokens_per_minute), limit(e.max_concurrent), e.sha256[:12]) for e in keys.keys]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
             for row in (header, *rows)]
    return "\n".join(lines) + "\n"
