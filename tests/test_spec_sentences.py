"""Spec sentences no other test pinned (found by breaking each rule and running the suite).

Each test names the sentence of ``failure-readmission-state.txt`` it covers;
``docs/spec-coverage.md`` maps every sentence to its code and tests.
"""

from __future__ import annotations

from narwhal.errors import EngineFailure, FailureClass, SuccessKind
from tests.test_request_core import Sink, body, make_core


async def test_a_complete_non_streamed_decode_clears_the_decode_row_like_a_terminal_marker():
    # "Decode stream reaching its terminal marker: connection, inference-status, and stream."
    # A non-streamed decode answered 200 in full is the same complete decode, without SSE framing.
    core, supervisor, pool, _ = make_core()
    sink = Sink()
    await core.handle("/v1/completions", body(), None, sink)
    assert sink.status == 200
    decode = pool.calls[-1][0]  # the decode engine the request was placed on
    assert supervisor.successes == [("p1", SuccessKind.PREFILL_HANDOFF), (decode, SuccessKind.DECODE_TERMINAL)]


async def test_a_failed_non_streamed_decode_clears_nothing_on_the_decode_engine():
    core, supervisor, pool, _ = make_core()
    pool.decode.append(EngineFailure("d1", FailureClass.INFERENCE_STATUS, "HTTP 500"))
    sink = Sink()
    await core.handle("/v1/completions", body(), None, sink)
    assert sink.status is not None and sink.status >= 500
    assert supervisor.failures == [("d1", FailureClass.INFERENCE_STATUS)]
    assert [kind for _, kind in supervisor.successes] == [SuccessKind.PREFILL_HANDOFF]

