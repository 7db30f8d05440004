"""Fault injection for the mock engine: one mode per failure class, as data.

A fault is a mode, a count (``None`` = until cleared), the legs it applies to
and the mode's parameters. ``FaultTable.take`` picks the faults that act on one
request and decrements their counts; it does no I/O and knows no clock, so the
engine decides what each mode does to the bytes it writes.

Faults are set through ``POST /mock/faults`` with a JSON object, or with
``--fault`` using the same keys: ``MODE[:KEY=VALUE[,KEY=VALUE...]]``, legs
joined with ``+``, e.g. ``status_500:count=3,legs=prefill+decode``.
``status_NNN`` is short for ``status_5xx`` with ``status=NNN``.

Faults act in the order they were set: the first replacing fault wins, and a
counted one gives way to the next when spent, so "500 three times, then 429"
is ``status_500:count=3`` set before ``status_429`` (``docs/mock-engine.md``).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import re
from typing import Any

import msgspec

from narwhal.errors import NarwhalError

__all__ = [
    "BAD_KV_VARIANTS",
    "MODE_RULES",
    "Applied",
    "Fault",
    "FaultError",
    "FaultRequest",
    "FaultTable",
    "Leg",
    "Mode",
    "ModeRule",
    "Operation",
    "parse_fault_spec",
]


class FaultError(NarwhalError, ValueError):
    """A fault request that cannot be applied; the message says why."""


class Mode(enum.StrEnum):
    REFUSE = "refuse"
    HANG = "hang"
    STATUS_408 = "status_408"
    STATUS_429 = "status_429"
    STATUS_5XX = "status_5xx"
    STALL = "stall"
    NO_DONE = "no_done"
    GARBAGE_STREAM = "garbage_stream"
    FIRST_TOKEN_DELAY = "first_token_delay"
    BAD_KV = "bad_kv"
    BAD_ATTESTATION = "bad_attestation"
    WRONG_NONCE = "wrong_nonce"
    GENERATION = "generation"
    MODEL = "model"
    SLOW_TOKENS = "slow_tokens"
    UNHEALTHY = "unhealthy"
    CUT = "cut"


class Leg(enum.StrEnum):
    """What a fault targets; ``any`` means every leg where its mode makes sense."""

    PREFILL = "prefill"
    DECODE = "decode"
    HEALTH = "health"
    TOKENIZE = "tokenize"
    IDENTITY = "identity"
    ANY = "any"


class Operation(enum.StrEnum):
    """One kind of engine request; finer than a leg (``identity`` covers three)."""

    PREFILL = "prefill"
    DECODE = "decode"
    HEALTH = "health"
    TOKENIZE = "tokenize"
    IDENTITY = "identity"
    ATTEST = "attest"
    MODELS = "models"


_LEG_OF: dict[Operation, Leg] = {
    Operation.PREFILL: Leg.PREFILL,
    Operation.DECODE: Leg.DECODE,
    Operation.HEALTH: Leg.HEALTH,
    Operation.TOKENIZE: Leg.TOKENIZE,
    Operation.IDENTITY: Leg.IDENTITY,
    Operation.ATTEST: Leg.IDENTITY,
    Operation.MODELS: Leg.IDENTITY,
}

BAD_KV_VARIANTS = ("missing_block_ids", "string", "null", "absent", "bad_port")

_REQUIRED = object()


@dataclasses.dataclass(frozen=True)
class ModeRule:
    """Where a mode acts and what it takes.

    ``terminal`` modes replace the whole response (one per request); the others
    modify it and combine. ``streamed_only`` modes act only on SSE responses,
    ``handoff_only`` ones only on prefills asked for a KV handoff.
    """

    operations: frozenset[Operation]
    default_legs: tuple[Leg, ...]
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    terminal: bool = False
    streamed_only: bool = False
    handoff_only: bool = False

    @property
    def allowed_legs(self) -> frozenset[Leg]:
        return frozenset(_LEG_OF[op] for op in self.operations) | {Leg.ANY}


_EVERY_OP = frozenset(Operation)
_INFERENCE = frozenset({Operation.PREFILL, Operation.DECODE})
_INFERENCE_LEGS = (Leg.PREFILL, Leg.DECODE)

MODE_RULES: dict[Mode, ModeRule] = {
    # Connection-level: handled by the serving shell, not per request.
    Mode.REFUSE: ModeRule(frozenset(), (), {"duration_s": None}),
    Mode.HANG: ModeRule(_EVERY_OP, _INFERENCE_LEGS, terminal=True),
    Mode.STATUS_408: ModeRule(_EVERY_OP, _INFERENCE_LEGS, terminal=True),
    Mode.STATUS_429: ModeRule(_EVERY_OP, _INFERENCE_LEGS, terminal=True),
    Mode.STATUS_5XX: ModeRule(_EVERY_OP, _INFERENCE_LEGS, {"status": 500}, terminal=True),
    Mode.UNHEALTHY: ModeRule(frozenset({Operation.HEALTH}), (Leg.HEALTH,), terminal=True),
    Mode.STALL: ModeRule(_INFERENCE, (Leg.DECODE,), {"after_tokens": 1}, streamed_only=True),
    Mode.NO_DONE: ModeRule(_INFERENCE, (Leg.DECODE,), streamed_only=True),
    # The connection closes halfway through the body (after_tokens tokens of a stream when set).
    Mode.CUT: ModeRule(_INFERENCE, (Leg.DECODE,), {"after_tokens": None}),
    Mode.GARBAGE_STREAM: ModeRule(_INFERENCE, (Leg.DECODE,), {"after_tokens": 0}, streamed_only=True),
    # A huge default delay is a first token that never comes.
    Mode.FIRST_TOKEN_DELAY: ModeRule(_INFERENCE, _INFERENCE_LEGS, {"delay_s": 3600.0}),
    Mode.SLOW_TOKENS: ModeRule(_INFERENCE, (Leg.DECODE,), {"delay_s": 0.05}),
    Mode.BAD_KV: ModeRule(frozenset({Operation.PREFILL}), (Leg.PREFILL,), {"variant": "missing_block_ids"},
                           handoff_only=True),
    Mode.BAD_ATTESTATION: ModeRule(frozenset({Operation.ATTEST}), (Leg.IDENTITY,)),
    Mode.WRONG_NONCE: ModeRule(frozenset({Operation.ATTEST}), (Leg.IDENTITY,)),
    Mode.GENERATION: ModeRule(
        frozenset({Operation.IDENTITY, Operation.ATTEST}), (Leg.IDENTITY,), {"value": _REQUIRED}
    ),
    Mode.MODEL: ModeRule(
        frozenset({Operation.IDENTITY, Operation.MODELS}), (Leg.IDENTITY,), {"value": _REQUIRED}
    ),
}


class FaultRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The body of ``POST /mock/faults`` (and the keys of ``--fault``)."""

    mode: str
    count: int | None = None
    legs: list[str] | None = None
    status: int | None = None
    after_tokens: int | None = None
    delay_s: float | None = None
    duration_s: float | None = None
    variant: str | None = None
    value: str | None = None


