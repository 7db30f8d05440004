"""Exact joins against a faithful model of vLLM 0.32's streaming detokenizer.

``FakeVLLM`` reproduces what the router meets at a token-ID join with real
vLLM: byte tokens that end inside a UTF-8 character stream no text; a
detokenizer primed with a prompt that ends inside a character emits that whole
prompt's text again (tokenizers' ``DecodeStream``, measured with 0.23.3);
stop strings are found only in the generated text, and while they are
excluded from it the last ``len(longest) - 1`` characters are held back; a
busy engine sends several tokens in one event. Generation is greedy: the token
at each position of the sequence is fixed, so an answer cut anywhere and
continued from the right place equals the uninterrupted one, byte for byte.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from narwhal.serving.continuation import StreamJoin

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

# The vocabulary: token i is a run of bytes. ASCII words, and every multi-byte character split into
# single-byte tokens (what a byte-level tokenizer does with a rare emoji or CJK character).
_WORDS = [b" whale", b" sea", b",", b" deep", b".", b" blue", b" song", b" a", b"b", b"c"]
_CHARS = ["\u00e9", "\u00f1", "\u4f60", "\u597d", "\U0001f40b", "\u00fc"]
VOCAB: list[bytes] = list(_WORDS) + sorted({bytes([b]) for ch in _CHARS for b in ch.encode()})
_ID = {piece: i for i, piece in enumerate(VOCAB)}


def _sequence(seed: int, length: int) -> list[int]:
    """The greedy model's whole answer: the token at each output position, whatever came before."""
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < length:
        if rng.random() < 0.35:
            ids.extend(_ID[bytes([b])] for b in rng.choice(_CHARS).encode())
        else:
            ids.append(_ID[rng.choice(_WORDS)])
    return ids[:length]


def _decode(ids: list[int]) -> str:
    return b"".join(VOCAB[i] for i in ids).decode("utf-8", errors="replace")


class _DecodeStream:
    """tokenizers' DecodeStream as vLLM 0.32 primes it with the prompt's IDs."""

    def __init__(self, prompt: list[int]) -> None:
        self.ids = list(prompt)
        primed = _decode(self.ids)
        # A prompt ending inside a character has no clean prefix: the first text out is the whole sequence's.
        self.prefix = "" if primed.endswith("\ufffd") else primed

    def step(self, token: int) -> str:
        self.ids.append(token)
        text = _decode(self.ids)
        if len(text) <= len(self.prefix) or text.endswith("\ufffd"):
            return ""
        out = text[len(self.prefix):]
        self.prefix = text
        return out


