"""The one relay loop (narwhal/serving/relay.py) and the exchange it reports into (narwhal/serving/exchange.py)."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from narwhal.config import EngineSpec
from narwhal.errors import EngineFailure
from narwhal.serving.continuation import plan
from narwhal.serving.exchange import Exchange, Leg
from narwhal.serving.relay import Step, relay, relay_joined

HEAD = [(b"content-type", b"text/event-stream")]
DECODE = EngineSpec(name="d1", url="http://127.0.0.1:1", role="decode")
PREFILL = EngineSpec(name="p1", url="http://127.0.0.1:2", role="prefill")


class Upstream:
    def __init__(self, *reads: bytes) -> None:
        self.reads = list(reads)

    async def read(self) -> bytes:
        return self.reads.pop(0) if self.reads else b""


class Sink:
    def __init__(self, started: bool = False) -> None:
        self.started = started
        self.finished = False
        self.calls: list[tuple[str, bytes]] = []

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.calls.append(("respond", body))

    async def start_stream(self, status: int, headers: list[tuple[bytes, bytes]], first: bytes = b"",
                           end: bool = False) -> None:
        self.started = True
        self.finished = end
        self.calls.append(("start_end" if end else "start", first))

    async def write(self, data: bytes) -> None:
        self.calls.append(("write", data))

    async def end_stream(self, last: bytes = b"") -> None:
        self.finished = True
        self.calls.append(("end", last))


def leg() -> Leg:
    return Leg("decode", DECODE, 1, "/v1/completions", {})


def upper_until(stop: bytes) -> Step:
    """A step that writes each read in capitals, nothing for b"-", and declines the read ``stop``."""
    def step(chunk: bytes, now: float) -> bytes | None:
        if chunk == stop:
            return None
        return b"" if chunk == b"-" else chunk.upper()
    return step


async def test_the_stream_starts_at_the_first_bytes_and_ends_at_the_declined_read() -> None:
    sink, decode = Sink(), leg()
    declined = await relay(Upstream(b"-", b"a", b"-", b"b", b"end", b"after"), sink, HEAD, upper_until(b"end"),
                           decode, clock=lambda: 0.0, pump=None)
    assert declined is True
    # Nothing before the first bytes, no empty write, nothing of the declined read or after it.
    assert sink.calls == [("start", b"A"), ("write", b"B")]
    assert decode.relay == "task"


async def test_a_body_that_ends_first_says_so() -> None:
    sink = Sink()
    assert await relay(Upstream(b"a"), sink, HEAD, upper_until(b"end"), leg(), clock=lambda: 0.0,
                       pump=None) is False
    assert sink.calls == [("start", b"A")]


async def test_the_pump_is_offered_the_stream_once_it_started_and_relays_it_with_the_same_step() -> None:
    offered: list[list[tuple[str, bytes]]] = []

    async def pump(upstream: Any, sink: Any, step: Step, decode: Leg) -> bytes | None:
        offered.append(list(sink.calls))
        decode.relay = "pump"
        while True:
            chunk = await upstream.read()
            out = step(chunk, 0.0)
            if out is None:
                return chunk
            sink.calls.append(("pumped", out))

    sink, decode = Sink(), leg()
    assert await relay(Upstream(b"-", b"a", b"b", b"end"), sink, HEAD, upper_until(b"end"), decode,
                       clock=lambda: 0.0, pump=pump) is True
    assert offered == [[("start", b"A")]]
    assert sink.calls == [("start", b"A"), ("pumped", b"B")]
    assert decode.relay == "pump"


async def test_a_pump_that_cannot_take_the_stream_leaves_it_to_the_task() -> None:
    async def declines(upstream: Any, sink: Any, step: Step, decode: Leg) -> bytes | None:
        return None

    sink, decode = Sink(started=True), leg()
    assert await relay(Upstream(b"a", b"end"), sink, HEAD, upper_until(b"end"), decode, clock=lambda: 0.0,
                       pump=declines) is True
    assert sink.calls == [("write", b"A")]
    assert decode.relay == "task"


def event(text: str) -> bytes:
    return b"data: " + json.dumps({"id": "c", "object": "text_completion", "created": 1, "model": "m",
                                   "choices": [{"index": 0, "text": text, "finish_reason": None}]}).encode() + b"\n\n"


async def test_a_joined_leg_ends_the_stream_at_done_in_one_write() -> None:
    join, _ = plan("/v1/completions", {"model": "m", "prompt": "hi", "stream": True}, enabled=True)
    assert join is not None
    sink, firsts = Sink(), []
    await relay_joined(join, Upstream(event("a"), event("b") + b"data: [DONE]\n\n", b"ignored"), sink, HEAD,
                       leg(), clock=lambda: 1.0, on_first=firsts.append, on_gap=lambda gap: None, pump=None)
    kinds = [kind for kind, _ in sink.calls]
    assert kinds == ["start", "end"] and sink.calls[1][1].endswith(b"data: [DONE]\n\n")
    assert firsts == [1.0]


async def test_a_joined_leg_whose_body_ends_before_done_is_a_stream_failure() -> None:
    join, _ = plan("/v1/completions", {"model": "m", "prompt": "hi", "stream": True}, enabled=True)
    assert join is not None
    with pytest.raises(EngineFailure, match="ended before data: \\[DONE\\]") as failed:
        await relay_joined(join, Upstream(event("a")), Sink(), HEAD, leg(), clock=lambda: 0.0,
                           on_first=lambda now: None, on_gap=lambda gap: None, pump=None)
    assert failed.value.engine == "d1"


# ---- the exchange ----


def test_the_request_line_is_built_from_the_exchange_and_its_legs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    ex = Exchange("/v1/completions", "r1", Sink(), 0.0)
    ex.join, _ = plan("/v1/completions", {"model": "m", "prompt": "hi", "stream": True}, enabled=True)
    assert ex.join is not None
    first = ex.attempt(PREFILL, DECODE, "/v1/completions", {})
    assert [leg.kind for leg in first] == ["prefill", "decode"] and first[1].attempt == 1
    first[1].relay = "pump"
    ex.join.feed(event("a"))  # the client has bytes: the next decode is a continuation
    second = ex.attempt(EngineSpec(name="p2", url="http://127.0.0.1:3", role="prefill"),
                        EngineSpec(name="d2", url="http://127.0.0.1:4", role="decode"), "/v1/completions", {})
    assert [leg.kind for leg in second] == ["prefill", "continuation"] and ex.join.continuations == 1
    second[1].relay = "task"
    ex.status, ex.tokens, ex.ttft_s = 200, 7, 0.0123456
    ex.log_line(1.5)
    (line,) = [json.loads(r.getMessage()) for r in caplog.records if '"request"' in r.getMessage()]
    fields = {key: value for key, value in line.items() if key not in ("event", "ts", "level")}
    assert list(fields) == ["request_id", "route", "status", "prefill", "decode", "ttft_ms", "tokens",
                            "duration_ms", "attempts", "continuations", "join_gap_ms", "regenerated_tokens",
                            "error", "continued_after", "prefix_match", "relay", "model", "tenant", "trace_id"]
    assert fields == {"request_id": "r1", "route": "/v1/completions", "status": 200, "prefill": "p2",
                      "decode": "d2", "ttft_ms": 12.346, "tokens": 7, "duration_ms": 1500.0, "attempts": 2,
                      "continuations": 1, "join_gap_ms": None, "regenerated_tokens": 0,
                      "error": None, "continued_after": None, "prefix_match": None, "relay": "pump",
                      "model": None, "tenant": None, "trace_id": None}
