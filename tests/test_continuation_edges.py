"""Stream continuation edge cases: legs of mixed kinds, divergence, usage, engine error events, defaults (each of
these failed in a review of the whole-character join)."""

from __future__ import annotations

import contextlib
import json
import random
from typing import Any

import msgspec
import pytest
from test_continuation import (
    CHAT,
    COMPLETIONS,
    PROMPT_TOKENS,
    ClientSink,
    Upstream,
    check_one_stream,
    decode_calls,
    make,
    make_shaped,
    numbers,
    request_body,
    request_line,
    text_of,
)
from test_continuation_joins import ORIGINAL, FakeVLLM, _client_view, _request, _sequence, feed_in_pieces

from narwhal.errors import FailureClass, UpstreamClientError
from narwhal.serving.continuation import StreamJoin
from narwhal.tools.mock.engine import MockEngine
from narwhal.tools.mock.faults import FaultRequest


@pytest.mark.parametrize("extra", [{"logprobs": True}, {"response_format": {"type": "text"}}],
                         ids=["logprobs", "response_format_text"])
async def test_a_chat_continued_as_text_resumes_after_all_the_client_has(caplog, extra):
    # A chat request with a key outside _CHAT_AS_COMPLETION (here logprobs, or a plain-text response_format) has
    # complete token IDs but continues as text: the messages carry the client's whole text, so nothing is cut back,
    # max_tokens counts all the client has, and nothing the new engine says is taken for a token generated again.
    core, _, pool, _, _ = make_shaped(tokens_per_event=2)
    pool.cuts = [4]
    sink = ClientSink()
    with caplog.at_level("INFO", logger="narwhal.events"):
        await core.handle(CHAT, request_body(CHAT, **extra), None, sink)
    second = decode_calls(pool)[1]
    assert second[1] == CHAT and second[2]["messages"][-1]["content"] == " n6 n7 n8 n9"
    # The client has 4 tokens: 6 are owed.
    max_tokens_sent = second[2]["max_tokens"]
    check_one_stream(sink, chat=True, prompt_tokens=PROMPT_TOKENS[CHAT], max_tokens=10)
    assert max_tokens_sent == 6
    line = request_line(caplog)
    assert line["regenerated_tokens"] == 0 and line["tokens"] == 10


def _one_token_events(ids_and_texts: list[tuple[list[int], str]]) -> bytes:
    out = b""
    for n, (ids, text) in enumerate(ids_and_texts):
        choice: dict[str, Any] = {"index": 0, "text": text, "token_ids": ids, "finish_reason": None}
        if n == 0:
            choice["prompt_token_ids"] = [1, 2]
        out += b"data: " + json.dumps({"id": "x", "created": 1, "choices": [choice]}).encode() + b"\n\n"
    return out


def test_regenerated_is_counted_once_per_join_not_once_per_next_leg_call():
    # request_core calls next_leg() once per attempt: again after a continuation's prefill fails, after a
    # continuation's decode fails before relaying anything, and every _QUEUE_POLL_S while no engine is free.
    join = StreamJoin(COMPLETIONS, {"model": "m", "prompt": [1, 2], "max_tokens": 8, "stream": True})
    join.next_leg()
    # Two tokens in one event: no whole-character point after them, so a join regenerates both.
    join.feed(_one_token_events([([5], " a"), ([6, 7], " bc")]))
    _, first = join.next_leg() or ("", {})
    _, again = join.next_leg() or ("", {})
    assert first == again and first["prompt"] == [1, 2, 5]
    out, _ = join.feed(b"".join(_event([{"index": 0, "text": text, "token_ids": [i], "finish_reason": None}])
                                for i, text in ((6, " b"), (7, "c"), (8, " d"))))
    assert join.regenerated == 2 and out.count(b"data: ") == 1


