"""What of an engine's answer the client sees: no P/D handoff, and which stream events are tokens.

``kv_transfer_params`` is the engines' business (prefill to decode, through the
router); a client asked for a completion and gets none of it, not even
``"kv_transfer_params": null``. A chat stream opens with an event that only
names the assistant's role: it carries no token and is not counted as one.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["KV_KEY", "is_role_only_event", "strip_kv_from_body", "strip_kv_from_events"]

KV_KEY = b'"kv_transfer_params"'
_DATA = b"data: "
_END = b"\n\n"

_decode = msgspec.json.Decoder()
_encode = msgspec.json.Encoder()


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
