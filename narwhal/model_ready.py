"""What ``/ready`` answers, for the whole router or for one model (``/ready?model=NAME``). Pure: no I/O.

The controller's app and each worker process answer with this one function, from
the same facts (the admission gate's refusal, each model's capacity problem), so
the text is the same wherever a load balancer's check lands.

- A closed gate (monitor degraded, standby, fenced, shutdown) is 503 for every model.
- ``/ready``: 503 only when no model can serve; else 200, ``ready`` and, when some
  models cannot serve, which and why (``ready; model 'b' cannot serve: ...``).
- ``/ready?model=NAME``: 200 or 503 for that model alone (an alias is its model);
  404 with OpenAI's error body (``model_not_found``) for a model not served.
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import parse_qs

import msgspec

from narwhal.served_models import ServedModels
from narwhal.wire import error_json

__all__ = ["TEXT", "ReadyAnswer", "query_model", "ready_answer"]

TEXT = "text/plain; charset=utf-8"
_JSON = "application/json"


class ReadyAnswer(msgspec.Struct, frozen=True):
    """The status, body and content type of one ``/ready`` answer."""

    status: int
    body: bytes
    content_type: str = TEXT


def query_model(query: str) -> str | None:
    """The ``model`` parameter of a ``/ready`` query string (its first value), or None without one."""
    values = parse_qs(query, keep_blank_values=True).get("model")
    return values[0] if values else None


def _text(status: int, text: str) -> ReadyAnswer:
    return ReadyAnswer(status, text.encode() + b"\n")


def ready_answer(model: str | None, *, refusal: str | None, capacity_problem: str | None,
                 capacity_problems: Mapping[str, str], served: ServedModels) -> ReadyAnswer:
    """``/ready`` (``model`` None) or ``/ready?model=...``: ``capacity_problem`` is the fleet's (no model can
    serve), ``capacity_problems`` each model's that cannot."""
    if model is not None:
        target = served.resolve(model)
        if target is None:
            served_names = ", ".join(repr(name) for name in served.names())
            return ReadyAnswer(404, error_json(f"The model {model[:200]!r} is not served by this router (it serves "
                                               f"{served_names})", "invalid_request_error", "model_not_found"),
                               _JSON)
        if refusal is not None:
            return _text(503, refusal)
        problem = capacity_problems.get(target.name)
        return _text(503, problem) if problem is not None else _text(200, "ready")
    if refusal is not None:
        return _text(503, refusal)
    if capacity_problem is not None:
        return _text(503, capacity_problem)
    cannot = [f"model {name!r} cannot serve: {capacity_problems[name]}" for name in served.names()
              if name in capacity_problems]
    return _text(200, "; ".join(["ready", *cannot]))
