"""What a config reload changes: the pure diff of two ``Config``s (no I/O).

Engines are matched by name, as the engine registry matches them
(``narwhal.fleet.registry.diff_entries``). An engine whose ``url``, ``role`` or
``model`` changed is a removal plus an addition (its evidence belonged to another
process or another role); it is listed under ``changed`` and in both
``removed`` and ``added``.
(Were ``engines`` ever taken out of ``RELOADABLE_KEYS``, a differing set
would also put ``engines`` among ``keys_needing_restart``.)
Every other key is compared as its dotted TOML path (``recovery.eject_after``)
and sorted into ``keys_changed`` (applied by a running router) or
``keys_needing_restart`` (logged; the router keeps its running value).
``RELOADABLE_KEYS`` is the one list of what a running router applies; the
table in docs/configuration.md follows it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from narwhal.config import ENGINE_TIMEOUT_KEYS, Config
from narwhal.fleet.registry import diff_entries, entries_from_config

__all__ = ["RELOADABLE_KEYS", "ConfigDiff", "diff_configs", "flat_keys", "is_reloadable", "merge_reloadable"]

# Whole sections (every key in them) or single keys that a running router applies on reload.
# Everything else (serving.listen, serving.workers, the lease, the handoff path, the TLS file
# names, the pools' sizes and memory bounds, ...) needs a restart: a reload logs it and keeps the running value.
RELOADABLE_KEYS: frozenset[str] = frozenset({
    "engines",
    "admin.token",
    "admin.allow_unauthenticated",
    "fleet.model",
    "fleet.generation",
    # Per-model keys; a model added or removed comes with its engines (engines is reloadable too).
    "fleet.models",
    "fleet.attestation_key",
    "fleet.attestation_key_file",
    "recovery",
    "controller.monitor_interval_s",
    "controller.stage_timeout_s",
    "controller.monitor_failure_limit",
    "controller.drift_factor",
    "controller.drift_intervals",
    "telemetry.interval_s",
    # The engine timeouts: calls and streams started after the reload use the new values.
    *(f"engine.{key}" for key in ENGINE_TIMEOUT_KEYS),
    # Placement, in every worker through its snapshot (narwhal.serving.placement.RequestPlacement.configure).
    "placement",
    # Read on every admin request, as admin.token is.
    "admin.allowed_hosts",
    # Discovered engines join [[engines]]: the watch restarts on a changed section, the union is applied again.
    "discovery",
    # Client keys: the keys file is read again (a bad one changes nothing), the reserve applies at once.
    "auth",
    "serving.max_queue",
    # Traces: the exporters take the new endpoint, headers and service name; new requests the new ratio.
    "tracing",
})


def is_reloadable(key: str) -> bool:
    """True when a running router applies a change of ``key`` (a dotted path) on reload."""
    section = key.split(".", 1)[0]
    return key in RELOADABLE_KEYS or section in RELOADABLE_KEYS


class ConfigDiff(msgspec.Struct, frozen=True, kw_only=True):
    """What changed between the running config and the file just read."""

    engines_added: list[str] = []
    engines_removed: list[str] = []
    # Engines whose url or role changed: each is in both lists above too.
    engines_changed: list[str] = []
    keys_changed: list[str] = []
    keys_needing_restart: list[str] = []

    @property
    def empty(self) -> bool:
        """True when the reload changes nothing (and asks for no restart)."""
        return not (self.engines_added or self.engines_removed or self.keys_changed
                    or self.keys_needing_restart)


def _flatten(section: str, value: Any) -> dict[str, Any]:
    if isinstance(value, msgspec.Struct):
        out: dict[str, Any] = {}
        for field in value.__struct_fields__:
            out.update(_flatten(f"{section}.{field}", getattr(value, field)))
        return out
    return {section: value}


def flat_keys(config: Config) -> dict[str, Any]:
    """Every key but ``engines`` as its dotted TOML path (``recovery.eject_after``) and value."""
    keys: dict[str, Any] = {}
    for field in config.__struct_fields__:
        if field != "engines":
            keys.update(_flatten(field, getattr(config, field)))
    return keys


def diff_configs(old: Config, new: Config) -> ConfigDiff:
    """The changes from ``old`` (running) to ``new`` (just read); engines in ``new``'s order."""
    # An engine that serves another model (its own key, or [fleet] model for one that names none) is changed.
    engines = diff_entries(entries_from_config(old), entries_from_config(new))
    added, removed = engines.added, engines.removed
    old_keys, new_keys = flat_keys(old), flat_keys(new)
    differing = sorted(key for key in old_keys.keys() | new_keys.keys() if old_keys.get(key) != new_keys.get(key))
    if (added or removed) and not is_reloadable("engines"):
        differing.append("engines")
    return ConfigDiff(engines_added=added, engines_removed=removed, engines_changed=engines.changed,
                      keys_changed=[key for key in differing if is_reloadable(key)],
                      keys_needing_restart=[key for key in differing if not is_reloadable(key)])


def merge_reloadable(running: Config, new: Config) -> Config:
    """``new``'s reloadable keys and engines over ``running``'s values for every other key."""
    sections: dict[str, Any] = {"engines": list((new if "engines" in RELOADABLE_KEYS else running).engines)}
    for field in running.__struct_fields__:
        if field == "engines":
            continue
        if field in RELOADABLE_KEYS:
            sections[field] = getattr(new, field)
            continue
        old_section, new_section = getattr(running, field), getattr(new, field)
        updates = {name: getattr(new_section, name) for name in new_section.__struct_fields__
                   if f"{field}.{name}" in RELOADABLE_KEYS}
        sections[field] = msgspec.structs.replace(old_section, **updates) if updates else old_section
    return msgspec.structs.replace(running, **sections)
