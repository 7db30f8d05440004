"""The mock inference engine: vLLM's OpenAI-compatible API with its P/D flow.

``MockEngine.handle`` answers one parsed HTTP request through a ``Responder``;
``serve_mock`` runs it on the project's HTTP/1.1 server; ``main`` is the CLI
(``python -m narwhal mock-engine`` / ``python -m narwhal.tools.mock``).

Tokenizer: a token is a whitespace-separated word of the prompt (a completion's
prompt given as a list of ints is taken as tokens; ``/tokenize``, as vLLM
0.32's, takes only a string); a chat request adds one token per message for
its role, except the final message of a ``continue_final_message`` request,
which the answer continues (the mock's generation prompt is empty). Token ids are
``crc32(word) % 32000``. Generated token ``i`` is the text ``" tok{i}"``; with
``numbered`` (``--numbered-tokens``) the token at sequence position ``p`` (the
prompt takes positions 0..L-1) is ``" n{p}"``, so an answer continued from its
prompt plus its output so far reads on without a repeat or a gap.
``return_token_ids`` and ``continue_final_message`` behave as in vLLM 0.32.

Three vLLM 0.32 stream behaviours a router must survive, off by default:
``split_every`` K (``--split-chars-every``) makes the generated token at each
position ``p`` with ``p % K == K - 1`` the first half of a character, sent as
vLLM sends a token that ends inside a character: its own token ID and empty
text, its text going out with the next token's. A token-ID prompt that ends on
such a generated first half (numbered mode: the last ID is that of ``" n{L-1}"``;
a prompt's own words are whole characters) then gets the *echo* of vLLM 0.32's detokenizer (tokenizers'
``DecodeStream`` finds no clean prefix of the prompt to start from): the first
text it sends is the whole prompt's text (the mock's stand-in:
``" n0 n1 ... n{L-1}"``) followed by the generated text. ``tokens_per_event``
N (``--tokens-per-event``) puts N tokens in one SSE event, as vLLM does when
its output loop falls behind. A request's ``stop`` strings (and
``include_stop_str_in_output``) end the answer as vLLM's: searched in the
generated text only, ``finish_reason`` "stop" with the string as
``stop_reason``, and while streaming the last ``max(len(stop)) - 1``
characters held back until more text or the end comes.

``n`` choices are answered as vLLM answers them: listed with their ``index``, or streamed interleaved one
choice per chunk (``choices[0].index``), an engine step's events together; choice ``c`` > 0 has its tokens
marked ``-c``. Requests vLLM's request model or sampling parameters refuse (``n`` < 1, ``temperature``
out of [0, 2] or not a number, an empty prompt, ...) get vLLM's 400 and error body.

Fault injection (``narwhal.tools.mock.faults``) is set with ``--fault`` or at run time
through ``/mock/faults``; ``/mock/stats`` reports what the engine saw. With ``--kv-events`` its
prefix cache's stores and evictions go out as vLLM's KV events (``narwhal.tools.mock.kv_publisher``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import errno
import hashlib
import itertools
import logging
import re
import secrets
import signal
import socket
import ssl
import struct
import sys
import time
import zlib
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import msgspec
import trio

from narwhal import attestation
from narwhal.config import ConfigError
from narwhal.errors import NarwhalError
from narwhal.http1.server import ClientDisconnected, HTTPServer
from narwhal.obs.logs import configure_logging, log_event
from narwhal.tls import server_context_from_files
from narwhal.tools.cli_args import OneLineParser
from narwhal.tools.mock.faults import (
    Applied,
    Fault,
    FaultError,
    FaultRequest,
    FaultTable,
    Mode,
    Operation,
    parse_fault_spec,
)
from narwhal.tools.mock.kv_publisher import KvEventsSettings, KvPublisher
from narwhal.tools.mock.prefix_cache import PrefixCache, block_hash
from narwhal.wire import AttestRequest, AttestResponse, EngineIdentity, KvEventsIdentity, KVTransferParams

if TYPE_CHECKING:
    from narwhal.http1.server import Request, Responder

__all__ = [
    "PROCESS_STARTED_AT",
    "MockEngine",
    "MockService",
    "MockSettings",
    "build_parser",
    "main",
    "serve_mock",
    "tokenize",
]

PROCESS_STARTED_AT = time.time()

_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_DONE = b"data: [DONE]\n\n"
_GARBAGE = b"<html><body>502 upstream confused</body></html>\r\n\x00\xff not server-sent events\r\n"
_BLOCK_TOKENS = 16
# Distinct first blocks /mock/stats counts prefills by (prefills_by_first_block); a bound, not a need.
_FIRST_BLOCK_KEYS = 4096
# Trace contexts /mock/stats keeps (trace_headers): enough for a test, never a leak under a bench.
_TRACE_HEADERS_KEPT = 256
_VOCAB = 32000
# vLLM samples greedily below this temperature, and then refuses n > 1.
_GREEDY_EPS = 1e-5
# vLLM's default VLLM_MAX_N_SEQUENCES: the most choices one request may ask for.
_MAX_N = 16384

_encode = msgspec.json.Encoder().encode
_decode_any = msgspec.json.Decoder().decode


# ----- request shapes --------------------------------------------------------

class _ChatMessage(msgspec.Struct):
    role: str = "user"
    content: str | list[Any] | None = None


class _StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _CompletionBody(msgspec.Struct):
    """The fields of an OpenAI completion / chat request that the mock reads, typed as vLLM's request models."""

    model: str | None = None
    prompt: str | list[Any] | None = None
    messages: list[_ChatMessage] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    # Completions type ``n`` as ``int`` (null is a 400), chat as ``int | None`` (null is 1).
    n: int | None = 1
    temperature: float | None = None
    stream: bool | None = False
    stream_options: _StreamOptions | None = None
    kv_transfer_params: dict[str, Any] | None = None
    return_token_ids: bool | None = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False


class _ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: int


class _ErrorResponse(msgspec.Struct):
    error: _ErrorInfo


def _error_body(message: str, type_: str, code: int, param: str | None = None) -> bytes:
    """vLLM's error body: ``{"error": {"message", "type", "param", "code"}}``, ``param`` always present."""
    return _encode(_ErrorResponse(_ErrorInfo(message=message, type=type_, param=param, code=code)))


