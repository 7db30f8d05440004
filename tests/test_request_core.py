"""The request core, driven directly with an in-process fake pool and a recording sink."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import msgspec
import pytest
import trio
import trio.testing

from narwhal.config import parse_config
from narwhal.errors import EngineFailure, FailureClass, PoolSaturated, SuccessKind, UpstreamClientError
from narwhal.fleet.admission import Admission
from narwhal.fleet.placement import InFlight
from narwhal.obs.router_metrics import RouterMetrics
from narwhal.serving.request_core import RequestCore

CONFIG = """
[serving]
count_tokens = {count_tokens}
policy = "{policy}"
request_deadline_s = 5.0
[[engines]]
name = "p1"
url = "http://127.0.0.1:9001"
role = "prefill"
[[engines]]
name = "d1"
url = "http://127.0.0.1:9002"
role = "decode"
[[engines]]
name = "d2"
url = "http://127.0.0.1:9003"
role = "decode"
"""

KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p1-eng",
      "remote_block_ids": [1, 2, 3], "remote_host": "127.0.0.1", "remote_port": 9001, "tp_size": 1}
SSE = [b'data: {"choices":[{"text":"a"}]}\n\n', b'data: {"choices":[{"text":"b"}]}\n\ndata: [DONE]\n\n']


class FakeSupervisor:
    def __init__(self) -> None:
        self.roles = {"prefill": ["p1"], "decode": ["d1", "d2"]}
        self.failures: list[tuple[str, FailureClass]] = []
        self.successes: list[tuple[str, SuccessKind]] = []

    def eligible(self, role: str, model: str | None = None) -> list[str]:
        return list(self.roles[role])

    def capacity_problem(self, model: str | None = None) -> str | None:
        for role in ("prefill", "decode"):
            if not self.roles[role]:
                return f"serving capacity exhausted: no eligible {role} engine"
        return None

    def record_failure(self, engine: str, failure_class: FailureClass) -> None:
        self.failures.append((engine, failure_class))

    def record_success(self, engine: str, kind: SuccessKind) -> None:
        self.successes.append((engine, kind))


class FakeStream:
    """Scripted reads; like the pool's stream, ``saw_terminal`` is set by the read that carries [DONE]."""

    def __init__(self, chunks: list[Any]) -> None:
        self.chunks = list(chunks)
        self.saw_terminal = False
        # The pool's count of the ``data: `` events read, which the request line's token count comes from.
        self.data_events = 0
        # No engine socket under it: the relay pump never takes it.
        self.relay_watch = None

    async def read(self) -> bytes:
        await trio.lowlevel.checkpoint()
        if not self.chunks:
            if not self.saw_terminal:
                raise EngineFailure("d1", FailureClass.STREAM, "stream ended without data: [DONE]")
            return b""
        chunk = self.chunks.pop(0)
        if isinstance(chunk, trio.Event):
            await chunk.wait()  # the engine pauses mid-stream until the test says
            return await self.read()
        if isinstance(chunk, BaseException):
            raise chunk
        if chunk == "hang":
            await trio.sleep_forever()
        if b"data: [DONE]" in chunk:
            self.saw_terminal = True
        self.data_events += chunk.count(b"data: ")
        return chunk


