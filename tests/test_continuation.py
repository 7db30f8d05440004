"""Stream continuation: the request core against in-process mock engines (numbered tokens).

Each engine is a real ``MockEngine`` answering through a recording responder, so
what the router sends (token-ID prompts, ``continue_final_message``) is what the
mock reads, and a join that repeats or skips shows as a broken count of ``nP``.
"""

from __future__ import annotations

import contextlib
import json
import re
import zlib
from typing import Any

import msgspec
import pytest
import trio

from narwhal.config import parse_config
from narwhal.errors import EngineFailure, FailureClass, UpstreamClientError
from narwhal.fleet.admission import Admission
from narwhal.fleet.placement import InFlight
from narwhal.http1.server import Request
from narwhal.obs.router_metrics import RouterMetrics
from narwhal.serving.continuation import StreamJoin, not_continued_reason
from narwhal.serving.request_core import RequestCore
from narwhal.tools.mock.engine import MockEngine, MockSettings
from narwhal.tools.mock.faults import FaultRequest

CONFIG = """
[serving]
count_tokens = false
policy = "bounded"
request_deadline_s = 30.0
max_attempts = {max_attempts}
continue_streams = {continue_streams}
[[engines]]
name = "p1"
url = "http://127.0.0.1:9001"
role = "prefill"
[[engines]]
name = "p2"
url = "http://127.0.0.1:9002"
role = "prefill"
[[engines]]
name = "d1"
url = "http://127.0.0.1:9003"
role = "decode"
[[engines]]
name = "d2"
url = "http://127.0.0.1:9004"
role = "decode"
[[engines]]
name = "d3"
url = "http://127.0.0.1:9005"
role = "decode"
"""

NUMBERED = re.compile(r" n(\d+)")


class Supervisor:
    def __init__(self, decode: list[str]) -> None:
        self.roles = {"prefill": ["p1", "p2"], "decode": decode}
        self.failures: list[tuple[str, FailureClass]] = []
        self.successes: list[tuple[str, Any]] = []

    def eligible(self, role: str, model: str | None = None) -> list[str]:
        return list(self.roles[role])

    def capacity_problem(self, model: str | None = None) -> str | None:
        return None

    def record_failure(self, engine: str, failure_class: FailureClass) -> None:
        self.failures.append((engine, failure_class))

    def record_success(self, engine: str, kind: Any) -> None:
        self.successes.append((engine, kind))


class Recorder:
    """A Responder stand-in: keeps what the mock wrote and whether it ended its answer."""

    def __init__(self) -> None:
        self.started = False
        self.finished = False
        self.client_disconnected = False
        self.status = 0
        self.writes: list[bytes] = []

    async def respond(self, status, headers, body):
        self.started = self.finished = True
        self.status = status
        self.writes.append(body)

    async def start_stream(self, status, headers, first=b"", end=False):
        self.started = True
        self.status = status
        self.finished = end
        if first:
            self.writes.append(first)

    async def write(self, data):
        self.writes.append(data)

    async def end_stream(self, last=b""):
        if last:
            self.writes.append(last)
        self.finished = True


class Upstream:
    """What the data pool hands over: the reads, then the failure the pool would raise."""

    def __init__(self, chunks: list[bytes], failure: EngineFailure | None) -> None:
        self.chunks = chunks
        self.failure = failure
        self.saw_terminal = False
        self.data_events = 0
        self.relay_watch = None

    async def read(self) -> bytes:
        await trio.lowlevel.checkpoint()
        if self.chunks:
            chunk = self.chunks.pop(0)
            if b"data: [DONE]" in chunk:
                self.saw_terminal = True
            self.data_events += chunk.count(b"data: ")
            return chunk
        if self.failure is not None:
            raise self.failure
        return b""


class MockPool:
    """The data pool's calls, answered by in-process mock engines."""

    def __init__(self, engines: dict[str, MockEngine]) -> None:
        self.engines = engines
        self.calls: list[tuple[str, str, dict[str, Any]]] = []
        # Successive decode legs, whichever engine they land on, are cut after these many tokens.
        self.cuts: list[int | None] = []
        self.pump = None

    async def _answer(self, engine, path: str, body: bytes) -> Recorder:
        payload = json.loads(body)
        self.calls.append((engine.name, path, payload))
        if self.cuts and payload.get("kv_transfer_params", {}).get("do_remote_prefill"):
            cut(self.engines[engine.name], after=self.cuts.pop(0))
        recorder = Recorder()
        request = Request(b"POST", path.encode(), [(b"content-type", b"application/json")], body)
        await self.engines[engine.name].handle(request, recorder)  # type: ignore[arg-type]
        if 400 <= recorder.status < 500:
            raise UpstreamClientError(engine.name, recorder.status, b"".join(recorder.writes))
        if recorder.status >= 500:
            raise EngineFailure(engine.name, FailureClass.INFERENCE_STATUS, f"HTTP {recorder.status}",
                                status=recorder.status)
        return recorder

    async def post_json(self, engine, path, body, *, request_id):
        recorder = await self._answer(engine, path, body)
        if not recorder.finished:
            raise EngineFailure(engine.name, FailureClass.CONNECTION, "connection closed mid-body")
        return recorder.status, b"".join(recorder.writes)

    @contextlib.asynccontextmanager
    async def stream(self, engine, path, body, *, request_id):
        recorder = await self._answer(engine, path, body)
        failure = None if recorder.finished else EngineFailure(
            engine.name, FailureClass.STREAM, "stream ended without data: [DONE] (connection closed)")
        yield Upstream(list(recorder.writes), failure)


