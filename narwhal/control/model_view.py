"""The served models as clients and operators see them: ``/v1/models``, ``/ready?model=``, ``/admin/models``.

``ModelViewer`` joins the config's served models (names, aliases, generation),
the fleet (each model's engines and whether it can serve) and what engines
reported of their context length (``ModelLengths``); the app encodes what it
returns as is. It reads and never changes anything.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import msgspec
import trio

from narwhal.config import Config, EngineSpec, RunningConfig
from narwhal.control.model_lengths import ModelLengths
from narwhal.fleet import EngineState, EngineView, state_name
from narwhal.model_ready import ReadyAnswer, ready_answer
from narwhal.served_models import ServedModel, ServedModels

__all__ = ["ModelCard", "ModelEngineEntry", "ModelEntry", "ModelList", "ModelViewer", "ModelsView", "engine_state"]



class ModelCard(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One entry of ``GET /v1/models`` (OpenAI's model object); an alias names its model as ``parent``."""

    id: str
    object: str
    created: int
    owned_by: str
    # The smallest its engines report; left out when none reported one.
    max_model_len: int | None = None
    parent: str | None = None


class ModelList(msgspec.Struct, frozen=True, kw_only=True):
    """``GET /v1/models``: OpenAI's list format."""

    object: str
    data: list[ModelCard]


class ModelEngineEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One engine of a model in ``/admin/models``: its state as the fleet page shows it."""

    name: str
    role: str
    state: EngineState
    removing: bool = False


class ModelEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One served model in ``/admin/models``."""

    name: str
    aliases: list[str]
    generation: str
    max_model_len: int | None
    can_serve: bool
    # Why it cannot serve (a role with no eligible engine), None when it can.
    reason: str | None
    engines: list[ModelEngineEntry]


class ModelsView(msgspec.Struct, frozen=True, kw_only=True):
    """The whole answer of ``GET /admin/models``."""

    models: list[ModelEntry]


def engine_state(view: EngineView) -> EngineState:
    """``ejected``, ``eligible`` or ``held`` (out of placement for a hold): the fleet page's words."""
    return state_name(view.ejected, view.eligible)


class _Fleet(Protocol):
    def views(self, now: float) -> list[EngineView]: ...
    def capacity_problem(self, now: float, model: str | None = None) -> str | None: ...
    def capacity_problems(self, now: float) -> dict[str, str]: ...


class ModelViewer:
    """Builds the model list, one model's card, ``/ready``'s answer and ``ModelsView``, at the current time."""

    def __init__(self, *, config: Config, fleet: _Fleet, lengths: ModelLengths, created: int,
                 refusal: Callable[[], str | None] = lambda: None,
                 clock: Callable[[], float] = trio.current_time,
                 specs: Callable[[], Iterable[EngineSpec]] | None = None) -> None:
        """``created`` is the cards' ``created`` (unix seconds, the router's start); ``refusal`` the admission
        gate's reason (closed for every model), None while open. ``specs()``: the engine set when it is not
        the config's alone (discovered engines bring their models): the models are read from it at each use."""
        self.config = config
        self._specs = specs
        self._served = ServedModels.of(config)
        self._served_key: tuple[tuple[str, str | None], ...] | None = None
        self.fleet = fleet
        self.lengths = lengths
        self.created = created
        self.refusal = refusal
        self.clock = clock

    def configure(self, running: RunningConfig) -> None:
        """A reload: the models, aliases and generations of the new config."""
        self.config = running.config
        self._served = ServedModels.of(running.config)
        self._served_key = None

    @property
    def served(self) -> ServedModels:
        """The models served: the config's, or those of the engine set ``specs()`` (rebuilt when it changes)."""
        if self._specs is None:
            return self._served
        specs = list(self._specs())
        key = tuple((spec.name, spec.model) for spec in specs)
        if key != self._served_key:
            config = self.config
            self._served = ServedModels(specs, config.fleet, config.serving)
            self._served_key = key
        return self._served

    def _engines(self, now: float) -> dict[str, list[EngineView]]:
        by_model: dict[str, list[EngineView]] = {}
        for view in self.fleet.views(now):
            by_model.setdefault(view.model, []).append(view)
        return by_model

    def _max_model_len(self, engines: list[EngineView]) -> int | None:
        return self.lengths.smallest(view.name for view in engines)

    def _cards(self, model: ServedModel, max_model_len: int | None) -> list[ModelCard]:
        own = ModelCard(id=model.name, object="model", created=self.created, owned_by="narwhal",
                        max_model_len=max_model_len)
        return [own, *(msgspec.structs.replace(own, id=alias, parent=model.name) for alias in model.aliases)]

    def models(self) -> ModelList:
        """``GET /v1/models``: every served model, then each of its aliases."""
        engines = self._engines(self.clock())
        data: list[ModelCard] = []
        for model in self.served.models.values():
            data += self._cards(model, self._max_model_len(engines.get(model.name, [])))
        return ModelList(object="list", data=data)

    def model(self, name: str) -> ModelCard | None:
        """``GET /v1/models/{name}``: the card of a model or alias, None when it is not served."""
        model = self.served.resolve(name)
        if model is None:
            return None
        engines = self._engines(self.clock()).get(model.name, [])
        return next(card for card in self._cards(model, self._max_model_len(engines)) if card.id == name)

    def ready(self, model: str | None) -> ReadyAnswer:
        """``/ready`` or ``/ready?model=``: see ``narwhal.model_ready``."""
        now = self.clock()
        return ready_answer(model, refusal=self.refusal(), capacity_problem=self.fleet.capacity_problem(now),
                            capacity_problems=self.fleet.capacity_problems(now), served=self.served)

    def admin(self) -> ModelsView:
        """``GET /admin/models``: each served model, whether it can serve, and its engines."""
        now = self.clock()
        engines = self._engines(now)
        problems = self.fleet.capacity_problems(now)
        entries = []
        for model in self.served.models.values():
            views = engines.get(model.name, [])
            reason = problems.get(model.name)
            entries.append(ModelEntry(
                name=model.name, aliases=list(model.aliases), generation=model.generation,
                max_model_len=self._max_model_len(views), can_serve=reason is None, reason=reason,
                engines=[ModelEngineEntry(name=view.name, role=view.role, state=engine_state(view),
                                          removing=view.removing) for view in views]))
        return ModelsView(models=entries)