class FakePool:
    """Scripted engine answers: a list of outcomes per (engine, path)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, Any], str]] = []
        self.prefill: list[Any] = []
        self.decode: list[Any] = []
        self.tokenize: list[Any] = []
        self.closed_streams = 0
        # No relay pump: streams go through the request task's own loop.
        self.pump = None

    def _next(self, script: list[Any], default: Any) -> Any:
        outcome = script.pop(0) if script else default
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    async def post_json(self, engine, path, body, *, request_id):
        payload = json.loads(body)
        self.calls.append((engine.name, path, payload, request_id))
        if path == "/tokenize":
            return self._next(self.tokenize, (200, b'{"count": 5, "max_model_len": 100, "tokens": []}'))
        if payload.get("kv_transfer_params", {}).get("do_remote_decode"):
            return self._next(self.prefill, (200, json.dumps({"kv_transfer_params": KV}).encode()))
        return self._next(self.decode, (200, b'{"choices": [{"text": "ab"}], "usage": {"completion_tokens": 2}}'))

    @contextlib.asynccontextmanager
    async def stream(self, engine, path, body, *, request_id):
        self.calls.append((engine.name, path, json.loads(body), request_id))
        chunks = self._next(self.decode, list(SSE))
        try:
            yield FakeStream(chunks)
        finally:
            self.closed_streams += 1


class Sink:
    def __init__(self) -> None:
        self.started = False
        self.finished = False
        self.status: int | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = b""
        self.writes: list[bytes] = []
        self.ended = False

    async def respond(self, status, headers, body):
        self.status, self.headers, self.body = status, headers, body
        self.finished = True

    async def start_stream(self, status, headers, first=b"", end=False):
        self.started = True
        self.status, self.headers = status, headers
        self.writes.append(first)
        self.ended = self.finished = end

    async def write(self, data):
        self.writes.append(data)

    async def end_stream(self, last=b""):
        if last:
            self.writes.append(last)
        self.ended = self.finished = True
        self.ended_with = last

    def direct(self) -> None:
        """No client socket under this sink: the relay pump never takes its stream."""
        return None

    def json(self) -> Any:
        return json.loads(self.body)


def make_core(*, count_tokens: bool = False, policy: str = "saturate"):
    config = parse_config(CONFIG.format(count_tokens=str(count_tokens).lower(), policy=policy))
    supervisor, pool = FakeSupervisor(), FakePool()
    admission = Admission()
    core = RequestCore(config=config, supervisor=supervisor, data_pool=pool,
                       in_flight=InFlight(e.name for e in config.engines), admission=admission,
                       metrics=RouterMetrics())
    return core, supervisor, pool, admission


def body(**fields: Any) -> bytes:
    payload = {"model": "mock-model", "prompt": "hello", "max_tokens": 7}
    payload.update(fields)
    return msgspec.json.encode({k: v for k, v in payload.items() if v is not ...})


async def test_prefill_gets_one_token_no_stream_and_a_remote_decode_request():
    core, _, pool, _ = make_core()
    sink = Sink()
    await core.handle("/v1/completions",
                      body(stream=True, stream_options={"include_usage": True}, max_completion_tokens=9,
                           temperature=0.5), None, sink)
    engine, path, prefill, _ = pool.calls[0]
    assert (engine, path) == ("p1", "/v1/completions")
    assert prefill["max_tokens"] == 1
    assert prefill["max_completion_tokens"] == 1
    assert prefill["stream"] is False
    assert "stream_options" not in prefill
    assert prefill["temperature"] == 0.5
    assert prefill["kv_transfer_params"] == {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None,
    }


async def test_decode_gets_the_original_body_plus_the_prefills_handoff_verbatim():
    core, supervisor, pool, _ = make_core()
    sink = Sink()
    await core.handle("/v1/completions", body(stream=True, stream_options={"include_usage": True}), None, sink)
    engine, path, decode, _ = pool.calls[1]
    assert engine in ("d1", "d2") and path == "/v1/completions"
    assert decode["max_tokens"] == 7
    assert decode["stream"] is True
    assert decode["stream_options"] == {"include_usage": True}
    assert decode["kv_transfer_params"] == KV
    assert (("p1", SuccessKind.PREFILL_HANDOFF) in supervisor.successes)
    assert ((engine, SuccessKind.DECODE_TERMINAL) in supervisor.successes)


@pytest.mark.parametrize("stream", [True, False])
async def test_the_handoff_reaches_decode_as_the_prefill_wrote_it(stream):
    # Key order, spacing, number spelling and escapes kept: the decode is sent the prefill's own bytes.
    kv_json = (b'{"tp_size": 1,  "remote_port": 9001, "remote_block_ids": [1, 2, 3], "remote_engine_id": "p1-eng",'
               b' "remote_host": "127.0.0.1", "scale": 1.50, "note": "\\u00e9"}')
    core, _, pool, _ = make_core()
    raw_bodies: list[bytes] = []
    stream_of, post_json_of = pool.stream, pool.post_json

    def stream_recorded(engine, path, body, *, request_id):
        raw_bodies.append(body)
        return stream_of(engine, path, body, request_id=request_id)

    async def post_json_recorded(engine, path, body, *, request_id):
        raw_bodies.append(body)
        return await post_json_of(engine, path, body, request_id=request_id)

    pool.stream, pool.post_json = stream_recorded, post_json_recorded
    pool.prefill.append((200, b'{"id": "x", "kv_transfer_params": ' + kv_json + b"}"))
    sink = Sink()
    await core.handle("/v1/completions", body(stream=stream), None, sink)
    assert sink.status == 200
    assert b'"kv_transfer_params":' + kv_json in raw_bodies[1]


async def test_prefill_without_max_completion_tokens_does_not_gain_it():
    core, _, pool, _ = make_core()
    await core.handle("/v1/completions", body(), None, Sink())
    assert "max_completion_tokens" not in pool.calls[0][2]


async def test_client_supplied_kv_params_never_reach_an_engine():
    core, _, pool, _ = make_core()
    await core.handle("/v1/completions", body(kv_transfer_params={"remote_host": "evil"}), None, Sink())
    assert pool.calls[1][2]["kv_transfer_params"] == KV


async def test_stream_is_relayed_chunk_for_chunk_without_reencoding():
    core, _, _, _ = make_core()
    sink = Sink()
    await core.handle("/v1/completions", body(stream=True), None, sink)
    assert sink.status == 200
    assert (b"content-type", b"text/event-stream") in sink.headers
    assert sink.writes == SSE
    assert sink.ended


async def test_the_read_carrying_done_goes_out_with_the_terminator():
    core, _, pool, _ = make_core()
    sink = Sink()
    await core.handle("/v1/completions", body(stream=True), None, sink)
    # SSE[1] ends with [DONE]: held back and written by end_stream together with the chunked terminator.
    assert sink.ended_with == SSE[1]


async def test_a_stream_in_one_read_is_head_body_and_terminator_in_one_write():
    core, _, pool, _ = make_core()
    pool.decode.append([b"".join(SSE)])
    sink = Sink()
    await core.handle("/v1/completions", body(stream=True), None, sink)
    assert sink.writes == [b"".join(SSE)] and sink.ended and not hasattr(sink, "ended_with")


async def test_non_streaming_decode_body_is_returned_as_is():
    core, _, _, _ = make_core()
    sink = Sink()
    await core.handle("/v1/chat/completions",
                      msgspec.json.encode({"model": "mock-model", "messages": [{"role": "user", "content": "x"}]}),
                      None, sink)
    assert sink.status == 200
    assert sink.json()["choices"][0]["text"] == "ab"


CHAT = msgspec.json.encode({"model": "mock-model", "messages": [{"role": "user", "content": "x"}], "stream": True})
ROLE_EVENT = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'


def token_event(text: str) -> bytes:
    return b'data: {"choices":[{"index":0,"delta":{"content":"%s"},"finish_reason":null}]}\n\n' % text.encode()


def request_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [json.loads(r.getMessage()) for r in caplog.records
            if r.name == "narwhal.events" and '"event":"request"' in r.getMessage()]


async def test_non_streamed_answers_do_not_show_kv_transfer_params():
    core, _, pool, _ = make_core()
    pool.decode.append((200, b'{"choices": [{"text": "ab"}], "usage": {"completion_tokens": 2}, '
                             b'"kv_transfer_params": null}'))
    sink = Sink()
    await core.handle("/v1/completions", body(), None, sink)
    assert sink.status == 200
    assert sink.json() == {"choices": [{"text": "ab"}], "usage": {"completion_tokens": 2}}


@pytest.mark.parametrize("policy", ["saturate", "bounded"])
async def test_streamed_events_carrying_kv_transfer_params_lose_it(policy):
    core, _, pool, _ = make_core(policy=policy)
    pool.decode.append([b'data: {"choices":[{"text":"a"}],"kv_transfer_params":null}\n\n',
                        b'data: {"choices":[{"text":"b"}],"kv_transfer_params":{"x":1}}\n\ndata: [DONE]\n\n'])
    sink = Sink()
    await core.handle("/v1/completions", body(stream=True), None, sink)
    assert b"".join(sink.writes) == (b'data: {"choices":[{"text":"a"}]}\n\n'
                                     b'data: {"choices":[{"text":"b"}]}\n\ndata: [DONE]\n\n')


@pytest.mark.parametrize("policy", ["saturate", "bounded"])
@pytest.mark.parametrize("one_read", [False, True])
async def test_a_chat_streams_role_only_first_event_is_not_a_token(caplog, one_read, policy):
    # bounded relays through the stream-continuation join, saturate directly: both count 8.
    caplog.set_level("INFO", logger="narwhal.events")
    core, _, pool, _ = make_core(policy=policy)
    events = [ROLE_EVENT, *(token_event(t) for t in "abcdefgh"), b"data: [DONE]\n\n"]
    pool.decode.append([b"".join(events)] if one_read else [events[0], *events[1:-2], b"".join(events[-2:])])
    sink = Sink()
    await core.handle("/v1/chat/completions", CHAT, None, sink)
    assert b"".join(sink.writes) == b"".join(events)
    assert [line["tokens"] for line in request_lines(caplog)] == [8]


def usage_event(completion_tokens: int) -> bytes:
    return (b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":%d,"total_tokens":%d}}\n\n'
            % (completion_tokens, completion_tokens + 3))


@pytest.mark.parametrize("policy", ["saturate", "bounded"])
@pytest.mark.parametrize("split", ["usage-with-done", "usage-before-done"])
async def test_the_usage_event_a_client_asked_for_is_not_a_token(caplog, policy, split):
    # Four tokens and the usage-only event the client asked for: the log says 4, not 5.
    caplog.set_level("INFO", logger="narwhal.events")
    core, _, pool, _ = make_core(policy=policy)
    tokens = [b'data: {"choices":[{"index":0,"text":"%s"}]}\n\n' % t for t in (b"a", b"b", b"c", b"d")]
    if split == "usage-with-done":
        pool.decode.append([*tokens, usage_event(4) + b"data: [DONE]\n\n"])
    else:
        pool.decode.append([*tokens, usage_event(4), b"data: [DONE]\n\n"])
    await core.handle("/v1/completions", body(stream=True, stream_options={"include_usage": True}), None, Sink())
    assert [line["tokens"] for line in request_lines(caplog)] == [4]


async def test_events_of_several_tokens_are_counted_by_the_engines_usage(caplog):
    # An engine that coalesces tokens (two per event here) says how many in its usage: that count is logged.
    caplog.set_level("INFO", logger="narwhal.events")
    core, _, pool, _ = make_core()
    tokens = [b'data: {"choices":[{"index":0,"text":"%s"}]}\n\n' % t for t in (b"ab", b"cd", b"ef")]
    pool.decode.append([*tokens, usage_event(6) + b"data: [DONE]\n\n"])
    await core.handle("/v1/completions", body(stream=True, stream_options={"include_usage": True}), None, Sink())
    assert [line["tokens"] for line in request_lines(caplog)] == [6]


async def test_a_chat_of_two_choices_opens_with_two_role_events_neither_a_token(caplog):
    caplog.set_level("INFO", logger="narwhal.events")
    core, _, pool, _ = make_core()
    role = [b'data: {"choices":[{"index":%d,"delta":{"role":"assistant","content":""}}]}\n\n' % i for i in (0, 1)]
    tokens = [b'data: {"choices":[{"index":%d,"delta":{"content":"x"}}]}\n\n' % i for i in (0, 1, 0, 1)]
    pool.decode.append([b"".join(role), *tokens, b"data: [DONE]\n\n"])
    chat = msgspec.json.encode({"model": "mock-model", "messages": [{"role": "user", "content": "x"}], "stream": True,
                                "n": 2, "temperature": 1.0})
    await core.handle("/v1/chat/completions", chat, None, Sink())
    assert [line["tokens"] for line in request_lines(caplog)] == [4]


async def test_a_first_chat_event_with_content_is_a_token(caplog):
    caplog.set_level("INFO", logger="narwhal.events")
    core, _, pool, _ = make_core()
    first = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":"a"}}]}\n\n'
    pool.decode.append([first, token_event("b") + b"data: [DONE]\n\n"])
    await core.handle("/v1/chat/completions", CHAT, None, Sink())
    assert [line["tokens"] for line in request_lines(caplog)] == [2]


async def test_request_id_from_client_is_sent_on_both_legs_and_echoed():
    core, _, pool, _ = make_core()
    sink = Sink()
    await core.handle("/v1/completions", body(), b"abc-123", sink)
    assert [call[3] for call in pool.calls] == ["abc-123", "abc-123"]
    assert (b"x-request-id", b"abc-123") in sink.headers


async def test_generated_request_ids_are_unique():
    core, _, pool, _ = make_core()
    await core.handle("/v1/completions", body(), None, Sink())
    await core.handle("/v1/completions", body(), None, Sink())
    assert pool.calls[0][3] == pool.calls[1][3]
    assert pool.calls[0][3] != pool.calls[2][3]


@pytest.mark.parametrize(
    ("raw", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),
        (b"[1, 2]", 400, "invalid_body"),
        (body(model="other"), 404, "model_not_found"),
        (body(model=3), 400, "invalid_model"),
        (body(prompt=...), 400, "invalid_prompt"),
        (body(prompt=[]), 400, "invalid_prompt"),
        (body(prompt=[1, "two"]), 400, "invalid_prompt"),
        (body(prompt=[True, 2]), 400, "invalid_prompt"),
        (body(prompt=["one", "two"]), 400, "prompt_list_unsupported"),
        (body(prompt=[[1, 2], [3]]), 400, "prompt_list_unsupported"),
        (body(stream="yes"), 400, "invalid_stream"),
        (body(max_tokens=0), 400, "invalid_max_tokens"),
        (body(max_tokens="9"), 400, "invalid_max_tokens"),
    ],
)
async def test_bad_requests_get_openai_errors_and_reach_no_engine(raw, status, code):
    core, _, pool, _ = make_core()
    sink = Sink()
    await core.handle("/v1/completions", raw, None, sink)
    assert sink.status == status
    error = sink.json()["error"]
    assert error["code"] == code and error["message"] and error["type"]
    assert pool.calls == []


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"", "request body is empty"),
        (b" \r\n", "request body is empty"),
        (b'{"model": "mock-model", "prompt": "\\ud800"}',
         "request body is not valid JSON: lone UTF-16 surrogate escape \\ud800 at byte 35"),
        (b'{"model": "mock-model", "prompt": "\\ud800"', "request body is not valid JSON: Input data was truncated"),
        (b'{"model": ', "request body is not valid JSON: Input data was truncated"),
    ],
)
async def test_a_body_that_is_not_json_says_why_in_words_that_fit(raw, message):
    core, _, pool, _ = make_core()
    sink = Sink()
    await core.handle("/v1/completions", raw, None, sink)
    assert sink.status == 400
    assert sink.json()["error"]["message"] == message
    assert sink.json()["error"]["code"] == "invalid_json"
    assert pool.calls == []


async def test_chat_needs_messages():
    core, _, pool, _ = make_core()
    sink = Sink()
    await core.handle("/v1/chat/completions", msgspec.json.encode({"model": "mock-model"}), None, sink)
    assert sink.status == 400 and sink.json()["error"]["code"] == "invalid_messages"


async def test_missing_model_means_the_fleets_model():
    core, _, pool, _ = make_core()
    sink = Sink()
    await core.handle("/v1/completions", body(model=...), None, sink)
    assert sink.status == 200
    assert pool.calls[0][2]["model"] == "mock-model"


async def test_unreadable_handoff_is_kv_handoff_on_the_prefill_and_nothing_goes_to_decode():
    core, supervisor, pool, _ = make_core()
    for bad in (b'{"choices": []}', b'{"kv_transfer_params": "x"}', b"not json",
                b'{"kv_transfer_params": {"remote_engine_id": "e"}}'):
        pool.calls.clear()
        pool.prefill.append((200, bad))
        sink = Sink()
        await core.handle("/v1/completions", body(stream=True), None, sink)
        assert sink.status == 502
        assert sink.json()["error"]["code"] == "kv_handoff"
        assert [c[0] for c in pool.calls] == ["p1"]
    assert supervisor.failures == [("p1", FailureClass.KV_HANDOFF)] * 4


@pytest.mark.parametrize(
    ("failure", "status"),
    [(FailureClass.CONNECTION, 502), (FailureClass.TIMEOUT, 504), (FailureClass.INFERENCE_STATUS, 502),
     (FailureClass.OVERLOAD, 502)],
)
async def test_engine_failure_before_streaming_is_evidence_and_an_honest_status(failure, status):
    core, supervisor, pool, _ = make_core()
    pool.prefill.append(EngineFailure("p1", failure, "boom"))
    sink = Sink()
    await core.handle("/v1/completions", body(), None, sink)
    assert sink.status == status
    assert supervisor.failures == [("p1", failure)]


async def test_failure_after_first_byte_ends_with_sse_error_and_no_done():
    core, supervisor, pool, _ = make_core()
    pool.decode.append([SSE[0], EngineFailure("d1", FailureClass.STREAM, "silence")])
    sink = Sink()
    await core.handle("/v1/completions", body(stream=True), None, sink)
    assert sink.status == 200 and sink.ended
    assert sink.writes[0] == SSE[0]
    last = sink.writes[-1]
    assert last.startswith(b"data: ") and b'"code":"stream"' in last
    assert not any(b"[DONE]" in w for w in sink.writes)
    assert supervisor.failures == [("d1", FailureClass.STREAM)]
    assert not any(kind is SuccessKind.DECODE_TERMINAL for _, kind in supervisor.successes)


async def test_upstream_client_error_is_relayed_and_clears_not_counts():
    core, supervisor, pool, _ = make_core()
    pool.prefill.append(UpstreamClientError("p1", 422, b'{"error": {"message": "bad logprobs"}}'))
    sink = Sink()
    await core.handle("/v1/completions", body(), None, sink)
    assert sink.status == 422
    assert sink.json()["error"]["message"] == "bad logprobs"
    assert supervisor.failures == []
    assert supervisor.successes == [("p1", SuccessKind.CLIENT_4XX)]


async def test_closed_admission_refuses_with_its_reason():
    core, _, pool, admission = make_core()
    admission.close("monitor", "monitoring degraded: health TimeoutError")
    sink = Sink()
    await core.handle("/v1/completions", body(), None, sink)
    assert sink.status == 503
    assert sink.json()["error"]["message"] == "monitoring degraded: health TimeoutError"
    assert pool.calls == []


async def test_no_eligible_decode_engine_is_503_capacity_exhausted():
    core, supervisor, pool, _ = make_core()
    supervisor.roles["decode"] = []
    sink = Sink()
    await core.handle("/v1/completions", body(), None, sink)
    assert sink.status == 503
    assert sink.json()["error"]["message"] == "serving capacity exhausted: no eligible decode engine"
    assert pool.calls == []


async def test_pool_saturation_is_503_and_not_engine_failure():
    core, supervisor, pool, _ = make_core()
    pool.prefill.append(PoolSaturated())
    sink = Sink()
    await core.handle("/v1/completions", body(), None, sink)
    assert sink.status == 503 and sink.json()["error"]["code"] == "pool_saturated"
    # A refusal for capacity says when to try again, as the priority gate's refusals do.
    assert dict(sink.headers)[b"retry-after"] == b"1"
    assert supervisor.failures == []


async def test_token_counting_refuses_prompts_longer_than_the_context():
    core, _, pool, _ = make_core(count_tokens=True)
    pool.tokenize.append((200, b'{"count": 101, "max_model_len": 100, "tokens": []}'))
    sink = Sink()
    await core.handle("/v1/completions", body(), None, sink)
    assert sink.status == 400 and sink.json()["error"]["code"] == "context_length_exceeded"
    assert [c[1] for c in pool.calls] == ["/tokenize"]
    assert pool.calls[0][0] == "p1" and pool.calls[0][2] == {"model": "mock-model", "prompt": "hello"}


async def test_token_counting_counts_prompt_plus_max_tokens():
    core, _, pool, _ = make_core(count_tokens=True)
    pool.tokenize.append((200, b'{"count": 95, "max_model_len": 100, "tokens": []}'))
    sink = Sink()
    await core.handle("/v1/completions", body(max_tokens=6), None, sink)
    assert sink.status == 400


async def test_a_list_of_prompts_is_refused_naming_the_limitation():
    core, _, pool, _ = make_core(count_tokens=True)
    sink = Sink()
    await core.handle("/v1/completions", body(prompt=["a b", "c d"]), None, sink)
    assert sink.status == 400 and "a list of prompts is not supported" in sink.json()["error"]["message"]
    assert pool.calls == []


async def test_token_id_prompts_are_counted_here_never_sent_to_tokenize():
    # vLLM 0.32's /tokenize takes only a string: a token-ID prompt is counted by its length.
    core, _, pool, _ = make_core(count_tokens=True)
    sink = Sink()
    await core.handle("/v1/completions", body(prompt=[43, 395, 295]), None, sink)
    assert sink.status == 200
    assert [c[1] for c in pool.calls] == ["/v1/completions", "/v1/completions"]
    assert all(c[2]["prompt"] == [43, 395, 295] for c in pool.calls)


async def test_token_id_prompts_over_the_context_learned_from_tokenize_get_400():
    core, _, pool, _ = make_core(count_tokens=True)
    await core.handle("/v1/completions", body(), None, Sink())  # /tokenize says max_model_len 100
    pool.calls.clear()
    sink = Sink()
    await core.handle("/v1/completions", body(prompt=list(range(101)), max_tokens=1), None, sink)
    assert sink.status == 400 and sink.json()["error"]["code"] == "context_length_exceeded"
    assert "101 tokens" in sink.json()["error"]["message"] and pool.calls == []
    sink = Sink()
    await core.handle("/v1/completions", body(prompt=list(range(95)), max_tokens=6), None, sink)
    assert sink.status == 400 and pool.calls == []
    sink = Sink()
    await core.handle("/v1/completions", body(prompt=list(range(95)), max_tokens=5), None, sink)
    assert sink.status == 200


async def test_token_id_prompt_before_any_limit_is_known_lets_the_engine_judge():
    core, supervisor, pool, _ = make_core(count_tokens=True)
    pool.prefill.append(UpstreamClientError("p1", 400, b'{"error": {"message": "too long"}}'))
    sink = Sink()
    await core.handle("/v1/completions", body(prompt=list(range(5000))), None, sink)
    assert sink.status == 400 and supervisor.failures == []
    assert [c[1] for c in pool.calls] == ["/v1/completions"]


async def test_token_counting_off_skips_tokenize():
    core, _, pool, _ = make_core(count_tokens=False)
    await core.handle("/v1/completions", body(), None, Sink())
    assert "/tokenize" not in [c[1] for c in pool.calls]


async def test_saturate_policy_makes_one_attempt():
    core, _, pool, _ = make_core(policy="saturate")
    pool.decode.append(EngineFailure("d1", FailureClass.CONNECTION, "refused"))
    sink = Sink()
    await core.handle("/v1/completions", body(), None, sink)
    assert sink.status == 502
    assert len(pool.calls) == 2


async def test_bounded_policy_retries_with_a_fresh_prefill():
    core, supervisor, pool, _ = make_core(policy="bounded")
    pool.decode.append(EngineFailure("d1", FailureClass.CONNECTION, "refused"))
    sink = Sink()
    await core.handle("/v1/completions", body(), None, sink)
    assert sink.status == 200
    legs = [(c[0], bool(c[2]["kv_transfer_params"].get("do_remote_decode"))) for c in pool.calls]
    # prefill, failed decode, then a NEW prefill before the second decode: fresh KV ownership.
    assert [prefill for _, prefill in legs] == [True, False, True, False]


async def test_bounded_policy_without_continue_streams_never_retries_after_tokens_reached_the_client():
    config = parse_config(CONFIG.format(count_tokens="false", policy="bounded")
                          .replace("policy =", "continue_streams = false\npolicy ="))
    pool = FakePool()
    core = RequestCore(config=config, supervisor=FakeSupervisor(), data_pool=pool,
                       in_flight=InFlight(e.name for e in config.engines), admission=Admission(),
                       metrics=RouterMetrics())
    pool.decode.append([SSE[0], EngineFailure("d1", FailureClass.STREAM, "cut")])
    sink = Sink()
    await core.handle("/v1/completions", body(stream=True), None, sink)
    assert len(pool.calls) == 2
    assert sink.writes[0] == SSE[0] and b"error" in sink.writes[-1]


async def test_bounded_policy_queues_for_capacity_within_the_deadline(autojump_clock):
    core, supervisor, pool, _ = make_core(policy="bounded")
    supervisor.roles["decode"] = []

    async def engine_returns():
        await trio.sleep(1.0)
        supervisor.roles["decode"] = ["d2"]

    sink = Sink()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine_returns)
        await core.handle("/v1/completions", body(), None, sink)
    assert sink.status == 200
    assert pool.calls[-1][0] == "d2"
    assert trio.current_time() >= 1.0


async def test_deadline_gives_504(autojump_clock):
    core, _, pool, _ = make_core()
    pool.decode.append(["hang"])
    sink = Sink()
    await core.handle("/v1/completions", body(stream=True), None, sink)
    assert sink.status == 504
    assert trio.current_time() == pytest.approx(5.0)
    assert pool.closed_streams == 1


async def test_bounded_retries_stop_at_the_original_deadline(autojump_clock):
    # Each decode fails after 2 s; max_attempts would allow 10. The deadline is the
    # request's, not each attempt's: attempts start at 0, 2 and 4 s and the third
    # is cut at the original 5 s deadline with a 504.
    config = parse_config(CONFIG.format(count_tokens="false", policy="bounded")
                          .replace("request_deadline_s = 5.0", "request_deadline_s = 5.0\nmax_attempts = 10"))
    supervisor, pool = FakeSupervisor(), FakePool()
    core = RequestCore(config=config, supervisor=supervisor, data_pool=pool,
                       in_flight=InFlight(e.name for e in config.engines), admission=Admission(),
                       metrics=RouterMetrics())
    scripted = pool.post_json
    decode_started: list[float] = []

    async def slow_failing_decode(engine, path, body, *, request_id):
        if not json.loads(body)["kv_transfer_params"].get("do_remote_decode"):
            decode_started.append(trio.current_time())
            await trio.sleep(2.0)
            raise EngineFailure(engine.name, FailureClass.INFERENCE_STATUS, "HTTP 500", status=500)
        return await scripted(engine, path, body, request_id=request_id)

    pool.post_json = slow_failing_decode
    sink = Sink()
    await core.handle("/v1/completions", body(), None, sink)
    assert sink.status == 504 and sink.json()["error"]["code"] == "deadline_exceeded"
    assert trio.current_time() == pytest.approx(5.0)
    assert decode_started == [0.0, 2.0, 4.0]
    assert core.in_flight.total() == 0


async def test_client_cancellation_releases_in_flight_and_closes_the_upstream():
    core, _, pool, _ = make_core()
    pool.decode.append([SSE[0], "hang"])
    sink = Sink()
    with trio.move_on_after(0.2):
        await core.handle("/v1/completions", body(stream=True), None, sink)
    assert sink.writes == [SSE[0]]
    assert pool.closed_streams == 1
    assert core.in_flight.total() == 0


async def test_least_outstanding_placement_avoids_the_busy_decode_engine():
    core, _, pool, _ = make_core()
    core.in_flight.acquire("d1")
    for _ in range(5):
        await core.handle("/v1/completions", body(), None, Sink())
    assert {c[0] for c in pool.calls[1::2]} == {"d2"}


async def test_bounded_retry_avoids_the_engine_that_just_failed():
    core, _, pool, _ = make_core(policy="bounded")
    # d2 is busier, so least-outstanding placement prefers d1 every time...
    core.in_flight.acquire("d2")
    pool.decode.append(EngineFailure("d1", FailureClass.CONNECTION, "refused"))
    sink = Sink()
    await core.handle("/v1/completions", body(), None, sink)
    assert sink.status == 200
    # ...but the retry after d1 failed goes to d2.
    assert [c[0] for c in pool.calls if c[0].startswith("d")] == ["d1", "d2"]


async def test_bounded_retry_falls_back_to_a_failed_engine_when_it_is_the_only_one():
    core, supervisor, pool, _ = make_core(policy="bounded")
    supervisor.roles["decode"] = ["d1"]
    pool.decode.append(EngineFailure("d1", FailureClass.CONNECTION, "refused"))
    sink = Sink()
    await core.handle("/v1/completions", body(), None, sink)
    assert sink.status == 200
    assert [c[0] for c in pool.calls if c[0].startswith("d")] == ["d1", "d1"]


# an engine a config reload removed: its legs still in flight are cut, without blame ---------------------

async def stream_on_d1(nursery: trio.Nursery, core, supervisor, pool) -> Sink:
    """A stream on d1 that sent its first event and then waits forever; returned once the client has it."""
    supervisor.roles["decode"] = ["d1"]
    pool.decode.append([SSE[0], "hang"])
    sink = Sink()
    nursery.start_soon(core.handle, "/v1/completions", body(stream=True), None, sink)
    while not sink.started:
        await trio.lowlevel.checkpoint()
    return sink


async def test_a_stream_on_a_removed_engine_is_cut_with_the_sse_error_and_no_evidence():
    core, supervisor, pool, _ = make_core()
    async with trio.open_nursery() as nursery:
        sink = await stream_on_d1(nursery, core, supervisor, pool)
        # The removal's grace has passed: the snapshot without d1 reaches the data plane.
        core.set_engines(spec for spec in core.engines.values() if spec.name != "d1")
    assert sink.writes[0] == SSE[0] and sink.ended
    error = json.loads(sink.ended_with.removeprefix(b"data: "))["error"]
    assert error["code"] == "engine_removed" and "d1" in error["message"]
    assert b"[DONE]" not in b"".join(sink.writes)
    assert supervisor.failures == [] and ("d1", SuccessKind.DECODE_TERMINAL) not in supervisor.successes
    assert pool.closed_streams == 1
    # Its in-flight entry went with its last request.
    assert "d1" not in core.in_flight.counts and core.in_flight.total() == 0


def gate_prefill(pool) -> tuple[trio.Event, trio.Event]:
    """(prefilling, go_on): the prefill call sets the first, then waits for the second before answering."""
    prefilling, go_on = trio.Event(), trio.Event()
    post_json = pool.post_json

    async def waiting_prefill(engine, path, body, *, request_id):
        prefilling.set()
        await go_on.wait()
        return await post_json(engine, path, body, request_id=request_id)

    pool.post_json = waiting_prefill
    return prefilling, go_on


async def test_a_prefill_on_a_removed_engine_is_cut_with_a_502_before_any_byte():
    core, supervisor, pool, _ = make_core()
    prefilling, _ = gate_prefill(pool)
    sink = Sink()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(core.handle, "/v1/completions", body(), None, sink)
        await prefilling.wait()
        core.set_engines(spec for spec in core.engines.values() if spec.name != "p1")
    assert sink.status == 502 and sink.json()["error"]["code"] == "engine_removed"
    assert "prefill engine p1" in sink.json()["error"]["message"]
    assert supervisor.failures == []


async def test_a_changed_url_cuts_the_legs_on_the_old_address_and_an_unchanged_set_cuts_nothing():
    core, supervisor, pool, _ = make_core()
    async with trio.open_nursery() as nursery:
        sink = await stream_on_d1(nursery, core, supervisor, pool)
        core.set_engines(list(core.engines.values()))
        await trio.testing.wait_all_tasks_blocked()
        assert not sink.ended
        moved = msgspec.structs.replace(core.engines["d1"], url="http://127.0.0.1:9102")
        core.set_engines([*(spec for spec in core.engines.values() if spec.name != "d1"), moved])
    assert b"engine_removed" in sink.ended_with
    assert core.engines["d1"].url == "http://127.0.0.1:9102"


async def test_a_removed_prefill_engine_no_longer_cuts_the_request_once_its_decode_runs():
    # The attempt's one cancel scope moves from the prefill engine to the decode engine with the leg.
    core, supervisor, pool, _ = make_core()
    async with trio.open_nursery() as nursery:
        sink = await stream_on_d1(nursery, core, supervisor, pool)
        core.set_engines(spec for spec in core.engines.values() if spec.name != "p1")
        await trio.testing.wait_all_tasks_blocked()
        assert not sink.ended
        # The decode engine's own removal still cuts it.
        core.set_engines(spec for spec in core.engines.values() if spec.name != "d1")
    assert b"engine_removed" in sink.ended_with and b"decode engine d1" in sink.ended_with


async def test_a_removed_decode_engine_does_not_cut_a_prefill_in_progress():
    core, supervisor, pool, _ = make_core()
    supervisor.roles["decode"] = ["d1"]
    prefilling, go_on = gate_prefill(pool)
    sink = Sink()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(core.handle, "/v1/completions", body(), None, sink)
        await prefilling.wait()
        # d1 leaves while p1 prefills: nothing of this request runs on d1 yet, so nothing is cut.
        core.set_engines(spec for spec in core.engines.values() if spec.name != "d1")
        await trio.testing.wait_all_tasks_blocked()
        go_on.set()
    assert sink.status == 200


async def test_a_prefill_engine_cut_as_its_leg_ends_lets_the_decode_run():
    # The removal lands after the prefill's last checkpoint: the prefill's answer counts (it came), and
    # the decode runs under a scope of its own, exactly as when each leg had its own scope.
    core, supervisor, pool, _ = make_core()
    post_json = pool.post_json

    async def prefill_then_removed(engine, path, body, *, request_id):
        answer = await post_json(engine, path, body, request_id=request_id)
        core.set_engines(spec for spec in core.engines.values() if spec.name != "p1")
        return answer

    pool.post_json = prefill_then_removed
    sink = Sink()
    await core.handle("/v1/completions", body(stream=True), None, sink)
    assert sink.status == 200 and sink.ended and b"[DONE]" in b"".join(sink.writes)
    assert b"engine_removed" not in b"".join(sink.writes)
    assert supervisor.failures == []


# -- a stream ended by cancellation logs the tokens the client received -----------------------------------------

TEN = [b'data: {"choices":[{"text":"t%d"}]}\n\n' % i for i in range(10)]


@pytest.mark.parametrize("policy", ["saturate", "bounded"])
async def test_a_stream_the_client_leaves_logs_the_tokens_it_received(caplog, policy):
    # The client goes away (the front cancels the handler) after 10 tokens; the engine is still streaming.
    core, _, pool, _ = make_core(policy=policy)
    pool.decode.append([*TEN, "hang"])
    sink = Sink()
    caplog.set_level("INFO", logger="narwhal.events")
    client = trio.CancelScope()

    async def request() -> None:
        with client:
            await core.handle("/v1/completions", body(stream=True), None, sink)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(request)
        while len(b"".join(sink.writes).split(b"\n\n")) <= 10:
            await trio.lowlevel.checkpoint()
        client.cancel()
    [line] = request_lines(caplog)
    assert line["status"] == 499 and line["error"] == "client_disconnected"
    assert line["tokens"] == 10


async def test_a_stream_cut_because_its_engine_was_removed_logs_the_tokens_relayed(caplog):
    core, supervisor, pool, _ = make_core()
    supervisor.roles["decode"] = ["d1"]
    pool.decode.append([*TEN, "hang"])
    sink = Sink()
    caplog.set_level("INFO", logger="narwhal.events")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(core.handle, "/v1/completions", body(stream=True), None, sink)
        while len(b"".join(sink.writes).split(b"\n\n")) <= 10:
            await trio.lowlevel.checkpoint()
        core.set_engines(spec for spec in core.engines.values() if spec.name != "d1")
    [line] = request_lines(caplog)
    assert line["error"] == "engine_removed" and line["tokens"] == 10


async def test_a_stream_cut_by_the_request_deadline_logs_the_tokens_relayed(caplog, autojump_clock):
    core, _, pool, _ = make_core()
    pool.decode.append([*TEN, "hang"])
    sink = Sink()
    caplog.set_level("INFO", logger="narwhal.events")
    await core.handle("/v1/completions", body(stream=True), None, sink)
    [line] = request_lines(caplog)
    assert line["error"] == "deadline" and line["tokens"] == 10


# -- saturate: the attempt's leg scope carries the request deadline (no scope of its own per request) ----------

async def test_a_deadline_during_the_prefill_is_a_504_not_a_removal_and_no_evidence(autojump_clock, caplog):
    core, supervisor, pool, _ = make_core()
    gate_prefill(pool)  # the prefill never answers
    caplog.set_level("INFO", logger="narwhal.events")
    sink = Sink()
    await core.handle("/v1/completions", body(), None, sink)
    assert sink.status == 504 and sink.json()["error"]["code"] == "deadline_exceeded"
    assert trio.current_time() == pytest.approx(5.0)
    assert supervisor.failures == [] and core.in_flight.total() == 0
    [line] = request_lines(caplog)
    assert line["status"] == 504 and line["error"] == "deadline"


async def test_a_deadline_mid_stream_ends_it_with_the_sse_error_and_no_done(autojump_clock):
    core, supervisor, pool, _ = make_core()
    pool.decode.append([SSE[0], "hang"])
    sink = Sink()
    await core.handle("/v1/completions", body(stream=True), None, sink)
    assert trio.current_time() == pytest.approx(5.0)
    assert sink.writes[0] == SSE[0] and sink.ended and b"[DONE]" not in b"".join(sink.writes)
    assert json.loads(sink.ended_with.removeprefix(b"data: "))["error"]["code"] == "deadline_exceeded"
    assert supervisor.failures == [] and pool.closed_streams == 1 and core.in_flight.total() == 0


async def test_the_decode_after_a_prefill_cut_as_its_leg_ended_keeps_the_request_deadline(autojump_clock):
    # The decode runs under a scope of its own (the attempt's was cancelled by the removal): that scope
    # carries the deadline too, so a decode that hangs still ends at the request deadline.
    core, supervisor, pool, _ = make_core()
    post_json = pool.post_json

    async def prefill_then_removed(engine, path, body, *, request_id):
        answer = await post_json(engine, path, body, request_id=request_id)
        core.set_engines(spec for spec in core.engines.values() if spec.name != "p1")
        return answer

    pool.post_json = prefill_then_removed
    pool.decode.append([SSE[0], "hang"])
    sink = Sink()
    with trio.fail_after(60):
        await core.handle("/v1/completions", body(stream=True), None, sink)
    assert trio.current_time() == pytest.approx(5.0)
    assert b"deadline_exceeded" in sink.ended_with and b"engine_removed" not in b"".join(sink.writes)
    assert supervisor.failures == [] and core.in_flight.total() == 0


async def test_a_deadline_that_passed_as_the_prefill_ended_sends_no_decode(autojump_clock):
    # The prefill answers just at the deadline, with no checkpoint after: the decode is not started.
    core, supervisor, pool, _ = make_core()
    post_json = pool.post_json

    async def prefill_at_the_deadline(engine, path, body, *, request_id):
        answer = await post_json(engine, path, body, request_id=request_id)
        autojump_clock.jump(5.0)  # no checkpoint from here to the decode's start
        return answer

    pool.post_json = prefill_at_the_deadline
    sink = Sink()
    await core.handle("/v1/completions", body(stream=True), None, sink)
    assert sink.status == 504 and sink.json()["error"]["code"] == "deadline_exceeded"
    assert [call[0] for call in pool.calls] == ["p1"]