class ClientSink:
    def __init__(self) -> None:
        self.started = False
        self.finished = False
        self.ended = False
        self.status = 0
        self.body = b""

    async def respond(self, status, headers, body):
        self.status, self.body, self.finished = status, body, True

    async def start_stream(self, status, headers, first=b"", end=False):
        self.started, self.status, self.body, self.ended, self.finished = True, status, first, end, end

    async def write(self, data):
        assert not self.ended
        self.body += data

    async def end_stream(self, last=b""):
        self.body += last
        self.ended = self.finished = True

    def direct(self) -> None:
        """No client socket under this sink: the relay pump never takes its stream."""
        return None

    def events(self) -> list[Any]:
        out = []
        for event in self.body.split(b"\n\n"):
            if event:
                assert event.startswith(b"data: "), event
                payload = event[6:]
                out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
        return out


def make(*, decode: tuple[str, ...] = ("d1", "d2", "d3"), max_attempts: int = 3, continue_streams: bool = True,
         return_ids: bool = True):
    config = parse_config(CONFIG.format(max_attempts=max_attempts, continue_streams=str(continue_streams).lower()))
    engines = {}
    for spec in config.engines:
        engines[spec.name] = MockEngine(MockSettings(role=spec.role, engine_id=spec.name, numbered=True, tokens=16))
    supervisor = Supervisor(list(decode))
    pool = MockPool(engines)
    metrics = RouterMetrics()
    core = RequestCore(config=config, supervisor=supervisor, data_pool=pool,
                       in_flight=InFlight(e.name for e in config.engines), admission=Admission(), metrics=metrics)
    if not return_ids:
        # An engine that ignores return_token_ids (older vLLM): joins fall back to text.
        original = MockPool._answer

        async def without_ids(self, engine, path, body):
            payload = json.loads(body)
            payload.pop("return_token_ids", None)
            return await original(self, engine, path, msgspec.json.encode(payload))

        pool._answer = without_ids.__get__(pool)  # type: ignore[method-assign]
    return core, supervisor, pool, engines, metrics


def cut(engine: MockEngine, after: int | None = None, count: int = 1) -> None:
    engine.add_fault(FaultRequest(mode="cut", after_tokens=after, count=count))


def text_of(events: list[Any], chat: bool) -> str:
    parts = []
    for event in events:
        if event == "[DONE]":
            continue
        for choice in event["choices"]:
            parts.append((choice["delta"].get("content") or "") if chat else choice["text"])
    return "".join(parts)


def numbers(text: str) -> list[int]:
    return [int(n) for n in NUMBERED.findall(text)]


def check_one_stream(sink: ClientSink, *, chat: bool, prompt_tokens: int, max_tokens: int,
                     usage: bool = True) -> list[Any]:
    """The client's view is one uninterrupted answer: the shared assertions of every join test."""
    assert sink.status == 200 and sink.ended
    events = sink.events()
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = events[:-1]
    assert len({e["id"] for e in chunks}) == 1
    assert len({e["created"] for e in chunks}) == 1
    # No repeat, no gap at any join: the numbers run on from the prompt's length.
    assert numbers(text_of(chunks, chat)) == list(range(prompt_tokens, prompt_tokens + max_tokens))
    finals = [c for e in chunks for c in e["choices"] if c.get("finish_reason") is not None]
    assert len(finals) == 1 and finals[0]["finish_reason"] == "length"
    usages = [e["usage"] for e in chunks if e.get("usage")]
    if usage:
        assert usages == [{"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens,
                           "total_tokens": prompt_tokens + max_tokens}]
    if chat:
        roles = [c for e in chunks for c in e["choices"] if "role" in c["delta"]]
        assert len(roles) == 1
    for event in chunks:
        assert "prompt_token_ids" not in event and "kv_transfer_params" not in event
        for choice in event["choices"]:
            assert "token_ids" not in choice and "prompt_token_ids" not in choice
    return chunks


def request_body(route: str, **extra: Any) -> bytes:
    body: dict[str, Any] = {"model": "mock-model", "max_tokens": 10, "stream": True,
                            "stream_options": {"include_usage": True}}
    if route == "/v1/chat/completions":
        body["messages"] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "count up"}]
    else:
        body["prompt"] = "one two three"
    body.update(extra)
    return msgspec.json.encode({k: v for k, v in body.items() if v is not ...})


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# The mock's tokenizer: one token per word, one per chat message for its role.
PROMPT_TOKENS = {COMPLETIONS: 3, CHAT: 6}


def decode_calls(pool: MockPool) -> list[tuple[str, str, dict[str, Any]]]:
    return [c for c in pool.calls if c[2].get("kv_transfer_params", {}).get("do_remote_prefill")]


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("with_ids", [True, False], ids=["token_ids", "text"])
async def test_a_decode_cut_halfway_is_continued_into_one_exact_stream(route, with_ids):
    core, supervisor, pool, engines, metrics = make(decode=("d1", "d2"), return_ids=with_ids)
    pool.cuts = [4]
    sink = ClientSink()
    await core.handle(route, request_body(route), None, sink)
    check_one_stream(sink, chat=route == CHAT, prompt_tokens=PROMPT_TOKENS[route], max_tokens=10)
    decodes = decode_calls(pool)
    assert len(decodes) == 2 and decodes[0][0] != decodes[1][0]
    second = decodes[1]
    if with_ids:
        # Exact join: the prompt's token IDs plus the 4 output IDs, as a completions prompt.
        assert second[1] == COMPLETIONS
        assert isinstance(second[2]["prompt"], list) and len(second[2]["prompt"]) == PROMPT_TOKENS[route] + 4
        assert "messages" not in second[2]
    elif route == CHAT:
        assert second[1] == CHAT
        assert second[2]["messages"][-1]["role"] == "assistant"
        assert second[2]["continue_final_message"] is True and second[2]["add_generation_prompt"] is False
    else:
        assert second[2]["prompt"] == "one two three n3 n4 n5 n6"
    assert second[2]["max_tokens"] == 6
    # The continuation's prefill is a fresh one (fresh KV ownership) before its decode.
    legs = [bool(c[2].get("kv_transfer_params", {}).get("do_remote_decode")) for c in pool.calls
            if c[1] != "/tokenize"]
    assert legs == [True, False, True, False]
    # Tokens without IDs are counted by the continuation's prefill engine (the text, and the prompt): never by events.
    assert len([c for c in pool.calls if c[1] == "/tokenize"]) == (0 if with_ids else 2)
    assert metrics.continuations.values == {("completed", "mock-model"): 1}
    assert 'narwhal_continuation_join_gap_seconds_count{model="mock-model"} 1' in metrics.render()