async def test_regenerated_tokens_in_the_request_log_grow_while_a_continuation_waits(
        caplog, autojump_clock):
    # The continuation finds no eligible decode engine for a while (queued: polled every 50 ms, no attempt
    # counted); each poll re-runs next_leg, which must not count the same overlap again.
    core, supervisor, pool, _, _ = make_shaped(tokens_per_event=2)
    pool.cuts = [4]
    eligible = supervisor.eligible
    calls = {"decode": 0}

    def flaky(role: str, model: str | None = None) -> list[str]:
        if role == "decode" and decode_calls(pool):
            calls["decode"] += 1
            if calls["decode"] <= 5:
                return []
        return eligible(role, model)

    supervisor.eligible = flaky  # type: ignore[method-assign]
    sink = ClientSink()
    with caplog.at_level("INFO", logger="narwhal.events"):
        await core.handle(COMPLETIONS, request_body(COMPLETIONS), None, sink)
    assert numbers(text_of(sink.events()[:-1], False)) == list(range(3, 13))
    check_one_stream(sink, chat=False, prompt_tokens=3, max_tokens=10)
    assert calls["decode"] > 5
    # Resumed at the prompt (events of two tokens, no whole-character point): the 4 tokens were generated again once.
    assert len(decode_calls(pool)[1][2]["prompt"]) == 3
    assert request_line(caplog)["regenerated_tokens"] == 4


# -- after a divergence: a second cut in a continuation must change nothing the client sees ---------------------



class _SampledVLLM(FakeVLLM):
    """A second engine that sampled differently. Its answer is its own sequence from where it first continued (a
    whole character, so its text is valid), whatever the prompt holds after that: a third leg on it regenerates
    exactly what the second said."""

    start: int | None = None

    def leg(self, route: str, body: dict[str, Any], *, events_of: list[int], cut_after: int | None) -> bytes:
        prompt = self.original if route == CHAT else body["prompt"]
        done = prompt[len(self.original):]
        if self.start is None:
            self.start = len(done)
        saved = self.truth
        self.truth = done + saved[len(done) - self.start:]
        try:
            return super().leg(route, body, events_of=events_of, cut_after=cut_after)
        finally:
            self.truth = saved


def _run_legs(route: str, request: dict[str, Any], engines: list[FakeVLLM], cuts: list[int],
              sizes: list[list[int]], rng: random.Random) -> tuple[bytes, StreamJoin]:
    join = StreamJoin(route, request)
    client = b""
    for number in range(len(cuts) + 1):
        leg_route, body = join.next_leg() or ("", {})
        if number == 1:
            # Where the first continuation resumed, and the tokens the client has that it generates again.
            join.resumed_at = [join.tokens_before]  # type: ignore[attr-defined]
            join.owed_at_first_join = len(join._sent) - join.tokens_before  # type: ignore[attr-defined]
        if number == 2:
            join.resumed_at.append(join.tokens_before)  # type: ignore[attr-defined]
        if number:
            join.continuations += 1
        cut = cuts[number] if number < len(cuts) else None
        raw = engines[min(number, len(engines) - 1)].leg(leg_route, body, events_of=sizes[number], cut_after=cut)
        out, done = feed_in_pieces(join, raw, rng)
        client += out
        if done:
            return client, join
    raise AssertionError("the last leg did not end")


