"""Each engine's ``max_model_len`` as its own ``GET /v1/models`` last reported it, and a model's smallest.

Written by the first identity read after startup and by every readmission's
``model`` check (``narwhal.control.readmission``); read by ``/v1/models`` and
``/admin/models`` (``narwhal.control.model_view``). No I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["ModelLengths"]


class ModelLengths:
    """Engine name -> the context length its model card gave; an engine whose card gave none is absent."""

    def __init__(self) -> None:
        self._by_engine: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"<ModelLengths {self._by_engine}>"

    def record(self, engine: str, max_model_len: int | None) -> None:
        """What ``engine`` reported now (None: its card gave no length, which replaces an older one)."""
        if max_model_len is None:
            self._by_engine.pop(engine, None)
        else:
            self._by_engine[engine] = max_model_len

    def forget(self, engine: str) -> None:
        """``engine`` left the fleet."""
        self._by_engine.pop(engine, None)

    def get(self, engine: str) -> int | None:
        """What ``engine`` last reported, or None."""
        return self._by_engine.get(engine)

    def smallest(self, engines: Iterable[str]) -> int | None:
        """The smallest length any of ``engines`` reported (a model's: every request fits each), or None."""
        reported = [self._by_engine[name] for name in engines if name in self._by_engine]
        return min(reported) if reported else None
