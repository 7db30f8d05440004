"""The mock engine: request/response shapes, every fault mode, and the real server.

Handler tests drive ``MockEngine.handle`` with a fake Responder (virtual time);
the socket tests serve it with the project's HTTP server and talk httpx to it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import hmac
import json
import os
import signal
import subprocess
import sys
import zlib
from typing import Any

import httpx
import msgspec
import pytest
import trio

from narwhal.http1.server import ClientDisconnected
from narwhal.tools.mock.engine import (
    MockEngine,
    MockSettings,
    _settings_from_args,
    build_parser,
    main,
    serve_mock,
    tokenize,
)
from narwhal.tools.mock.faults import FaultError, FaultRequest, FaultTable, Leg, Mode, Operation, parse_fault_spec
from narwhal.wire import KVTransferParams

PREFILL_KV = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}
DECODE_KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "prefill-1",
             "remote_block_ids": [1, 2], "remote_host": "127.0.0.1", "remote_port": 9, "tp_size": 1}


# ----- fakes -------------------------------------------------------------------------

@dataclasses.dataclass
class FakeRequest:
    method: bytes
    path: str
    body: bytes = b""
    headers: list[tuple[bytes, bytes]] = dataclasses.field(default_factory=list)
    target: bytes = b""
    query: bytes = b""
    http_version: str = "1.1"
    keep_alive: bool = True
    client: Any = None

    def get_header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k == name), None)


class FakeResponder:
    """Records what the engine writes, and when (trio time)."""

    def __init__(self, disconnect_after_writes: int | None = None) -> None:
        self.started = False
        self.status: int | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.writes: list[tuple[float, bytes]] = []
        self.ended = False
        self.client_disconnected = False
        self._disconnect_after = disconnect_after_writes

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.status, self.headers, self.started, self.ended = status, headers, True, True
        self.writes.append((trio.current_time(), body))

    async def start_stream(self, status: int, headers: list[tuple[bytes, bytes]], first: bytes = b"") -> None:
        self.status, self.headers, self.started = status, headers, True
        self.writes.append((trio.current_time(), first))

    async def write(self, data: bytes) -> None:
        if self._disconnect_after is not None and len(self.writes) >= self._disconnect_after:
            self.client_disconnected = True
            raise ClientDisconnected()
        self.writes.append((trio.current_time(), data))

    async def end_stream(self, last: bytes = b"") -> None:
        self.writes.append((trio.current_time(), last))
        self.ended = True

    @property
    def body(self) -> bytes:
        return b"".join(data for _, data in self.writes)

    def json(self) -> Any:
        return json.loads(self.body)

    def events(self) -> list[str]:
        """The SSE ``data:`` payloads, in order."""
        text = self.body.decode()
        assert text.endswith("\n\n") or not self.ended, text
        return [block.removeprefix("data: ") for block in text.split("\n\n") if block]


def engine(role: str = "decode", **overrides: Any) -> MockEngine:
    settings = MockSettings(role=role, port=8100, **overrides)  # type: ignore[arg-type]
    return MockEngine(settings)


async def call(mock: MockEngine, method: str, path: str, body: Any = None, *,
               headers: list[tuple[bytes, bytes]] | None = None, responder: FakeResponder | None = None,
               ) -> FakeResponder:
    raw = body if isinstance(body, bytes) else b"" if body is None else json.dumps(body).encode()
    responder = responder or FakeResponder()
    await mock.handle(FakeRequest(method.encode(), path, raw, headers or []), responder)  # type: ignore[arg-type]
    return responder


def set_fault(mock: MockEngine, spec: str) -> None:
    mock.add_fault(parse_fault_spec(spec))


def completion(kv: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "mock-model", "prompt": "the quick brown fox", **fields}
    if kv is not None:
        body["kv_transfer_params"] = kv
    return body


def chat(kv: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "mock-model", "messages": [{"role": "user", "content": "hi there"}], **fields}
    if kv is not None:
        body["kv_transfer_params"] = kv
    return body


# ----- plain engine routes -------------------------------------------------------------

async def test_health_models_and_tokenize_shapes() -> None:
    mock = engine(max_model_len=2048)
    health = await call(mock, "GET", "/health")
    assert (health.status, health.body) == (200, b"")
    models = (await call(mock, "GET", "/v1/models")).json()
    assert models["object"] == "list"
    assert {k: models["data"][0][k] for k in ("id", "object", "owned_by", "max_model_len")} == {
        "id": "mock-model", "object": "model", "owned_by": "narwhal-mock", "max_model_len": 2048}
    counted = (await call(mock, "POST", "/tokenize", {"model": "mock-model", "prompt": "a b  c\nd"})).json()
    assert counted["count"] == 4 and counted["max_model_len"] == 2048 and len(counted["tokens"]) == 4
    assert counted["tokens"] == tokenize("a b c d")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text",
                                                                                         "text": "hi"}]}]
    counted = (await call(mock, "POST", "/tokenize", {"model": "mock-model", "messages": messages})).json()
    assert counted["count"] == 2 + 2 + 1  # one role token per message plus the words
    # As vLLM 0.32: /tokenize takes a prompt only as a string; a completion takes token IDs.
    ids = await call(mock, "POST", "/tokenize", {"prompt": [5, 6, 7]})
    assert ids.status == 400 and "Input should be a valid string" in ids.json()["error"]["message"]
    prefill = await call(mock, "POST", "/v1/completions", completion(prompt=[5, 6, 7], max_tokens=1))
    assert prefill.status == 200 and prefill.json()["usage"]["prompt_tokens"] == 3


async def test_bad_requests_are_openai_errors() -> None:
    mock = engine()
    bad_json = await call(mock, "POST", "/v1/completions", b"{not json")
    assert bad_json.status == 400 and bad_json.json()["error"]["type"] == "BadRequestError"
    wrong_model = await call(mock, "POST", "/v1/completions", completion(model="other"))
    assert wrong_model.status == 404 and "other" in wrong_model.json()["error"]["message"]
    assert (await call(mock, "POST", "/tokenize", {"model": "other", "prompt": "x"})).status == 404
    assert (await call(mock, "POST", "/v1/chat/completions", {"model": "mock-model"})).status == 400
    too_long = await call(mock, "POST", "/v1/completions", completion(max_tokens=5000))
    assert too_long.status == 400 and "maximum context length is 4096" in too_long.json()["error"]["message"]
    assert (await call(mock, "GET", "/nope")).status == 404
    wrong_method = await call(mock, "GET", "/v1/completions")
    assert wrong_method.status == 405 and (b"allow", b"POST") in wrong_method.headers


# ----- the P/D flow -------------------------------------------------------------------------

async def test_prefill_returns_one_token_and_a_readable_handoff() -> None:
    mock = engine("prefill", host="127.0.0.1")
    answer = await call(mock, "POST", "/v1/completions", completion(PREFILL_KV, max_tokens=1, stream=False),
                        headers=[(b"x-request-id", b"r-1")])
    body = answer.json()
    assert answer.status == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == " tok0" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}
    kv = body["kv_transfer_params"]
    assert kv == {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "prefill-8100",
                  "remote_block_ids": [1], "remote_host": "127.0.0.1", "remote_port": 8100, "tp_size": 1}
    msgspec.convert(kv, KVTransferParams)
    # A streamed prefill is still answered in one JSON body, and gets fresh blocks.
    again = (await call(mock, "POST", "/v1/chat/completions", chat(PREFILL_KV, stream=True))).json()
    assert again["object"] == "chat.completion" and again["choices"][0]["message"]["role"] == "assistant"
    assert again["kv_transfer_params"]["remote_block_ids"] == [2]
    stats = mock.stats.describe()
    assert stats["prefill"] == 2 and stats["requests"] == {"/v1/completions": 1, "/v1/chat/completions": 1}
    assert stats["last_prefill_body"]["messages"][0]["content"] == "hi there"
    assert stats["last_request_ids"] == {"prefill": None, "decode": None}  # the last one had no header


async def test_decode_streams_completion_chunks_then_done() -> None:
    mock = engine()
    answer = await call(mock, "POST", "/v1/completions",
                        completion(DECODE_KV, max_tokens=3, stream=True, stream_options={"include_usage": True}),
                        headers=[(b"x-request-id", b"r-7")])
    assert answer.status == 200 and (b"content-type", b"text/event-stream") in answer.headers
    events = answer.events()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["text"] for c in chunks[:3]] == [" tok0", " tok1", " tok2"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:3]] == [None, None, "length"]
    assert chunks[0]["object"] == "text_completion" and chunks[0]["model"] == "mock-model"
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[3]["choices"] == [] and chunks[3]["usage"]["completion_tokens"] == 3
    # Unpaced: head and first token in one write, the rest with the terminator in the next.
    assert len(answer.writes) == 2 and answer.ended
    stats = mock.stats.describe()
    assert stats["decode"] == 1 and stats["last_kv_transfer_params"] == DECODE_KV
    assert stats["last_request_ids"]["decode"] == "r-7"
    assert stats["last_decode_body"]["max_tokens"] == 3


async def test_decode_streams_chat_chunks_and_defaults_to_tokens_option() -> None:
    mock = engine(tokens=2)
    events = (await call(mock, "POST", "/v1/chat/completions", chat(DECODE_KV, stream=True))).events()
    assert events[-1] == "[DONE]" and len(events) == 4  # role, two tokens, DONE; no usage unless asked
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"] for c in chunks[1:]] == [{"content": " tok0"}, {"content": " tok1"}]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


async def test_decode_without_stream_is_one_json_body() -> None:
    mock = engine()
    body = (await call(mock, "POST", "/v1/completions", completion(DECODE_KV, max_tokens=2))).json()
    assert body["choices"][0]["text"] == " tok0 tok1" and body["usage"]["completion_tokens"] == 2
    assert body["kv_transfer_params"] is None


async def test_decode_needs_the_remote_fields() -> None:
    mock = engine()
    for missing in ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port"):
        kv = {k: v for k, v in DECODE_KV.items() if k != missing}
        answer = await call(mock, "POST", "/v1/completions", completion(kv))
        assert answer.status == 400, missing
        assert missing in answer.json()["error"]["message"]


async def test_role_check_and_kv_roles_override() -> None:
    decode_only, prefill_only = engine("decode"), engine("prefill")
    assert (await call(decode_only, "POST", "/v1/completions", completion(PREFILL_KV))).status == 400
    assert (await call(prefill_only, "POST", "/v1/completions", completion(DECODE_KV))).status == 400
    both = engine("decode", kv_roles=("producer", "consumer"))
    assert (await call(both, "POST", "/v1/completions", completion(PREFILL_KV))).status == 200
    assert (await call(both, "POST", "/v1/completions", completion(DECODE_KV))).status == 200


async def test_plain_request_is_served_like_a_normal_engine() -> None:
    mock = engine("prefill")
    events = (await call(mock, "POST", "/v1/completions", completion(max_tokens=2, stream=True))).events()
    assert len(events) == 3 and events[-1] == "[DONE]"
    assert mock.stats.plain == 1 and mock.stats.prefill == 0


async def test_per_event_writes_put_every_event_in_a_write_of_its_own() -> None:
    mock = engine(sse_writes="per-event")
    answer = await call(mock, "POST", "/v1/completions",
                        completion(DECODE_KV, max_tokens=3, stream=True, stream_options={"include_usage": True}))
    # The head alone, three tokens, the usage event, [DONE], then the bare terminator, as vLLM writes them.
    parts = [data for _, data in answer.writes]
    assert parts[0] == b"" and parts[-1] == b""
    events = parts[1:-1]
    assert len(events) == 5 and all(e.startswith(b"data: ") and e.count(b"\n\n") == 1 and e.endswith(b"\n\n")
                                     for e in events)
    assert events[-1] == b"data: [DONE]\n\n" and answer.events()[-1] == "[DONE]" and answer.ended


async def test_token_delay_paces_one_write_per_token(autojump_clock: Any) -> None:
    mock = engine(token_delay_s=0.25)
    answer = await call(mock, "POST", "/v1/completions", completion(DECODE_KV, max_tokens=3, stream=True))
    assert [t for t, _ in answer.writes] == [0.25, 0.5, 0.75]
    assert answer.writes[-1][1].endswith(b"data: [DONE]\n\n")


# ----- identity and attestation --------------------------------------------------------------

async def test_identity_and_attestation_signature() -> None:
    mock = engine("prefill", engine_id="p1", generation="g7", attestation_key="k",
                  process_started_at=1234.5)
    identity = (await call(mock, "GET", "/narwhal/identity")).json()
    assert identity == {"engine_id": "p1", "model": "mock-model", "generation": "g7",
                        "process_started_at": 1234.5, "kv_roles": ["producer"], "kv_events": None}
    assert (await call(engine(), "GET", "/narwhal/identity")).json()["kv_roles"] == ["consumer"]
    attest = (await call(mock, "POST", "/narwhal/attest", {"nonce": "n-1"})).json()
    expected = hmac.new(b"k", b"p1|n-1|g7", hashlib.sha256).hexdigest()
    assert attest == {"engine_id": "p1", "nonce": "n-1", "signature": expected}
    assert (await call(mock, "POST", "/narwhal/attest", {"nonce": 3})).status == 400


async def test_identity_faults_change_what_is_reported() -> None:
    mock = engine("prefill", engine_id="p1")
    set_fault(mock, "generation:value=g2")
    set_fault(mock, "model:value=other-model")
    identity = (await call(mock, "GET", "/narwhal/identity")).json()
    assert (identity["generation"], identity["model"]) == ("g2", "other-model")
    assert (await call(mock, "GET", "/v1/models")).json()["data"][0]["id"] == "other-model"
    attest = (await call(mock, "POST", "/narwhal/attest", {"nonce": "n"})).json()
    assert attest["signature"] == hmac.new(b"narwhal-dev-key", b"p1|n|g2", hashlib.sha256).hexdigest()
    set_fault(mock, "bad_attestation:count=1")
    forged = (await call(mock, "POST", "/narwhal/attest", {"nonce": "n"})).json()
    assert forged["nonce"] == "n" and forged["signature"] != attest["signature"]
    set_fault(mock, "wrong_nonce:count=1")
    stale = (await call(mock, "POST", "/narwhal/attest", {"nonce": "n"})).json()
    assert stale["nonce"] != "n"
    assert (await call(mock, "POST", "/narwhal/attest", {"nonce": "n"})).json() == attest


# ----- faults that replace the answer -----------------------------------------------------------

async def test_status_faults_count_down_then_clear() -> None:
    mock = engine()
    set_fault(mock, "status_503:count=2")
    first = await call(mock, "POST", "/v1/completions", completion(DECODE_KV))
    assert first.status == 503 and first.json()["error"]["code"] == 503
    assert mock.faults.describe()[0]["count"] == 1
    assert (await call(mock, "POST", "/v1/completions", completion(DECODE_KV))).status == 503
    assert (await call(mock, "POST", "/v1/completions", completion(DECODE_KV))).status == 200
    assert mock.faults.describe() == []
    for spec, status in (("status_408:count=1", 408), ("status_429:count=1", 429), ("status_5xx", 500)):
        set_fault(mock, spec)
        assert (await call(mock, "POST", "/v1/chat/completions", chat(DECODE_KV))).status == status
    # Health is not an inference leg, so the default legs leave it alone.
    assert (await call(mock, "GET", "/health")).status == 200


async def test_fault_legs_select_the_requests_they_hit() -> None:
    mock = engine(kv_roles=("producer", "consumer"))
    set_fault(mock, "status_500:legs=prefill")
    assert (await call(mock, "POST", "/v1/completions", completion(PREFILL_KV))).status == 500
    assert (await call(mock, "POST", "/v1/completions", completion(DECODE_KV))).status == 200
    mock.faults.clear()
    set_fault(mock, "status_500:legs=any,count=4")
    for method, path, body in (("GET", "/health", None), ("POST", "/tokenize", {"prompt": "x"}),
                               ("GET", "/narwhal/identity", None), ("GET", "/v1/models", None)):
        assert (await call(mock, method, path, body)).status == 500, path
    # Control routes are never faulted.
    assert (await call(mock, "GET", "/mock/stats")).status == 200


async def test_unhealthy_and_hang(autojump_clock: Any) -> None:
    mock = engine()
    set_fault(mock, "unhealthy:count=1")
    assert (await call(mock, "GET", "/health")).status == 503
    assert (await call(mock, "GET", "/health")).status == 200
    set_fault(mock, "hang:count=1,legs=health+decode")
    responder = FakeResponder()
    with trio.move_on_after(100) as scope:
        await call(mock, "GET", "/health", responder=responder)
    assert scope.cancelled_caught and responder.writes == []
    assert mock.stats.disconnects == 0  # cancelled, but not because the client went
    # The server cancels a handler when its client goes: that is a disconnect.
    set_fault(mock, "hang:count=1")
    responder.client_disconnected = True
    with trio.move_on_after(100):
        await call(mock, "POST", "/v1/completions", completion(DECODE_KV), responder=responder)
    assert mock.stats.disconnects == 1
    assert (await call(mock, "POST", "/v1/completions", completion(DECODE_KV))).status == 200
    assert mock.faults.describe() == []


# ----- faults that break the stream -------------------------------------------------------------

async def test_stall_sends_some_tokens_then_goes_silent(autojump_clock: Any) -> None:
    mock = engine()
    set_fault(mock, "stall:after_tokens=2,count=1")
    responder = FakeResponder()
    with trio.move_on_after(60):
        await call(mock, "POST", "/v1/completions", completion(DECODE_KV, max_tokens=5, stream=True),
                   responder=responder)
    assert responder.started and not responder.ended
    assert [json.loads(e)["choices"][0]["text"] for e in responder.events()] == [" tok0", " tok1"]
    # A non-streamed decode is not a stream to stall: it neither acts nor spends the count.
    assert mock.faults.describe() == []
    set_fault(mock, "stall:count=1")
    assert (await call(mock, "POST", "/v1/completions", completion(DECODE_KV))).status == 200
    assert mock.faults.describe()[0]["count"] == 1


async def test_no_done_and_garbage_stream() -> None:
    mock = engine()
    set_fault(mock, "no_done:count=1")
    cut = await call(mock, "POST", "/v1/completions", completion(DECODE_KV, max_tokens=2, stream=True))
    assert cut.ended and b"[DONE]" not in cut.body and len(cut.events()) == 2
    set_fault(mock, "garbage_stream:count=1")
    garbage = await call(mock, "POST", "/v1/completions", completion(DECODE_KV, stream=True))
    assert garbage.ended and not garbage.body.startswith(b"data:") and b"[DONE]" not in garbage.body
    set_fault(mock, "garbage_stream:count=1,after_tokens=1")
    late = await call(mock, "POST", "/v1/completions", completion(DECODE_KV, stream=True))
    assert late.body.startswith(b"data: {") and b"[DONE]" not in late.body


async def test_first_token_delay_and_slow_tokens(autojump_clock: Any) -> None:
    mock = engine()
    set_fault(mock, "first_token_delay:delay_s=5,count=1")
    delayed = await call(mock, "POST", "/v1/completions", completion(DECODE_KV, max_tokens=2, stream=True))
    # Headers go out at once; the first token is what is late.
    assert delayed.writes[0] == (0.0, b"") and delayed.writes[1][0] == 5.0
    start = trio.current_time()
    mock_both = engine(kv_roles=("producer", "consumer"))
    set_fault(mock_both, "first_token_delay:delay_s=2,count=1,legs=prefill")
    await call(mock_both, "POST", "/v1/completions", completion(PREFILL_KV))
    assert trio.current_time() - start == 2.0
    set_fault(mock, "slow_tokens:delay_s=0.5,count=1")
    start = trio.current_time()
    slow = await call(mock, "POST", "/v1/completions", completion(DECODE_KV, max_tokens=3, stream=True))
    assert [t - start for t, _ in slow.writes] == [0.5, 1.0, 1.5]
    start = trio.current_time()
    fast = await call(mock, "POST", "/v1/completions", completion(DECODE_KV, max_tokens=3, stream=True))
    assert [t - start for t, _ in fast.writes] == [0.0, 0.0]


@pytest.mark.parametrize("variant", ["missing_block_ids", "string", "null", "absent", "bad_port"])
async def test_bad_kv_variants_are_unreadable_handoffs(variant: str) -> None:
    mock = engine("prefill")
    set_fault(mock, f"bad_kv:variant={variant},count=1")
    body = (await call(mock, "POST", "/v1/completions", completion(PREFILL_KV))).json()
    kv = body.get("kv_transfer_params")
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(kv, KVTransferParams)
    healthy = (await call(mock, "POST", "/v1/completions", completion(PREFILL_KV))).json()
    msgspec.convert(healthy["kv_transfer_params"], KVTransferParams)


async def test_client_gone_mid_stream_is_counted() -> None:
    mock = engine(token_delay_s=0.001)
    responder = FakeResponder(disconnect_after_writes=2)
    await call(mock, "POST", "/v1/completions", completion(DECODE_KV, max_tokens=5, stream=True),
               responder=responder)
    assert len(responder.writes) == 2 and mock.stats.disconnects == 1


# ----- the /mock control API -----------------------------------------------------------------------

async def test_fault_api_sets_lists_and_clears() -> None:
    mock = engine()
    made = await call(mock, "POST", "/mock/faults", {"mode": "status_5xx", "status": 502, "count": 2})
    assert made.status == 200 and made.json()["fault"]["status"] == 502
    listed = (await call(mock, "GET", "/mock/faults")).json()["faults"]
    assert [(f["mode"], f["count"], f["legs"], f["status"]) for f in listed] == [
        ("status_5xx", 2, ["decode", "prefill"], 502)]
    rejected = await call(mock, "POST", "/mock/faults", {"mode": "bad_kv", "legs": ["decode"]})
    assert rejected.status == 400 and "leg" in rejected.json()["error"]["message"]
    assert (await call(mock, "POST", "/mock/faults", {"mode": "stall", "nonsense": 1})).status == 400
    # Closing the listener needs the serving shell; a bare engine says so.
    assert (await call(mock, "POST", "/mock/faults", {"mode": "refuse", "duration_s": 1})).status == 400
    assert (await call(mock, "DELETE", "/mock/faults")).json() == {"faults": []}
    assert mock.faults.describe() == []


async def test_stats_reset() -> None:
    mock = engine()
    await call(mock, "POST", "/v1/completions", completion(DECODE_KV))
    assert (await call(mock, "GET", "/mock/stats")).json()["decode"] == 1
    reset = (await call(mock, "POST", "/mock/stats/reset")).json()
    assert reset["decode"] == 0 and reset["requests"] == {} and reset["last_kv_transfer_params"] is None


# ----- the fault table on its own ------------------------------------------------------------------

def test_fault_spec_parsing_and_validation() -> None:
    request = parse_fault_spec("status_500:count=3,legs=prefill+decode")
    assert request == FaultRequest(mode="status_500", count=3, legs=["prefill", "decode"])
    table = FaultTable()
    fault = table.validate(request)
    assert (fault.mode, fault.params, fault.remaining) == (Mode.STATUS_5XX, {"status": 500}, 3)
    assert table.validate(parse_fault_spec("slow_tokens")).params == {"delay_s": 0.05}
    assert table.validate(parse_fault_spec("first_token_delay")).legs == {Leg.PREFILL, Leg.DECODE}
    assert table.validate(parse_fault_spec("refuse:count=2")).remaining == 2
    for bad in ("nope", "status_500:count=0", "generation", "stall:delay_s=1", "refuse",
                "refuse:count=1,duration_s=2", "bad_kv:variant=weird", "unhealthy:legs=decode",
                "status_5xx:status=404", "hang:legs=everywhere", "stall:count"):
        with pytest.raises(FaultError):
            table.validate(parse_fault_spec(bad))


def test_fault_table_take_precedence_and_counts() -> None:
    table = FaultTable()
    for spec in ("status_500:count=1", "hang:count=1", "slow_tokens:count=2", "slow_tokens:delay_s=9"):
        table.add(table.validate(parse_fault_spec(spec)))
    applied = table.take(Operation.DECODE, streamed=True)
    # The first terminal fault wins and only it is spent; one modifier per mode, the first set.
    assert applied.terminal is not None and applied.terminal.mode is Mode.STATUS_5XX
    assert applied.get(Mode.SLOW_TOKENS).params["delay_s"] == 0.05  # type: ignore[union-attr]
    assert [(f["mode"], f["count"]) for f in table.describe()] == [
        ("hang", 1), ("slow_tokens", 1), ("slow_tokens", None)]
    assert table.take(Operation.HEALTH).terminal is None
    assert not table.take_connection_refusal()
    table.add(table.validate(parse_fault_spec("bad_kv:count=1")))
    # A prefill that asked for no handoff has none to spoil: the count stays.
    assert table.take(Operation.PREFILL).get(Mode.BAD_KV) is None
    assert table.take(Operation.PREFILL, handoff=True).get(Mode.BAD_KV) is not None
    table.add(table.validate(parse_fault_spec("refuse:count=1")))
    assert table.take_connection_refusal() and not table.take_connection_refusal()


# ----- over real sockets ------------------------------------------------------------------------------

@pytest.fixture
async def served(nursery: trio.Nursery) -> Any:
    """A decode mock served on 127.0.0.1 by the project's HTTP server, and a client for it."""
    settings = MockSettings(role="decode", engine_id="d1", kv_roles=("producer", "consumer"))
    service = await nursery.start(serve_mock, settings)
    base = f"http://127.0.0.1:{service.engine.port}"
    async with httpx.AsyncClient(base_url=base, timeout=5) as client:
        yield service, client
    service.stop(0)


