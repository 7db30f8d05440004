"""A request's JSON values read as vLLM reads them: integers that are not booleans, lax booleans."""

from __future__ import annotations

from typing import Any, TypeGuard

__all__ = ["int_list", "is_int", "lax_bool"]


def is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def int_list(value: Any) -> list[int] | None:
    """``value`` when it is a list of integers (token IDs), else None."""
    if isinstance(value, list) and all(is_int(v) for v in value):
        return value
    return None


_TRUE_WORDS = frozenset({"1", "on", "t", "true", "y", "yes"})


def lax_bool(value: Any) -> bool:
    """A boolean request field as vLLM reads it (pydantic's lax mode: 1 and "true" are true)."""
    if isinstance(value, str):
        return value.strip().lower() in _TRUE_WORDS
    return value is True or (is_int(value) and value == 1)