class FakeVLLM:
    """One decode leg of a greedy engine whose answer is ``truth`` (positions after the original prompt)."""

    def __init__(self, truth: list[int], original_prompt: list[int]) -> None:
        self.truth = truth
        self.original = original_prompt

    def leg(self, route: str, body: dict[str, Any], *, events_of: list[int], cut_after: int | None) -> bytes:
        """The SSE bytes of one leg: tokens grouped as ``events_of`` says (cycled), cut after that many tokens."""
        chat = route == CHAT
        prompt = self.original if chat else body["prompt"]
        assert isinstance(prompt, list)
        assert prompt[:len(self.original)] == self.original
        done = len(prompt) - len(self.original)
        assert prompt[len(self.original):] == self.truth[:done], "the continuation's prompt is not the answer so far"
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        stream = _DecodeStream(prompt)
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        include = body.get("include_stop_str_in_output") is True
        held = max((len(s) for s in stops), default=1) - 1 if stops and not include else 0
        output = ""
        sent = 0
        events: list[bytes] = []
        group: list[int] = []
        text_out = ""
        finish = None
        generated = 0
        sizes = iter(events_of * (max_tokens + 1))
        size = next(sizes)

        def emit(final: str | None) -> None:
            nonlocal group, text_out, size
            choice: dict[str, Any] = {"index": 0}
            if chat:
                choice["delta"] = {"content": text_out}
            else:
                choice["text"] = text_out
            choice["token_ids"] = group
            choice["finish_reason"] = final
            if final == "stop":
                choice["stop_reason"] = stop_hit
            event: dict[str, Any] = {"id": "x", "created": 1, "choices": [choice]}
            if not events and not chat:
                choice["prompt_token_ids"] = prompt
            if not events and chat:
                event["prompt_token_ids"] = prompt
            events.append(b"data: " + json.dumps(event).encode() + b"\n\n")
            group, text_out = [], ""
            size = next(sizes)

        stop_hit = None
        for position in range(done, done + max_tokens):
            if cut_after is not None and generated == cut_after:
                return b"".join(events)
            token = self.truth[position]
            generated += 1
            before = len(output)
            output += stream.step(token)
            group.append(token)
            if stops and len(output) > before:
                window = output[max(0, before - max(len(s) for s in stops) + 1):]
                for stop in stops:
                    at = window.find(stop)
                    if at >= 0:
                        end = max(0, before - max(len(s) for s in stops) + 1) + at
                        output = output[:end + (len(stop) if include else 0)]
                        stop_hit = stop
                        finish = "stop"
                        break
            last = finish is not None or generated == max_tokens
            visible = len(output) if last else max(len(output) - held, sent)
            text_out += output[sent:visible]
            sent = visible
            if last:
                emit(finish or "length")
                break
            if len(group) >= size:
                emit(None)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": generated,
                 "total_tokens": len(prompt) + generated}
        events.append(b"data: " + json.dumps({"id": "x", "created": 1, "choices": [], "usage": usage}).encode()
                      + b"\n\n")
        events.append(b"data: [DONE]\n\n")
        return b"".join(events)


def _client_view(raw: bytes, chat: bool) -> tuple[str, list[int], list[dict[str, Any]], list[Any]]:
    text, ids, usage, finals = "", [], [], []
    for event in raw.split(b"\n\n"):
        if not event or event == b"data: [DONE]":
            continue
        obj = json.loads(event[6:])
        for choice in obj["choices"]:
            text += (choice["delta"].get("content") or "") if chat else choice["text"]
            ids += choice.get("token_ids") or []
            if choice.get("finish_reason"):
                finals.append((choice["finish_reason"], choice.get("stop_reason")))
        if obj.get("usage"):
            usage.append(obj["usage"])
    return text, ids, usage, finals


def _run(route: str, request: dict[str, Any], engine: FakeVLLM, cuts: list[int], rng: random.Random,
         ) -> tuple[bytes, StreamJoin]:
    """The client's bytes for ``request`` whose decode legs are cut after ``cuts`` tokens, in turn."""
    join = StreamJoin(route, request)
    client = b""
    for leg_number in range(len(cuts) + 1):
        leg = join.next_leg()
        assert leg is not None
        leg_route, body = leg
        if leg_number:
            join.continuations += 1
        cut = cuts[leg_number] if leg_number < len(cuts) else None
        sizes = [rng.choice([1, 1, 1, 2, 3, 5]) for _ in range(7)]
        out, done = feed_in_pieces(join, engine.leg(leg_route, body, events_of=sizes, cut_after=cut), rng)
        client += out
        if done:
            return client + b"data: [DONE]\n\n", join
    raise AssertionError("the last leg did not end")


def feed_in_pieces(join: StreamJoin, raw: bytes, rng: random.Random) -> tuple[bytes, bool]:
    """Feed one leg's bytes in reads split anywhere (the join holds an event until it is whole)."""
    client = b""
    done = False
    at = 0
    while at < len(raw):
        step = rng.randint(1, 200)
        out, done = join.feed(raw[at:at + step])
        client += out
        at += step
    return client, done


ORIGINAL = [_ID[b" whale"], _ID[b" sea"]]


def _request(route: str, max_tokens: int, client_ids: bool, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "max_tokens": max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}, **extra}
    if client_ids:
        body["return_token_ids"] = True
    if route == CHAT:
        body["messages"] = [{"role": "user", "content": "x"}]
    else:
        body["prompt"] = ORIGINAL
    return body


