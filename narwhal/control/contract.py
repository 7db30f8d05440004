"""The engine contract's verdicts, without I/O: shared by readmission and ``engine-check``.

Each function takes what an engine answered and either returns what it learnt
or raises ``ContractViolation`` with the operator-facing reason, so the router
and the operator's pre-flight check refuse an engine for the same words.
"""

from __future__ import annotations

import hmac
from typing import Any

import msgspec

from narwhal import attestation
from narwhal.errors import NarwhalError
from narwhal.wire import PREFILL_KV_REQUEST, AttestResponse, EngineIdentity

__all__ = [
    "KV_ROLE_FOR",
    "MAX_IDENTITY_BYTES",
    "PROBE_PROMPT",
    "ContractViolation",
    "bounded",
    "check_generation",
    "check_identity_model",
    "check_kv_role",
    "check_listed_model",
    "listed_max_model_len",
    "listed_models",
    "probe_decode_body",
    "probe_prefill_body",
    "read_identity",
    "shown",
    "shown_list",
    "status_reason",
    "verify_attestation",
]

# The KV role an engine's kv_roles must allow for it to serve its placement role.
KV_ROLE_FOR: dict[str, str] = {"prefill": "producer", "decode": "consumer"}

PROBE_PROMPT = "narwhal inference probe"

# An engine's error message quoted in a reason is cut here: reasons go to logs and tables.
_MAX_QUOTED_CHARS = 200
# Every engine-supplied string is cut to this where it is quoted (reasons, logs, /admin, engine-check).
_MAX_SHOWN_CHARS = 120
# A list from an engine (model ids, kv_roles) shows at most this many items.
_MAX_SHOWN_ITEMS = 8
_MAX_SHOWN_ITEM_CHARS = 60
# The identity document is a handful of short fields; anything larger is refused unread.
MAX_IDENTITY_BYTES = 16 * 1024
_MAX_ATTEST_ANSWER_BYTES = 4096
# Field bounds of the identity (attestation.IDENTITY_FIELD_CHARS, which the plugin checks too) and its roles.
_MAX_KV_ROLES = 8
_MAX_KV_ROLE_CHARS = 32


class ContractViolation(NarwhalError):
    """An engine's answer breaks the contract; ``reason`` says how."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _ModelCard(msgspec.Struct):
    id: str
    # vLLM's card says the context length; anything else (absent, not a positive integer) is no limit.
    max_model_len: Any = None


class _ModelList(msgspec.Struct):
    data: list[_ModelCard]


class _ErrorDetail(msgspec.Struct):
    message: str


class _ErrorBody(msgspec.Struct):
    error: _ErrorDetail


_encode = msgspec.json.Encoder().encode


def status_reason(method: str, path: str, status: int, body: bytes = b"") -> str:
    """``GET /x answered HTTP 503``, plus the engine's own message when it sent an OpenAI-style error."""
    reason = f"{method} {path} answered HTTP {status}"
    try:
        message = msgspec.json.decode(body, type=_ErrorBody).error.message
    except msgspec.DecodeError:
        return reason
    if len(message) > _MAX_QUOTED_CHARS:
        message = message[:_MAX_QUOTED_CHARS] + "..."
    return f"{reason}: {message}"


# A ZeroMQ endpoint or topic is tens of characters.
_MAX_KV_EVENTS_CHARS = 512


