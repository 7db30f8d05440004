"""Resume: decide whether a saved handoff may be applied at start, then apply it.

``narwhal-serve --resume`` applies the handoff only when its schema and its
engine set (names, URLs, roles, models) match the configuration. An engine that
moved to another model is another engine set; a handoff written before models
were named (no ``model`` in its entries and records) fits the same engines
whatever model they serve now, as the one model its router served. Anything else (no
file, an unreadable file, another schema, another engine set) means a fresh
start with a one-line reason, never a crash. Monitor-failure counters are not
in the handoff, so they always start fresh.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Protocol

import msgspec

from narwhal.config import Config, EngineSpec
from narwhal.fleet import EngineRecord, HoldKind
from narwhal.state.handoff import (
    EngineSetEntry,
    HandoffDocument,
    HandoffError,
    HandoffMissing,
    HandoffSchemaMismatch,
    HandoffUnreadable,
    read_document,
)

__all__ = ["ResumePlan", "apply_resume", "engine_set_difference", "operator_holds", "plan_document", "plan_resume"]

# What an operator put an engine into: a restart without --resume forgets it.
_OPERATOR_HOLDS = frozenset({HoldKind.OPERATOR_DRAIN, HoldKind.MAINTENANCE})


class ResumePlan(msgspec.Struct, frozen=True, kw_only=True):
    """The decision: apply ``document``, or start fresh for ``reason``."""

    path: str
    applied: bool
    document: HandoffDocument | None = None
    # One line, "handoff not applied: ...", when ``applied`` is False.
    reason: str | None = None

    def event_fields(self) -> dict[str, Any]:
        """Fields for the "handoff_applied" / "handoff_not_applied" log event."""
        if self.document is None or not self.applied:
            return {"path": self.path, "reason": self.reason}
        doc = self.document
        return {
            "path": self.path,
            "writer": doc.router_id,
            "writer_pid": doc.pid,
            "pass": doc.pass_number,
            "written_at": doc.written_at,
            "ejected": [record.name for record in doc.engines if record.ejected],
            "holds": {record.name: [hold.kind.value for hold in record.holds]
                      for record in doc.engines if record.holds},
            "lease_holder": doc.lease.holder,
            "lease_epoch": doc.lease.epoch,
        }


def _not_applied(path: str, why: str) -> ResumePlan:
    return ResumePlan(path=path, applied=False, reason=f"handoff not applied: {why}".replace("\n", " "))


def engine_set_difference(saved: Sequence[EngineSetEntry], configured: Sequence[EngineSpec],
                          default_model: str = "") -> str | None:
    """How the saved engine set differs from the configured one, or None when they match.

    For example "added d2, removed d1, changed p1"; a changed URL, role or model counts
    (``default_model``: the model of an engine spec that names none, ``[fleet] model``).
    A saved entry without a model (an older handoff) matches any model.
    """
    saved_by_name = {entry.name: entry for entry in saved}
    configured_by_name = {spec.name: spec for spec in configured}
    added = sorted(configured_by_name.keys() - saved_by_name.keys())
    removed = sorted(saved_by_name.keys() - configured_by_name.keys())

    def differs(name: str) -> bool:
        entry, spec = saved_by_name[name], configured_by_name[name]
        model = spec.model if spec.model is not None else default_model
        return ((entry.url.rstrip("/"), entry.role) != (spec.base_url, spec.role)
                or (entry.model != "" and entry.model != model))

    changed = sorted(name for name in saved_by_name.keys() & configured_by_name.keys() if differs(name))
    parts = [f"{label} {', '.join(names)}"
             for label, names in (("added", added), ("removed", removed), ("changed", changed)) if names]
    if len(saved_by_name) != len(saved):
        parts.append("repeated engine names")
    return ", ".join(parts) or None


def _records_problem(document: HandoffDocument) -> str | None:
    """Why the engine records disagree with the document's own engine set, or None."""
    entries = {entry.name: entry for entry in document.engine_set}
    seen: set[str] = set()
    for record in document.engines:
        if record.name in seen:
            return f"engine {record.name} is recorded twice"
        entry = entries.get(record.name)
        if entry is None or entry.role != record.role:
            return f"engine record {record.name} ({record.role}) is not in its engine set"
        if record.model and entry.model and record.model != entry.model:
            return f"engine record {record.name} (model {record.model!r}) is not in its engine set"
        seen.add(record.name)
    return None


def plan_resume(path: str | os.PathLike[str], config: Config,
                engines: Sequence[EngineSpec] | None = None) -> ResumePlan:
    """Read the handoff at ``path`` and decide whether it may be applied to ``config``'s fleet (``engines``:
    the engine set to compare with, as ``plan_document`` takes it)."""
    where = os.fspath(path)
    try:
        document = read_document(where)
    except HandoffMissing:
        return _not_applied(where, f"no handoff at {where}")
    except HandoffSchemaMismatch as exc:
        return _not_applied(where, str(exc))
    except HandoffUnreadable as exc:
        return _not_applied(where, f"unreadable: {exc}")
    return plan_document(document, config, where, engines)


def plan_document(document: HandoffDocument, config: Config, where: str,
                  engines: Sequence[EngineSpec] | None = None) -> ResumePlan:
    """Decide whether an already decoded handoff (from ``where``) may be applied to ``config``'s fleet.

    A warm standby uses this for every document it follows, as resume does for the file.
    ``engines``: the engine set to compare with (default ``config.engines``; with discovery, the
    file's engines plus those discovered).
    """
    engines = config.engines if engines is None else engines
    difference = engine_set_difference(document.engine_set, engines, config.fleet.model)
    if difference is not None:
        return _not_applied(where, f"engine set differs: {difference}")
    problem = _records_problem(document)
    if problem is not None:
        return _not_applied(where, f"unreadable: {problem}")
    # A record's own model (its engine set entry may name none) must be the configured one too.
    configured = {spec.name: config.model_of(spec) for spec in engines}
    moved = sorted(record.name for record in document.engines
                   if record.model and record.model != configured.get(record.name, record.model))
    if moved:
        return _not_applied(where, f"engine set differs: changed {', '.join(moved)}")
    return ResumePlan(path=where, applied=True, document=document)


def operator_holds(path: str | os.PathLike[str], config: Config) -> dict[str, list[str]]:
    """Configured engines the handoff at ``path`` holds drained or in maintenance, with those hold kinds.

    Empty when there is no readable handoff: a start without ``--resume`` has nothing to warn about then.
    """
    try:
        document = read_document(path)
    except HandoffError:
        return {}
    configured = {spec.name for spec in config.engines}
    held = {record.name: sorted(hold.kind.value for hold in record.holds if hold.kind in _OPERATOR_HOLDS)
            for record in document.engines if record.name in configured}
    for name in document.drained:
        if name in configured and HoldKind.OPERATOR_DRAIN.value not in held.get(name, []):
            held[name] = sorted([*held.get(name, []), HoldKind.OPERATOR_DRAIN.value])
    return {name: kinds for name, kinds in sorted(held.items()) if kinds}


class _Restorable(Protocol):
    def restore(self, records: Sequence[EngineRecord], now: float, wall_now: float) -> None: ...


def apply_resume(plan: ResumePlan, fleet: _Restorable, now: float, wall_now: float) -> None:
    """Restore the fleet (its writer, in the router) from an applicable plan; a plan not applied changes nothing.

    Holds keep their wall-clock deadlines, so one that passed while no router
    ran comes back already expired.
    """
    if not plan.applied or plan.document is None:
        return
    fleet.restore(plan.document.engines, now, wall_now)