@pytest.mark.parametrize("seed", range(60))
@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_a_greedy_answer_cut_anywhere_joins_to_the_uninterrupted_one(seed, route):
    rng = random.Random(seed)
    truth = _sequence(seed, 200)
    engine = FakeVLLM(truth, ORIGINAL)
    extra: dict[str, Any] = {}
    if seed % 3 == 1:
        extra["stop"] = ["@@@@", "zz"]
    elif seed % 3 == 2:
        # A stop string that occurs in this answer, so it ends on it (perhaps right at a join).
        reference_text = _decode(truth[:60])
        start = rng.randrange(20, len(reference_text) - 6)
        extra["stop"] = reference_text[start:start + rng.randint(2, 5)]
        extra["include_stop_str_in_output"] = seed % 2 == 0
    client_ids = seed % 4 == 0
    request = _request(route, 60, client_ids, **extra)
    reference, _ = _run(route, request, engine, [], rng)
    cuts = [rng.randint(1, 40) for _ in range(rng.choice([1, 1, 2, 3]))]
    interrupted, join = _run(route, request, engine, cuts, rng)
    chat = route == CHAT
    ref_text, ref_ids, ref_usage, ref_finals = _client_view(reference, chat)
    text, ids, usage, finals = _client_view(interrupted, chat)
    assert "\ufffd" not in text
    assert text == ref_text
    assert finals == ref_finals and len(finals) == 1
    assert usage == ref_usage
    if client_ids:
        assert ids == ref_ids
    else:
        assert ids == []
    assert not join.diverged


