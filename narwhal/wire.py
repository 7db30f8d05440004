"""Typed shapes of what crosses the wire to engines and clients."""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "AttestRequest",
    "AttestResponse",
    "EngineIdentity",
    "ErrorBody",
    "ErrorDetail",
    "KVTransferParams",
    "PREFILL_KV_REQUEST",
    "error_json",
    "extract_handoff",
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


class EngineIdentity(msgspec.Struct, kw_only=True):
    engine_id: str
    model: str
    generation: str
    process_started_at: float
    kv_roles: list[str]


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


def extract_handoff(raw: bytes) -> dict[str, Any] | None:
    """A prefill response's kv_transfer_params, validated, as the dict to forward verbatim.

    None when the body is not JSON or the handoff is missing or unreadable.
    """
    try:
        response = _decode_json.decode(raw)
    except msgspec.DecodeError:
        return None
    kv = response.get("kv_transfer_params") if isinstance(response, dict) else None
    if not isinstance(kv, dict):
        return None
    try:
        msgspec.convert(kv, KVTransferParams)
    except msgspec.ValidationError:
        return None
    return kv