def bounded(text: str, limit: int = _MAX_SHOWN_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was when cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def shown(value: str, limit: int = _MAX_SHOWN_CHARS) -> str:
    """An engine-supplied string as a reason quotes it: repr, cut to a bound."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


def shown_list(values: list[str]) -> str:
    """An engine-supplied list as a reason quotes it: at most a few items, each cut to a bound."""
    items = ", ".join(shown(value, _MAX_SHOWN_ITEM_CHARS) for value in values[:_MAX_SHOWN_ITEMS])
    more = f", ... ({len(values)} in all)" if len(values) > _MAX_SHOWN_ITEMS else ""
    return f"[{items}{more}]"


class _IdentityKvEventsUnread(msgspec.Struct, kw_only=True):
    """An identity whose ``kv_events`` is not read (the fields EngineIdentity requires, and the rest skipped)."""

    engine_id: str
    model: str
    generation: str
    process_started_at: float
    kv_roles: list[str]


def read_identity(raw: bytes) -> EngineIdentity:
    """The ``GET /narwhal/identity`` answer, typed; an oversized document or field is refused."""
    if len(raw) > MAX_IDENTITY_BYTES:
        raise ContractViolation(f"GET /narwhal/identity: the identity document is {len(raw)} bytes, "
                                f"more than {MAX_IDENTITY_BYTES}: refused unread")
    try:
        identity = msgspec.json.decode(raw, type=EngineIdentity)
    except msgspec.DecodeError as exc:
        try:
            # A kv_events we cannot read costs only the KV event feed: the engine is still identified.
            unread = msgspec.json.decode(raw, type=_IdentityKvEventsUnread)
        except msgspec.DecodeError:
            raise ContractViolation(f"GET /narwhal/identity: unreadable identity: {bounded(str(exc))}") from None
        identity = EngineIdentity(engine_id=unread.engine_id, model=unread.model, generation=unread.generation,
                                  process_started_at=unread.process_started_at, kv_roles=unread.kv_roles)
    for field, limit in attestation.IDENTITY_FIELD_CHARS.items():
        value: str = getattr(identity, field)
        if len(value) > limit:
            raise ContractViolation(f"GET /narwhal/identity: {field} is {len(value)} characters long, "
                                    f"more than {limit}: refused")
    if len(identity.kv_roles) > _MAX_KV_ROLES or any(len(role) > _MAX_KV_ROLE_CHARS for role in identity.kv_roles):
        raise ContractViolation(f"GET /narwhal/identity: kv_roles must be at most {_MAX_KV_ROLES} roles of at most "
                                f"{_MAX_KV_ROLE_CHARS} characters: refused")
    events = identity.kv_events
    if events is not None:
        for field in ("endpoint", "replay_endpoint", "topic"):
            value = getattr(events, field)
            if value is not None and len(value) > _MAX_KV_EVENTS_CHARS:
                raise ContractViolation(f"GET /narwhal/identity: kv_events.{field} is {len(value)} characters "
                                        f"long, more than {_MAX_KV_EVENTS_CHARS}: refused")
    return identity


def verify_attestation(key: bytes, identity: EngineIdentity, nonce: str, raw_answer: bytes) -> None:
    """The ``POST /narwhal/attest`` answer echoes ``nonce`` for the identity's engine, signed with ``key``."""
    if len(raw_answer) > _MAX_ATTEST_ANSWER_BYTES:
        raise ContractViolation(f"POST /narwhal/attest: the answer is {len(raw_answer)} bytes, "
                                f"more than {_MAX_ATTEST_ANSWER_BYTES}: refused unread")
    try:
        answer = msgspec.json.decode(raw_answer, type=AttestResponse)
    except msgspec.DecodeError as exc:
        raise ContractViolation(f"POST /narwhal/attest: unreadable answer: {bounded(str(exc))}") from None
    if not hmac.compare_digest(answer.nonce.encode(), nonce.encode()):
        raise ContractViolation("attestation did not echo our nonce (a replayed or stale answer)")
    if answer.engine_id != identity.engine_id:
        raise ContractViolation(f"attestation answered for engine_id {shown(answer.engine_id)}, "
                                f"identity names {shown(identity.engine_id)}")
    # The signature covers the generation the engine claims; the generation check judges the claim.
    if not attestation.verify(key, identity.engine_id, nonce, identity.generation, answer.signature):
        raise ContractViolation("attestation signature does not verify with the fleet attestation key")


def listed_models(raw: bytes) -> list[str]:
    """The model ids of a ``GET /v1/models`` answer."""
    try:
        return [card.id for card in msgspec.json.decode(raw, type=_ModelList).data]
    except msgspec.DecodeError as exc:
        raise ContractViolation(f"GET /v1/models: unreadable model list: {bounded(str(exc))}") from None


def listed_max_model_len(raw: bytes, model: str) -> int | None:
    """The ``max_model_len`` a ``GET /v1/models`` answer gives ``model``'s card, or None when it gives none."""
    try:
        cards = msgspec.json.decode(raw, type=_ModelList).data
    except msgspec.DecodeError:
        return None
    for card in cards:
        value = card.max_model_len
        if card.id == model and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def check_identity_model(identity: EngineIdentity, model: str) -> None:
    """The identity names ``model``."""
    if identity.model != model:
        raise ContractViolation(f"/narwhal/identity names model {shown(identity.model)}; the engine is configured "
                                f"for model {model!r}")


def check_listed_model(listed: list[str], model: str) -> None:
    """vLLM itself serves ``model``: a plugin claiming another model cannot pass."""
    if model not in listed:
        raise ContractViolation(f"/v1/models lists {shown_list(listed)}; the engine's model {model!r} is not "
                                "among them")


def check_generation(identity: EngineIdentity, generation: str) -> None:
    """The identity reports ``generation``."""
    if identity.generation != generation:
        raise ContractViolation(f"engine reports generation {shown(identity.generation)}; "
                                f"fleet.generation is {generation!r}")


def check_kv_role(role: str, identity: EngineIdentity) -> None:
    """The identity's kv_roles allow the KV transfer a ``role`` engine does."""
    needed = KV_ROLE_FOR[role]
    if needed not in identity.kv_roles:
        raise ContractViolation(f"a {role} engine needs KV role {needed!r}; "
                                f"engine reports kv_roles {shown_list(identity.kv_roles)}")


def probe_prefill_body(model: str) -> bytes:
    """A one-token prefill that keeps its KV for a remote decode."""
    return _encode({"model": model, "prompt": PROBE_PROMPT, "max_tokens": 1, "stream": False,
                    "kv_transfer_params": PREFILL_KV_REQUEST})


def probe_decode_body(model: str, kv: msgspec.Raw) -> bytes:
    """A one-token streamed decode of the probe prompt from the prefill's handoff ``kv``."""
    return _encode({"model": model, "prompt": PROBE_PROMPT, "max_tokens": 1, "stream": True,
                    "kv_transfer_params": kv})