def _diverged_case(seed: int, stop: bool, client_ids: bool) -> tuple[Any, Any, StreamJoin, int]:
    """The case this seed draws, redrawn until it applies: leg 2 diverged from leg 1, is cut after the tokens it
    generated again, and its join resumes after them (before them is the known limit, docs/architecture.md)."""
    rng = random.Random(seed)
    first = _sequence(seed, 120)
    # The second engine sampled: same distribution, another draw (it agrees with the first nowhere in particular).
    second = _sequence(seed + 1000, 120)
    extra: dict[str, Any] = {"stop": ["@@@@@@"]} if stop else {}
    request = _request(COMPLETIONS, 50, client_ids, **extra)
    for _ in range(20):
        # Leg 2 sends one token per event (its own divergence is then split token by token, the same in both runs);
        # legs 1 and 3 as a busy engine does.
        sizes = [[rng.choice([1, 1, 2, 3]) for _ in range(5)], [1], [rng.choice([1, 2, 3]) for _ in range(5)]]
        c1 = rng.randint(6, 20)
        feed_seed = rng.randrange(1 << 30)
        once, join = _run_legs(COMPLETIONS, request, [FakeVLLM(first, ORIGINAL), _SampledVLLM(second, ORIGINAL)],
                               [c1], sizes[:2], random.Random(feed_seed))
        owed = join.owed_at_first_join  # type: ignore[attr-defined]
        if not join.diverged:
            continue  # leg 2 generated nothing again, or the same: no divergence to test
        # The second cut falls after the tokens leg 2 generated again, so the client holds B's text there.
        for c2 in rng.sample(range(owed + 2, owed + 26), 24):
            twice, join = _run_legs(COMPLETIONS, request,
                                    [FakeVLLM(first, ORIGINAL), _SampledVLLM(second, ORIGINAL)],
                                    [c1, c2], sizes, random.Random(feed_seed))
            resumed_first, resumed_second = join.resumed_at  # type: ignore[attr-defined]
            if resumed_second >= resumed_first + owed:
                return _client_view(once, False), _client_view(twice, False), join, owed
    raise AssertionError(f"seed {seed} drew no case with a divergence and a second join after it")


@pytest.mark.parametrize("seed", range(60))
def test_after_a_divergence_a_second_cut_changes_nothing_the_client_sees(seed):
    # Under a stop string (text held back). Leg 1 on engine A is cut; leg 2 on engine B (sampled: it differs from A)
    # runs on; in the second run B is cut too, after it passed the tokens it generated again (so the client holds B's
    # text there), and leg 3 on B regenerates exactly what B said. The client must see the same answer in both runs.
    # Leg 3 regenerates B's own tokens: it must align by characters again (B's text lags its tokens by the
    # held-back characters, so aligning by events would repeat or lose text).
    once, twice, join, owed = _diverged_case(seed, True, client_ids=seed % 2 == 0)
    assert join.diverged and owed > 0 and join.continuations == 2
    assert "\ufffd" not in twice[0]
    assert twice[0] == once[0]
    assert twice[1] == once[1] and twice[2] == once[2] and twice[3] == once[3]


async def test_a_text_join_after_a_leg_without_ids_drops_nothing():
    # A fleet mid-upgrade: one decode engine returns no token IDs. Leg 1 (IDs, two tokens an event) is cut after 4
    # tokens: the exact join resumes at the prompt and leg 2 is to regenerate 4 tokens. Leg 2 lands on the engine
    # without IDs: the overlap is skipped by characters. Leg 2 is cut after 6 tokens; the join is now a text join
    # (prompt + text so far), and leg 3 (IDs again) must not take its first tokens for ones generated again.
    core, _, pool, engines, _ = make_shaped(tokens_per_event=2)
    pool.cuts = [4, 6]
    original = type(pool)._answer
    decodes = {"n": 0}

    async def second_leg_without_ids(self, engine, path, body):
        payload = json.loads(body)
        if payload.get("kv_transfer_params", {}).get("do_remote_prefill"):
            decodes["n"] += 1
            if decodes["n"] == 2:
                payload.pop("return_token_ids", None)
                body = json.dumps(payload).encode()
        return await original(self, engine, path, body)

    pool._answer = second_leg_without_ids.__get__(pool)  # type: ignore[method-assign]
    # Three decode engines, so the third leg has one to go to.
    core.supervisor.roles["decode"] = ["d1", "d2", "d3"]
    core._decode_engines = frozenset({"d1", "d2", "d3"})
    sink = ClientSink()
    await core.handle(COMPLETIONS, request_body(COMPLETIONS), None, sink)
    assert len(decode_calls(pool)) == 3
    assert isinstance(decode_calls(pool)[2][2]["prompt"], str)
    # Nothing repeated or lost, and exactly max_tokens: the leg without token IDs (events of two tokens each) is
    # counted by the third leg's prefill engine (/tokenize of the client's text), not by its events.
    got = numbers(text_of(sink.events()[:-1], False))
    assert got == list(range(3, 13))
    assert sink.events()[-1] == "[DONE]" and sink.events().count("[DONE]") == 1