async def test_socket_prefill_then_streamed_decode(served: Any) -> None:
    service, client = served
    prefill = await client.post("/v1/completions", json=completion(PREFILL_KV, max_tokens=1))
    kv = prefill.json()["kv_transfer_params"]
    assert kv["remote_port"] == service.engine.port and kv["remote_engine_id"] == "d1"
    body = completion(kv, max_tokens=4, stream=True, stream_options={"include_usage": True})
    async with client.stream("POST", "/v1/completions", json=body, headers={"x-request-id": "rq"}) as response:
        assert response.headers["transfer-encoding"] == "chunked"
        assert response.headers["content-type"] == "text/event-stream"
        lines = [line async for line in response.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]" and len(lines) == 6
    assert json.loads(lines[-2].removeprefix("data: "))["usage"]["completion_tokens"] == 4
    stats = (await client.get("/mock/stats")).json()
    assert stats["last_kv_transfer_params"] == kv and stats["last_request_ids"]["decode"] == "rq"
    assert stats["connections_opened"] == 1  # keep-alive: one connection for all of it


async def test_socket_identity_attestation_and_fault_counts(served: Any) -> None:
    _, client = served
    identity = (await client.get("/narwhal/identity")).json()
    assert identity["engine_id"] == "d1" and identity["kv_roles"] == ["producer", "consumer"]
    attest = (await client.post("/narwhal/attest", json={"nonce": "abc"})).json()
    assert attest["signature"] == hmac.new(b"narwhal-dev-key", b"d1|abc|g1", hashlib.sha256).hexdigest()
    made = await client.post("/mock/faults", json={"mode": "status_429", "count": 2, "legs": ["health"]})
    assert made.status_code == 200
    assert [(await client.get("/health")).status_code for _ in range(3)] == [429, 429, 200]
    assert (await client.get("/mock/faults")).json() == {"faults": []}


