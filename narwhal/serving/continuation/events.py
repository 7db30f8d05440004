"""Event rewriting: the bytes and fields of an engine's SSE events that the client never sees.

Narwhal's token IDs (asked for to join exactly), the engines' KV handoff, an
engine's error event (raised, never relayed), and the shape a chat answer takes
when its continuation runs as a completion. Pure: no state, no I/O.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from narwhal.errors import NarwhalError

__all__ = ["DATA", "DONE_EVENT", "ERROR_MARK", "IDS", "MAX_EVENT_BYTES", "OLD_ERROR_MARK", "EngineErrorEvent",
           "Event", "decode_event", "drop_logprobs", "error_message", "raise_error_events",
           "finish_event", "read_head", "strip_compact_ids", "usage_event"]

# One SSE event larger than this is not a stream we can join (a prompt's token IDs fit easily).
MAX_EVENT_BYTES = 16 * 1024 * 1024
DONE_EVENT = b"data: [DONE]\n\n"
DATA = b"data: "

decode_json = msgspec.json.Decoder()
encode_json = msgspec.json.Encoder()


class EngineErrorEvent(NarwhalError, ValueError):
    """An engine ended its stream with an error event (vLLM does when its engine core dies): a failed stream."""


class Delta(msgspec.Struct):
    content: str | None = None
    # A reasoning parser's output (vLLM names it either way across versions).
    reasoning_content: str | None = None
    reasoning: str | None = None


class Choice(msgspec.Struct):
    text: str | None = None
    delta: Delta | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    finish_reason: str | None = None


class Event(msgspec.Struct):
    """The fields of a first-leg chunk the join records; the chunk itself is relayed as it came."""

    id: Any = None
    created: Any = None
    choices: list[Choice] | None = None
    prompt_token_ids: list[int] | None = None
    usage: dict[str, Any] | None = None
    kv_transfer_params: Any = None


class _Head(msgspec.Struct):
    id: Any = None
    created: Any = None


decode_event = msgspec.json.Decoder(Event).decode
_decode_head = msgspec.json.Decoder(_Head).decode

# A token-ID list (or null) and its comma, as a key of a JSON object: the quote before the key
# cannot occur unescaped inside a string, so this never matches text. One pass per read and key for
# the compact form vLLM writes (each pattern starts with a long literal, which is searched for
# quickly), then any spacing, only if some is left. The event lists are captured, to count their IDs.
IDS = re.compile(rb',\s*"(?:prompt_)?token_ids":\s*(?:\[[\d,\s]*\]|null)'
                 rb'|"(?:prompt_)?token_ids":\s*(?:\[[\d,\s]*\]|null)\s*,')
_PROMPT_IDS_COMPACT = re.compile(rb',"prompt_token_ids":(?:\[[\d,]*\]|null)')
_TOKEN_IDS_COMPACT = re.compile(rb',"token_ids":(\[[\d,]*\]|null)')


def strip_compact_ids(data: bytes) -> tuple[bytes, int, int]:
    """``data`` less its compact token-ID lists, with the event lists removed and their IDs
    (counted as ``lazy.FirstLeg.tokens`` would)."""
    if b'prompt_token_ids"' in data:
        data = _PROMPT_IDS_COMPACT.sub(b"", data)
    parts = _TOKEN_IDS_COMPACT.split(data)
    if len(parts) == 1:
        return data, 0, 0
    removed = b"".join(parts[1::2])
    # Each list is "[...]" of digits and commas (or null): its IDs are its commas plus one, unless empty.
    lists = removed.count(b"[")
    return b"".join(parts[::2]), lists, lists - removed.count(b"[]") + removed.count(b",")


# How an engine's error event starts (vLLM 0.32: {"error": {...}}; older: {"object": "error", ...}), searched for
# per read. A JSON string cannot hold either unescaped, so a token's text never matches.
ERROR_MARK = b'data: {"error"'
OLD_ERROR_MARK = b'"object":"error"'


def error_message(obj: dict[str, Any]) -> str:
    error = obj.get("error")
    message = error.get("message") if isinstance(error, dict) else obj.get("message")
    return f"the engine ended its stream with an error event: {str(message)[:200]}"


def raise_error_events(complete: bytes) -> None:
    """Raise EngineErrorEvent if one of these complete events is an engine's error event."""
    for event in complete.split(b"\n\n"):
        if event.startswith(DATA) and (ERROR_MARK[6:] in event or OLD_ERROR_MARK in event):
            try:
                obj = decode_json.decode(event[len(DATA):])
            except (msgspec.DecodeError, RecursionError):
                continue
            if isinstance(obj, dict) and ("error" in obj or obj.get("object") == "error"):
                raise EngineErrorEvent(error_message(obj))


def read_head(complete: bytes) -> tuple[Any, Any] | None:
    """The ``id`` and ``created`` of the first readable event among these complete events, if any."""
    for event in complete.split(b"\n\n", 8):
        if event.startswith(DATA):
            try:
                head = _decode_head(event[len(DATA):])
            except (msgspec.DecodeError, RecursionError):
                continue
            return head.id, head.created
    return None


def drop_logprobs(choice: dict[str, Any], count: int) -> None:
    """Drop the first ``count`` tokens' entries from a completions choice's ``logprobs``."""
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict):
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            entries = logprobs.get(key)
            if isinstance(entries, list):
                logprobs[key] = entries[count:]


def usage_event(id_: Any, created: Any, model: Any, chat: bool, usage: dict[str, int]) -> bytes:
    """A usage-only chunk of the answer (no choices), as the engines send it."""
    obj = {"id": id_, "object": "chat.completion.chunk" if chat else "text_completion",
           "created": created, "model": model, "choices": [], "usage": usage}
    return DATA + encode_json.encode(obj) + b"\n\n"


def finish_event(id_: Any, created: Any, model: Any, chat: bool, reason: str) -> bytes:
    """A chunk that ends the one choice with ``finish_reason`` and no text, as an engine's last chunk would."""
    choice: dict[str, Any] = ({"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason} if chat else
                              {"index": 0, "text": "", "logprobs": None, "finish_reason": reason})
    obj = {"id": id_, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
           "model": model, "choices": [choice]}
    return DATA + encode_json.encode(obj) + b"\n\n"
