"""Reading a small file the router depends on (the config, the handoff, the fleet key): bounded, never blocking.

The file is opened without blocking (a FIFO at the path must not hang the
reader until a writer comes) and checked with fstat, so a FIFO, a device (a
symlink to /dev/zero) or a directory is refused rather than read, and so is a
file over the bound.
"""

from __future__ import annotations

import os
import stat

from narwhal.errors import NarwhalError

__all__ = ["FileRefused", "read_regular_file"]


class FileRefused(NarwhalError):
    """Not a regular file, or over its size bound; the message says which (without the path)."""


def read_regular_file(path: str | os.PathLike[str], max_bytes: int) -> bytes:
    """The bytes of the regular file at ``path``, at most ``max_bytes`` of them.

    Raises ``FileRefused`` for anything else, ``OSError`` when it cannot be opened or read.
    """
    fd = os.open(os.fspath(path), os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FileRefused(f"not a regular file ({_file_kind(info.st_mode)})")
        if info.st_size > max_bytes:
            raise FileRefused(f"{info.st_size} bytes, over the {max_bytes} byte bound")
        parts = []
        size = 0
        # Read to EOF but never past the bound: the file may grow while we read it.
        while chunk := os.read(fd, min(1 << 20, max_bytes + 1 - size)):
            parts.append(chunk)
            size += len(chunk)
            if size > max_bytes:
                raise FileRefused(f"grew over the {max_bytes} byte bound while read")
        return b"".join(parts)
    finally:
        os.close(fd)


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a plain file"
