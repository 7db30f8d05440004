"""The bench's client keys: a keys file of the tenants a run needs, and the header each tenant sends.

The keys are made fresh for each run (``narwhal.auth.keys.new_key``) and live only in the
bench's memory and its scratch directory's keys file (as sha256, as the router wants them).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from narwhal.auth.keys import Priority, hash_key, new_key

__all__ = ["BENCH_TENANT", "auth_sections", "write_keys_file"]

# bench --auth: the one tenant (normal priority, no limits) every request is sent as.
BENCH_TENANT = "bench"


def write_keys_file(path: Path, tenants: Sequence[tuple[str, Priority]]) -> dict[str, str]:
    """Write ``[[keys]]`` for each (name, priority), no limits, mode 0600; returns each name's new key."""
    keys = {name: new_key() for name, _ in tenants}
    lines: list[str] = []
    for name, priority in tenants:
        lines += ["[[keys]]", f'name = "{name}"', f'sha256 = "{hash_key(keys[name])}"',
                  f'priority = "{priority}"', ""]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write("\n".join(lines))
    return keys


def auth_sections(keys_file: Path, reserve_high: float = 0.0) -> dict[str, dict[str, object]]:
    """The router's ``[auth]`` section for ``keys_file`` (an absolute path: the config is elsewhere)."""
    section: dict[str, object] = {"keys_file": str(keys_file.resolve())}
    if reserve_high:
        section["reserve_high"] = reserve_high
    return {"auth": section}
