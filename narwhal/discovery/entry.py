"""The value an engine registers under ``<prefix><name>``, and turning a stored key into an engine.

The value is ``{"url": "http://HOST:PORT", "role": "prefill"|"decode", "model": "..."}``
(``model`` optional: absent means the router's default model), and for a prefill
engine optionally ``kv_events``, ``kv_events_replay``, ``kv_events_topic``. It is checked
exactly as an ``[[engines]]`` entry is, by building an ``EngineSpec``; a key or
value that fails gives an ``EntryProblem`` for the caller to log, never an
exception that would stop a watch.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from narwhal.config import EngineSpec

__all__ = ["MAX_VALUE_BYTES", "EngineRegistration", "EntryProblem", "encode_registration", "engine_name",
           "parse_entry"]

# A registration is about 100 bytes; anything near this is not one, and is not worth decoding.
MAX_VALUE_BYTES = 64 * 1024


class EngineRegistration(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The JSON value of a registration key; unknown fields are ignored, so newer registrars may add some."""

    url: str
    role: Literal["prefill", "decode"]
    model: str | None = None
    # A prefill engine's KV event publisher, as [[engines]] kv_events* (tcp://HOST:PORT).
    kv_events: str | None = None
    kv_events_replay: str | None = None
    kv_events_topic: str | None = None


class EntryProblem(msgspec.Struct, frozen=True, kw_only=True):
    """A key under the prefix that names no engine: ``discovery_entry_invalid`` logs it."""

    key: str
    problem: str


_decode = msgspec.json.Decoder(EngineRegistration)
_encoder = msgspec.json.Encoder()


def encode_registration(registration: EngineRegistration) -> bytes:
    """The JSON value a registrar puts."""
    return _encoder.encode(registration)


def engine_name(key: str, prefix: str) -> str | EntryProblem:
    """The engine's name: the key's last segment after ``prefix`` (non-empty, no ``/``)."""
    try:
        key.encode()
    except UnicodeEncodeError:
        # Read with surrogateescape: show the bytes, escaped, so the log line can name the key.
        shown = key.encode(errors="surrogateescape").decode(errors="backslashreplace")
        return EntryProblem(key=shown, problem="key is not UTF-8")
    if not key.startswith(prefix):
        return EntryProblem(key=key, problem=f"key is not under the prefix {prefix!r}")
    name = key[len(prefix):]
    if not name:
        return EntryProblem(key=key, problem="key has no engine name after the prefix")
    if "/" in name:
        return EntryProblem(key=key, problem="engine name must be one segment (no '/') after the prefix")
    return name


def parse_entry(key: str, value: bytes, prefix: str) -> EngineSpec | EntryProblem:
    """The engine that ``key = value`` registers, or why it registers none."""
    name = engine_name(key, prefix)
    if isinstance(name, EntryProblem):
        return name
    if len(value) > MAX_VALUE_BYTES:
        return EntryProblem(key=key, problem=f"value is {len(value)} bytes, over {MAX_VALUE_BYTES}")
    try:
        registration = _decode.decode(value)
        return EngineSpec(name=name, url=registration.url, role=registration.role, model=registration.model,
                          kv_events=registration.kv_events, kv_events_replay=registration.kv_events_replay,
                          kv_events_topic=registration.kv_events_topic)
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
        return EntryProblem(key=key, problem=str(exc))
