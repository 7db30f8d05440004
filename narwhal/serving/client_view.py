"""What of an engine's answer the client sees: no P/D handoff, and which stream events are tokens.

``kv_transfer_params`` is the engines' business (prefill to decode, through the
router); a client asked for a completion and gets none of it, not even
``"kv_transfer_params": null``. A chat stream opens with an event that only
names the assistant's role (one such event per choice): it carries no token and
is not counted as one; nor is the usage-only event a client asked for with
``stream_options.include_usage``, whose count is the answer's own.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "KV_KEY", "choice_count", "final_usage_tokens", "is_role_only_event", "strip_kv_from_body", "strip_kv_from_events",
    "wants_usage",
]

KV_KEY = b'"kv_transfer_params"'
_DATA = b"data: "
_END = b"\n\n"

_USAGE = b'"usage"'

_decode = msgspec.json.Decoder()
_encode = msgspec.json.Encoder()


class _Usage(msgspec.Struct):
    completion_tokens: int | None = None


class _UsageEvent(msgspec.Struct):
    choices: list[Any] | None = None
    usage: _Usage | None = None


_decode_usage_event = msgspec.json.Decoder(_UsageEvent)


def strip_kv_from_body(raw: bytes) -> bytes:
    """``raw`` without a top-level ``kv_transfer_params``; untouched when it has none or is not a JSON object."""
    if KV_KEY not in raw:
        return raw
    try:
        body = _decode.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return raw
    if not isinstance(body, dict) or "kv_transfer_params" not in body:
        return raw
    del body["kv_transfer_params"]
    return _encode.encode(body)


def strip_kv_from_events(chunk: bytes) -> bytes:
    """Each complete SSE ``data:`` event in ``chunk`` without ``kv_transfer_params``.

    Called only for a read that contains the key (a byte search per read, no
    allocation otherwise). An event split across two reads is left as it is.
    """
    out: list[bytes] = []
    start = 0
    while True:
        end = chunk.find(_END, start)
        if end < 0:
            out.append(chunk[start:])
            break
        event = chunk[start:end]
        if event.startswith(_DATA) and KV_KEY in event:
            event = _DATA + strip_kv_from_body(event[len(_DATA):])
        out.append(event + _END)
        start = end + len(_END)
    return b"".join(out)


def is_role_only_event(chunk: bytes) -> bool:
    """True when the first SSE event in ``chunk`` is a chat delta with a role and no content, tool call or reasoning."""
    if not chunk.startswith(_DATA):
        return False
    end = chunk.find(_END)
    if end < 0:
        return False
    try:
        event: Any = _decode.decode(chunk[len(_DATA):end])
    except (msgspec.DecodeError, RecursionError):
        return False
    choices = event.get("choices") if isinstance(event, dict) else None
    if not isinstance(choices, list) or not choices:
        return False
    for choice in choices:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if not isinstance(delta, dict) or "role" not in delta:
            return False
        if any(value for key, value in delta.items() if key != "role"):
            return False
    return True


def choice_count(request: dict[str, Any]) -> int:
    """How many choices the request asks for (``n``; 1 when absent or not a positive integer)."""
    n = request.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


def wants_usage(request: dict[str, Any]) -> bool:
    """True when the client asked for the final usage event (``stream_options.include_usage``)."""
    options = request.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


def final_usage_tokens(chunk: bytes) -> int | None:
    """``completion_tokens`` of the last usage-only event in ``chunk`` (the engine's own count), else None.

    Read once, at a stream's end: the per-read relay never parses events for this.
    """
    at = chunk.rfind(_USAGE)
    while at >= 0:
        start = chunk.rfind(_DATA, 0, at)
        end = chunk.find(_END, at)
        if start < 0 or end < 0:
            return None
        try:
            event = _decode_usage_event.decode(chunk[start + len(_DATA):end])
        except (msgspec.DecodeError, RecursionError):
            event = None
        if event is not None and not event.choices and event.usage is not None:
            tokens = event.usage.completion_tokens
            return tokens if isinstance(tokens, int) and tokens >= 0 else None
        at = chunk.rfind(_USAGE, 0, start)
    return None
