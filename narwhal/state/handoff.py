"""The durable handoff: the control plane's state as one versioned JSON document.

The persistence stage writes a ``HandoffDocument`` on every monitor pass;
``narwhal-serve --resume`` and a warm standby read it back. ``write_atomic``
replaces the file so that a reader, a concurrent writer or a crash never sees
anything but one complete document.

Errors::

    HandoffError                 any problem reading a handoff
    ├── HandoffMissing           no file at the path
    ├── HandoffUnreadable        cannot be read, is not JSON, or does not fit the struct
    └── HandoffSchemaMismatch    a complete document of another schema version
"""

from __future__ import annotations

import errno
import os
import re
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import msgspec

from narwhal.errors import NarwhalError
from narwhal.files import FileRefused, read_regular_file
from narwhal.fleet import EngineRecord

__all__ = [
    "HANDOFF_SCHEMA",
    "ConsolidationRisk",
    "EngineSetEntry",
    "HandoffDocument",
    "HandoffError",
    "HandoffMissing",
    "HandoffSchemaMismatch",
    "HandoffUnreadable",
    "LeaseOwnership",
    "decode_document",
    "discard_prepared",
    "encode_document",
    "fsync_directory",
    "json_nesting_exceeds",
    "prepare_atomic",
    "read_document",
    "write_atomic",
]

# Bump only for a change an older reader would misread; adding a field with a
# default keeps the schema, since older documents still decode.
HANDOFF_SCHEMA = 1

ConsolidationRisk = Literal["none", "elevated", "critical"]


class HandoffError(NarwhalError):
    """A handoff could not be used; the message is fit to show an operator."""


class HandoffMissing(HandoffError):
    """There is no handoff file at the path."""


class HandoffUnreadable(HandoffError):
    """The file cannot be read or is not a complete handoff document."""


class HandoffSchemaMismatch(HandoffError):
    """The document is of another schema version than this router's."""

    def __init__(self, found: int, expected: int = HANDOFF_SCHEMA) -> None:
        super().__init__(f"schema {found} differs from {expected}")
        self.found = found
        self.expected = expected


class EngineSetEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One configured engine as the writer knew it; resume compares these to the config."""

    name: str
    url: str
    role: str
    # The model the engine served; "" in a handoff written before models were named (it fits any model).
    model: str = ""


class LeaseOwnership(msgspec.Struct, frozen=True, kw_only=True):
    """Who held the serving lease when the document was written; "none" without a lease."""

    holder: str = "none"
    epoch: int = 0


class HandoffDocument(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a restarted or standby router needs to carry the fleet's state over.

    Engine records carry roles, ejections, every hold (drains, maintenance,
    quarantine, drift, inference verification) with wall-clock deadlines, and
    counters. The monitor-failure streak is deliberately absent: a restarted
    router starts with fresh monitor-failure counters.
    """

    schema: int
    router_id: str
    pid: int
    pass_number: int
    # Wall-clock unix seconds.
    written_at: float
    engine_set: list[EngineSetEntry]
    engines: list[EngineRecord]
    # Role -> risk that the role's serving consolidates onto too few engines (its worst model's).
    consolidation_risk: dict[str, ConsolidationRisk] = {}
    lease: LeaseOwnership = LeaseOwnership()
    # Engines whose operator drain has settled (no requests left in flight).
    drained: list[str] = []


# A real handoff is a few KiB per engine; these bound what --resume will read and parse.
MAX_DOCUMENT_BYTES = 64 * 1024 * 1024
# The document itself nests about 6 deep (document, engines, record, holds, hold).
MAX_DOCUMENT_DEPTH = 16

# A JSON string once its escapes are gone: its brackets are text, not structure.
_JSON_STRING = re.compile(rb'"[^"]*"')
# Keep only brackets, as one kind: depth does not depend on which (a mismatch is the decoder's to find).
_OPEN_CLOSE = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))


def json_nesting_exceeds(data: bytes, max_depth: int) -> bool:
    """True when the JSON text ``data`` nests arrays/objects deeper than ``max_depth``.

    Without recursion and in C-speed passes: strings are blanked, everything but
    brackets dropped, then innermost pairs removed once per level; anything left
    after ``max_depth`` rounds is deeper (or unbalanced, which no decoder accepts).
    """
    # Escaped backslashes first, so that what remains of \" is an escaped quote.
    unescaped = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = _JSON_STRING.sub(b"", unescaped).translate(_OPEN_CLOSE, _NOT_BRACKETS)
    for _ in range(max_depth):
        if not brackets:
            return False
        # One pass removes exactly the innermost level: replace() does not rescan what it joined.
        shorter = brackets.replace(b"[]", b"")
        if len(shorter) == len(brackets):
            return False  # unbalanced: the decoder will say it is not JSON
        brackets = shorter
    return bool(brackets)


class _SchemaOnly(msgspec.Struct):
    schema: int