class _BadRequest(NarwhalError):
    def __init__(self, status: int, message: str, type_: str = "BadRequestError", param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type_ = type_
        self.param = param


def _invalid(message: str, parameter: str | None = None, value: Any = None) -> _BadRequest:
    """A ``VLLMValidationError`` raised while serving: its text names the parameter and the value."""
    extras = [f"parameter={parameter}"] if parameter is not None else []
    if value is not None:
        extras.append(f"value={value}")
    text = f"{message} ({', '.join(extras)})" if extras else message
    return _BadRequest(400, text, "BadRequestError", parameter)


def _request_invalid(kind: str, loc: str, msg: str, param: str | None = None) -> _BadRequest:
    """A 400 from vLLM's request-model validation (FastAPI's handler): one error, type "Bad Request"."""
    text = f"1 validation error:\n  {{'type': '{kind}', 'loc': '{loc}', 'msg': '{msg}'}}"
    return _BadRequest(400, text, "Bad Request", param or loc)


# ----- tokenizer ---------------------------------------------------------------

def _word_ids(text: str) -> list[int]:
    return [zlib.crc32(word.encode()) % _VOCAB for word in text.split()]


def _message_text(content: str | list[Any] | None) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def tokenize(prompt: str | list[Any] | None = None, messages: list[_ChatMessage] | None = None, *,
             continue_final: bool = False) -> list[int]:
    """The mock's deterministic token ids for a prompt or a chat (see the module docstring)."""
    if messages is not None:
        tokens: list[int] = []
        for i, message in enumerate(messages):
            if not (continue_final and i == len(messages) - 1):
                tokens.append(zlib.crc32(f"<|{message.role}|>".encode()) % _VOCAB)
            tokens.extend(_word_ids(_message_text(message.content)))
        return tokens
    if isinstance(prompt, str):
        return _word_ids(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise _BadRequest(400, "prompt must be a string or a list of token ids (one prompt per request)")


_token_texts: list[bytes] = []


def _text_id(text: bytes) -> int:
    """The token ID of a generated token's text (one word), as the tokenizer would give it."""
    return zlib.crc32(text.strip()) % _VOCAB


def _token_text(i: int) -> bytes:
    """JSON-safe text of generated token ``i``, encoded once per process."""
    while len(_token_texts) <= i:
        _token_texts.append(b" tok%d" % len(_token_texts))
    return _token_texts[i]


# ----- settings and stats ----------------------------------------------------

class MockSettings(msgspec.Struct, frozen=True, kw_only=True):
    """What one mock engine is; ``engine_id`` None = ``f"{role}-{bound port}"``."""

    role: Literal["prefill", "decode"]
    host: str = "127.0.0.1"
    port: int = 0
    engine_id: str | None = None
    model: str = "mock-model"
    generation: str = "g1"
    attestation_key: str = "narwhal-dev-key"
    max_model_len: int = 4096
    tokens: int = 16
    # Token text " n{position}" instead of " tok{i}" (see the module docstring).
    numbered: bool = False
    token_delay_s: float = 0.0
    # "batched": head + first token, then the rest in one write (the least the relay can be given);
    # "per-event": every SSE event, [DONE] and the chunked terminator in writes of their own, as vLLM's
    # uvicorn sends them, so a relay sees one upstream read per event.
    sse_writes: Literal["batched", "per-event"] = "batched"
    # Empty = from the role: prefill produces KV, decode consumes it.
    kv_roles: tuple[str, ...] = ()
    process_started_at: float = PROCESS_STARTED_AT
    # Fault specs applied at start (``--fault``).
    faults: tuple[str, ...] = ()
    # vLLM's uvicorn closes idle keep-alive connections after 5 s; so does the mock.
    idle_timeout_s: float = 5.0
    # HTTPS with this certificate and key; a client CA makes callers present a certificate (mTLS).
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None
    # A prefix cache of this many 16-token blocks (0: none), and the time a prefill takes per prompt
    # token it did not find cached; prefills then run one at a time, so misses cost and queues form.
    prefix_cache_blocks: int = 0
    prefill_s_per_token: float = 0.0
    # vLLM 0.32's stream shapes (see the module docstring): every K-th sequence position a character's
    # first half (0: none), and N tokens per SSE event.
    split_every: int = 0
    tokens_per_event: int = 1
    # Publish the prefix cache's stores and evictions as vLLM's KV events (None: off).
    kv_events: KvEventsSettings | None = None

    @property
    def effective_kv_roles(self) -> tuple[str, ...]:
        if self.kv_roles:
            return self.kv_roles
        return ("producer",) if self.role == "prefill" else ("consumer",)


@dataclasses.dataclass
class MockStats:
    """What the engine saw, for ``GET /mock/stats``; bodies stay raw until asked for."""

    requests: Counter[str] = dataclasses.field(default_factory=Counter)
    prefill: int = 0
    decode: int = 0
    plain: int = 0
    connections_opened: int = 0
    disconnects: int = 0
    last_kv_transfer_params: dict[str, Any] | None = None
    last_prefill_body: bytes | None = None
    last_decode_body: bytes | None = None
    last_request_ids: dict[str, str | None] = dataclasses.field(
        default_factory=lambda: {"prefill": None, "decode": None})
    # Prefills through the prefix cache by their prompt's first block (a hash), so the bench can tell
    # whether one prefix always went to the same engine; at most _FIRST_BLOCK_KEYS keys.
    prefills_by_first_block: Counter[str] = dataclasses.field(default_factory=Counter)
    # The W3C trace context of the last completion requests (kind, request id, traceparent, tracestate): what a
    # router's tracing passed on (issue 40). Bounded: the last _TRACE_HEADERS_KEPT.
    trace_headers: collections.deque[dict[str, str | None]] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=_TRACE_HEADERS_KEPT))

    def describe(self) -> dict[str, Any]:
        def body(raw: bytes | None) -> Any:
            return None if raw is None else _decode_any(raw)

        return {
            "requests": dict(self.requests),
            "prefill": self.prefill,
            "decode": self.decode,
            "plain": self.plain,
            "connections_opened": self.connections_opened,
            "disconnects": self.disconnects,
            "last_kv_transfer_params": self.last_kv_transfer_params,
            "last_prefill_body": body(self.last_prefill_body),
            "last_decode_body": body(self.last_decode_body),
            "last_request_ids": dict(self.last_request_ids),
            "prefills_by_first_block": dict(self.prefills_by_first_block),
            "trace_headers": list(self.trace_headers),
        }


# ----- response shapes ---------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Shape:
    """Pre-encoded pieces of one request's SSE events, so a token costs one join."""

    head: bytes      # 'data: {..."choices":[{"index":0,' up to the token text
    open_text: bytes  # '"text":"' or '"delta":{"content":"'
    close_text: bytes  # '"' or '"}': ends the text; token IDs may follow
    mid: bytes       # closes a token event that is not the last
    last: bytes      # closes the last token event (finish_reason "length")
    role_event: bytes  # chat's leading role event; b"" for completions
    usage_head: bytes  # 'data: {...,"choices":[],"usage":'

    def token_event(self, text: bytes, final: bool, extra: bytes = b"") -> bytes:
        return b"".join((self.head, self.open_text, text, self.close_text, extra, self.last if final else self.mid))

    def for_choice(self, index: int) -> _Shape:
        """The same pieces for choice ``index`` of an ``n`` > 1 answer."""
        if index == 0:
            return self
        first, other = b'"choices":[{"index":0,', b'"choices":[{"index":%d,' % index
        return dataclasses.replace(self, head=self.head.replace(first, other, 1),
                                   role_event=self.role_event.replace(first, other, 1))


def _stream_shape(chat: bool, rid: str, created: int, model_json: bytes) -> _Shape:
    if chat:
        common = b'{"id":"%s","object":"chat.completion.chunk","created":%d,"model":%s,' % (
            rid.encode(), created, model_json)
        return _Shape(
            head=b'data: ' + common + b'"choices":[{"index":0,',
            open_text=b'"delta":{"content":"',
            close_text=b'"}',
            mid=b',"logprobs":null,"finish_reason":null}]}\n\n',
            last=b',"logprobs":null,"finish_reason":"length","stop_reason":null}]}\n\n',
            role_event=b'data: ' + common
            + b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
            b'"logprobs":null,"finish_reason":null}]}\n\n',
            usage_head=b'data: ' + common + b'"choices":[],"usage":',
        )
    common = b'{"id":"%s","object":"text_completion","created":%d,"model":%s,' % (rid.encode(), created, model_json)
    return _Shape(
        head=b'data: ' + common + b'"choices":[{"index":0,',
        open_text=b'"text":"',
        close_text=b'"',
        mid=b',"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n',
        last=b',"logprobs":null,"finish_reason":"length","stop_reason":null}]}\n\n',
        role_event=b"",
        usage_head=b'data: ' + common + b'"choices":[],"usage":',
    )


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens}


_STATUS_ERRORS = {
    Mode.STATUS_408: (408, "request timed out (injected fault)", "RequestTimeout"),
    Mode.STATUS_429: (429, "too many requests (injected fault)", "RateLimitError"),
    Mode.UNHEALTHY: (503, "engine unhealthy (injected fault)", "ServiceUnavailable"),
}


class _Completion(msgspec.Struct, frozen=True, kw_only=True):
    """One validated completion request, classified."""

    op: Operation
    # True for a disaggregated prefill: answered in one body that carries the handoff.
    handoff: bool
    chat: bool
    prompt_tokens: int
    max_tokens: int
    # Choices to answer (vLLM's ``n``): streamed interleaved, each chunk's ``choices[0].index`` naming its own.
    n: int
    stream: bool
    include_usage: bool
    # The prompt's token IDs when the request asked for token IDs back (return_token_ids).
    prompt_ids: list[int] | None = None
    # The prompt was given as token IDs and ends on a generated token (only such a prompt can end inside a
    # character: a prompt's own words are whole).
    ids_prompt: bool = False
    stop: tuple[str, ...] = ()
    include_stop: bool = False
    # Some option changes the answer's shape: it goes through ``_generate``, not the fast path.
    shaped: bool = False


@dataclasses.dataclass
class _Answer:
    """A shaped answer: per generated token its ID and the text its SSE event carries."""

    ids: list[int] = dataclasses.field(default_factory=list)
    texts: list[str] = dataclasses.field(default_factory=list)
    # The stop string that ended the answer; None when max_tokens did.
    stop: str | None = None