async def test_socket_refuse_resets_counted_connections(served: Any) -> None:
    service, client = served
    await client.post("/mock/faults", json={"mode": "refuse", "count": 2})
    base = str(client.base_url)
    for _ in range(2):
        async with httpx.AsyncClient(base_url=base) as fresh:
            # The reset can beat the client's own connect bookkeeping: any transport error.
            with pytest.raises(httpx.TransportError):
                await fresh.get("/health")
    async with httpx.AsyncClient(base_url=base) as fresh:
        assert (await fresh.get("/health")).status_code == 200
    assert service.engine.stats.connections_opened == 4


async def until_healthy(client: httpx.AsyncClient) -> None:
    """Poll /health until it answers 200; connection errors mean the port is still closed."""
    with trio.fail_after(5):
        while True:
            try:
                if (await client.get("/health")).status_code == 200:
                    return
            except httpx.ConnectError:
                pass
            await trio.sleep(0.02)


async def test_socket_refuse_window_closes_then_reopens_the_port(served: Any) -> None:
    service, client = served
    closed_for_s = 0.3
    asked_at = trio.current_time()
    answer = await client.post("/mock/faults", json={"mode": "refuse", "duration_s": closed_for_s})
    assert answer.status_code == 200
    async with httpx.AsyncClient(base_url=str(client.base_url)) as fresh:
        with pytest.raises(httpx.ConnectError):
            await fresh.get("/health")
        await until_healthy(fresh)
    assert trio.current_time() - asked_at >= closed_for_s