def _event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
    return b"data: " + json.dumps({"id": "x", "created": 1, "choices": choices, **extra}).encode() + b"\n\n"


def test_usage_counts_the_tokens_the_client_got_when_a_sampled_leg_ends_inside_the_overlap():
    # Resumed one event back (two tokens in one event); the new engine samples differently and ends (EOS) after one
    # token, inside the overlap. The client got 3 token IDs (and their text): usage and ``tokens`` say 3.
    request = {"model": "m", "prompt": [1, 2], "max_tokens": 8, "stream": True, "return_token_ids": True,
               "stream_options": {"include_usage": True}}
    join = StreamJoin(COMPLETIONS, request)
    join.next_leg()
    first, _ = join.feed(_event([{"index": 0, "text": " a", "token_ids": [5], "prompt_token_ids": [1, 2],
                                  "finish_reason": None}])
                         + _event([{"index": 0, "text": " bc", "token_ids": [6, 7], "finish_reason": None}]))
    _, body = join.next_leg() or ("", {})
    assert body["prompt"] == [1, 2, 5]
    out, done = join.feed(_event([{"index": 0, "text": " x", "token_ids": [9], "finish_reason": "stop"}])
                          + _event([], usage={"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4})
                          + b"data: [DONE]\n\n")
    assert done and join.diverged
    client_ids = [i for raw in (first, out) for e in raw.split(b"\n\n") if e
                  for c in json.loads(e[6:])["choices"] for i in c.get("token_ids") or []]
    usage = [json.loads(e[6:])["usage"] for e in out.split(b"\n\n") if e and b'"usage"' in e]
    assert len(client_ids) == join.tokens == 3
    assert usage[0]["completion_tokens"] == len(client_ids)


def test_a_reasoning_models_thoughts_are_not_sent_again_as_content():
    # vLLM with a reasoning parser streams the thinking as delta.reasoning_content (or delta.reasoning), with token
    # IDs. A continuation could not tell the new engine's thinking from its answer (the failed engine's parser
    # knew), so such a stream is not continued: it ends with the SSE error event, as before continuation existed.
    request = {"model": "m", "messages": [{"role": "user", "content": "q"}], "max_tokens": 20, "stream": True}
    for key in ("reasoning_content", "reasoning"):
        join = StreamJoin(CHAT, request)
        join.next_leg()
        join.feed(_event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "token_ids": [],
                           "finish_reason": None}], prompt_token_ids=[1, 2, 3])
                  + b"".join(_event([{"index": 0, "delta": {key: word}, "token_ids": [10 + n],
                                      "finish_reason": None}]) for n, word in enumerate(["Let", " me", " think"])))
        assert join.next_leg() is None and join.not_resumable == "reasoning"


async def test_a_reasoning_stream_that_fails_ends_with_the_sse_error_and_says_why(caplog):
    core, _, pool, _, _ = make_shaped()
    original = type(pool)._answer

    async def reasoning(self, engine, path, body):
        recorder = await original(self, engine, path, body)
        # The mock's answer as a reasoning parser would split it: every token is thinking.
        recorder.writes = [w.replace(b'"delta":{"content"', b'"delta":{"reasoning_content"') for w in recorder.writes]
        return recorder

    pool._answer = reasoning.__get__(pool)  # type: ignore[method-assign]
    pool.cuts = [4]
    sink = ClientSink()
    with caplog.at_level("INFO", logger="narwhal.events"):
        await core.handle(CHAT, request_body(CHAT), None, sink)
    events = sink.events()
    assert events[-1]["error"]["code"] == "not_continued" and "reasoning" in events[-1]["error"]["message"]
    assert len(decode_calls(pool)) == 1
    assert '"reason":"reasoning"' in caplog.text