async def test_token_ids_the_client_asked_for_are_relayed_once_and_complete():
    core, _, pool, engines, _ = make(decode=("d1", "d2"))
    pool.cuts = [3]
    sink = ClientSink()
    await core.handle(COMPLETIONS, request_body(COMPLETIONS, return_token_ids=True), None, sink)
    events = sink.events()[:-1]
    prompt_ids = [c["prompt_token_ids"] for e in events for c in e["choices"] if "prompt_token_ids" in c]
    assert len(prompt_ids) == 1 and len(prompt_ids[0]) == 3
    ids = [i for e in events for c in e["choices"] for i in c.get("token_ids") or []]
    assert len(ids) == 10
    assert numbers(text_of(events, False)) == list(range(3, 13))


async def test_a_token_id_prompt_resumes_at_the_exact_token():
    core, _, pool, engines, _ = make(decode=("d1", "d2"))
    pool.cuts = [5]
    sink = ClientSink()
    await core.handle(COMPLETIONS, request_body(COMPLETIONS, prompt=[11, 12, 13, 14]), None, sink)
    check_one_stream(sink, chat=False, prompt_tokens=4, max_tokens=10)
    assert decode_calls(pool)[1][2]["prompt"][:4] == [11, 12, 13, 14]


async def test_a_continuation_whose_own_decode_fails_is_continued_again():
    core, supervisor, pool, engines, metrics = make()
    pool.cuts = [3, 3]
    sink = ClientSink()
    await core.handle(COMPLETIONS, request_body(COMPLETIONS, max_tokens=12), None, sink)
    check_one_stream(sink, chat=False, prompt_tokens=3, max_tokens=12)
    decodes = [c[0] for c in decode_calls(pool)]
    assert sorted(decodes) == ["d1", "d2", "d3"]
    assert metrics.continuations.values == {("failed", "mock-model"): 1, ("completed", "mock-model"): 1}
    # Evidence per failed engine: exactly one stream failure each for the two that cut, none for the third.
    stream_failures = [f for f in supervisor.failures if f[1] is FailureClass.STREAM]
    assert sorted(stream_failures) == sorted((name, FailureClass.STREAM) for name in decodes[:2])


async def test_max_attempts_exhausted_ends_with_the_sse_error():
    core, supervisor, pool, engines, metrics = make(max_attempts=2)
    pool.cuts = [2, 2, 2]
    sink = ClientSink()
    await core.handle(COMPLETIONS, request_body(COMPLETIONS), None, sink)
    events = sink.events()
    assert "[DONE]" not in events
    assert events[-1]["error"]["code"] == "stream"
    assert numbers(text_of(events[:-1], False)) == [3, 4, 5, 6]
    assert len(decode_calls(pool)) == 2
    assert ("exhausted", "mock-model") in metrics.continuations.values


async def test_continue_streams_off_ends_with_the_sse_error_as_before():
    core, supervisor, pool, engines, metrics = make(continue_streams=False)
    pool.cuts = [2, 2]
    sink = ClientSink()
    await core.handle(COMPLETIONS, request_body(COMPLETIONS), None, sink)
    events = sink.events()
    assert events[-1]["error"]["code"] == "stream" and "[DONE]" not in events
    assert len(decode_calls(pool)) == 1
    # Nothing was added to the client's request: the engine got what the client sent.
    assert "return_token_ids" not in decode_calls(pool)[0][2]
    assert metrics.continuations.values == {("not_eligible", "mock-model"): 1}


@pytest.mark.parametrize("extra", [
    {"n": 2}, {"best_of": 3}, {"echo": True}, {"response_format": {"type": "json_object"}},
    {"guided_json": {"type": "object"}}, {"structured_outputs": {"regex": "a+"}},
    {"tools": [{"type": "function", "function": {"name": "f"}}]}, {"tool_choice": "auto"},
])
async def test_requests_that_cannot_be_resumed_are_not_continued(extra):
    core, _, pool, engines, metrics = make()
    pool.cuts = [2, 2]
    sink = ClientSink()
    await core.handle(COMPLETIONS, request_body(COMPLETIONS, **extra), None, sink)
    events = sink.events()
    assert events[-1]["error"]["code"] == "stream" and "[DONE]" not in events
    assert len(decode_calls(pool)) == 1
    assert metrics.continuations.values == {("not_eligible", "mock-model"): 1}