async def test_socket_refuse_window_set_at_start(nursery: trio.Nursery) -> None:
    asked_at = trio.current_time()
    # A window long enough that a loaded machine still connects inside it (0.2 s was flaky under load).
    service = await nursery.start(serve_mock, MockSettings(role="prefill", faults=("refuse:duration_s=1.5",)))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.engine.port}") as client:
        with pytest.raises(httpx.ConnectError):
            await client.get("/health")
        await until_healthy(client)
    assert trio.current_time() - asked_at >= 1.5
    service.stop(0)


async def test_socket_client_gone_mid_stream_and_during_hang(served: Any) -> None:
    service, client = served
    await client.post("/mock/faults", json={"mode": "slow_tokens", "delay_s": 0.05, "count": 1})
    # A raw socket, so the client can walk away mid-stream without httpx's generators complaining.
    body = json.dumps(completion(DECODE_KV, max_tokens=50, stream=True)).encode()
    stream = await trio.open_tcp_stream("127.0.0.1", service.engine.port)
    async with stream:
        await stream.send_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                              b"content-length: %d\r\n\r\n%b" % (len(body), body))
        assert b" tok0" in await stream.receive_some(65536)
    await client.post("/mock/faults", json={"mode": "hang", "count": 1})
    with pytest.raises(httpx.ReadTimeout):
        await client.post("/v1/completions", json=completion(DECODE_KV), timeout=0.2)
    with trio.fail_after(5):
        while service.engine.stats.disconnects < 2:
            await trio.sleep(0.01)