class _LaxVLLM(FakeVLLM):
    """vLLM reads the request with pydantic in lax mode: ``include_stop_str_in_output: 1`` (or "true") is True."""

    def leg(self, route: str, body: dict[str, Any], *, events_of: list[int], cut_after: int | None) -> bytes:
        lax = {**body, "include_stop_str_in_output": body.get("include_stop_str_in_output") in (True, 1, "true")}
        return super().leg(route, lax, events_of=events_of, cut_after=cut_after)


@pytest.mark.parametrize("include", [1, "true"])
def test_a_stop_string_across_the_join_with_include_given_as_a_truthy_value(include):
    # vLLM coerces include_stop_str_in_output 1 and "true" to True and holds nothing back; the join must read it
    # the same way, or it resumes too late and the new engine misses the stop string spanning the join.
    from test_continuation_joins import _ID
    truth = [_ID[p] for p in (b" whale", b" sea", b" deep", b" blue", b" song", b".", b" a")]
    engine = _LaxVLLM(truth, ORIGINAL)
    request = _request(COMPLETIONS, 7, False, stop="deep blue", include_stop_str_in_output=include)
    reference, _ = _run_legs(COMPLETIONS, request, [engine], [], [[1]], random.Random(0))
    interrupted, _ = _run_legs(COMPLETIONS, request, [engine, engine], [3], [[1], [1]], random.Random(0))
    assert _client_view(reference, False)[0] == " whale sea deep blue"
    assert _client_view(interrupted, False)[0] == " whale sea deep blue"


async def test_an_engine_core_that_dies_mid_stream_is_continued_not_ended_with_done():
    # The most common mid-stream death of a real vLLM: its EngineCore process dies (GPU fault, OOM) while the API
    # server lives on; vLLM ends the stream with `data: {"error": ...}` then `data: [DONE]`. That is a failed
    # stream: continued, the client never sees the error event.


    core, supervisor, pool, _, _ = make_shaped()
    pool.cuts = [4]
    original = pool.stream

    @contextlib.asynccontextmanager
    async def stream(engine, path, body, *, request_id):
        async with original(engine, path, body, request_id=request_id) as upstream:
            if upstream.failure is not None:
                error = {"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the root "
                                              "cause.", "type": "InternalServerError", "param": None, "code": 500}}
                upstream = Upstream(upstream.chunks + [b"data: " + json.dumps(error).encode() + b"\n\n",
                                                       b"data: [DONE]\n\n"], None)
            yield upstream

    pool.stream = stream  # type: ignore[method-assign]
    sink = ClientSink()
    await core.handle(COMPLETIONS, request_body(COMPLETIONS), None, sink)
    assert len(decode_calls(pool)) == 2
    check_one_stream(sink, chat=False, prompt_tokens=3, max_tokens=10)


def test_a_chat_without_max_tokens_continues_as_chat_so_it_is_not_cut_to_16_tokens():
    # A chat request without max_tokens/max_completion_tokens may run to the end of the context. As a completion it
    # would stop after 16 tokens: vLLM 0.32 turns a missing or null max_tokens into 16 (measured with real vLLM), and
    # the router does not know the engine's context length. So it continues as chat, from its text.
    request = {"model": "m", "messages": [{"role": "user", "content": "q"}], "stream": True}
    join = StreamJoin(CHAT, request)
    join.next_leg()
    join.feed(_event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "token_ids": [],
                       "finish_reason": None}], prompt_token_ids=[1, 2, 3])
              + _event([{"index": 0, "delta": {"content": " a"}, "token_ids": [7], "finish_reason": None}]))
    route, body = join.next_leg() or ("", {})
    assert route == CHAT and "max_tokens" not in body and "max_completion_tokens" not in body
    assert body["messages"][-1] == {"role": "assistant", "content": " a"} and body["continue_final_message"]
    # With a limit it resumes exactly, as a token-ID completion asking for the rest.
    join = StreamJoin(CHAT, {**request, "max_completion_tokens": 9})
    join.next_leg()
    join.feed(_event([{"index": 0, "delta": {"content": " a"}, "token_ids": [7], "finish_reason": None}],
                     prompt_token_ids=[1, 2, 3]))
    route, body = join.next_leg() or ("", {})
    assert route == COMPLETIONS and body["prompt"] == [1, 2, 3, 7] and body["max_tokens"] == 8