def test_not_continued_reasons_name_the_field():
    assert not_continued_reason(COMPLETIONS, {"n": 1, "best_of": 1, "response_format": {"type": "text"}}) is None
    assert not_continued_reason(CHAT, {"tool_choice": "none"}) == "tools"
    assert not_continued_reason(COMPLETIONS, {"prompt": ["a", "b"]}) == "several_prompts"
    assert not_continued_reason(COMPLETIONS, {"prompt": ["a"]}) is None


async def test_the_deadline_ends_a_continuation_with_the_sse_error(autojump_clock):
    core, supervisor, pool, engines, metrics = make(decode=("d1", "d2"))
    pool.cuts = [2]
    # The continuation's decode never answers: the request's original deadline (30 s) ends it.
    engines["d1"].add_fault(FaultRequest(mode="first_token_delay", delay_s=3600.0, count=1))
    engines["d2"].add_fault(FaultRequest(mode="first_token_delay", delay_s=3600.0, count=1))
    sink = ClientSink()
    await core.handle(COMPLETIONS, request_body(COMPLETIONS), None, sink)
    events = sink.events()
    assert events[-1]["error"]["code"] == "deadline_exceeded" and "[DONE]" not in events
    assert trio.current_time() == pytest.approx(30.0)
    assert metrics.continuations.values == {("exhausted", "mock-model"): 1}
    assert core.in_flight.total() == 0


async def test_the_join_gap_is_measured_from_the_last_bytes_to_the_next(autojump_clock):
    core, supervisor, pool, engines, metrics = make(decode=("d1", "d2"))
    pool.cuts = [2]
    # The continuation's prefill takes 0.5 s: the client waits that long at the join.
    for name in ("p1", "p2"):
        engines[name].add_fault(FaultRequest(mode="first_token_delay", delay_s=0.5, legs=["prefill"]))
    sink = ClientSink()
    await core.handle(COMPLETIONS, request_body(COMPLETIONS), None, sink)
    check_one_stream(sink, chat=False, prompt_tokens=3, max_tokens=10)
    rendered = metrics.render()
    assert 'narwhal_continuation_join_gap_seconds_count{model="mock-model"} 1' in rendered
    assert 'narwhal_continuation_join_gap_seconds_sum{model="mock-model"} 0.5' in rendered


async def test_a_stream_that_lost_only_its_done_is_finished_not_continued():
    core, supervisor, pool, engines, metrics = make(decode=("d1", "d2"))
    # All 10 tokens (the last with its finish_reason) went out; the connection closed before usage/[DONE].
    pool.cuts = [10]
    sink = ClientSink()
    await core.handle(COMPLETIONS, request_body(COMPLETIONS), None, sink)
    check_one_stream(sink, chat=False, prompt_tokens=3, max_tokens=10)
    assert len(decode_calls(pool)) == 1
    # The engine still gets exactly today's evidence for the broken stream.
    assert [f[1] for f in supervisor.failures] == [FailureClass.STREAM]


async def test_a_non_streamed_request_whose_decode_breaks_is_retried_on_another_engine():
    core, supervisor, pool, engines, metrics = make(decode=("d1", "d2"))
    pool.cuts = [None]
    sink = ClientSink()
    await core.handle(COMPLETIONS, request_body(COMPLETIONS, stream=False, stream_options=...), None, sink)
    assert sink.status == 200
    answer = json.loads(sink.body)
    assert numbers(answer["choices"][0]["text"]) == list(range(3, 13))
    decodes = [c[0] for c in decode_calls(pool)]
    assert len(decodes) == 2 and decodes[0] != decodes[1]
    assert [f[1] for f in supervisor.failures] == [FailureClass.CONNECTION]


async def test_saturate_policy_never_continues():
    config = parse_config(CONFIG.format(max_attempts=3, continue_streams="true").replace('"bounded"', '"saturate"'))
    engines = {s.name: MockEngine(MockSettings(role=s.role, engine_id=s.name, numbered=True)) for s in config.engines}
    pool = MockPool(engines)
    core = RequestCore(config=config, supervisor=Supervisor(["d1"]), data_pool=pool,
                       in_flight=InFlight(e.name for e in config.engines), admission=Admission(),
                       metrics=RouterMetrics())
    pool.cuts = [2]
    sink = ClientSink()
    await core.handle(COMPLETIONS, request_body(COMPLETIONS), None, sink)
    assert sink.events()[-1]["error"]["code"] == "stream"
    assert "return_token_ids" not in decode_calls(pool)[0][2]


def test_a_join_rewrites_a_continuations_events_into_the_first_legs_stream():
    join = StreamJoin(CHAT, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4})
    join.next_leg()
    out, done = join.feed(b'data: {"id":"a","created":1,"prompt_token_ids":[1,2],"choices":[{"index":0,'
                          b'"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\ndata: {"id":"a",'
                          b'"created":1,"choices":[{"index":0,"delta":{"content":" x"},"token_ids":[7],'
                          b'"finish_reason":null}]}\n\n')
    assert not done and b"prompt_token_ids" not in out and b"token_ids" not in out
    route, body = join.next_leg() or ("", {})
    assert route == COMPLETIONS and body["prompt"] == [1, 2, 7] and body["max_tokens"] == 3
    join.continuations = 1
    out, done = join.feed(b'data: {"id":"b","created":2,"choices":[{"index":0,"text":" y","token_ids":[8],'
                          b'"finish_reason":"length"}]}\n\ndata: [DONE]\n\n')
    event = json.loads(out[6:])
    assert done and event["id"] == "a" and event["created"] == 1
    assert event["object"] == "chat.completion.chunk"
    assert event["choices"][0]["delta"] == {"content": " y"} and event["choices"][0]["finish_reason"] == "length"
    # An event split across reads is held until it is whole.
    join2 = StreamJoin(COMPLETIONS, {"prompt": "p"})
    join2.next_leg()
    assert join2.feed(b'data: {"id":"c","choices":[{"text":"')[0] == b""
    assert join2.feed(b' z"}]}\n\n')[0].startswith(b"data: ")
    assert join2.output_text == " z"


