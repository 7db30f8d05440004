"""The admin API's query parameters: which route takes which, and their values parsed from ASCII digits only.

``str.isdigit`` and ``int`` accept superscripts and other scripts' digits
(``²``, ``１２``); a parameter here is ``0``-``9`` only, else a 400 that names it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from narwhal.errors import NarwhalError

__all__ = ["ADMIN_QUERY_PARAMETERS", "QueryParameterError", "unexpected_parameter", "whole_number"]

# Every admin route (as registered) that takes query parameters; the others take none.
ADMIN_QUERY_PARAMETERS: Mapping[str, frozenset[str]] = {
    "/admin/timeline": frozenset({"seconds"}),
}


class QueryParameterError(NarwhalError):
    """A query parameter the route does not take, or a value it cannot parse; the message names it."""

    def __init__(self, parameter: str, message: str, code: str) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.code = code


def unexpected_parameter(rule: str, names: Iterable[str]) -> QueryParameterError | None:
    """The first parameter in ``names`` that the admin route ``rule`` does not take, as an error; else None."""
    allowed = ADMIN_QUERY_PARAMETERS.get(rule, frozenset())
    for name in names:
        if name not in allowed:
            takes = f"it takes {', '.join(sorted(allowed))}" if allowed else "it takes none"
            return QueryParameterError(name, f"{rule} has no query parameter {name[:64]!r} ({takes})",
                                       "unknown_query_parameter")
    return None


def whole_number(name: str, values: Sequence[str], *, max_digits: int, what: str) -> int | None:
    """``values`` (every value given for ``name``) as one whole number of at most ``max_digits`` ASCII digits.

    None when the parameter is absent; ``QueryParameterError`` (code ``invalid_<name>``) otherwise.
    """
    if not values:
        return None
    code = f"invalid_{name}"
    if len(values) > 1:
        raise QueryParameterError(name, f"query parameter {name} given {len(values)} times; give it once", code)
    raw = values[0]
    if not 0 < len(raw) <= max_digits or not all("0" <= ch <= "9" for ch in raw):
        raise QueryParameterError(name, f"query parameter {name} must be {what} in ASCII digits (at most "
                                        f"{max_digits}), got {raw[:32]!r}", code)
    return int(raw)