def test_a_join_inside_a_character_resumes_before_it_without_the_prompts_echo():
    # "ab" then the first byte of "é": the engine dies with the client holding "ab" and three token IDs.
    e1, e2 = "\u00e9".encode()
    truth = [_ID[b" a"], _ID[b"b"], _ID[bytes([e1])], _ID[bytes([e2])], _ID[b"c"]]
    engine = FakeVLLM(truth, ORIGINAL)
    request = _request(COMPLETIONS, 5, True)
    join = StreamJoin(COMPLETIONS, request)
    _, body = join.next_leg() or ("", {})
    first, _ = join.feed(engine.leg(COMPLETIONS, body, events_of=[1], cut_after=3))
    assert _client_view(first, False)[:2] == (" ab", truth[:3])
    route, body = join.next_leg() or ("", {})
    # The prompt stops before the half character, so the new engine's detokenizer starts clean.
    assert body["prompt"] == ORIGINAL + truth[:2] and body["max_tokens"] == 3
    raw = engine.leg(route, body, events_of=[1], cut_after=None)
    # Resuming at the exact token instead makes this engine echo its whole prompt (what vLLM does).
    echo = engine.leg(COMPLETIONS, {**body, "prompt": ORIGINAL + truth[:3], "max_tokens": 2}, events_of=[1],
                      cut_after=None)
    assert _client_view(echo, False)[0].startswith(" whale sea ab\u00e9")
    out, done = join.feed(raw)
    text, ids, usage, _ = _client_view(out, False)
    # The half character's token is not sent twice; its text comes whole with the next token.
    assert done and text == "\u00e9c" and ids == truth[3:]
    assert usage == [{"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}]
    assert join.regenerated == 1 and join.tokens == 5 and not join.diverged


def test_text_held_back_under_a_stop_string_is_not_lost_at_a_join():
    truth = [_ID[p] for p in (b" whale", b" sea", b" deep", b" blue", b" song", b".", b" a")]
    engine = FakeVLLM(truth, ORIGINAL)
    request = _request(COMPLETIONS, 7, False, stop=["@@@@@@@@@@"])
    join = StreamJoin(COMPLETIONS, request)
    _, body = join.next_leg() or ("", {})
    first, _ = join.feed(engine.leg(COMPLETIONS, body, events_of=[1], cut_after=5))
    # Nine characters are held back: the client has " whale sea deep " of " whale sea deep blue song".
    assert _client_view(first, False)[0] == " whale sea deep "
    route, body = join.next_leg() or ("", {})
    # Resumed at the last token whose text the client has whole: after " deep"; its held-back " " is not repeated.
    assert body["prompt"] == ORIGINAL + truth[:3] and body["max_tokens"] == 4
    out, done = join.feed(engine.leg(route, body, events_of=[1], cut_after=None))
    assert done and _client_view(out, False)[0] == "blue song. a"
    assert join.output_text == " whale sea deep blue song. a"


def test_a_stop_string_spanning_the_join_still_ends_the_answer():
    truth = [_ID[p] for p in (b" whale", b" sea", b" deep", b" blue", b" song", b".", b" a")]
    engine = FakeVLLM(truth, ORIGINAL)
    request = _request(COMPLETIONS, 7, False, stop="deep blue", include_stop_str_in_output=True)
    join = StreamJoin(COMPLETIONS, request)
    _, body = join.next_leg() or ("", {})
    first, _ = join.feed(engine.leg(COMPLETIONS, body, events_of=[1], cut_after=3))
    assert _client_view(first, False)[0] == " whale sea deep"
    route, body = join.next_leg() or ("", {})
    # "deep blue" would span a join after " deep": the new engine starts far enough back to see it.
    assert len(body["prompt"]) <= len(ORIGINAL) + 1
    out, done = join.feed(engine.leg(route, body, events_of=[1], cut_after=None))
    text, _, _, finals = _client_view(out, False)
    assert done and text == " blue" and finals == [("stop", "deep blue")]


def test_regenerated_tokens_that_differ_are_flagged_and_the_text_still_runs_on():
    truth = [_ID[p] for p in (b" whale", b" sea", b" deep", b" blue")]
    engine = FakeVLLM(truth, ORIGINAL)
    request = _request(COMPLETIONS, 4, True)
    join = StreamJoin(COMPLETIONS, request)
    _, body = join.next_leg() or ("", {})
    # A busy engine: the two tokens came in one event, so the join cannot tell where a character ends.
    join.feed(engine.leg(COMPLETIONS, body, events_of=[2], cut_after=2))
    route, body = join.next_leg() or ("", {})
    assert body["prompt"] == ORIGINAL
    # A sampled answer: the new engine says something else for the tokens the client has.
    other = FakeVLLM([_ID[b" a"], _ID[b"b"], _ID[b" deep"], _ID[b" blue"]], ORIGINAL)
    out, done = join.feed(other.leg(route, body, events_of=[1], cut_after=None))
    text, ids, _, _ = _client_view(out, False)
    assert done and join.diverged and join.regenerated == 2
    assert text == " deep blue" and ids == [_ID[b" deep"], _ID[b" blue"]]


def test_logprobs_of_regenerated_tokens_are_not_sent_twice():
    join = StreamJoin(COMPLETIONS, _request(COMPLETIONS, 4, False, logprobs=1))
    join.next_leg()
    join.feed(b'data: {"id":"x","created":1,"choices":[{"index":0,"text":"","token_ids":[5],'
              b'"prompt_token_ids":[1,2],"logprobs":{"tokens":["?"],"token_logprobs":[-1.0],'
              b'"top_logprobs":[null],"text_offset":[0]},"finish_reason":null}]}\n\n')
    _, body = join.next_leg() or ("", {})
    assert body["prompt"] == ORIGINAL
    out, _ = join.feed(b'data: {"id":"y","created":2,"choices":[{"index":0,"text":"\\u00e9","token_ids":[5,6],'
                       b'"logprobs":{"tokens":["?","?"],"token_logprobs":[-1.0,-2.0],"top_logprobs":[null,null],'
                       b'"text_offset":[0,0]},"finish_reason":null}]}\n\n')
    choice = json.loads(out[6:])["choices"][0]
    assert choice["text"] == "\u00e9" and "token_ids" not in choice
    assert choice["logprobs"]["token_logprobs"] == [-2.0] and len(choice["logprobs"]["tokens"]) == 1