_PARAM_NAMES = ("status", "after_tokens", "delay_s", "duration_s", "variant", "value")


@dataclasses.dataclass
class Fault:
    """One active fault; ``remaining`` counts down, ``None`` = until cleared."""

    id: int
    mode: Mode
    remaining: int | None
    legs: frozenset[Leg]
    params: dict[str, Any]

    def applies_to(self, op: Operation, *, streamed: bool, handoff: bool) -> bool:
        rule = MODE_RULES[self.mode]
        if op not in rule.operations or (rule.streamed_only and not streamed) or (rule.handoff_only and not handoff):
            return False
        return Leg.ANY in self.legs or _LEG_OF[op] in self.legs

    def describe(self) -> dict[str, Any]:
        """The JSON shape ``GET /mock/faults`` lists."""
        return {
            "id": self.id,
            "mode": str(self.mode),
            "count": self.remaining,
            "legs": sorted(str(leg) for leg in self.legs),
            **self.params,
        }


@dataclasses.dataclass
class Applied:
    """The faults acting on one request: at most one terminal, one modifier per mode."""

    terminal: Fault | None = None
    modifiers: dict[Mode, Fault] = dataclasses.field(default_factory=dict)

    def get(self, mode: Mode) -> Fault | None:
        return self.modifiers.get(mode)


_NO_FAULTS = Applied()
_STATUS_ALIAS = re.compile(r"status_(\d{3})")


def _validate_params(mode: Mode, request: FaultRequest) -> dict[str, Any]:
    rule = MODE_RULES[mode]
    params: dict[str, Any] = {}
    for name in _PARAM_NAMES:
        given = getattr(request, name)
        if name not in rule.params:
            if given is not None:
                raise FaultError(f"mode {mode} takes no parameter {name!r}")
            continue
        if given is None:
            if rule.params[name] is _REQUIRED:
                raise FaultError(f"mode {mode} needs parameter {name!r}")
            given = rule.params[name]
        params[name] = given
    status = params.get("status")
    if status is not None and not 500 <= status <= 599:
        raise FaultError(f"status must be 500-599, got {status}")
    if (params.get("after_tokens") or 0) < 0:
        raise FaultError("after_tokens must be >= 0")
    if params.get("delay_s", 0.0) < 0:
        raise FaultError("delay_s must be >= 0")
    duration_s = params.get("duration_s")
    if duration_s is not None and duration_s <= 0:
        raise FaultError("duration_s must be > 0")
    if "variant" in params and params["variant"] not in BAD_KV_VARIANTS:
        raise FaultError(f"variant must be one of {', '.join(BAD_KV_VARIANTS)}")
    if "value" in params and not params["value"]:
        raise FaultError("value must not be empty")
    return params