async def test_a_fleet_with_one_decode_engine_ends_the_stream_at_once(autojump_clock):
    # The continuation may not go back to the engine that broke the stream; with no other decode
    # engine configured, waiting until the deadline could not help.
    one_decode = CONFIG.format(max_attempts=3, continue_streams="true").split('[[engines]]\nname = "d2"')[0]
    config = parse_config(one_decode)
    engines = {s.name: MockEngine(MockSettings(role=s.role, engine_id=s.name, numbered=True)) for s in config.engines}
    pool = MockPool(engines)
    metrics = RouterMetrics()
    core = RequestCore(config=config, supervisor=Supervisor(["d1"]), data_pool=pool,
                       in_flight=InFlight(e.name for e in config.engines), admission=Admission(), metrics=metrics)
    pool.cuts = [2]
    sink = ClientSink()
    await core.handle(COMPLETIONS, request_body(COMPLETIONS), None, sink)
    assert sink.events()[-1]["error"]["code"] == "stream"
    assert metrics.continuations.values == {("not_eligible", "mock-model"): 1}
    assert trio.current_time() == 0.0


async def test_a_token_id_prompt_without_output_ids_cannot_be_resumed_from_text():
    core, _, pool, _, metrics = make(decode=("d1", "d2"), return_ids=False)
    pool.cuts = [3]
    sink = ClientSink()
    await core.handle(COMPLETIONS, request_body(COMPLETIONS, prompt=[5, 6, 7]), None, sink)
    events = sink.events()
    assert events[-1]["error"]["code"] == "not_continued" and "[DONE]" not in events
    assert numbers(text_of(events[:-1], False)) == [3, 4, 5]
    assert len(decode_calls(pool)) == 1
    assert metrics.continuations.values == {("not_eligible", "mock-model"): 1}


@pytest.mark.parametrize("raw", [
    b'{"id":"a","choices":[{"index":0,"text":" x","token_ids":[1,2],"prompt_token_ids":[3],"finish_reason":null}]}',
    b'{"id":"a","choices":[{"index":0,"text":" x","token_ids": [1, 2],"prompt_token_ids":null}]}',
    b'{"id":"a","prompt_token_ids":[3,4],"choices":[{"token_ids":[1,2],"text":" x"}]}',
])
def test_the_first_legs_events_lose_only_the_ids_narwhal_asked_for(raw):
    join = StreamJoin(COMPLETIONS, {"prompt": "p"})
    join.next_leg()
    out, _ = join.feed(b"data: " + raw + b"\n\n")
    event = json.loads(out[6:])
    assert b"token_ids" not in out and event["id"] == "a"
    assert event["choices"][0]["text"] == " x"
    assert join.token_ids == [1, 2] and join.output_text == " x"
    # Asked for by the client: relayed untouched.
    asked = StreamJoin(COMPLETIONS, {"prompt": "p", "return_token_ids": True})
    asked.next_leg()
    assert asked.feed(b"data: " + raw + b"\n\n")[0] == b"data: " + raw + b"\n\n"


async def test_a_long_first_leg_is_read_in_batches_and_still_joins_exactly(monkeypatch):
    # Past _FOLD_BYTES the first leg's events are read as they go (bounded memory per stream).
    monkeypatch.setattr("narwhal.serving.continuation.lazy._FOLD_BYTES", 600)
    core, _, pool, _, _ = make(decode=("d1", "d2"))
    pool.cuts = [30]
    sink = ClientSink()
    await core.handle(COMPLETIONS, request_body(COMPLETIONS, max_tokens=50), None, sink)
    check_one_stream(sink, chat=False, prompt_tokens=3, max_tokens=50)
    assert len(decode_calls(pool)) == 2 and decode_calls(pool)[1][2]["max_tokens"] == 20


async def test_a_stream_that_ends_cleanly_logs_its_tokens_without_reading_its_events(caplog):
    core, _, pool, _, _ = make()
    sink = ClientSink()
    with caplog.at_level("INFO", logger="narwhal.events"):
        await core.handle(CHAT, request_body(CHAT, max_tokens=9), None, sink)
    check_one_stream(sink, chat=True, prompt_tokens=6, max_tokens=9)
    line = next(json.loads(r.getMessage()) for r in caplog.records if '"event":"request"' in r.getMessage())
    assert line["tokens"] == 9 and line["continuations"] == 0 and line["join_gap_ms"] is None


def test_done_inside_the_text_is_not_the_end_of_the_stream():
    join = StreamJoin(COMPLETIONS, {"prompt": "p"})
    join.next_leg()
    out, done = join.feed(b'data: {"id":"a","choices":[{"text":" [DONE]","token_ids":[9]}]}\n\ndata: [DONE]\n\n')
    assert done and out == b'data: {"id":"a","choices":[{"text":" [DONE]"}]}\n\n'
    assert join.output_text == " [DONE]" and join.tokens == 1


def request_line(caplog: pytest.LogCaptureFixture) -> dict[str, Any]:
    """The one ``request`` event logged."""
    [line] = [json.loads(r.getMessage()) for r in caplog.records if '"event":"request"' in r.getMessage()]
    return line


