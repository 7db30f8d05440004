"""Typed shapes of what crosses the wire to engines and clients."""

from __future__ import annotations

from typing import Any

import msgspec

from narwhal.errors import NarwhalError

__all__ = [
    "AttestRequest",
    "AttestResponse",
    "EngineIdentity",
    "ErrorBody",
    "ErrorDetail",
    "HandoffRejected",
    "KVTransferParams",
    "KvEventsIdentity",
    "PREFILL_KV_REQUEST",
    "error_json",
    "extract_handoff",
    "read_handoff",
]

# What a prefill request carries: "keep the KV for a remote decode" (vLLM's P/D flow).
PREFILL_KV_REQUEST: dict[str, object] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class KVTransferParams(msgspec.Struct, kw_only=True):
    """The KV handoff a prefill returns and a decode consumes (vLLM's P/D flow)."""

    remote_engine_id: str | int
    remote_block_ids: list[int | list[int]]
    remote_host: str
    remote_port: int
    do_remote_prefill: bool = True
    do_remote_decode: bool = False


class KvEventsIdentity(msgspec.Struct, kw_only=True, frozen=True):
    """vLLM's ``--kv-events-config`` endpoints as the engine gives them (a wildcard host and all)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


class EngineIdentity(msgspec.Struct, kw_only=True):
    engine_id: str
    model: str
    generation: str
    process_started_at: float
    kv_roles: list[str]
    # Its KV event publisher (the plugin reports vLLM's --kv-events-config); None: it publishes none.
    kv_events: KvEventsIdentity | None = None


class AttestRequest(msgspec.Struct):
    nonce: str


class AttestResponse(msgspec.Struct, kw_only=True):
    engine_id: str
    nonce: str
    signature: str


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    code: str | int | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


_encoder = msgspec.json.Encoder()


def error_json(message: str, type_: str, code: str | int | None = None) -> bytes:
    """An OpenAI-style error body."""
    return _encoder.encode(ErrorBody(ErrorDetail(message=message, type=type_, code=code)))


_decode_json = msgspec.json.Decoder()


# Default for engine.max_handoff_bytes; nesting deeper than this is no handoff any connector sends.
DEFAULT_MAX_HANDOFF_BYTES = 1024 * 1024
MAX_HANDOFF_DEPTH = 16


_HANDOFF_FIELDS = frozenset(KVTransferParams.__struct_fields__)


class _PrefillAnswer(msgspec.Struct):
    """The one field of a prefill's answer the router reads; the rest is skipped unbuilt."""

    kv_transfer_params: msgspec.Raw = msgspec.Raw(b"null")


_prefill_answer = msgspec.json.Decoder(_PrefillAnswer)
_handoff_decoder = msgspec.json.Decoder(KVTransferParams)


class HandoffRejected(NarwhalError, ValueError):
    """A prefill's kv_transfer_params that must not reach a decode engine; the message says why."""


def read_handoff(raw: bytes, *, max_bytes: int = DEFAULT_MAX_HANDOFF_BYTES) -> msgspec.Raw:
    """A prefill response's kv_transfer_params, validated and bounded: the engine's own JSON, to forward as is.

    Raises ``HandoffRejected`` when the body is not JSON, nests too deep, or the
    handoff is missing, malformed, not UTF-8, over ``max_bytes`` of JSON, or over
    ``MAX_HANDOFF_DEPTH`` levels deep: the prefill's fault, found before decode sees it.
    """
    # Only the handoff's own bytes are taken out of the answer (the rest is skipped, not built), and
    # they are what the decode is sent: no dict is built of them unless they may nest too deep.
    try:
        kv_json = _prefill_answer.decode(raw).kv_transfer_params
    except msgspec.ValidationError:
        raise HandoffRejected("prefill response carries no kv_transfer_params object") from None
    except msgspec.DecodeError:
        raise HandoffRejected("prefill response is not JSON") from None
    except RecursionError:
        raise HandoffRejected("prefill response nests too deep") from None
    try:
        # Skipping checks a string's quotes and escapes, not its UTF-8: checked here, as a full decode would.
        text = str(kv_json, "utf-8")
    except UnicodeDecodeError:
        raise HandoffRejected("kv_transfer_params is not valid UTF-8") from None
    if not text.startswith("{"):
        raise HandoffRejected("prefill response carries no kv_transfer_params object")
    try:
        _handoff_decoder.decode(text)
    except msgspec.ValidationError as exc:
        raise HandoffRejected(f"kv_transfer_params: {exc}") from None
    size = len(kv_json)
    if size > max_bytes:
        raise HandoffRejected(f"kv_transfer_params is {size} bytes, over the {max_bytes} byte bound "
                              "(engine.max_handoff_bytes)")
    # The typed fields nest three levels at most (the decode above saw to it): only other keys can go
    # deeper, and only a handoff with more brackets than levels can nest that deep.
    if text.count("[") + text.count("{") > MAX_HANDOFF_DEPTH:
        try:
            kv = _decode_json.decode(text)
        except RecursionError:
            raise HandoffRejected("prefill response nests too deep") from None
        for key, value in kv.items():
            if (key not in _HANDOFF_FIELDS and isinstance(value, (dict, list))
                    and _too_deep(value, MAX_HANDOFF_DEPTH - 1)):
                raise HandoffRejected(f"kv_transfer_params nests deeper than {MAX_HANDOFF_DEPTH} levels")
    return msgspec.Raw(text)


def _too_deep(value: Any, levels_left: int) -> bool:
    if not isinstance(value, (dict, list)):
        return False
    if levels_left <= 0:
        return True
    items = value.values() if isinstance(value, dict) else value
    return any(_too_deep(item, levels_left - 1) for item in items if isinstance(item, (dict, list)))


def extract_handoff(raw: bytes, *, max_bytes: int = DEFAULT_MAX_HANDOFF_BYTES) -> msgspec.Raw | None:
    """As ``read_handoff``, but None instead of the reason."""
    try:
        return read_handoff(raw, max_bytes=max_bytes)
    except HandoffRejected:
        return None