def test_subprocess_prints_ready_line_and_stops_on_sigterm() -> None:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    command = [sys.executable, "-m", "narwhal.tools.mock", "--role", "prefill", "--port", "0",
               "--fault", "unhealthy:count=1"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True) as process:
        assert process.stdout is not None and process.stderr is not None
        try:
            ready = json.loads(process.stdout.readline())
            assert ready["event"] == "mock_engine_ready" and ready["engine_id"] == f"prefill-{ready['port']}"
            with httpx.Client(base_url=f"http://127.0.0.1:{ready['port']}", timeout=5) as client:
                assert [client.get("/health").status_code for _ in range(2)] == [503, 200]
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=10) == 0
        finally:
            if process.poll() is None:
                process.kill()
        assert "Traceback" not in process.stderr.read()


def test_main_rejects_a_bad_fault_before_binding(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--role", "decode", "--fault", "status_500:count=0"])
    assert exited.value.code == 2 and "count must be >= 1" in capsys.readouterr().err


def test_first_n_of_one_fault_then_another_is_two_faults_set_in_order() -> None:
    # "500 three times, then 429 until cleared" (docs/mock-engine.md; issue 10's overload test).
    table = FaultTable()
    table.add(table.validate(parse_fault_spec("status_500:count=3,legs=decode")))
    table.add(table.validate(parse_fault_spec("status_429:legs=decode")))
    seen = []
    for _ in range(6):
        terminal = table.take(Operation.DECODE, streamed=True).terminal
        assert terminal is not None
        seen.append(terminal.mode)
    assert seen == [Mode.STATUS_5XX] * 3 + [Mode.STATUS_429] * 3
    assert table.take(Operation.HEALTH).terminal is None


# ----- stream continuation support (issue 22) -------------------------------------------

async def test_numbered_tokens_name_their_position_and_continue_from_any_prompt() -> None:
    mock = engine(numbered=True)
    first = (await call(mock, "POST", "/v1/completions", completion(max_tokens=3))).json()
    assert first["choices"][0]["text"] == " n4 n5 n6"  # the prompt is 4 words: positions 0-3
    # The prompt plus the output so far, as text or as token IDs, reads on with the next number.
    text = (await call(mock, "POST", "/v1/completions",
                       completion(prompt="the quick brown fox n4 n5", max_tokens=2))).json()
    assert text["choices"][0]["text"] == " n6 n7"
    ids = tokenize("the quick brown fox n4 n5")
    by_ids = (await call(mock, "POST", "/v1/completions", completion(prompt=ids, max_tokens=1))).json()
    assert by_ids["choices"][0]["text"] == " n6"


async def test_return_token_ids_as_vllm_0_32_sends_them() -> None:
    mock = engine(numbered=True)
    events = (await call(mock, "POST", "/v1/completions",
                         completion(DECODE_KV, max_tokens=2, stream=True, return_token_ids=True))).events()
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == tokenize("the quick brown fox")
    assert "prompt_token_ids" not in chunks[1]["choices"][0]
    assert [c["choices"][0]["token_ids"] for c in chunks] == [tokenize("n4"), tokenize("n5")]
    chat_events = (await call(mock, "POST", "/v1/chat/completions",
                              chat(DECODE_KV, max_tokens=1, stream=True, return_token_ids=True))).events()
    role, token = (json.loads(e) for e in chat_events[:2])
    # Chat: the prompt's IDs at the top of the first chunk, token IDs in each choice.
    assert role["prompt_token_ids"] == [zlib.crc32(b"<|user|>") % 32000, *tokenize("hi there")]
    assert token["choices"][0]["token_ids"] == tokenize("n3")
    whole = (await call(mock, "POST", "/v1/completions",
                        completion(max_tokens=2, return_token_ids=True))).json()["choices"][0]
    assert whole["token_ids"] == tokenize("n4 n5") and whole["prompt_token_ids"] == tokenize("the quick brown fox")
    # Not asked: no token IDs at all.
    plain = (await call(mock, "POST", "/v1/completions", completion(max_tokens=1))).json()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain


async def test_continue_final_message_continues_the_assistant_message() -> None:
    mock = engine(numbered=True)
    messages = [{"role": "user", "content": "hi there"}]
    first = (await call(mock, "POST", "/v1/chat/completions", chat(max_tokens=2))).json()
    assert first["choices"][0]["message"]["content"] == " n3 n4"
    body = chat(max_tokens=2, messages=[*messages, {"role": "assistant", "content": " n3 n4"}],
                continue_final_message=True, add_generation_prompt=False)
    rest = (await call(mock, "POST", "/v1/chat/completions", body)).json()
    assert rest["choices"][0]["message"]["content"] == " n5 n6"
    both = await call(mock, "POST", "/v1/chat/completions", {**body, "add_generation_prompt": True})
    assert both.status == 400 and "continue_final_message" in both.json()["error"]["message"]


async def test_cut_closes_a_stream_or_a_body_halfway() -> None:
    mock = engine()
    set_fault(mock, "cut:count=2")
    stream = await call(mock, "POST", "/v1/completions", completion(DECODE_KV, max_tokens=8, stream=True))
    assert not stream.ended and stream.status == 200
    assert [json.loads(e)["choices"][0]["text"] for e in stream.events()] == [" tok0", " tok1", " tok2", " tok3"]
    whole = await call(mock, "POST", "/v1/completions", completion(DECODE_KV, max_tokens=8))
    assert not whole.ended and whole.status == 200
    with pytest.raises(json.JSONDecodeError):
        whole.json()
    # Spent: the next answer is whole.
    assert (await call(mock, "POST", "/v1/completions", completion(DECODE_KV, max_tokens=8))).ended
    set_fault(mock, "cut:after_tokens=1")
    stream = await call(mock, "POST", "/v1/completions", completion(DECODE_KV, max_tokens=8, stream=True))
    assert len(stream.events()) == 1
    with pytest.raises(FaultError):
        FaultTable().validate(parse_fault_spec("cut:after_tokens=-1"))



# ----- the prefix cache ------------------------------------------------------------------------

def test_prefix_cache_hits_whole_block_prefixes_and_evicts_tails_first() -> None:
    from narwhal.tools.mock.prefix_cache import PrefixCache

    cache = PrefixCache(capacity_blocks=6, block_tokens=4)
    a = list(range(16))  # 4 blocks
    assert cache.prefill(a) == 0
    assert cache.prefill(a) == 15  # all but the last token, as vLLM computes at least one
    assert cache.prefill(a[:8] + [99, 98, 97, 96, 95]) == 8
    # 5 blocks held: a's 4 and the new tail; 2 more evict a's last block, never its prefix.
    assert cache.prefill(list(range(50, 58))) == 0
    assert cache.prefill(a) == 12
    described = cache.describe()
    assert described["queries"] == 5 and described["hits"] == 3 and described["blocks"] == 6
    assert (described["prompt_tokens"], described["cached_tokens"]) == (16 + 16 + 13 + 8 + 16, 15 + 8 + 12)


async def test_prefills_run_one_at_a_time_and_misses_cost_time(autojump_clock: Any) -> None:
    mock = engine("prefill", prefix_cache_blocks=100, prefill_s_per_token=0.01)
    prompt = " ".join(f"w{i}" for i in range(64))
    times: list[float] = []

    async def one(text: str) -> None:
        started = trio.current_time()
        answer = await call(mock, "POST", "/v1/completions", completion(PREFILL_KV, prompt=text, max_tokens=1))
        assert answer.status == 200
        times.append(trio.current_time() - started)

    await one(prompt)
    assert times[-1] == pytest.approx(0.64)  # 64 uncached tokens
    await one(prompt)
    assert times[-1] == pytest.approx(0.01)  # one token computed
    async with trio.open_nursery() as nursery:
        # Two misses at once: the second waits for the first (one prefill at a time).
        nursery.start_soon(one, prompt.replace("w", "x"))
        nursery.start_soon(one, prompt.replace("w", "y"))
    assert sorted(times[-2:]) == [pytest.approx(0.64), pytest.approx(1.28)]
    stats = (await call(mock, "GET", "/mock/stats")).json()["prefix_cache"]
    assert stats["queries"] == 4 and stats["hits"] == 1
    assert (stats["prompt_tokens"], stats["cached_tokens"]) == (256, 63)
    reset = (await call(mock, "POST", "/mock/stats/reset")).json()["prefix_cache"]
    assert reset["queries"] == 0 and reset["blocks"] == stats["blocks"]
    assert (await call(engine("prefill"), "GET", "/mock/stats")).json()["prefix_cache"] is None


# ----- vLLM 0.32 stream shapes: split characters, the echo, coalesced events, stop strings (issue 22) ----------

def choices(responder: FakeResponder) -> list[dict[str, Any]]:
    """The first choice of every token chunk of a stream (chat's role event and usage left out)."""
    chunks = [json.loads(e) for e in responder.events() if e != "[DONE]"]
    return [c["choices"][0] for c in chunks if c["choices"] and "role" not in c["choices"][0].get("delta", {})]


def text_of(choice: dict[str, Any]) -> str:
    return choice["text"] if "text" in choice else choice["delta"]["content"]


def numbered(start: int, stop: int) -> str:
    """The numbered mode's text of sequence positions start..stop-1."""
    return "".join(f" n{p}" for p in range(start, stop))


async def test_split_characters_send_the_first_half_empty_with_its_id() -> None:
    mock = engine(numbered=True, split_every=3)
    # Prompt positions 0-3; generated 4-9; positions 5 and 8 (p % 3 == 2) are first halves.
    streamed = choices(await call(mock, "POST", "/v1/completions",
                                  completion(max_tokens=6, stream=True, return_token_ids=True)))
    assert [text_of(c) for c in streamed] == [" n4", "", " n5 n6", " n7", "", " n8 n9"]
    assert [c["token_ids"] for c in streamed] == [tokenize(f"n{p}") for p in range(4, 10)]
    assert [c["finish_reason"] for c in streamed] == [None] * 5 + ["length"]
    # The answer's text is the unsplit one, streamed or not.
    whole = (await call(mock, "POST", "/v1/completions", completion(max_tokens=6))).json()["choices"][0]
    assert whole["text"] == "".join(text_of(c) for c in streamed) == numbered(4, 10)
    # A first half that is the answer's last token has its text in the final event.
    last = choices(await call(mock, "POST", "/v1/completions", completion(max_tokens=2, stream=True)))
    assert [(text_of(c), c["finish_reason"]) for c in last] == [(" n4", None), (" n5", "length")]
    # Chat: the first half is a delta with empty content (the chat prompt is 3 tokens: positions 0-2).
    chat_stream = choices(await call(mock, "POST", "/v1/chat/completions", chat(max_tokens=4, stream=True)))
    assert [c["delta"] for c in chat_stream] == [{"content": " n3"}, {"content": " n4"}, {"content": ""},
                                                 {"content": " n5 n6"}]


async def test_a_stream_cut_after_a_first_half_never_sends_its_text() -> None:
    mock = engine(numbered=True, split_every=3)
    set_fault(mock, "cut:after_tokens=2,count=1")
    cut = await call(mock, "POST", "/v1/completions", completion(max_tokens=6, stream=True, return_token_ids=True))
    assert not cut.ended
    assert [(text_of(c), c["token_ids"]) for c in choices(cut)] == [(" n4", tokenize("n4")), ("", tokenize("n5"))]


async def test_the_echo_comes_exactly_when_a_token_id_prompt_ends_on_a_first_half() -> None:
    mock = engine(numbered=True, split_every=3)
    # Position 5 is a first half, and the prompt's last token is the one the mock generates there (" n5").
    six = tokenize("a b c d e n5")
    echoed = choices(await call(mock, "POST", "/v1/completions", completion(prompt=six, max_tokens=3, stream=True)))
    # As vLLM 0.32's detokenizer: the whole prompt's text, the completed character, then on as usual.
    assert [text_of(c) for c in echoed] == [numbered(0, 6) + " n6", " n7", " n8"]
    whole = (await call(mock, "POST", "/v1/completions", completion(prompt=six, max_tokens=3))).json()
    assert whole["choices"][0]["text"] == numbered(0, 9)
    # Not for a token-ID prompt ending elsewhere, a string prompt, or without split characters.
    five = choices(await call(mock, "POST", "/v1/completions", completion(prompt=six[:5], max_tokens=2,
                                                                          stream=True)))
    assert [text_of(c) for c in five] == ["", " n5 n6"]
    text = choices(await call(mock, "POST", "/v1/completions", completion(prompt="a b c d e f", max_tokens=2,
                                                                          stream=True)))
    assert [text_of(c) for c in text] == [" n6", " n7"]
    plain = choices(await call(engine(numbered=True), "POST", "/v1/completions",
                               completion(prompt=six, max_tokens=2, stream=True)))
    assert [text_of(c) for c in plain] == [" n6", " n7"]
    # A prompt's own words are whole characters, wherever they end.
    words = choices(await call(mock, "POST", "/v1/completions", completion(prompt=tokenize("a b c d e f"),
                                                                           max_tokens=2, stream=True)))
    assert [text_of(c) for c in words] == [" n6", " n7"]


async def test_tokens_per_event_coalesces_tokens_and_their_ids(autojump_clock: Any) -> None:
    mock = engine(numbered=True, tokens_per_event=3)
    answer = await call(mock, "POST", "/v1/completions",
                        completion(max_tokens=7, stream=True, return_token_ids=True,
                                   stream_options={"include_usage": True}))
    streamed = choices(answer)
    assert [text_of(c) for c in streamed] == [numbered(4, 7), numbered(7, 10), " n10"]
    assert [c["token_ids"] for c in streamed] == [tokenize(numbered(4, 7)), tokenize(numbered(7, 10)),
                                                  tokenize("n10")]
    assert [c["finish_reason"] for c in streamed] == [None, None, "length"]
    assert streamed[0]["prompt_token_ids"] == tokenize("the quick brown fox")
    assert json.loads(answer.events()[-2])["usage"]["completion_tokens"] == 7
    assert answer.events()[-1] == "[DONE]"
    # With split characters: a first half ending an event has its text in the next one.
    both = engine(numbered=True, tokens_per_event=2, split_every=3)
    mixed = choices(await call(both, "POST", "/v1/completions",
                               completion(max_tokens=6, stream=True, return_token_ids=True)))
    # Positions 4-9 in pairs; first halves at 5 (ends the first event) and 8 (starts the last).
    assert [(text_of(c), c["token_ids"]) for c in mixed] == [
        (" n4", tokenize("n4 n5")), (" n5 n6 n7", tokenize("n6 n7")), (" n8 n9", tokenize("n8 n9"))]
    # A fault cuts after that many tokens, not events: the event before the cut carries what there was.
    set_fault(mock, "stall:after_tokens=4,count=1")
    stalled = FakeResponder()
    with trio.move_on_after(60):
        await call(mock, "POST", "/v1/completions", completion(max_tokens=7, stream=True, return_token_ids=True),
                   responder=stalled)
    assert [c["token_ids"] for c in choices(stalled)] == [tokenize(numbered(4, 7)), tokenize("n7")]


async def test_stop_string_spanning_two_tokens_ends_the_answer() -> None:
    mock = engine(numbered=True)
    # " n10 n11" holds "0 n11": token n11 completes it, the 8th generated token (positions 4-11).
    for include, text in ((False, numbered(4, 10) + " n1"), (True, numbered(4, 12))):
        fields = {"max_tokens": 20, "stop": ["zzz", "0 n11"], "include_stop_str_in_output": include}
        whole = (await call(mock, "POST", "/v1/completions", completion(**fields))).json()
        assert whole["choices"][0]["text"] == text
        assert (whole["choices"][0]["finish_reason"], whole["choices"][0]["stop_reason"]) == ("stop", "0 n11")
        assert whole["usage"]["completion_tokens"] == 8
        answer = await call(mock, "POST", "/v1/completions",
                            completion(**fields, stream=True, stream_options={"include_usage": True}))
        streamed = choices(answer)
        assert "".join(text_of(c) for c in streamed) == text
        assert len(streamed) == 8 and [c["finish_reason"] for c in streamed] == [None] * 7 + ["stop"]
        assert streamed[-1]["stop_reason"] == "0 n11"
        assert json.loads(answer.events()[-2])["usage"]["completion_tokens"] == 8
        # Held back while streaming: max(len(stop)) - 1 = 4 characters, none when the stop string is sent.
        hold = 0 if include else 4
        sent = ""
        for i, choice in enumerate(streamed[:-1]):
            sent += text_of(choice)
            assert sent == numbered(4, 5 + i)[:max(0, len(numbered(4, 5 + i)) - hold)], i
    # Chat, the same way; a string stop.
    whole_chat = (await call(mock, "POST", "/v1/chat/completions", chat(max_tokens=20, stop="1 n12"))).json()
    assert whole_chat["choices"][0]["message"]["content"] == numbered(3, 11) + " n1"
    assert whole_chat["choices"][0]["stop_reason"] == "1 n12" and whole_chat["usage"]["completion_tokens"] == 10
    chat_stream = choices(await call(mock, "POST", "/v1/chat/completions",
                                     chat(max_tokens=20, stop="1 n12", stream=True)))
    assert "".join(text_of(c) for c in chat_stream) == numbered(3, 11) + " n1"
    assert (chat_stream[-1]["finish_reason"], chat_stream[-1]["stop_reason"]) == ("stop", "1 n12")
    # Never found: the answer runs to max_tokens, all its text out by the final chunk.
    unfound = choices(await call(mock, "POST", "/v1/completions",
                                 completion(max_tokens=3, stop=["n99"], stream=True)))
    assert [text_of(c) for c in unfound] == [" ", "n4 ", "n5 n6"]  # held back: len("n99") - 1
    assert (unfound[-1]["finish_reason"], unfound[-1]["stop_reason"]) == ("length", None)


async def test_stop_strings_are_searched_in_the_generated_text_only() -> None:
    mock = engine(numbered=True, split_every=3)
    # The echoed prompt holds " n2 " and the prompt string "fox": neither stops the answer.
    six = tokenize("a b c d e n5")
    echoed = (await call(mock, "POST", "/v1/completions", completion(prompt=six, max_tokens=3, stop=["n2 "]))).json()
    assert echoed["choices"][0]["text"] == numbered(0, 9) and echoed["choices"][0]["finish_reason"] == "length"
    streamed = choices(await call(mock, "POST", "/v1/completions",
                                  completion(prompt=six, max_tokens=3, stop=["n2 "], stream=True)))
    assert "".join(text_of(c) for c in streamed) == numbered(0, 9)
    by_text = (await call(mock, "POST", "/v1/completions", completion(max_tokens=2, stop="fox"))).json()
    assert by_text["choices"][0]["text"] == " n4 n5" and by_text["choices"][0]["stop_reason"] is None
    # With split characters and coalescing too, the streamed text is the non-streamed text.
    shaped = engine(numbered=True, split_every=2, tokens_per_event=3)
    fields = {"max_tokens": 30, "stop": ["n17 n"]}
    whole = (await call(shaped, "POST", "/v1/completions", completion(**fields))).json()["choices"][0]
    assert whole["text"] == numbered(4, 17) + " " and whole["stop_reason"] == "n17 n"
    streamed = choices(await call(shaped, "POST", "/v1/completions", completion(**fields, stream=True)))
    assert "".join(text_of(c) for c in streamed) == whole["text"] and streamed[-1]["finish_reason"] == "stop"


async def test_a_bad_stop_is_a_400() -> None:
    mock = engine()
    for stop in (3, [1, 2], {"s": 1}, [""]):
        answer = await call(mock, "POST", "/v1/completions", completion(stop=stop))
        assert answer.status == 400 and "stop" in answer.json()["error"]["message"], stop
    assert (await call(mock, "POST", "/v1/chat/completions", chat(stop=[None]))).status == 400


@pytest.mark.parametrize(("flags", "named"), [
    (["--split-chars-every", "1"], "--split-chars-every"), (["--split-chars-every", "-2"], "--split-chars-every"),
    (["--tokens-per-event", "0"], "--tokens-per-event")])
def test_main_rejects_bad_stream_shape_flags(flags: list[str], named: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--role", "decode", *flags])
    assert exited.value.code == 2 and named in capsys.readouterr().err


def test_stream_shape_flags_make_settings() -> None:
    args = build_parser(argparse.ArgumentParser()).parse_args(
        ["--role", "decode", "--split-chars-every", "4", "--tokens-per-event", "3"])
    settings = _settings_from_args(args)
    assert (settings.split_every, settings.tokens_per_event) == (4, 3)
    assert (MockSettings(role="decode").split_every, MockSettings(role="decode").tokens_per_event) == (0, 1)


async def test_socket_stream_with_every_shape_at_once(nursery: trio.Nursery) -> None:
    settings = MockSettings(role="decode", numbered=True, split_every=2, tokens_per_event=2, sse_writes="per-event")
    service = await nursery.start(serve_mock, settings)
    body = completion(max_tokens=10, stream=True, return_token_ids=True, stop=" n9")
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.engine.port}", timeout=5) as client:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            lines = [line async for line in response.aiter_lines() if line]
    service.stop(0)
    assert lines[-1] == "data: [DONE]"
    streamed = [json.loads(line.removeprefix("data: "))["choices"][0] for line in lines[:-1]]
    # Two tokens to an event, odd positions first halves, the last 2 characters held back for " n9"; the
    # first half n9 gives no text, so token n10 (" n9 n10") completes the stop string and ends the answer.
    assert [(c["text"], c["token_ids"]) for c in streamed] == [
        (" ", tokenize("n4 n5")), ("n4 n5 ", tokenize("n6 n7")), ("n6 n7 ", tokenize("n8 n9")),
        ("n8", tokenize("n10"))]
    assert (streamed[-1]["finish_reason"], streamed[-1]["stop_reason"]) == ("stop", " n9")


# ----- n choices and vLLM's request validation ----------------------------------------------------------------

def stream_choices(answer: FakeResponder) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The streamed chunks that carry a choice, and the rest (usage), before [DONE]."""
    events = answer.events()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    return [c for c in chunks if c["choices"]], [c for c in chunks if not c["choices"]]


async def test_n_answers_n_choices_in_one_body() -> None:
    mock = engine()
    one = (await call(mock, "POST", "/v1/completions", completion(max_tokens=3))).json()
    body = (await call(mock, "POST", "/v1/completions", completion(max_tokens=3, n=2, return_token_ids=True))).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    # Choice 0 is the answer n=1 gets; the others differ (as sampled choices do), deterministically.
    assert body["choices"][0]["text"] == one["choices"][0]["text"] == " tok0 tok1 tok2"
    assert body["choices"][1]["text"] == " tok0-1 tok1-1 tok2-1"
    assert all(c["prompt_token_ids"] == tokenize("the quick brown fox") and len(c["token_ids"]) == 3
               for c in body["choices"])
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}
    chat_body = (await call(mock, "POST", "/v1/chat/completions", chat(max_tokens=2, n=3))).json()
    assert [(c["index"], c["message"]["content"]) for c in chat_body["choices"]] == [
        (0, " tok0 tok1"), (1, " tok0-1 tok1-1"), (2, " tok0-2 tok1-2")]
    assert chat_body["usage"]["completion_tokens"] == 6


async def test_n_streams_choices_interleaved_with_their_index() -> None:
    mock = engine()
    answer = await call(mock, "POST", "/v1/completions",
                        completion(max_tokens=3, n=2, stream=True, stream_options={"include_usage": True}))
    chunks, usage = stream_choices(answer)
    assert all(len(c["choices"]) == 1 for c in chunks)
    assert [c["choices"][0]["index"] for c in chunks] == [0, 1, 0, 1, 0, 1]
    texts = {i: "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) for i in (0, 1)}
    assert texts == {0: " tok0 tok1 tok2", 1: " tok0-1 tok1-1 tok2-1"}
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, None, "length", "length"]
    assert usage[0]["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}
    # Chat: one role chunk per choice first (each with the prompt's IDs when asked), then the tokens.
    chat_chunks, _ = stream_choices(await call(mock, "POST", "/v1/chat/completions",
                                               chat(max_tokens=2, n=2, stream=True, return_token_ids=True)))
    assert [(c["choices"][0]["index"], c["choices"][0]["delta"]) for c in chat_chunks] == [
        (0, {"role": "assistant", "content": ""}), (1, {"role": "assistant", "content": ""}),
        (0, {"content": " tok0"}), (1, {"content": " tok0-1"}), (0, {"content": " tok1"}), (1, {"content": " tok1-1"})]
    assert [("prompt_token_ids" in c) for c in chat_chunks] == [True, True, False, False, False, False]


async def test_n_with_stream_shapes_stop_strings_and_faults() -> None:
    shaped = engine(tokens_per_event=2)
    chunks, _ = stream_choices(await call(shaped, "POST", "/v1/completions",
                                          completion(max_tokens=6, n=2, stream=True, stop="tok3-1")))
    by_choice = {i: [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i] for i in (0, 1)}
    assert "".join(c["text"] for c in by_choice[0]) == " tok0 tok1 tok2 tok3 tok4 tok5"
    assert by_choice[0][-1]["finish_reason"] == "length"
    # The stop string is choice 1's: it ends that choice alone.
    assert "".join(c["text"] for c in by_choice[1]) == " tok0-1 tok1-1 tok2-1 "
    assert (by_choice[1][-1]["finish_reason"], by_choice[1][-1]["stop_reason"]) == ("stop", "tok3-1")
    mock = engine()
    set_fault(mock, "cut:after_tokens=2")
    cut = await call(mock, "POST", "/v1/completions", completion(DECODE_KV, max_tokens=5, n=2, stream=True))
    assert b"[DONE]" not in cut.body
    indexes = [json.loads(e)["choices"][0]["index"] for e in cut.events()]
    assert indexes == [0, 1, 0, 1]  # after_tokens counts each choice's tokens


async def test_n_on_a_prefill_answers_n_one_token_choices_and_one_handoff() -> None:
    mock = engine("prefill")
    body = (await call(mock, "POST", "/v1/completions", completion(PREFILL_KV, max_tokens=1, n=2))).json()
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, " tok0"), (1, " tok0-1")]
    assert body["usage"]["completion_tokens"] == 2 and body["kv_transfer_params"]["remote_block_ids"] == [1]


def vllm_error(answer: FakeResponder) -> dict[str, Any]:
    assert answer.status == 400, answer.body
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == 400
    return error


@pytest.mark.parametrize(("path", "fields", "type_", "param", "message"), [
    # vLLM's SamplingParams checks: BadRequestError, the message names the parameter.
    ("/v1/completions", {"n": 0}, "BadRequestError", None, "n must be at least 1, got 0."),
    ("/v1/chat/completions", {"n": -1}, "BadRequestError", None, "n must be at least 1, got -1."),
    ("/v1/completions", {"n": 16385}, "BadRequestError", None, "n must be at most 16384, got 16385."),
    ("/v1/completions", {"temperature": -0.5}, "BadRequestError", "temperature",
     "temperature must be non-negative, got -0.5. (parameter=temperature, value=-0.5)"),
    ("/v1/chat/completions", {"temperature": 3}, "BadRequestError", "temperature",
     "temperature must be in [0, 2], got 3.0. (parameter=temperature, value=3.0)"),
    ("/v1/completions", {"n": 2, "temperature": 0}, "BadRequestError", None,
     "n must be 1 when using greedy sampling, got 2."),
    ("/v1/completions", {"max_tokens": 0}, "BadRequestError", "max_tokens",
     "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"),
    ("/v1/chat/completions", {"max_completion_tokens": -3}, "BadRequestError", "max_tokens",
     "max_tokens must be at least 1, got -3. (parameter=max_tokens, value=-3)"),
    ("/v1/completions", {"prompt": []}, "BadRequestError", None, "The decoder prompt cannot be empty"),
    # vLLM's request model (pydantic): "Bad Request", the message lists the error.
    ("/v1/completions", {"temperature": "hot"}, "Bad Request", "body.temperature",
     "'float_parsing', 'loc': 'body.temperature'"),
    ("/v1/completions", {"n": "two"}, "Bad Request", "body.n", "'int_parsing', 'loc': 'body.n'"),
    ("/v1/completions", {"n": 1.5}, "Bad Request", "body.n", "'int_type', 'loc': 'body.n'"),
    ("/v1/completions", {"n": None}, "Bad Request", "body.n", "'int_type', 'loc': 'body.n'"),
    ("/v1/chat/completions", {"max_tokens": [3]}, "Bad Request", "body.max_tokens", "'loc': 'body.max_tokens'"),
    ("/v1/completions", {"stream": "sometimes"}, "Bad Request", "body.stream", "'bool_parsing'"),
    ("/v1/completions", {"prompt": ""}, "Bad Request", "prompt",
     "Either prompt or prompt_embeds must be provided and non-empty."),
    ("/v1/completions", {"prompt": None}, "Bad Request", "prompt",
     "Either prompt or prompt_embeds must be provided and non-empty."),
    ("/v1/completions", {"stream_options": {"include_usage": True}}, "Bad Request", "stream_options",
     "Stream options can only be defined when `stream=True`."),
])
async def test_invalid_requests_are_vllm_400s(path: str, fields: dict[str, Any], type_: str, param: str | None,
                                              message: str) -> None:
    mock = engine()
    body = completion(**fields) if path == "/v1/completions" else chat(**fields)
    error = vllm_error(await call(mock, "POST", path, body))
    assert (error["type"], error["param"]) == (type_, param)
    assert message in error["message"]
    assert mock.stats.plain == 0


async def test_what_vllm_accepts_the_mock_accepts() -> None:
    mock = engine()
    # A lax model: numbers and booleans in strings, a whole float for an int, null for chat's n and for stream.
    for path, body in [("/v1/completions", completion(n="2", temperature="0.5", max_tokens=2.0, stream=None)),
                       ("/v1/chat/completions", chat(n=None, temperature=None, max_tokens=2)),
                       ("/v1/completions", completion(n=2, temperature=0.7, max_tokens=2)),
                       ("/v1/completions", completion(temperature=0, max_tokens=2))]:
        answer = await call(mock, "POST", path, body)
        assert answer.status == 200, (body, answer.body)
    # Every error the mock answers has vLLM's four fields.
    assert set((await call(mock, "GET", "/nope")).json()["error"]) == {"message", "type", "param", "code"}