@pytest.mark.parametrize("cuts, continuations", [([4], 1), ([10], 0)], ids=["continued", "only_done_lost"])
async def test_a_stream_completed_after_a_failure_logs_no_error_and_what_it_was_continued_after(
        caplog, cuts, continuations):
    core, supervisor, pool, _, _ = make(decode=("d1", "d2"))
    pool.cuts = cuts
    sink = ClientSink()
    with caplog.at_level("INFO", logger="narwhal.events"):
        await core.handle(COMPLETIONS, request_body(COMPLETIONS), None, sink)
    check_one_stream(sink, chat=False, prompt_tokens=3, max_tokens=10)
    line = request_line(caplog)
    # The client got the whole answer: no error for the request; the failure it survived is recorded.
    assert (line["status"], line["error"], line["continued_after"]) == (200, None, "stream")
    assert line["continuations"] == continuations and line["tokens"] == 10
    # The engine's failure is still evidence, and still its own event.
    assert [f[1] for f in supervisor.failures] == [FailureClass.STREAM]


async def test_a_stream_whose_continuations_ran_out_logs_its_error(caplog):
    core, _, pool, _, _ = make(max_attempts=2)
    pool.cuts = [2, 2, 2]
    with caplog.at_level("INFO", logger="narwhal.events"):
        await core.handle(COMPLETIONS, request_body(COMPLETIONS), None, ClientSink())
    line = request_line(caplog)
    # Status 200 (the head went out) but the client saw the SSE error: the request's error stands.
    assert (line["status"], line["error"], line["continued_after"]) == (200, "stream", None)


async def test_a_stream_cut_because_its_engine_was_removed_continues_on_another_without_blame():
    core, supervisor, pool, _, metrics = make(decode=("d1", "d2"))
    first_token = trio.Event()
    stream = pool.stream

    @contextlib.asynccontextmanager
    async def first_leg_stalls(engine, path, body, *, request_id):
        async with stream(engine, path, body, request_id=request_id) as upstream:
            if not first_token.is_set():
                read = upstream.read

                async def one_token_then_nothing() -> bytes:
                    if first_token.is_set():
                        await trio.sleep_forever()
                    first_token.set()
                    return await read()

                upstream.read = one_token_then_nothing  # type: ignore[method-assign]
            yield upstream

    pool.stream = first_leg_stalls  # type: ignore[method-assign]
    sink = ClientSink()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(core.handle, COMPLETIONS, request_body(COMPLETIONS), None, sink)
        while not sink.started:  # the client has its first token
            await trio.lowlevel.checkpoint()
        [(removed, _, _)] = decode_calls(pool)
        # The removal's grace passed: the engine leaves the placement and the snapshot.
        supervisor.roles["decode"] = [name for name in supervisor.roles["decode"] if name != removed]
        core.set_engines(spec for spec in core.engines.values() if spec.name != removed)
    check_one_stream(sink, chat=False, prompt_tokens=PROMPT_TOKENS[COMPLETIONS], max_tokens=10)
    decodes = decode_calls(pool)
    assert len(decodes) == 2 and decodes[1][0] != removed
    assert supervisor.failures == []
    assert metrics.continuations.values == {("completed", "mock-model"): 1}


# The first leg's ID stripping and token count as they were before the per-read fast path, for reference:
# one pattern for both keys, then the spaced forms; the count read from every event list at the end.
_REFERENCE_COMPACT = re.compile(rb',"(?:prompt_)?token_ids":(?:\[[\d,]*\]|null)')
_REFERENCE_LISTS = re.compile(rb'"token_ids":\s*\[([\d,\s]*)\]')


def _reference_strip(data: bytes) -> bytes:
    from narwhal.serving.continuation.events import IDS as _IDS
    data = _REFERENCE_COMPACT.sub(b"", data)
    return _IDS.sub(b"", data) if b'token_ids"' in data else data


def _reference_tokens(raw: bytes) -> int:
    lists = _REFERENCE_LISTS.findall(raw)
    if lists:
        return sum(1 + ids.count(b",") for ids in lists if ids.strip())
    return raw.count(b'"text":"') - raw.count(b'"text":""')


_ID_EVENTS = [
    b'{"id":"a","choices":[{"index":0,"text":" x","token_ids":[1],"finish_reason":null}]}',
    b'{"id":"a","choices":[{"index":0,"text":" x","prompt_token_ids":[3,4,5],"token_ids":[1]}]}',
    b'{"id":"a","choices":[{"index":0,"text":" xy","token_ids":[1,2,7],"finish_reason":null}]}',
    b'{"id":"a","choices":[{"index":0,"text":"","token_ids":[],"finish_reason":"length"}]}',
    b'{"id":"a","choices":[{"index":0,"text":" x","token_ids":null}]}',
    b'{"id":"a","choices":[{"index":0,"text":" x","token_ids": [1, 2]}]}',
    b'{"id":"a","choices":[{"token_ids":[9],"index":0,"text":" x"}]}',
    b'{"id":"a","prompt_token_ids":[3],"choices":[{"index":0,"text":" \\"token_ids\\":[5]","token_ids":[8]}]}',
    b'{"id":"a","choices":[{"index":0,"text":" x"}]}',
    b'{"id":"a","choices":[],"usage":{"completion_tokens":3}}',
]