def _validate_legs(mode: Mode, legs: list[str] | None) -> frozenset[Leg]:
    rule = MODE_RULES[mode]
    if legs is None:
        return frozenset(rule.default_legs)
    if mode is Mode.REFUSE:
        raise FaultError("mode refuse acts on connections and takes no legs")
    if not legs:
        raise FaultError("legs must not be empty")
    chosen = set()
    for name in legs:
        try:
            leg = Leg(name)
        except ValueError:
            raise FaultError(f"unknown leg {name!r}") from None
        if leg not in rule.allowed_legs:
            allowed = ", ".join(sorted(rule.allowed_legs))
            raise FaultError(f"mode {mode} does not act on leg {name!r} (allowed: {allowed})")
        chosen.add(leg)
    return frozenset(chosen)


def _validate_mode(request: FaultRequest) -> tuple[Mode, FaultRequest]:
    alias = _STATUS_ALIAS.fullmatch(request.mode)
    if alias and request.mode not in (Mode.STATUS_408, Mode.STATUS_429):
        status = int(alias.group(1))
        if request.status is not None and request.status != status:
            raise FaultError(f"mode {request.mode} contradicts status={request.status}")
        return Mode.STATUS_5XX, msgspec.structs.replace(request, status=status)
    try:
        return Mode(request.mode), request
    except ValueError:
        modes = ", ".join(m.value for m in Mode)
        raise FaultError(f"unknown mode {request.mode!r} (modes: {modes}, status_NNN)") from None


class FaultTable:
    """The active faults of one mock engine, in the order they were set."""

    def __init__(self) -> None:
        self._faults: list[Fault] = []
        self._ids = itertools.count(1)

    def __repr__(self) -> str:
        return f"<FaultTable [{', '.join(f'{f.mode}x{f.remaining}' for f in self._faults)}]>"

    def validate(self, request: FaultRequest) -> Fault:
        """Turn a request into a fault, or raise FaultError naming the problem."""
        mode, request = _validate_mode(request)
        if request.count is not None and request.count < 1:
            raise FaultError("count must be >= 1, or null for until cleared")
        params = _validate_params(mode, request)
        if mode is Mode.REFUSE and (request.count is None) == (params["duration_s"] is None):
            raise FaultError("mode refuse needs exactly one of count and duration_s")
        legs = _validate_legs(mode, request.legs)
        return Fault(id=next(self._ids), mode=mode, remaining=request.count, legs=legs, params=params)

    def add(self, fault: Fault) -> None:
        """Activate a validated fault."""
        self._faults.append(fault)

    def clear(self) -> None:
        self._faults.clear()

    def describe(self) -> list[dict[str, Any]]:
        return [fault.describe() for fault in self._faults]

    def take(self, op: Operation, *, streamed: bool = False, handoff: bool = False) -> Applied:
        """The faults that act on one request of kind ``op``; their counts go down by one."""
        if not self._faults:
            return _NO_FAULTS
        applied = Applied()
        for fault in self._faults:
            if fault.mode is Mode.REFUSE or not fault.applies_to(op, streamed=streamed, handoff=handoff):
                continue
            if MODE_RULES[fault.mode].terminal:
                if applied.terminal is None:
                    applied.terminal = fault
            elif fault.mode not in applied.modifiers:
                applied.modifiers[fault.mode] = fault
        chosen = [applied.terminal] if applied.terminal else []
        chosen.extend(applied.modifiers.values())
        if not chosen:
            return _NO_FAULTS
        for fault in chosen:
            self._spend(fault)
        return applied

    def take_connection_refusal(self) -> bool:
        """Whether a counted ``refuse`` fault claims the connection just accepted."""
        for fault in self._faults:
            if fault.mode is Mode.REFUSE and fault.remaining is not None:
                self._spend(fault)
                return True
        return False

    def _spend(self, fault: Fault) -> None:
        if fault.remaining is None:
            return
        fault.remaining -= 1
        if fault.remaining <= 0:
            self._faults.remove(fault)


def parse_fault_spec(text: str) -> FaultRequest:
    """Parse ``MODE[:KEY=VALUE,...]`` (legs joined with ``+``) into a FaultRequest."""
    mode, _, rest = text.strip().partition(":")
    fields: dict[str, Any] = {"mode": mode.strip()}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise FaultError(f"expected KEY=VALUE in fault spec, got {item!r}")
        if key == "legs":
            fields[key] = [leg for leg in value.split("+") if leg]
        elif value == "null":
            fields[key] = None
        else:
            fields[key] = value
    try:
        # Lax conversion turns "3" into 3 and "0.5" into 0.5, as JSON would have.
        return msgspec.convert(fields, FaultRequest, strict=False)
    except msgspec.ValidationError as exc:
        raise FaultError(f"fault spec {text!r}: {exc}") from None
