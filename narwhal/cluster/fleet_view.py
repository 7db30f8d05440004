"""The controller's published fleet as a pure function of the keys under ``<key>/fleet/``: no I/O, no clock.

``FleetRecordsView`` has the shape the etcd watcher drives (``reset`` from a
list, ``apply`` from watch events, ``revision``, ``engines``), so a replica
follows the fleet with the same list-then-watch code discovery uses. A value
that does not decode is no engine (counted in ``invalid``), as discovery treats
an invalid registration.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from narwhal.cluster.records import FleetEntry
from narwhal.config import EngineSpec
from narwhal.discovery.view import KeyEvent, StoredKey, ViewChange

__all__ = ["FleetRecordsView"]

_decode = msgspec.json.Decoder(FleetEntry).decode


class FleetRecordsView:
    """The fleet entries under ``prefix``, by engine name, as of ``revision``."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.revision = 0
        self.entries: dict[str, FleetEntry] = {}
        # The revision each entry was last written at (the lag of a router is measured against these).
        self.mod_revisions: dict[str, int] = {}
        self.invalid = 0

    @property
    def engines(self) -> dict[str, EngineSpec]:
        """What the entries name, as addresses (the watcher's report carries these)."""
        return {name: entry.entry.spec() for name, entry in self.entries.items()}

    def _decode(self, key: str, value: bytes) -> FleetEntry | None:
        name = key[len(self.prefix):]
        try:
            entry = _decode(value)
        except (msgspec.DecodeError, ValueError):
            self.invalid += 1
            return None
        if not name or entry.entry.name != name or entry.record.name != name:
            self.invalid += 1
            return None
        try:
            entry.entry.spec()  # an address the pools could not use is no engine
        except ValueError:
            self.invalid += 1
            return None
        return entry

    def reset(self, keys: Iterable[StoredKey], revision: int) -> ViewChange:
        """Replace the view with a full list taken at ``revision``."""
        before = self.entries
        entries: dict[str, FleetEntry] = {}
        mods: dict[str, int] = {}
        for stored in keys:
            entry = self._decode(stored.key, stored.value)
            if entry is not None:
                entries[entry.entry.name] = entry
                mods[entry.entry.name] = stored.mod_revision
        self.entries, self.mod_revisions, self.revision = entries, mods, revision
        return _diff(before, entries)

    def apply(self, events: Sequence[KeyEvent]) -> ViewChange:
        """Apply watch events in order; those at or below ``revision`` (seen already) are skipped."""
        base = self.revision
        before = dict(self.entries)
        for event in events:
            if event.mod_revision <= base or not event.key.startswith(self.prefix):
                continue
            self.revision = max(self.revision, event.mod_revision)
            name = event.key[len(self.prefix):]
            entry = self._decode(event.key, event.value) if event.kind == "put" else None
            if entry is None:
                self.entries.pop(name, None)
                self.mod_revisions.pop(name, None)
            else:
                self.entries[name] = entry
                self.mod_revisions[name] = event.mod_revision
        return _diff(before, self.entries)


def _diff(old: dict[str, FleetEntry], new: dict[str, FleetEntry]) -> ViewChange:
    removed = tuple(sorted(old.keys() - new.keys()))
    changed = tuple(sorted(name for name in old.keys() & new.keys() if old[name] != new[name]))
    return ViewChange(added=tuple(sorted(new.keys() - old.keys())), removed=removed, changed=changed,
                      previous={name: old[name].entry.spec() for name in (*removed, *changed)})