_encoder = msgspec.json.Encoder()
_schema_decoder = msgspec.json.Decoder(_SchemaOnly)
_document_decoder = msgspec.json.Decoder(HandoffDocument)


def encode_document(document: HandoffDocument) -> bytes:
    """The document as JSON bytes, ending in a newline."""
    return _encoder.encode(document) + b"\n"


def decode_document(data: bytes) -> HandoffDocument:
    """Parse a document, reading its schema first; raise a ``HandoffError`` subclass if unusable.

    Nesting is checked before decoding: a document nested deeper than any
    handoff (``MAX_DOCUMENT_DEPTH``) is unreadable, never a RecursionError.
    """
    if not data.strip():
        raise HandoffUnreadable("empty (a write cut short before its first byte, or not a handoff)")
    if json_nesting_exceeds(data, MAX_DOCUMENT_DEPTH):
        raise HandoffUnreadable(f"nested deeper than {MAX_DOCUMENT_DEPTH} levels")
    try:
        schema = _schema_decoder.decode(data).schema
    except msgspec.ValidationError as exc:
        raise HandoffUnreadable(f"no schema number: {exc}") from None
    except msgspec.DecodeError as exc:
        # msgspec says "Input data was truncated" for a document that stops early.
        detail = "cut short (it ends inside the JSON)" if "truncated" in str(exc) else str(exc)
        raise HandoffUnreadable(f"not JSON: {detail}") from None
    if schema != HANDOFF_SCHEMA:
        raise HandoffSchemaMismatch(schema)
    try:
        return _document_decoder.decode(data)
    except msgspec.DecodeError as exc:  # ValidationError is a subclass
        raise HandoffUnreadable(f"not a handoff document: {exc}") from None


def read_document(path: str | os.PathLike[str], *, max_bytes: int = MAX_DOCUMENT_BYTES) -> HandoffDocument:
    """Read and decode the handoff at ``path``: a regular file of at most ``max_bytes``.

    ``narwhal.files.read_regular_file`` reads it: a FIFO, a device or a
    directory is unreadable rather than read, and startup never hangs on it.
    """
    where = os.fspath(path)
    try:
        data = read_regular_file(where, max_bytes)
    except FileNotFoundError:
        raise HandoffMissing(f"no handoff at {where}") from None
    except FileRefused as exc:
        raise HandoffUnreadable(f"cannot read {where}: {exc}") from None
    except (OSError, ValueError) as exc:  # ValueError: a path the OS cannot take (NUL byte)
        raise HandoffUnreadable(f"cannot read {where}: {getattr(exc, 'strerror', None) or exc}") from None
    return decode_document(data)


def write_atomic(path: str | os.PathLike[str], data: bytes, *,
                 proceed: Callable[[], bool] | None = None, sync_directory: bool = True, mode: int = 0o644) -> bool:
    """Replace ``path`` with ``data`` so that readers only ever see a complete file.

    A temporary file unique to this process and call (pid and a random suffix)
    is created next to the destination, written in full, fsynced and renamed
    over the destination; then the directory is fsynced so the rename itself
    survives a power loss. If any step up to the rename fails, the temporary
    file is removed, the destination is untouched, and the error propagates.
    A failed directory fsync also propagates, though the rename (the commit
    point) has then already put the new complete document in place.

    ``proceed``, when given, is asked just before the rename; if it says no
    (the writer was fenced meanwhile) nothing is replaced and False is returned.

    ``sync_directory=False`` leaves out the directory fsync: after a power loss
    the path then holds this document or the one it replaced (each complete, its
    data fsynced before its rename). The persistence stage does so when the
    document repeats the state of the last one whose rename was made durable.

    ``mode``: the new file's permissions (less the umask); the keys file is 0600.
    """
    destination = Path(path)
    temporary = prepare_atomic(destination, data, mode=mode)
    renamed = False
    try:
        if proceed is not None and not proceed():
            return False
        os.replace(temporary, destination)
        renamed = True
    finally:
        if not renamed:
            discard_prepared(temporary)
    if sync_directory:
        fsync_directory(destination.parent)
    return True


def prepare_atomic(destination: Path, data: bytes, *, mode: int = 0o644) -> Path:
    """A temporary file beside ``destination`` holding ``data``, written in full and fsynced: the rename is the
    caller's (``write_atomic``, or a lease change that renames under its lock); removed if the write fails."""
    # Same directory as the destination: os.replace is atomic only within one filesystem.
    temporary = destination.parent / f".{destination.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        discard_prepared(temporary)
        raise
    return temporary


def discard_prepared(temporary: Path) -> None:
    """Remove a prepared file that was not renamed into place."""
    try:
        os.unlink(temporary)
    except OSError:
        pass  # the error that led here is the one worth raising


def fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (a no-op where the filesystem cannot fsync a directory)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:
        # As PostgreSQL's fsync_fname: some filesystems cannot fsync a directory
        # at all; that is no reason to call every write a failure.
        if exc.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(fd)
