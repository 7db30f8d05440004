"""Stream continuation: one client stream across decode legs on several engines.

Under ``serving.policy = "bounded"`` with ``serving.continue_streams`` on, a
streamed request whose decode leg fails (class connection, timeout or stream,
or cut because a reload removed its engine) after its stream reached the
client is continued: a fresh prefill of the original prompt plus the output so
far, then a decode on another engine asking for the tokens still owed, relayed
into the same client stream.

``plan`` says whether a request may be continued (and why not). A ``StreamJoin``
(``join``) holds one request's answer so far and composes one part per job:
``events`` (what the client never sees of an engine's events), ``lazy`` (the
first leg's events read only when needed), ``accounting`` (token counts),
``resume`` (resume points and divergence) and ``legs`` (each next leg's
request); ``policy`` says which streams are continued. ``narwhal.serving.relay``
relays one decode leg through a join into the client's sink. No I/O here.
"""

from __future__ import annotations

from typing import Any

from narwhal.serving.continuation.events import EngineErrorEvent
from narwhal.serving.continuation.join import StreamJoin
from narwhal.serving.continuation.policy import (
    CHAT,
    COMPLETIONS,
    CONTINUED_CLASSES,
    ENGINE_REMOVED,
    not_continued_reason,
)

__all__ = ["CHAT", "COMPLETIONS", "CONTINUED_CLASSES", "ENGINE_REMOVED", "EngineErrorEvent", "StreamJoin",
           "not_continued_reason", "plan"]


def plan(route: str, request: dict[str, Any], *, enabled: bool) -> tuple[StreamJoin | None, str | None]:
    """A StreamJoin for a streamed request that may be continued, else None and the reason."""
    if not enabled:
        return None, "continue_streams_off"
    reason = not_continued_reason(route, request)
    if reason is not None:
        return None, reason
    return StreamJoin(route, request), None
