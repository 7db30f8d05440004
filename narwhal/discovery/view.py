"""The discovered engines as a pure function of the keys under the prefix: no I/O, no clock.

``EngineView`` holds {name: EngineSpec} and the revision it reflects. A full
list replaces it (``reset``), watch events move it on (``apply``); both say
what changed. The view depends only on what the store holds, so every router
watching the same prefix (a standby too) sees the same engines: a key whose
value is invalid registers no engine, whatever that key held before.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

import msgspec

from narwhal.config import EngineSpec
from narwhal.discovery.entry import EntryProblem, engine_name, parse_entry

__all__ = ["EngineView", "KeyEvent", "StoredKey", "ViewChange", "diff_views"]


class StoredKey(msgspec.Struct, frozen=True):
    """One key of a list: its text, value and the revision that last wrote it."""

    key: str
    value: bytes
    mod_revision: int


class KeyEvent(msgspec.Struct, frozen=True):
    """One watch event: a put of ``value`` or a delete, at ``mod_revision``."""

    kind: Literal["put", "delete"]
    key: str
    mod_revision: int
    value: bytes = b""


class ViewChange(msgspec.Struct, frozen=True, kw_only=True):
    """Names added, removed and changed (url, role or model), sorted; and the invalid keys newly seen.

    ``previous`` holds what the removed and changed names were, for ``engine_vanished`` lines.
    """

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()
    problems: tuple[EntryProblem, ...] = ()
    previous: dict[str, EngineSpec] = {}

    @property
    def engines_changed(self) -> bool:
        return bool(self.added or self.removed or self.changed)

    def __bool__(self) -> bool:
        return self.engines_changed or bool(self.problems)


def diff_views(old: Mapping[str, EngineSpec], new: Mapping[str, EngineSpec]) -> ViewChange:
    """What differs between two views, by name."""
    removed = tuple(sorted(old.keys() - new.keys()))
    changed = tuple(sorted(name for name in old.keys() & new.keys() if old[name] != new[name]))
    return ViewChange(added=tuple(sorted(new.keys() - old.keys())), removed=removed, changed=changed,
                      previous={name: old[name] for name in (*removed, *changed)})


class EngineView:
    """The engines registered under ``prefix``, as of ``revision``."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.revision = 0
        self._engines: dict[str, EngineSpec] = {}
        # Invalid keys already reported, with the revision of the value reported: once per value, not per list.
        self._reported: dict[str, int] = {}

    @property
    def engines(self) -> dict[str, EngineSpec]:
        """A copy: callers keep it as the view of the moment."""
        return dict(self._engines)

    def _parse(self, key: str, value: bytes, mod_revision: int, problems: list[EntryProblem]) -> EngineSpec | None:
        parsed = parse_entry(key, value, self.prefix)
        if isinstance(parsed, EngineSpec):
            self._reported.pop(key, None)
            return parsed
        if self._reported.get(key) != mod_revision:
            self._reported[key] = mod_revision
            problems.append(parsed)
        return None

    def reset(self, keys: Iterable[StoredKey], revision: int) -> ViewChange:
        """Replace the view with a full list taken at ``revision``."""
        problems: list[EntryProblem] = []
        engines: dict[str, EngineSpec] = {}
        seen: set[str] = set()
        for stored in keys:
            seen.add(stored.key)
            spec = self._parse(stored.key, stored.value, stored.mod_revision, problems)
            if spec is not None:
                engines[spec.name] = spec
        for key in self._reported.keys() - seen:
            del self._reported[key]
        change = diff_views(self._engines, engines)
        self._engines = engines
        self.revision = revision
        return msgspec.structs.replace(change, problems=tuple(problems))

    def apply(self, events: Sequence[KeyEvent]) -> ViewChange:
        """Apply watch events in order; those at or below ``revision`` (seen already) are skipped."""
        base = self.revision
        before = dict(self._engines)
        problems: list[EntryProblem] = []
        for event in events:
            if event.mod_revision <= base:
                continue
            self.revision = max(self.revision, event.mod_revision)
            name = engine_name(event.key, self.prefix)
            if event.kind == "delete":
                self._reported.pop(event.key, None)
                if isinstance(name, str):
                    self._engines.pop(name, None)
                continue
            spec = self._parse(event.key, event.value, event.mod_revision, problems)
            if spec is not None:
                self._engines[spec.name] = spec
            elif isinstance(name, str):
                self._engines.pop(name, None)  # an invalid value registers nothing, whatever was there
        change = diff_views(before, self._engines)
        return msgspec.structs.replace(change, problems=tuple(problems))
