"""The engine set with discovery on: the file's engines plus the discovered ones (pure: no I/O, no clock).

A discovered engine joins as ``EngineEntry(source="discovery")`` with its own
model, else ``[fleet] model``. It is refused (left out, and said why) when its
name is a file engine's, or when another engine already has its url for its
role (the file's own rule: one engine listed twice would take a double share).
The file always wins; between two discovered engines, the first by name.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence

import msgspec

from narwhal.config import EngineSpec
from narwhal.fleet.registry import EngineEntry

__all__ = ["Refused", "union_entries"]


class Refused(msgspec.Struct, frozen=True, kw_only=True):
    """A discovered engine left out of the set, and why (``discovery_entry_invalid`` logs it)."""

    name: str
    problem: str
    in_file: bool = False  # its name is a file engine's: at startup, a startup error


def _no_problem(spec: EngineSpec) -> str | None:
    return None


def union_entries(file_entries: Sequence[EngineEntry], discovered: Mapping[str, EngineSpec], *,
                  default_model: str, problem: Callable[[EngineSpec], str | None] = _no_problem,
                  ) -> tuple[list[EngineEntry], list[Refused]]:
    """The file's entries (in file order), then the discovered ones that may join (by name); and the refused.

    ``problem(spec)``: a reason of the caller's to refuse a discovered engine (its url is this router's own).
    """
    entries = list(file_entries)
    names = {entry.name for entry in entries}
    by_address: dict[tuple[str, str, int, str], str] = {
        (*EngineSpec(name=entry.name, url=entry.url, role=entry.role).address, entry.role): entry.name
        for entry in entries}
    refused: list[Refused] = []
    for name in sorted(discovered):
        spec = discovered[name]
        if name in names:
            refused.append(Refused(name=name, in_file=True,
                                   problem=f"engine {json.dumps(name)} is also in the config file's [[engines]]: "
                                           "names are unique; the file's entry stands"))
            continue
        own = problem(spec)
        if own is not None:
            refused.append(Refused(name=name, problem=own))
            continue
        address = (*spec.address, spec.role)
        other = by_address.get(address)
        if other is not None:
            refused.append(Refused(name=name, problem=f"{spec.url} is also engine {json.dumps(other)}'s url, both "
                                                      f"{spec.role}: one engine listed twice would get a double "
                                                      "share of placement"))
            continue
        by_address[address] = name
        names.add(name)
        entries.append(EngineEntry(name=name, url=spec.url, role=spec.role,
                                   model=spec.model if spec.model is not None else default_model,
                                   source="discovery", kv_events=spec.kv_events,
                                   kv_events_replay=spec.kv_events_replay, kv_events_topic=spec.kv_events_topic))
    return entries, refused