def _find_stop(output: str, new_chars: int, stops: tuple[str, ...], include: bool,
               searched_from: int) -> tuple[str, int] | None:
    """The stop string the newest ``new_chars`` completed and where the text ends, as vLLM's stop checker."""
    # vLLM checks the strings in the request's order and looks only where the new text could complete one.
    for stop in stops:
        at = output.find(stop, max(searched_from, len(output) + 1 - new_chars - len(stop)))
        if at != -1:
            return stop, at + len(stop) if include else at
    return None


def _lead(shape: _Shape, job: _Completion, events: list[bytes]) -> list[bytes]:
    """Put a chat's role events, one per choice, in front of the first token event."""
    if events and shape.role_event:
        roles = []
        for index in range(job.n):
            role = shape.for_choice(index).role_event
            if job.prompt_ids is not None:
                # vLLM 0.32 sends a chat's prompt IDs at the top level of its role chunks.
                role = role.replace(b'"choices":', b'"prompt_token_ids":' + _encode(job.prompt_ids)
                                    + b',"choices":', 1)
            roles.append(role)
        events[0] = b"".join(roles) + events[0]
    return events


def _check_sampling(n: int, temperature: float | None, max_tokens: int) -> None:
    """vLLM's ``SamplingParams`` checks of the fields the mock reads, with its messages."""
    if n < 1:
        raise _invalid(f"n must be at least 1, got {n}.")
    if n > _MAX_N:
        raise _invalid(f"n must be at most {_MAX_N}, got {n}. To increase this limit, set the "
                       "VLLM_MAX_N_SEQUENCES environment variable.")
    if temperature is not None:
        if temperature < 0.0:
            raise _invalid(f"temperature must be non-negative, got {temperature}.", "temperature", temperature)
        if temperature > 2.0:
            raise _invalid(f"temperature must be in [0, 2], got {temperature}.", "temperature", temperature)
    if max_tokens < 1:
        raise _invalid(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
    if temperature is not None and temperature < _GREEDY_EPS and n > 1:
        raise _invalid(f"n must be 1 when using greedy sampling, got {n}.")


# ----- the engine ----------------------------------------------------------------

_T = TypeVar("_T")
_Route = Callable[["Request", "Responder"], Awaitable[None]]


class MockEngine:
    """A vLLM-like engine in one object; ``handle`` is the HTTP server's handler."""

    def __init__(self, settings: MockSettings, *, on_refuse: Callable[[float], None] | None = None) -> None:
        self.settings = settings
        self.faults = FaultTable()
        self.stats = MockStats()
        # The serving shell closes the listener for a ``refuse`` window.
        self.on_refuse = on_refuse
        self.port = settings.port
        self.engine_id = settings.engine_id or f"{settings.role}-{settings.port}"
        self._model_json = _encode(settings.model)
        self._ids = itertools.count(1)
        self._id_prefix = secrets.token_hex(4)
        self._blocks = itertools.count(1)
        self.kv_publisher = KvPublisher(settings.kv_events, settings.host) if settings.kv_events else None
        self.prefix_cache = PrefixCache(settings.prefix_cache_blocks, _BLOCK_TOKENS, listener=self.kv_publisher) \
            if settings.prefix_cache_blocks > 0 else None
        self._prefill_lock = trio.Lock()
        for spec in settings.faults:
            self.add_fault(parse_fault_spec(spec))
        self._routes: dict[str, dict[bytes, _Route]] = {
            "/health": {b"GET": self._health},
            "/v1/models": {b"GET": self._models},
            "/tokenize": {b"POST": self._tokenize},
            "/v1/completions": {b"POST": self._completion},
            "/v1/chat/completions": {b"POST": self._completion},
            "/narwhal/identity": {b"GET": self._identity},
            "/narwhal/attest": {b"POST": self._attest},
            "/mock/faults": {b"GET": self._list_faults, b"POST": self._set_fault, b"DELETE": self._clear_faults},
            "/mock/stats": {b"GET": self._get_stats},
            "/mock/stats/reset": {b"POST": self._reset_stats},
            "/reset_prefix_cache": {b"POST": self._reset_prefix_cache},
        }

    def __repr__(self) -> str:
        return f"<MockEngine {self.engine_id} {self.settings.role} port={self.port} {self.faults!r}>"

    def on_bound(self, port: int) -> None:
        """Learn the bound port: it is advertised in handoffs and names the engine by default."""
        self.port = port
        self.engine_id = self.settings.engine_id or f"{self.settings.role}-{port}"

    def add_fault(self, request: FaultRequest) -> Fault:
        """Validate and activate a fault; a ``refuse`` window goes to the serving shell."""
        fault = self.faults.validate(request)
        duration_s = fault.params.get("duration_s")
        if fault.mode is Mode.REFUSE and duration_s is not None:
            if self.on_refuse is None:
                raise FaultError("this engine is not served by a shell that can close its listener")
            self.on_refuse(duration_s)
        else:
            self.faults.add(fault)
        return fault

    async def handle(self, request: Request, responder: Responder) -> None:
        """Answer one request; a client gone mid-answer is counted, not raised."""
        path = request.path
        methods = self._routes.get(path)
        if methods is None:
            await responder.respond(404, _JSON, _error_body(f"no route {path}", "NotFoundError", 404))
            return
        handler = methods.get(request.method)
        if handler is None:
            allow = b", ".join(methods)
            await responder.respond(405, [*_JSON, (b"allow", allow)],
                                    _error_body(f"method not allowed on {path}", "MethodNotAllowed", 405))
            return
        if not path.startswith("/mock/"):
            self.stats.requests[path] += 1
        try:
            try:
                await handler(request, responder)
            except _BadRequest as exc:
                await responder.respond(exc.status, _JSON, _error_body(exc.message, exc.type_, exc.status, exc.param))
        except ClientDisconnected:
            self.stats.disconnects += 1
        except trio.Cancelled:
            # The server cancels a handler whose client went away; count that, let it pass.
            if responder.client_disconnected:
                self.stats.disconnects += 1
            raise

    # ----- faults that replace the whole answer --------------------------------

    async def _terminal(self, fault: Fault, responder: Responder) -> None:
        if fault.mode is Mode.HANG:
            await trio.sleep_forever()
        if fault.mode is Mode.STATUS_5XX:
            status = fault.params["status"]
            body = _error_body(f"engine error {status} (injected fault)", "InternalServerError", status)
        else:
            status, message, type_ = _STATUS_ERRORS[fault.mode]
            body = _error_body(message, type_, status)
        await responder.respond(status, _JSON, body)

    async def _take_or_answer(self, op: Operation, responder: Responder, *, streamed: bool = False,
                              handoff: bool = False) -> Applied | None:
        """The faults for this request; None when a terminal fault already answered it."""
        applied = self.faults.take(op, streamed=streamed, handoff=handoff)
        if applied.terminal is not None:
            await self._terminal(applied.terminal, responder)
            return None
        return applied

    # ----- engine routes -----------------------------------------------------------

    async def _health(self, request: Request, responder: Responder) -> None:
        if await self._take_or_answer(Operation.HEALTH, responder) is not None:
            await responder.respond(200, [], b"")

    def _reported_model(self, applied: Applied) -> str:
        fault = applied.get(Mode.MODEL)
        return fault.params["value"] if fault else self.settings.model

    def _reported_generation(self, applied: Applied) -> str:
        fault = applied.get(Mode.GENERATION)
        return fault.params["value"] if fault else self.settings.generation

    async def _models(self, request: Request, responder: Responder) -> None:
        applied = await self._take_or_answer(Operation.MODELS, responder)
        if applied is None:
            return
        card = {"id": self._reported_model(applied), "object": "model",
                "created": int(self.settings.process_started_at), "owned_by": "narwhal-mock",
                "root": self.settings.model, "max_model_len": self.settings.max_model_len}
        await responder.respond(200, _JSON, _encode({"object": "list", "data": [card]}))

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.model:
            raise _BadRequest(404, f"The model `{model}` does not exist.", "NotFoundError")

    async def _tokenize(self, request: Request, responder: Responder) -> None:
        body = _decode_request(request.body)
        self._check_model(body.model)
        if body.messages is None and body.prompt is None:
            raise _BadRequest(400, "the request needs prompt or messages")
        if body.messages is None and not isinstance(body.prompt, str):
            # As vLLM 0.32: /tokenize takes a prompt only as a string (completions take token IDs too).
            raise _request_invalid("string_type", "body.prompt", "Input should be a valid string")
        tokens = tokenize(body.prompt, body.messages, continue_final=body.continue_final_message)
        if await self._take_or_answer(Operation.TOKENIZE, responder) is None:
            return
        await responder.respond(200, _JSON, _encode(
            {"count": len(tokens), "max_model_len": self.settings.max_model_len, "tokens": tokens}))

    async def _identity(self, request: Request, responder: Responder) -> None:
        applied = await self._take_or_answer(Operation.IDENTITY, responder)
        if applied is None:
            return
        identity = EngineIdentity(
            engine_id=self.engine_id, model=self._reported_model(applied),
            generation=self._reported_generation(applied),
            process_started_at=self.settings.process_started_at,
            kv_roles=list(self.settings.effective_kv_roles),
            kv_events=None if self.kv_publisher is None else self.kv_publisher.identity())
        await responder.respond(200, _JSON, _encode(identity))

    def signature(self, nonce: str, generation: str | None = None) -> str:
        """The attestation signature: hex HMAC-SHA256 over ``engine_id|nonce|generation``."""
        return attestation.sign(self.settings.attestation_key.encode(), self.engine_id, nonce,
                                generation or self.settings.generation)

    async def _attest(self, request: Request, responder: Responder) -> None:
        nonce = _decode_body(request.body, AttestRequest).nonce
        applied = await self._take_or_answer(Operation.ATTEST, responder)
        if applied is None:
            return
        if applied.get(Mode.WRONG_NONCE):
            # A replayed answer: correctly signed, for some other nonce.
            nonce = f"{nonce}-stale"
        signature = self.signature(nonce, self._reported_generation(applied))
        if applied.get(Mode.BAD_ATTESTATION):
            signature = hashlib.sha256(signature.encode()).hexdigest()
        await responder.respond(200, _JSON, _encode(
            AttestResponse(engine_id=self.engine_id, nonce=nonce, signature=signature)))

    # ----- completions ---------------------------------------------------------------

    def _classify(self, body: _CompletionBody, chat: bool) -> _Completion:
        """Validate a completion request as vLLM does (its request model, then its renderer, then its sampling
        parameters) and name its leg."""
        if chat and body.messages is None:
            raise _request_invalid("missing", "body.messages", "Field required")
        if not chat and (body.prompt is None or body.prompt == ""):
            raise _request_invalid("value_error", "body", "Value error, Either prompt or prompt_embeds must be "
                                   "provided and non-empty.", param="prompt")
        if not chat and body.n is None:
            raise _request_invalid("int_type", "body.n", "Input should be a valid integer")
        if body.stream_options is not None and not body.stream:
            raise _request_invalid("value_error", "body", "Value error, Stream options can only be defined when "
                                   "`stream=True`.", param="stream_options")
        self._check_model(body.model)
        if chat and not body.messages:
            raise _BadRequest(400, "the request needs messages")
        if chat and body.continue_final_message and body.add_generation_prompt:
            raise _BadRequest(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        prompt_ids = (tokenize(messages=body.messages, continue_final=body.continue_final_message) if chat
                      else tokenize(body.prompt))
        prompt_tokens = len(prompt_ids)
        if not prompt_tokens and not chat and isinstance(body.prompt, list):
            raise _BadRequest(400, "The decoder prompt cannot be empty")
        kv = body.kv_transfer_params
        roles = self.settings.effective_kv_roles
        if kv is not None and kv.get("do_remote_prefill"):
            if "consumer" not in roles:
                raise _BadRequest(400, f"engine {self.engine_id} is not a KV consumer (kv_roles: {list(roles)})")
            try:
                msgspec.convert(kv, KVTransferParams)
            except msgspec.ValidationError as exc:
                raise _BadRequest(400, f"decode needs a readable kv_transfer_params: {exc}") from None
            op, handoff = Operation.DECODE, False
        elif kv is not None and kv.get("do_remote_decode"):
            if "producer" not in roles:
                raise _BadRequest(400, f"engine {self.engine_id} is not a KV producer (kv_roles: {list(roles)})")
            op, handoff = Operation.PREFILL, True
        else:
            # Served as a non-disaggregated engine would; faults see this engine's role's leg.
            op, handoff = (Operation.PREFILL if self.settings.role == "prefill" else Operation.DECODE), False
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = 1 if handoff and (requested is None or requested >= 1) else \
            self.settings.tokens if requested is None else requested
        if prompt_tokens + max_tokens > self.settings.max_model_len:
            raise _BadRequest(400, f"This model's maximum context length is {self.settings.max_model_len} "
                              f"tokens. However, you requested {prompt_tokens + max_tokens} tokens "
                              f"({prompt_tokens} in the messages, {max_tokens} in the completion).")
        n = 1 if body.n is None else body.n
        _check_sampling(n, body.temperature, max_tokens)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        if "" in stop:
            raise _invalid("stop cannot contain an empty string.")
        settings = self.settings
        # A prefill is answered in one JSON body, whatever it asked for.
        return _Completion(op=op, handoff=handoff, chat=chat, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                           n=n, stream=bool(body.stream) and not handoff, include_usage=include_usage,
                           prompt_ids=prompt_ids if body.return_token_ids else None,
                           ids_prompt=not chat and isinstance(body.prompt, list) and self._ends_generated(prompt_ids),
                           stop=stop,
                           include_stop=body.include_stop_str_in_output,
                           shaped=bool(stop) or settings.split_every > 0 or settings.tokens_per_event > 1)

    def _ends_generated(self, prompt_ids: list[int]) -> bool:
        """Whether a token-ID prompt's last token is one this mock generates at that position (numbered mode;
        without it any last token is taken as generated)."""
        if not self.settings.numbered or not prompt_ids:
            return True
        return prompt_ids[-1] == _text_id(b" n%d" % (len(prompt_ids) - 1))

    def _record(self, request: Request, job: _Completion, kv: dict[str, Any] | None) -> None:
        stats = self.stats
        traceparent = request.get_header(b"traceparent")
        if traceparent is not None:
            state = request.get_header(b"tracestate")
            stats.trace_headers.append({
                "kind": "prefill" if job.handoff else "decode" if kv is not None else "plain",
                "request_id": _request_id(request), "traceparent": traceparent.decode("latin-1"),
                "tracestate": None if state is None else state.decode("latin-1")})
        if job.handoff:
            stats.prefill += 1
            stats.last_prefill_body = request.body
            stats.last_request_ids["prefill"] = _request_id(request)
        elif kv is not None and job.op is Operation.DECODE:
            stats.decode += 1
            stats.last_kv_transfer_params = kv
            stats.last_decode_body = request.body
            stats.last_request_ids["decode"] = _request_id(request)
        else:
            stats.plain += 1

    async def _completion(self, request: Request, responder: Responder) -> None:
        chat = request.path == "/v1/chat/completions"
        body = _decode_request(request.body)
        job = self._classify(body, chat)
        self._record(request, job, body.kv_transfer_params)
        applied = await self._take_or_answer(job.op, responder, streamed=job.stream, handoff=job.handoff)
        if applied is None:
            return
        if job.op is Operation.PREFILL and (self.prefix_cache is not None or self.settings.prefill_s_per_token):
            await self._compute_prefill(body, chat)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{self._id_prefix}{next(self._ids):x}"
        created = int(time.time())
        slow = applied.get(Mode.SLOW_TOKENS)
        token_delay_s = slow.params["delay_s"] if slow else self.settings.token_delay_s
        first = applied.get(Mode.FIRST_TOKEN_DELAY)
        first_delay_s = first.params["delay_s"] if first else None
        if job.stream:
            await self._stream(responder, _stream_shape(chat, rid, created, self._model_json), job, applied,
                               token_delay_s, first_delay_s)
            return
        if first_delay_s is not None:
            await trio.sleep(first_delay_s)
        choices = [self._choice(job, index) for index in range(job.n)]
        generated = [len(choice.get("token_ids") or ()) for choice in choices]
        if token_delay_s:
            # The choices are generated side by side: the longest takes longest.
            await trio.sleep(token_delay_s * max(generated))
        answer: dict[str, Any] = {
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": self.settings.model, "choices": choices,
            "usage": _usage(job.prompt_tokens, sum(generated)),
        }
        for choice in choices:
            if job.prompt_ids is None:
                del choice["prompt_token_ids"], choice["token_ids"]
            elif chat:
                del choice["prompt_token_ids"]
        if job.prompt_ids is not None and chat:
            # vLLM 0.32: completions carry prompt IDs in each choice, chat at the top level.
            answer["prompt_token_ids"] = job.prompt_ids
        cut = applied.get(Mode.CUT)
        if cut and not job.handoff:
            raw = _encode(answer)
            # Half the body under a 200 head, then the connection closes.
            await responder.start_stream(200, _JSON, raw[:len(raw) // 2])
            return
        if job.handoff:
            self._put_handoff(answer, job.prompt_tokens, applied.get(Mode.BAD_KV))
        else:
            answer["kv_transfer_params"] = None
        await responder.respond(200, _JSON, _encode(answer))

    async def _compute_prefill(self, body: _CompletionBody, chat: bool) -> None:
        """One prefill at a time, taking ``prefill_s_per_token`` per prompt token not in the prefix cache."""
        tokens = tokenize(messages=body.messages) if chat else tokenize(body.prompt)
        by_block = self.stats.prefills_by_first_block
        if len(tokens) >= _BLOCK_TOKENS:
            key = block_hash(None, tokens[:_BLOCK_TOKENS])[:8].hex()
            if key in by_block or len(by_block) < _FIRST_BLOCK_KEYS:
                by_block[key] += 1
        async with self._prefill_lock:
            cached = self.prefix_cache.prefill(tokens) if self.prefix_cache is not None else 0
            if self.kv_publisher is not None:
                self.kv_publisher.flush()
            delay_s = (len(tokens) - cached) * self.settings.prefill_s_per_token
            if delay_s > 0:
                await trio.sleep(delay_s)

    def _put_handoff(self, answer: dict[str, Any], prompt_tokens: int, bad_kv: Fault | None) -> None:
        """The prefill's KV handoff, or the unreadable one a ``bad_kv`` fault asks for."""
        blocks = max(1, -(-prompt_tokens // _BLOCK_TOKENS))
        kv: dict[str, Any] = {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
            "remote_block_ids": [next(self._blocks) for _ in range(blocks)],
            "remote_host": self.settings.host, "remote_port": self.port, "tp_size": 1,
        }
        variant = bad_kv.params["variant"] if bad_kv else None
        if variant == "absent":
            return
        if variant == "null":
            answer["kv_transfer_params"] = None
            return
        if variant == "string":
            answer["kv_transfer_params"] = _encode(kv).decode()
            return
        if variant == "missing_block_ids":
            del kv["remote_block_ids"]
        elif variant == "bad_port":
            kv["remote_port"] = "not-a-port"
        answer["kv_transfer_params"] = kv

    def _choice(self, job: _Completion, index: int) -> dict[str, Any]:
        """Choice ``index`` of a JSON answer, with its ``prompt_token_ids`` and ``token_ids`` (the caller keeps
        what the request asked for)."""
        if job.shaped:
            shaped = self._generate(job, index)
            text, token_ids, stop_reason = "".join(shaped.texts), shaped.ids, shaped.stop
        else:
            texts = [self._text(job, i, index) for i in range(job.max_tokens)]
            text, token_ids, stop_reason = b"".join(texts).decode(), [_text_id(t) for t in texts], None
        choice: dict[str, Any] = {"index": index, "logprobs": None,
                                  "finish_reason": "length" if stop_reason is None else "stop",
                                  "stop_reason": stop_reason}
        if job.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["prompt_token_ids"] = job.prompt_ids
        choice["token_ids"] = token_ids
        return choice

    def _text(self, job: _Completion, i: int, choice: int = 0) -> bytes:
        """The text of generated token ``i`` of choice ``choice`` (choices after the first are marked ``-c``)."""
        if self.settings.numbered:
            return b" n%d-%d" % (job.prompt_tokens + i, choice) if choice else b" n%d" % (job.prompt_tokens + i)
        return b" tok%d-%d" % (i, choice) if choice else _token_text(i)

    def _events(self, shape: _Shape, job: _Completion, count: int, choice: int = 0) -> list[bytes]:
        n = job.max_tokens
        if job.prompt_ids is None:
            return [shape.token_event(self._text(job, i, choice), i == n - 1) for i in range(count)]
        events = []
        for i in range(count):
            text = self._text(job, i, choice)
            extra = b',"token_ids":[%d]' % _text_id(text)
            if i == 0 and not job.chat:
                extra = b',"prompt_token_ids":' + _encode(job.prompt_ids) + extra
            events.append(shape.token_event(text, i == n - 1, extra))
        return events

    def _generate(self, job: _Completion, choice: int = 0) -> _Answer:
        """The answer token by token as vLLM's detokenizer emits it: split characters, the echo, stop strings."""
        split = self.settings.split_every
        length = job.prompt_tokens
        # vLLM 0.32's echo: a token-ID prompt ending inside a character makes the first text the whole
        # prompt's (the completed character's first half, at position L-1, included).
        echo = split > 0 and job.ids_prompt and length > 0 and (length - 1) % split == split - 1
        output = "".join(f" n{p}" for p in range(length)) if echo else ""
        searched_from = len(output)  # stop strings are looked for in the generated text only
        hold = max(map(len, job.stop)) - 1 if job.stop and not job.include_stop else 0
        answer = _Answer()
        sent = 0
        pending = ""  # a character's first half, waiting for the token that completes it
        for i in range(job.max_tokens):
            raw = self._text(job, i, choice)
            answer.ids.append(_text_id(raw))
            final = i == job.max_tokens - 1
            if split and (length + i) % split == split - 1 and not final:
                pending, new = raw.decode(), ""
            else:
                new, pending = pending + raw.decode(), ""
            output += new
            end = len(output)
            if new and job.stop:
                found = _find_stop(output, len(new), job.stop, job.include_stop, searched_from)
                if found is not None:
                    answer.stop, end = found
                    final = True
            # Until the end, the last ``hold`` characters wait: they may be the start of a stop string.
            upto = end if final else max(sent, end - hold)
            answer.texts.append(output[sent:upto])
            sent = upto
            if final:
                break
        return answer

    def _shaped_events(self, shape: _Shape, job: _Completion, answer: _Answer, count: int) -> list[bytes]:
        """The SSE events of the answer's first ``count`` tokens, ``tokens_per_event`` tokens to an event."""
        per = self.settings.tokens_per_event
        total = len(answer.ids)
        if answer.stop is None:
            last = shape.last
        else:
            last = b',"logprobs":null,"finish_reason":"stop","stop_reason":%b}]}\n\n' % _encode(answer.stop)
        events = []
        # A fault that cuts after ``count`` tokens cuts after exactly that many: the event before the cut
        # carries what the output loop had, which may be fewer than ``per`` tokens.
        for start in range(0, count, per):
            end = min(start + per, count)
            extra = b""
            if job.prompt_ids is not None:
                extra = b',"token_ids":' + _encode(answer.ids[start:end])
                if start == 0 and not job.chat:
                    extra = b',"prompt_token_ids":' + _encode(job.prompt_ids) + extra
            # The mock's texts are ASCII words: JSON-safe as they are.
            text = "".join(answer.texts[start:end]).encode()
            events.append(b"".join((shape.head, shape.open_text, text, shape.close_text, extra,
                                    last if end == total else shape.mid)))
        return events

    async def _stream(self, responder: Responder, shape: _Shape, job: _Completion, applied: Applied,
                      token_delay_s: float, first_delay_s: float | None) -> None:
        """Write the SSE answer: one write per token when paced, else head+first token, then the rest."""
        answers = [self._generate(job, index) for index in range(job.n)] if job.shaped else None
        lengths = [job.max_tokens] * job.n if answers is None else [len(answer.ids) for answer in answers]
        stall = applied.get(Mode.STALL)
        garbage = applied.get(Mode.GARBAGE_STREAM)
        closed = applied.get(Mode.CUT)
        cut = stall or garbage
        # Faults that end the stream early count tokens per choice: every choice stops after that many.
        per_choice = []
        for index, n in enumerate(lengths):
            if closed:
                after = closed.params["after_tokens"]
                count = min(n, n // 2 if after is None else after)
            else:
                count = min(n, cut.params["after_tokens"]) if cut else n
            choice_shape = shape.for_choice(index)
            per_choice.append(self._events(choice_shape, job, count, index) if answers is None
                              else self._shaped_events(choice_shape, job, answers[index], count))
        if job.n == 1:
            events = per_choice[0]
        else:
            # vLLM steps the choices together: one engine step's events, one per choice still going, go
            # out together (and are paced as one).
            events = [b"".join(choice[step] for choice in per_choice if step < len(choice))
                      for step in range(max(map(len, per_choice)))]
        events = _lead(shape, job, events)
        if answers is not None:
            # The pause is per token: an event of N tokens comes N pauses after the one before.
            token_delay_s *= self.settings.tokens_per_event
        if closed:
            # Half the answer, then the connection closes: no [DONE], no chunked terminator.
            await self._write_each(responder, events, token_delay_s)
            return
        if garbage:
            tail = _GARBAGE
        elif stall:
            tail = b""
        else:
            tail = (shape.usage_head + _encode(_usage(job.prompt_tokens, sum(lengths))) + b"}\n\n"
                    if job.include_usage else b"")
            if not applied.get(Mode.NO_DONE):
                tail += _DONE
        if self.settings.sse_writes == "per-event" and not stall:
            await self._stream_per_event(responder, events, tail, token_delay_s, first_delay_s)
            return
        # events[:split] go out one write each; the rest goes with the terminator in the last write.
        if stall:
            split = len(events)
        elif token_delay_s:
            split = max(0, len(events) - 1)
        else:
            split = min(1, len(events))
        if first_delay_s is not None:
            await responder.start_stream(200, _SSE)
            await trio.sleep(first_delay_s)
        await self._write_each(responder, events[:split], token_delay_s)
        if stall:
            await trio.sleep_forever()
        if token_delay_s and split < len(events):
            await trio.sleep(token_delay_s)
        await responder.end_stream(b"".join(events[split:]) + tail)

    async def _write_each(self, responder: Responder, events: list[bytes], token_delay_s: float) -> None:
        """One write per event, ``token_delay_s`` before each; the stream is started even with no event."""
        for event in events:
            if token_delay_s:
                await trio.sleep(token_delay_s)
            if responder.started:
                await responder.write(event)
            else:
                await responder.start_stream(200, _SSE, event)
        if not responder.started:
            await responder.start_stream(200, _SSE)

    async def _stream_per_event(self, responder: Responder, events: list[bytes], tail: bytes,
                                token_delay_s: float, first_delay_s: float | None) -> None:
        """One write per SSE event as vLLM does: the head alone, each event, usage, [DONE], the terminator."""
        await responder.start_stream(200, _SSE)
        if first_delay_s is not None:
            await trio.sleep(first_delay_s)
        for event in events:
            if token_delay_s:
                await trio.sleep(token_delay_s)
            await responder.write(event)
        # The tail is the usage event and [DONE] (or garbage that is not SSE): one write per event.
        *whole, rest = tail.split(b"\n\n")
        for part in whole:
            await responder.write(part + b"\n\n")
        if rest:
            await responder.write(rest)
        await responder.end_stream()

    # ----- /mock control ---------------------------------------------------------------

    async def _list_faults(self, request: Request, responder: Responder) -> None:
        await responder.respond(200, _JSON, _encode({"faults": self.faults.describe()}))

    async def _set_fault(self, request: Request, responder: Responder) -> None:
        fault_request = _decode_body(request.body, FaultRequest)
        try:
            fault = self.add_fault(fault_request)
        except FaultError as exc:
            raise _BadRequest(400, str(exc)) from None
        await responder.respond(200, _JSON, _encode({"fault": fault.describe()}))

    async def _clear_faults(self, request: Request, responder: Responder) -> None:
        self.faults.clear()
        await responder.respond(200, _JSON, _encode({"faults": []}))

    async def _get_stats(self, request: Request, responder: Responder) -> None:
        await responder.respond(200, _JSON, _encode(self._describe_stats()))

    async def _reset_stats(self, request: Request, responder: Responder) -> None:
        self.stats = MockStats()
        if self.prefix_cache is not None:
            self.prefix_cache.reset_counters()
        await responder.respond(200, _JSON, _encode(self._describe_stats()))

    async def _reset_prefix_cache(self, request: Request, responder: Responder) -> None:
        # vLLM's dev-mode route: empties the cache (AllBlocksCleared on the KV event feed), keeps the metrics.
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        if self.kv_publisher is not None:
            self.kv_publisher.flush()
        await responder.respond(200, _JSON, _encode({"success": True}))

    def _describe_stats(self) -> dict[str, Any]:
        described = self.stats.describe()
        described["prefix_cache"] = None if self.prefix_cache is None else self.prefix_cache.describe()
        publisher = self.kv_publisher
        described["kv_events"] = None if publisher is None else {
            **msgspec.structs.asdict(publisher.identity()), "published": publisher.published,
            "dropped": publisher.dropped}
        return described


def _decode_body(raw: bytes, type_: type[_T]) -> _T:
    try:
        return msgspec.json.decode(raw, type=type_)
    except msgspec.DecodeError as exc:
        raise _BadRequest(400, f"invalid JSON body: {exc}") from None


_EXPECTED = re.compile(r"Expected `([^`]*)`")
_PATH_PART = re.compile(r"\.(\w+)|\[(\d+)\]")
# pydantic's error type and message for a value of the wrong kind, by the field's type and whether the
# value was a string (a lax model parses numbers and booleans out of strings).
_TYPE_ERRORS = {
    ("float", True): ("float_parsing", "Input should be a valid number, unable to parse string as a number"),
    ("float", False): ("float_type", "Input should be a valid number"),
    ("int", True): ("int_parsing", "Input should be a valid integer, unable to parse string as an integer"),
    ("int", False): ("int_type", "Input should be a valid integer"),
    ("bool", True): ("bool_parsing", "Input should be a valid boolean, unable to interpret input"),
    ("bool", False): ("bool_type", "Input should be a valid boolean"),
    ("str", False): ("string_type", "Input should be a valid string"),
}


def _decode_request(raw: bytes) -> _CompletionBody:
    """A completion request read as vLLM's (pydantic, lax) request model reads it: ``"2"`` is an int, ``"hot"``
    no float; a field of the wrong type is vLLM's validation 400 naming it."""
    try:
        data = _decode_any(raw)
    except msgspec.DecodeError as exc:
        raise _BadRequest(400, f"invalid JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise _request_invalid("model_attributes_type", "body", "Input should be a valid dictionary or object")
    try:
        return msgspec.convert(data, _CompletionBody, strict=False)
    except msgspec.ValidationError as exc:
        text = str(exc)
        message, _, path = text.partition(" - at `$")
        loc = "body" + "".join(f".{name or index}" for name, index in _PATH_PART.findall(path.rstrip("`")))
        expected = _EXPECTED.search(message)
        value: Any = data
        for name, index in _PATH_PART.findall(path.rstrip("`")):
            value = value.get(name) if name and isinstance(value, dict) else \
                value[int(index)] if index and isinstance(value, list) and int(index) < len(value) else None
        kind = next((k for k in ("float", "int", "bool", "str")
                     if expected and k in expected.group(1).replace("|", " ").split()), "")
        known = _TYPE_ERRORS.get((kind, isinstance(value, str) and kind != "str"))
        if known is None:
            raise _request_invalid("type_error", loc, message) from None
        raise _request_invalid(known[0], loc, known[1]) from None


def _request_id(request: Request) -> str | None:
    value = request.get_header(b"x-request-id")
    return value.decode("latin-1") if value is not None else None


# ----- serving --------------------------------------------------------------------

_SHUTDOWN_GRACE_S = 1.0


class _MockListener(trio.abc.Listener[trio.SocketStream]):
    """A TCP listener that counts connections and resets the ones a counted ``refuse`` claims."""

    def __init__(self, inner: trio.SocketListener, engine: MockEngine) -> None:
        self._inner = inner
        self._engine = engine
        # HTTPServer closes listeners through ``.socket``.
        self.socket = inner.socket

    async def accept(self) -> trio.SocketStream:
        while True:
            stream = await self._inner.accept()
            self._engine.stats.connections_opened += 1
            if not self._engine.faults.take_connection_refusal():
                return stream
            # Linger 0 makes close() send RST: the client sees a reset, no response.
            stream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            stream.socket.close()

    async def aclose(self) -> None:
        await self._inner.aclose()


def _ssl_context(settings: MockSettings) -> ssl.SSLContext | None:
    """The mock's HTTPS context, or None for plain HTTP; ConfigError names the bad option."""
    if settings.tls_cert_file is None or settings.tls_key_file is None:
        return None
    client_ca = Path(settings.tls_client_ca_file) if settings.tls_client_ca_file else None
    return server_context_from_files(Path(settings.tls_cert_file), Path(settings.tls_key_file), client_ca,
                                     names=("--tls-cert-file", "--tls-key-file", "--tls-client-ca-file"))


class MockService:
    """Serves one MockEngine; closes and reopens its listener for ``refuse`` windows."""

    def __init__(self, settings: MockSettings) -> None:
        self._server: HTTPServer | None = None
        self._ssl_context = _ssl_context(settings)
        self._reopen_at: float | None = None
        self._window: trio.CancelScope | None = None
        self._stopping = False
        self.engine = MockEngine(settings, on_refuse=self._refuse)

    def __repr__(self) -> str:
        return f"<MockService {self.engine!r} server={self._server!r}>"

    def _refuse(self, duration_s: float) -> None:
        if self._stopping:
            return
        self._reopen_at = trio.current_time() + duration_s
        if self._server is not None:
            # In-flight answers (the one that set this fault, too) may finish within the window.
            self._server.shutdown(duration_s)

    def stop(self, grace_s: float) -> None:
        """Stop serving; requests in flight get ``grace_s`` to finish."""
        self._stopping = True
        self._reopen_at = None
        if self._server is not None:
            self._server.shutdown(grace_s)
        if self._window is not None:
            self._window.cancel()

    async def run(self, *, task_status: trio.TaskStatus[MockEngine] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until ``stop``; reports the engine once its port (and KV event publisher, if any) is bound."""
        publisher = self.engine.kv_publisher
        if publisher is None:
            await self._serve(task_status=task_status)
            return
        async with trio.open_nursery() as nursery:
            # Bound before the engine reports: its identity names the publisher's ports.
            await nursery.start(publisher.run)
            await self._serve(task_status=task_status)
            nursery.cancel_scope.cancel()

    async def _serve(self, *, task_status: trio.TaskStatus[MockEngine]) -> None:
        engine = self.engine
        host, port = engine.settings.host, engine.settings.port
        reported = False
        while not self._stopping:
            listeners = await trio.open_tcp_listeners(port, host=host)
            port = listeners[0].socket.getsockname()[1]
            if not reported:
                engine.on_bound(port)
                task_status.started(engine)
                reported = True
            if self._reopen_at is None:
                # Like uvicorn in front of vLLM, EOF from the router cancels the engine's work at once.
                self._server = HTTPServer(engine.handle, idle_timeout_s=engine.settings.idle_timeout_s,
                                          half_close=False, server_name=b"narwhal-mock",
                                          ssl_context=self._ssl_context)
                try:
                    await self._server.serve_listeners([_MockListener(listener, engine) for listener in listeners])
                finally:
                    self._server = None
            else:
                # A refuse window set before the first bind (``--fault refuse:duration_s=...``).
                for listener in listeners:
                    await listener.aclose()
            if self._reopen_at is not None:
                with trio.CancelScope() as self._window:
                    await trio.sleep_until(self._reopen_at)
                self._window = None
                self._reopen_at = None


async def serve_mock(settings: MockSettings, *,
                     task_status: trio.TaskStatus[MockService] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve a mock engine until cancelled; reports its MockService once bound."""
    service = MockService(settings)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        task_status.started(service)


# ----- CLI ---------------------------------------------------------------------------

def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the mock engine's options to ``parser``."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind and advertise (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to bind; 0 picks one (default 0)")
    # Required unless --prefill-engines names every engine's role (checked in _fleet_from_args).
    parser.add_argument("--role", choices=("prefill", "decode"),
                        help="the engine's role: prefill answers with a KV handoff, decode takes one")
    parser.add_argument("--engine-id", help="engine id (default ROLE-PORT; with --engines N: ID-0 ... ID-(N-1))")
    parser.add_argument("--engines", type=int, default=1, metavar="N",
                        help="serve N engines from this process, each on its own port with its own identity "
                             "(default 1); with --port P they bind P ... P+N-1")
    parser.add_argument("--prefill-engines", type=int, metavar="K",
                        help="with --engines: the first K engines are prefill, the rest decode (replaces --role)")
    parser.add_argument("--engines-file", metavar="PATH",
                        help="once every engine is bound, write them (engine_id, role, port, url) to PATH as JSON")
    parser.add_argument("--model", default="mock-model", help="model name in /v1/models (default mock-model)")
    parser.add_argument("--generation", default="g1", help="generation in its identity (default g1)")
    parser.add_argument("--attestation-key", default="narwhal-dev-key",
                        help="the fleet key it signs attestations with (default narwhal-dev-key)")
    parser.add_argument("--max-model-len", type=int, default=4096,
                        help="context length in /v1/models; longer prompts get 400 (default 4096)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per decode without max_tokens (default 16)")
    parser.add_argument("--numbered-tokens", action="store_true",
                        help='generated token at sequence position P is " nP" (a continuation shows a repeat '
                             "or a gap at once)")
    parser.add_argument("--token-delay-s", type=float, default=0.0, help="pause before each token (default 0)")
    parser.add_argument("--split-chars-every", type=int, default=0, metavar="K",
                        help="the generated token at every sequence position P with P %% K == K-1 is the first "
                             "half of a character, sent as vLLM does: its ID, empty text (K >= 2; default 0: off)")
    parser.add_argument("--tokens-per-event", type=int, default=1, metavar="N",
                        help="N tokens per SSE event, as vLLM sends when its output loop is behind (default 1)")
    parser.add_argument("--sse-writes", choices=("batched", "per-event"), default="batched",
                        help="batched: head and first token, then the rest in one write (default); "
                             "per-event: every SSE event, [DONE] and the terminator in its own write, as vLLM does")
    parser.add_argument("--kv-roles", help="comma-separated KV roles, e.g. producer,consumer (default: from role)")
    parser.add_argument("--idle-timeout-s", type=float, default=5.0,
                        help="close idle keep-alive connections after this long, as vLLM's uvicorn does")
    parser.add_argument("--tls-cert-file", metavar="PEM",
                        help="serve HTTPS with this certificate (needs --tls-key-file)")
    parser.add_argument("--tls-key-file", metavar="PEM", help="the certificate's private key")
    parser.add_argument("--tls-client-ca-file", metavar="PEM",
                        help="require client certificates signed by this CA (mutual TLS)")
    parser.add_argument("--prefix-cache-blocks", type=int, default=0, metavar="N",
                        help="model a prefix cache: an LRU of N 16-token prompt blocks (default 0: none)")
    parser.add_argument("--cache-blocks", type=int, dest="prefix_cache_blocks", default=0, metavar="N",
                        help="the same as --prefix-cache-blocks")
    parser.add_argument("--kv-events", type=int, metavar="PORT",
                        help="publish the prefix cache's stores and evictions as vLLM's KV events (ZeroMQ PUB on "
                             "PORT, 0 picks one; needs --cache-blocks); with --engines N: PORT ... PORT+N-1")
    parser.add_argument("--kv-events-replay", type=int, metavar="PORT",
                        help="answer vLLM's replay requests on PORT (ZeroMQ ROUTER; 0 picks one)")
    parser.add_argument("--kv-events-topic", default="", metavar="T", help="the events' topic (default empty)")
    parser.add_argument("--kv-events-encoding", choices=("vllm", "array", "map"), default="vllm",
                        help="vllm: as vLLM 0.32 sends them (default); array: events as tagged arrays (older vLLM); "
                             "map: the batch as a map")
    parser.add_argument("--kv-events-hash", choices=("int", "bytes"), default="int",
                        help="block hashes as unsigned 64-bit ints (default, as vLLM) or 32 bytes")
    parser.add_argument("--prefill-s-per-token", type=float, default=0.0, metavar="S",
                        help="prefill time per prompt token not in the prefix cache; prefills run one at a time "
                             "(default 0)")
    parser.add_argument("--fault", action="append", default=[], metavar="SPEC",
                        help="fault at start, MODE[:KEY=VALUE,...] (repeatable), e.g. status_500:count=3")
    return parser


def _settings_from_args(args: argparse.Namespace) -> MockSettings:
    kv_roles = tuple(role.strip() for role in args.kv_roles.split(",") if role.strip()) if args.kv_roles else ()
    unknown = set(kv_roles) - {"producer", "consumer"}
    if unknown:
        raise ValueError(f"--kv-roles: unknown role(s) {', '.join(sorted(unknown))}")
    if args.prefix_cache_blocks < 0 or not args.prefill_s_per_token >= 0:
        raise ValueError("--prefix-cache-blocks and --prefill-s-per-token must be >= 0")
    if args.tokens < 1 or args.max_model_len < 1 or args.token_delay_s < 0 or args.idle_timeout_s <= 0:
        raise ValueError("--tokens and --max-model-len must be >= 1, --token-delay-s >= 0, --idle-timeout-s > 0")
    if (args.tls_cert_file is None) != (args.tls_key_file is None):
        raise ValueError("--tls-cert-file and --tls-key-file go together")
    if args.split_chars_every < 0 or args.split_chars_every == 1:
        raise ValueError(f"--split-chars-every must be 0 (off) or >= 2, got {args.split_chars_every}")
    if args.tokens_per_event < 1:
        raise ValueError(f"--tokens-per-event must be >= 1, got {args.tokens_per_event}")
    if args.tls_client_ca_file is not None and args.tls_cert_file is None:
        raise ValueError("--tls-client-ca-file needs --tls-cert-file and --tls-key-file")
    kv_events: KvEventsSettings | None = None
    if args.kv_events is not None:
        if args.prefix_cache_blocks <= 0:
            raise ValueError("--kv-events needs a prefix cache to report: --cache-blocks N")
        if not all(0 <= port <= 65535 for port in (args.kv_events, args.kv_events_replay or 0)):
            raise ValueError("--kv-events and --kv-events-replay must be ports (0 picks one)")
        kv_events = KvEventsSettings(port=args.kv_events, replay_port=args.kv_events_replay,
                                     topic=args.kv_events_topic, encoding=args.kv_events_encoding,
                                     hashes=args.kv_events_hash)
    elif args.kv_events_replay is not None:
        raise ValueError("--kv-events-replay needs --kv-events")
    return MockSettings(
        role=args.role or "decode", host=args.host, port=args.port, engine_id=args.engine_id, model=args.model,
        generation=args.generation, attestation_key=args.attestation_key, max_model_len=args.max_model_len,
        tokens=args.tokens, numbered=args.numbered_tokens, token_delay_s=args.token_delay_s, kv_roles=kv_roles,
        faults=tuple(args.fault),
        idle_timeout_s=args.idle_timeout_s, sse_writes=args.sse_writes, tls_cert_file=args.tls_cert_file,
        tls_key_file=args.tls_key_file, tls_client_ca_file=args.tls_client_ca_file,
        prefix_cache_blocks=args.prefix_cache_blocks, prefill_s_per_token=args.prefill_s_per_token,
        split_every=args.split_chars_every, tokens_per_event=args.tokens_per_event, kv_events=kv_events)


def _fleet_from_args(args: argparse.Namespace) -> list[MockSettings]:
    """One MockSettings per engine ``--engines`` asks for; ValueError names a bad combination."""
    if args.engines < 1:
        raise ValueError(f"--engines must be >= 1, got {args.engines}")
    if args.prefill_engines is None:
        if args.role is None:
            raise ValueError("the following arguments are required: --role (or --engines N --prefill-engines K)")
        roles = [args.role] * args.engines
    else:
        if args.role is not None:
            raise ValueError("--role and --prefill-engines exclude each other")
        if not 0 <= args.prefill_engines <= args.engines:
            raise ValueError(f"--prefill-engines must be between 0 and --engines ({args.engines}), "
                             f"got {args.prefill_engines}")
        roles = ["prefill"] * args.prefill_engines + ["decode"] * (args.engines - args.prefill_engines)
    if args.port and args.port + args.engines - 1 > 65535:
        raise ValueError(f"--port {args.port} with --engines {args.engines} runs past port 65535")
    base = _settings_from_args(args)
    if args.engines == 1:
        return [msgspec.structs.replace(base, role=roles[0])]
    return [msgspec.structs.replace(
        base, role=role, port=base.port + i if base.port else 0,
        engine_id=f"{base.engine_id}-{i}" if base.engine_id else None,
        kv_events=_offset_kv_events(base.kv_events, i)) for i, role in enumerate(roles)]


def _offset_kv_events(settings: KvEventsSettings | None, i: int) -> KvEventsSettings | None:
    """Engine ``i``'s publisher ports: offset by ``i`` as vLLM offsets them per data-parallel rank (0 stays 0)."""
    if settings is None or i == 0:
        return settings
    return msgspec.structs.replace(settings, port=settings.port + i if settings.port else 0,
                                   replay_port=settings.replay_port + i if settings.replay_port else
                                   settings.replay_port)


class _EngineEntry(msgspec.Struct, frozen=True):
    """One served engine, as ``--engines-file`` lists it."""

    engine_id: str
    role: str
    port: int
    url: str
    # Its KV event publisher (``--kv-events``), as its identity reports it; null when off.
    kv_events: KvEventsIdentity | None = None


class _EnginesFile(msgspec.Struct, frozen=True):
    engines: list[_EngineEntry]


def _write_engines_file(path: Path, engines: list[MockEngine]) -> None:
    """Write the served engines to ``path`` whole (a temporary file renamed over it)."""
    entries = [_EngineEntry(engine.engine_id, engine.settings.role, engine.port,
                            f"{'https' if engine.settings.tls_cert_file else 'http'}://"
                            f"{engine.settings.host}:{engine.port}",
                            None if engine.kv_publisher is None else engine.kv_publisher.identity())
               for engine in engines]
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(msgspec.json.encode(_EnginesFile(entries)) + b"\n")
    partial.replace(path)


async def _run(fleet: MockSettings | list[MockSettings], engines_file: Path | None = None) -> None:
    """Serve every engine of ``fleet`` until SIGTERM/SIGINT; one ready line per engine once bound."""
    fleet = [fleet] if isinstance(fleet, MockSettings) else fleet
    services = [MockService(settings) for settings in fleet]
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            engines: list[MockEngine] = []
            for service in services:
                engine = await nursery.start(service.run)
                engines.append(engine)
                settings = engine.settings
                ready = {"event": "mock_engine_ready", "port": engine.port, "engine_id": engine.engine_id,
                         "role": settings.role, "model": settings.model, "tls": settings.tls_cert_file is not None}
                if engine.kv_publisher is not None:
                    ready["kv_events"] = msgspec.structs.asdict(engine.kv_publisher.identity())
                sys.stdout.write(_encode(ready).decode() + "\n")
            if engines_file is not None:
                _write_engines_file(engines_file, engines)
            if len(services) > 1:
                # After every engine's line (and the file): a reader waits for this one line.
                sys.stdout.write(_encode({"event": "mock_fleet_ready", "engines": len(engines)}).decode() + "\n")
            sys.stdout.flush()
            async for _ in signals:
                for service in services:
                    service.stop(_SHUTDOWN_GRACE_S)
                break


def main(argv: list[str]) -> int:
    """Run mock engines until SIGTERM/SIGINT; prints a ready line per engine with its bound port."""
    parser = build_parser(OneLineParser(
        prog="narwhal mock-engine", description="A mock vLLM engine with P/D handoffs and fault injection."))
    args = parser.parse_args(argv)
    try:
        fleet = _fleet_from_args(args)
        settings = fleet[0]
        # Faults and certificates are checked before binding, so a typo fails at once.
        for spec in settings.faults:
            FaultTable().validate(parse_fault_spec(spec))
        _ssl_context(settings)
    except (ValueError, ConfigError) as exc:  # FaultError too
        parser.error(str(exc))
    configure_logging()
    try:
        trio.run(_run, fleet, Path(args.engines_file) if args.engines_file else None)
    except (OSError, BaseExceptionGroup) as caught:
        error = _os_error(caught)
        if error is None:
            raise
        log_event("mock_engine_error", level=logging.ERROR, **{"class": type(error).__name__}, message=str(error))
        if isinstance(error, socket.gaierror) or error.errno in _CANNOT_BIND:
            # As `narwhal serve` does: one line, exit 2, no traceback.
            ports = f"{settings.port}-{fleet[-1].port}" if len(fleet) > 1 and settings.port else str(settings.port)
            print(f"narwhal mock-engine: cannot listen on {settings.host}:{ports}: "
                  f"{error.strerror or error}", file=sys.stderr)
            return 2
        print(f"narwhal mock-engine: {error}", file=sys.stderr)
        return 1
    return 0


_CANNOT_BIND = frozenset({errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES})


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError in ``exc``, unwrapping the exception groups nurseries add around it."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc if isinstance(exc, OSError) else None