def test_continuous_usage_chunks_of_regenerated_tokens_do_not_become_final_usage_chunks():
    # With stream_options.continuous_usage_stats every vLLM chunk carries usage. A chunk whose tokens the client
    # already has goes whole: `"choices": []` with usage mid-stream would read as the final usage chunk (OpenAI
    # clients take it as the end-of-stream usage), and a tail() after a later lost [DONE] would write none.
    request = {"model": "m", "prompt": [1, 2], "max_tokens": 8, "stream": True,
               "stream_options": {"include_usage": True, "continuous_usage_stats": True}}

    def usage(n: int) -> dict[str, int]:
        return {"prompt_tokens": 2, "completion_tokens": n, "total_tokens": 2 + n}

    join = StreamJoin(COMPLETIONS, request)
    join.next_leg()
    join.feed(_event([{"index": 0, "text": " a", "token_ids": [5], "prompt_token_ids": [1, 2],
                       "finish_reason": None}], usage=usage(1))
              + _event([{"index": 0, "text": " bc", "token_ids": [6, 7], "finish_reason": None}], usage=usage(3)))
    _, body = join.next_leg() or ("", {})
    assert body["prompt"] == [1, 2, 5]
    out, _ = join.feed(_event([{"index": 0, "text": " b", "token_ids": [6], "finish_reason": None}], usage=usage(1))
                       + _event([{"index": 0, "text": "c", "token_ids": [7], "finish_reason": None}], usage=usage(2))
                       + _event([{"index": 0, "text": " d", "token_ids": [8], "finish_reason": None}],
                                usage=usage(3)))
    chunks = [json.loads(e[6:]) for e in out.split(b"\n\n") if e]
    assert all(chunk["choices"] for chunk in chunks)
    assert not join.usage_sent


# -- engines without token IDs: the tokens the client has are counted by the engine (/tokenize), never by events ----

def _make_without_ids(**shape: Any):
    """Mock engines that ignore return_token_ids (as an engine without them), streaming with ``shape``."""
    core, supervisor, pool, engines, metrics = make(decode=("d1", "d2"), return_ids=False)
    for name, engine in list(engines.items()):
        engines[name] = MockEngine(msgspec.structs.replace(engine.settings, **shape))
    return core, supervisor, pool, engines, metrics


def _tokenize_calls(pool: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c[0], c[2]) for c in pool.calls if c[1] == "/tokenize"]


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("shape", [{"tokens_per_event": 2}, {"split_every": 3}], ids=["two_per_event", "split"])
async def test_a_continuation_without_token_ids_asks_for_exactly_what_is_owed(caplog, route, shape):
    # No token IDs; events of two tokens (or empty events for half a character). Cut after 5 tokens: the client has
    # 5 tokens in 3 events, so 7 are owed (counting events said 9, and the client got 14 of 12). The usage counts
    # the original prompt (not the continuation's) and the 12 tokens the client got.
    core, _, pool, _, _ = _make_without_ids(**shape)
    pool.cuts = [5]
    sink = ClientSink()
    with caplog.at_level("INFO", logger="narwhal.events"):
        await core.handle(route, request_body(route, max_tokens=12), None, sink)
    check_one_stream(sink, chat=route == CHAT, prompt_tokens=PROMPT_TOKENS[route], max_tokens=12)
    second = decode_calls(pool)[1][2]
    assert second["max_tokens"] == 7
    # The text the client had, counted by the continuation's prefill engine; the prompt too (count_tokens is off).
    (engine, text), (same, prompt) = _tokenize_calls(pool)
    assert engine == same and engine.startswith("p")
    assert text["add_special_tokens"] is False and numbers(text["prompt"]) == list(range(PROMPT_TOKENS[route],
                                                                                      PROMPT_TOKENS[route] + 5))
    assert ("messages" in prompt) == (route == CHAT)
    assert request_line(caplog)["tokens"] == 12