@pytest.mark.parametrize("seed", range(40))
def test_the_first_legs_fast_strip_and_count_match_the_reference(seed):
    # Random reads of these events (several per read, KV params on some, the client asking for IDs
    # or not): what reaches the client and the token count are what the one-pattern strip gave.
    import random
    rng = random.Random(seed)
    client_ids = seed % 5 == 0
    join = StreamJoin(COMPLETIONS, {"prompt": "p", **({"return_token_ids": True} if client_ids else {})})
    join.next_leg()
    raw_all = b""
    for _ in range(rng.randint(1, 6)):
        events = []
        for _ in range(rng.randint(1, 4)):
            event = rng.choice(_ID_EVENTS)
            if rng.random() < 0.1:
                event = event[:-1] + b',"kv_transfer_params":{"remote_block_ids":[1,2]}}'
            events.append(b"data: " + event + b"\n\n")
        read = b"".join(events)
        raw_all += read
        out, done = join.feed(read)
        assert not done
        expected = read if client_ids else _reference_strip(read)
        if b"kv_transfer_params" in read:
            from narwhal.serving.client_view import strip_kv_from_events
            expected = strip_kv_from_events(read)
            expected = expected if client_ids else strip_kv_from_events(_reference_strip(expected))
        assert out == expected
        assert join.tokens == _reference_tokens(raw_all)


def make_shaped(**shape: Any):
    """``make`` with mock engines that stream as a busy vLLM with a byte-level tokenizer does."""
    core, supervisor, pool, engines, metrics = make(decode=("d1", "d2"))
    for name, engine in list(engines.items()):
        engines[name] = MockEngine(msgspec.structs.replace(engine.settings, **shape))
    return core, supervisor, pool, engines, metrics


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("client_ids", [False, True], ids=["ids_stripped", "ids_asked"])
async def test_a_join_inside_a_character_resumes_before_it_and_nothing_is_echoed(caplog, route, client_ids):
    # Every third position is the first half of a character. Cut after 3 tokens, the engine dies right after one:
    # resuming at the exact token would make the next engine echo its whole prompt (as vLLM does).
    core, _, pool, _, _ = make_shaped(split_every=3)
    pool.cuts = [3]
    sink = ClientSink()
    extra = {"return_token_ids": True} if client_ids else {}
    with caplog.at_level("INFO", logger="narwhal.events"):
        await core.handle(route, request_body(route, **extra), None, sink)
    prompt = PROMPT_TOKENS[route]
    assert (prompt + 2) % 3 == 2, "the third generated token must be a first half"
    if client_ids:
        events = sink.events()
        ids = [i for e in events[:-1] for c in e["choices"] for i in c.get("token_ids") or []]
        # Each token's ID once, in order (the mock's ID of " nP" is crc32("nP") % 32000).
        assert ids == [zlib.crc32(b"n%d" % p) % 32000 for p in range(prompt, prompt + 10)]
        for event in events[:-1]:
            for choice in event["choices"]:
                choice.pop("token_ids", None)
                event.pop("prompt_token_ids", None)
                choice.pop("prompt_token_ids", None)
        sink.body = b"".join(b"data: " + (json.dumps(e).encode() if e != "[DONE]" else b"[DONE]") + b"\n\n"
                             for e in events)
    check_one_stream(sink, chat=route == CHAT, prompt_tokens=prompt, max_tokens=10)
    second = decode_calls(pool)[1][2]
    # The continuation's prompt ends before the half character; the new engine generates it again.
    assert len(second["prompt"]) == prompt + 2 and second["max_tokens"] == 8
    line = request_line(caplog)
    assert line["regenerated_tokens"] == 1 and line["tokens"] == 10 and line["continuations"] == 1


# A four-word prompt, two tokens per event, every third position the first half of a character (5, 8, ...). Cut after
# 4 tokens: events " n4" (4 and 5) and " n5 n6 n7" (6 and 7), no event of one token with text, so no point inside the
# answer is known to end on a whole character: back to the original prompt. Cut after 3: the last event is token 6
# alone with text " n5 n6", a known whole character.
@pytest.mark.parametrize("cut_after, resumed_after", [(4, 0), (3, 3)])
async def test_a_join_after_events_of_several_tokens_goes_back_to_a_known_whole_character(
        caplog, cut_after, resumed_after):
    core, _, pool, _, _ = make_shaped(split_every=3, tokens_per_event=2)
    pool.cuts = [cut_after]
    sink = ClientSink()
    with caplog.at_level("INFO", logger="narwhal.events"):
        await core.handle(COMPLETIONS, request_body(COMPLETIONS, prompt="one two three four"), None, sink)
    # The client gets nothing twice.
    check_one_stream(sink, chat=False, prompt_tokens=4, max_tokens=10)
    second = decode_calls(pool)[1][2]
    assert len(second["prompt"]) == 4 + resumed_after and second["max_tokens"] == 10 - resumed_after
    assert request_line(caplog)["regenerated_tokens"] == cut_after - resumed_after


@pytest.mark.parametrize("include", [False, True])
async def test_a_stop_string_across_a_join_ends_the_answer_as_without_the_failure(include):
    # " n3 n4 n5 n6 ...": "5 n6" spans tokens 5 and 6; the engine dies after token 5.
    request = request_body(COMPLETIONS, stop=["5 n6"], include_stop_str_in_output=include)
    core, _, pool, _, _ = make(decode=("d1", "d2"))
    reference = ClientSink()
    await core.handle(COMPLETIONS, request, None, reference)
    core, _, pool, _, _ = make(decode=("d1", "d2"))
    pool.cuts = [3]
    sink = ClientSink()
    await core.handle(COMPLETIONS, request, None, sink)
    assert len(decode_calls(pool)) == 2
    ref_events, events = reference.events(), sink.events()
    assert text_of(events, False) == text_of(ref_events, False) == (" n3 n4 n5 n6" if include else " n3 n4 n")
    finals = [(c["finish_reason"], c.get("stop_reason")) for e in events[:-1] for c in e["choices"]
              if c.get("finish_reason")]
    assert finals == [("stop", "5 n6")]
    assert [e["usage"] for e in events[:-1] if e.get("usage")] == [e["usage"] for e in ref_events[:-1]
                                                                     if e.get("usage")]



