"""The models one router serves: each model's own name, aliases and per-model limits, read from a config.

A model is served when an ``[[engines]]`` entry names it (or names none and so
serves ``[fleet] model``) or a ``[[fleet.models]]`` entry does; the config's
own checks make sure each has a prefill and a decode engine. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from narwhal.config import Config, EngineSpec, FleetConfig, ServingConfig

__all__ = ["ServedModel", "ServedModels"]


class ServedModel(msgspec.Struct, frozen=True, kw_only=True):
    """One served model with every per-model key resolved (the fleet's or serving's value where unset)."""

    name: str
    generation: str
    aliases: tuple[str, ...] = ()
    max_attempts: int
    request_deadline_s: float


class ServedModels:
    """Every model a config serves, in order of first mention, and the names (aliases too) clients may send."""

    __slots__ = ("by_name", "decode_engines", "engines", "models", "only")

    def __init__(self, engines: Iterable[EngineSpec], fleet: FleetConfig, serving: ServingConfig) -> None:
        engines = list(engines)
        entries = {entry.name: entry for entry in fleet.models}
        # Each engine's model, by engine name (an engine that names none serves [fleet] model).
        self.engines: dict[str, str] = {spec.name: spec.model or fleet.model for spec in engines}
        order = list(dict.fromkeys([*self.engines.values(), *entries]))
        bounded = serving.policy == "bounded"
        self.models: dict[str, ServedModel] = {}
        for name in order:
            entry = entries.get(name)
            attempts = entry.max_attempts if entry is not None and entry.max_attempts is not None \
                else serving.max_attempts
            self.models[name] = ServedModel(
                name=name,
                generation=fleet.generation_of(name),
                aliases=tuple(entry.aliases) if entry is not None else (),
                # The saturate policy makes one attempt whatever the key says.
                max_attempts=attempts if bounded else 1,
                request_deadline_s=entry.request_deadline_s if entry is not None
                and entry.request_deadline_s is not None else serving.request_deadline_s)
        # Each model's decode engines: a continuation needs one other than the engine that failed.
        self.decode_engines: dict[str, frozenset[str]] = {
            name: frozenset(spec.name for spec in engines if spec.role == "decode"
                            and self.engines[spec.name] == name) for name in self.models}

        # What a request's `model` may say: each model's own name and its aliases.
        self.by_name: dict[str, ServedModel] = {}
        for model in self.models.values():
            self.by_name[model.name] = model
            for alias in model.aliases:
                self.by_name[alias] = model
        # The model a request without `model` gets: only when exactly one is served.
        self.only: ServedModel | None = next(iter(self.models.values())) if len(self.models) == 1 else None

    @classmethod
    def of(cls, config: Config) -> ServedModels:
        """The models ``config`` serves."""
        return cls(config.engines, config.fleet, config.serving)

    def __len__(self) -> int:
        return len(self.models)

    def __contains__(self, name: object) -> bool:
        return name in self.models

    def resolve(self, name: str) -> ServedModel | None:
        """The model a client's ``model`` names (its own name or an alias), or None."""
        return self.by_name.get(name)

    def names(self) -> list[str]:
        """The served models' own names, in order."""
        return list(self.models)