async def test_the_prompt_count_from_token_counting_is_used_and_not_asked_again(caplog):
    core, _, pool, _, _ = _make_without_ids(tokens_per_event=2)
    core._count_tokens = True
    pool.cuts = [5]
    sink = ClientSink()
    await core.handle(COMPLETIONS, request_body(COMPLETIONS, max_tokens=12), None, sink)
    check_one_stream(sink, chat=False, prompt_tokens=3, max_tokens=12)
    # One /tokenize for the prompt before the first leg (count_tokens), one for the client's text at the join.
    assert [c[1].get("add_special_tokens") for c in _tokenize_calls(pool)] == [None, False]


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
async def test_a_lost_usage_written_by_the_router_counts_the_true_prompt_and_tokens(route):
    # The last token and its finish_reason came (events of two tokens, no IDs); the usage and [DONE] were lost. The
    # router writes the usage: the prompt's count and the 12 tokens, from /tokenize (never 0, never events).
    core, _, pool, _, _ = _make_without_ids(tokens_per_event=2)
    pool.cuts = [12]
    sink = ClientSink()
    await core.handle(route, request_body(route, max_tokens=12), None, sink)
    check_one_stream(sink, chat=route == CHAT, prompt_tokens=PROMPT_TOKENS[route], max_tokens=12)
    assert len(decode_calls(pool)) == 1


async def test_a_lost_usage_that_no_engine_can_count_is_left_out_not_invented(caplog):
    core, _, pool, engines, _ = _make_without_ids(tokens_per_event=2)
    for name in ("p1", "p2"):
        engines[name].add_fault(FaultRequest(mode="status_5xx", legs=["tokenize"]))
    pool.cuts = [12]
    sink = ClientSink()
    await core.handle(COMPLETIONS, request_body(COMPLETIONS, max_tokens=12), None, sink)
    check_one_stream(sink, chat=False, prompt_tokens=3, max_tokens=12, usage=False)
    assert not [e for e in sink.events()[:-1] if e.get("usage")]


async def test_a_tokenize_failure_at_a_join_is_the_attempts_failure_and_the_next_engine_counts(caplog):
    core, supervisor, pool, engines, _ = _make_without_ids(tokens_per_event=2)
    # p1's /tokenize fails: evidence against p1 (stage tokenize), and the next attempt counts on p2.
    supervisor.roles["prefill"] = ["p1"]
    engines["p1"].add_fault(FaultRequest(mode="status_5xx", legs=["tokenize"]))
    pool.cuts = [5]
    sink = ClientSink()
    eligible = supervisor.eligible

    def p2_after_p1_failed(role: str, model: str | None = None) -> list[str]:
        return ["p1", "p2"] if role == "prefill" and supervisor.failures[1:] else eligible(role, model)

    supervisor.eligible = p2_after_p1_failed  # type: ignore[method-assign]
    with caplog.at_level("INFO", logger="narwhal.events"):
        await core.handle(COMPLETIONS, request_body(COMPLETIONS, max_tokens=12), None, sink)
    assert ("p1", FailureClass.INFERENCE_STATUS) in supervisor.failures
    check_one_stream(sink, chat=False, prompt_tokens=3, max_tokens=12)
    assert [name for name, _ in _tokenize_calls(pool)] == ["p1", "p2", "p2"]


async def test_an_engine_whose_tokenize_cannot_count_ends_the_stream_as_not_continued(caplog):
    core, _, pool, engines, metrics = _make_without_ids(tokens_per_event=2)
    original = pool._answer

    async def no_tokenize(engine, path, body):
        if path == "/tokenize":
            raise UpstreamClientError(engine.name, 404, b'{"detail": "Not Found"}')
        return await original(engine, path, body)

    pool._answer = no_tokenize  # type: ignore[method-assign]
    pool.cuts = [5]
    sink = ClientSink()
    with caplog.at_level("INFO", logger="narwhal.events"):
        await core.handle(COMPLETIONS, request_body(COMPLETIONS, max_tokens=12), None, sink)
    error = sink.events()[-1]["error"]
    assert error["code"] == "not_continued" and "counted" in error["message"]
    assert metrics.continuations.values.get(("not_eligible", "mock-model")) == 1
    assert len(decode_calls(pool)) == 1