def _first_leg_ends_in_spaces(pool: MockPool) -> None:
    """The first decode leg's tokens end in a space (``"n3 "``, as a tokenizer's word-then-space pieces do): a text
    join that trims or pads the answer so far changes the prompt the next engine continues."""
    answer = pool._answer

    async def first_leg_ends_in_spaces(engine, path, body):
        recorder = await answer(engine, path, body)
        if decode_calls(pool)[:1] == [pool.calls[-1]] and len(decode_calls(pool)) == 1:
            recorder.writes = [re.sub(rb'":" (n\d+)"', rb'":"\1 "', write) for write in recorder.writes]
        return recorder

    pool._answer = first_leg_ends_in_spaces  # type: ignore[method-assign]


@pytest.mark.parametrize("shape", ["completion", "chat", "chat_continuing_its_final_message"])
async def test_a_text_join_continues_from_exactly_the_text_the_client_has(shape):
    # No token IDs (an engine that ignores return_token_ids): the next leg's prompt is the original one plus the
    # answer so far, character for character: not trimmed, not padded.
    route = COMPLETIONS if shape == "completion" else CHAT
    core, _, pool, _, _ = make(decode=("d1", "d2"), return_ids=False)
    _first_leg_ends_in_spaces(pool)
    pool.cuts = [4]
    extra: dict[str, Any] = {}
    if shape == "chat_continuing_its_final_message":
        extra = {"messages": [{"role": "user", "content": "count up"}, {"role": "assistant", "content": "Sure:"}],
                 "continue_final_message": True, "add_generation_prompt": False}
    sink = ClientSink()
    await core.handle(route, request_body(route, **extra), None, sink)
    events = sink.events()
    assert sink.status == 200 and events[-1] == "[DONE]"
    client_text = text_of(events[:-1], route == CHAT)
    # The first leg's four tokens, each ending in its space, then the next leg's six.
    so_far = re.match(r"(n\d+ ){4}", client_text)
    assert so_far is not None, client_text
    first, second = decode_calls(pool)
    assert first[0] != second[0] and len(numbers(client_text[so_far.end():])) == 6
    if shape == "completion":
        assert second[2]["prompt"] == "one two three" + so_far[0]
    elif shape == "chat":
        assert second[2]["messages"] == [*json.loads(request_body(CHAT))["messages"],
                                         {"role": "assistant", "content": so_far[0]}]
    else:
        assert second[2]["messages"] == [{"role": "user", "content": "count up"},
                                         {"role": "assistant", "content": "Sure:" + so_far[0]}]


def _on_decode_leg(pool: MockPool, number: int, then: Any) -> None:
    """Call ``then(engine)`` when decode leg ``number`` (1-based) reaches its engine."""
    answer = pool._answer

    async def answer_and_watch(engine, path, body):
        calls = len(decode_calls(pool))
        recorder = await answer(engine, path, body)
        if len(decode_calls(pool)) == number > calls:
            then(engine.name)
        return recorder

    pool._answer = answer_and_watch  # type: ignore[method-assign]


@pytest.mark.parametrize("decoders", [2, 3])
async def test_a_continuation_never_goes_back_to_the_decode_engine_that_just_broke(decoders):
    # Every decode engine breaks the stream once, the last one while the others are busier (another client's
    # requests): least-outstanding placement would pick it, and every engine has failed this request already,
    # so only the rule against the engine that just broke keeps the next leg off it.
    decode = ("d1", "d2", "d3")[:decoders]
    core, _, pool, _, _ = make(decode=decode, max_attempts=decoders + 1)
    pool.cuts = [2] * decoders
    broke: list[str] = []

    def others_get_busy(engine: str) -> None:
        broke.append(engine)
        for name in decode:
            if name != engine:
                core.in_flight.acquire(name)

    _on_decode_leg(pool, decoders, others_get_busy)
    sink = ClientSink()
    await core.handle(COMPLETIONS, request_body(COMPLETIONS), None, sink)
    check_one_stream(sink, chat=False, prompt_tokens=3, max_tokens=10)
    legs = [call[0] for call in decode_calls(pool)]
    assert len(legs) == decoders + 1 and sorted(legs[:-1]) == list(decode)
    assert legs[-2] == broke[0] and legs[-1] != broke[0]


async def test_a_continuation_whose_broken_engine_is_the_only_eligible_one_waits_for_another(autojump_clock):
    # The documented rule: with only the engine that broke eligible, the continuation waits for capacity (within
    # the request's deadline) rather than going back to it.
    core, supervisor, pool, _, _ = make(decode=("d1", "d2"))
    pool.cuts = [4]
    broke: list[str] = []

    def others_drained(engine: str) -> None:
        broke.append(engine)
        supervisor.roles["decode"] = [engine]

    _on_decode_leg(pool, 1, others_drained)
    sink = ClientSink()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(core.handle, COMPLETIONS, request_body(COMPLETIONS), None, sink)
        await trio.sleep(5.0)
        assert len(decode_calls(pool)) == 1 and not sink.ended
        supervisor.roles["decode"] = ["d1", "d2"]
    check_one_stream(sink, chat=False, prompt_tokens=3, max_tokens=10)
    legs = [call[0] for call in decode_calls(pool)]
    assert legs[0] == broke[0] and legs[1] != broke[0] and len(legs) == 2