# vLLM 0.32's refusal of a prompt longer than its context (renderers/params.py), as its API server sends it.
_CONTEXT_REFUSAL = json.dumps({
    "error": {"message": "This model's maximum context length is 2048 tokens. However, your prompt contains 2049 "
                         "input tokens, which exceeds this limit even without any output tokens. Please reduce the "
                         "length of the input prompt.", "type": "BadRequestError", "param": "input_tokens",
              "code": 400}}).encode()


def _refuse_continuations(pool, body: bytes) -> None:
    original = pool._answer

    async def refuse(engine, path, raw):
        if json.loads(raw).get("continue_final_message"):
            raise UpstreamClientError(engine.name, 400, body)
        return await original(engine, path, raw)

    pool._answer = refuse


@pytest.mark.parametrize("usage", [True, False], ids=["with-usage", "without-usage"])
async def test_a_continuation_that_no_longer_fits_the_context_ends_the_answer_as_length(caplog, usage):
    # A chat answer without max_tokens runs to the end of the context. Continued from its text, the answer so far
    # may tokenize to more than the context holds (a random model's bytes did, with real vLLM): the engine refuses,
    # and the answer ends where the uninterrupted one would have, with finish_reason "length", not with an error.
    core, supervisor, pool, _, metrics = make()
    _refuse_continuations(pool, _CONTEXT_REFUSAL)
    pool.cuts = [4]
    sink = ClientSink()
    extra: dict[str, Any] = {} if usage else {"stream_options": ...}
    with caplog.at_level("INFO", logger="narwhal.events"):
        await core.handle(CHAT, request_body(CHAT, max_tokens=..., **extra), None, sink)
    assert sink.status == 200 and sink.ended
    events = sink.events()
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = events[:-1]
    assert all("error" not in c for c in chunks)
    assert numbers(text_of(chunks, chat=True)) == list(range(PROMPT_TOKENS[CHAT], PROMPT_TOKENS[CHAT] + 4))
    finals = [c for e in chunks for c in e["choices"] if c.get("finish_reason") is not None]
    assert finals == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}]
    assert len({e["id"] for e in chunks}) == 1 and len({e["created"] for e in chunks}) == 1
    usages = [e["usage"] for e in chunks if e.get("usage")]
    assert usages == ([{"prompt_tokens": PROMPT_TOKENS[CHAT], "completion_tokens": 4,
                        "total_tokens": PROMPT_TOKENS[CHAT] + 4}] if usage else [])
    line = request_line(caplog)
    assert (line["status"], line["error"], line["continued_after"], line["continuations"], line["tokens"]) == (
        200, None, "stream", 1, 4)
    ended = [json.loads(r.getMessage()) for r in caplog.records if '"stream_ended_at_context"' in r.getMessage()]
    assert len(ended) == 1 and ended[0]["tokens"] == 4 and "maximum context length" in ended[0]["message"]
    assert metrics.continuations.values[("context_full", "mock-model")] == 1
    # The refusal is the request's, never evidence against the engine that gave it.
    assert all(engine.startswith("d") for engine, _ in supervisor.failures)


async def test_a_continuation_refused_for_another_reason_still_ends_with_the_error(caplog):
    core, _, pool, _, metrics = make()
    _refuse_continuations(pool, json.dumps({"error": {"message": "continue_final_message is not supported",
                                                      "type": "BadRequestError", "code": 400}}).encode())
    pool.cuts = [4]
    sink = ClientSink()
    await core.handle(CHAT, request_body(CHAT, max_tokens=...), None, sink)
    events = sink.events()
    # As before: the stream ends with the engine's refusal as an SSE error event (and no [DONE]).
    assert events[-1]["error"]["code"] == "upstream_rejected" and "[DONE]" not in events
    assert not [c for e in events[:-1] for c in e["choices"] if c.get("finish_reason")]
    assert ("context_full", "mock-model") not in metrics.continuations.values
