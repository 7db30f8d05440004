"""Event rewriting and lazy parsing, alone: what the client never sees of an engine's events, and the
first leg's events kept unread and counted without reading them."""

from __future__ import annotations

import json

import pytest

from narwhal.serving.continuation import events
from narwhal.serving.continuation.events import EngineErrorEvent
from narwhal.serving.continuation.lazy import FirstLeg


def test_the_compact_token_id_lists_are_stripped_and_counted():
    data = (b'data: {"id":"a","prompt_token_ids":[1,2],"choices":[{"text":"x","token_ids":[7,8]}]}\n\n'
            b'data: {"id":"a","choices":[{"text":"","token_ids":[]}]}\n\n'
            b'data: {"id":"a","choices":[{"text":"y","token_ids":null}]}\n\n')
    stripped, lists, ids = events.strip_compact_ids(data)
    assert b"token_ids" not in stripped and (lists, ids) == (2, 2)
    assert json.loads(stripped.split(b"\n\n")[0][6:]) == {"id": "a", "choices": [{"text": "x"}]}
    assert events.strip_compact_ids(b'data: {"choices":[]}\n\n') == (b'data: {"choices":[]}\n\n', 0, 0)


def test_an_error_event_raises_in_either_shape_and_text_about_errors_does_not():
    with pytest.raises(EngineErrorEvent, match="engine core died"):
        events.raise_error_events(b'data: {"error": {"message": "engine core died"}}\n\n')
    with pytest.raises(EngineErrorEvent, match="old"):
        events.raise_error_events(b'data: {"id":"a"}\n\ndata: {"object":"error","message":"old"}\n\n')
    events.raise_error_events(b'data: {"choices":[{"text":"\\"error\\": no"}]}\n\n')


def test_the_head_is_the_first_readable_events():
    assert events.read_head(b': hi\n\ndata: nope\n\ndata: {"id":"a","created":3}\n\n') == ("a", 3)
    assert events.read_head(b": hi\n\n") is None


def test_logprobs_of_tokens_the_client_has_are_dropped():
    choice = {"logprobs": {"tokens": ["a", "b"], "token_logprobs": [0, 1], "text_offset": [0, 1],
                           "top_logprobs": None}}
    events.drop_logprobs(choice, 1)
    assert choice["logprobs"] == {"tokens": ["b"], "token_logprobs": [1], "text_offset": [1], "top_logprobs": None}


def test_a_usage_event_is_a_chunk_without_choices():
    out = events.usage_event("a", 3, "m", True, {"prompt_tokens": 1})
    assert out.endswith(b"\n\n") and json.loads(out[6:]) == {
        "id": "a", "object": "chat.completion.chunk", "created": 3, "model": "m", "choices": [],
        "usage": {"prompt_tokens": 1}}


def test_the_first_leg_relays_its_events_less_narwhals_additions_and_keeps_them_unread():
    first = FirstLeg(client_ids=False, chat=False)
    raw = (b'data: {"id":"a","choices":[{"text":" [DONE]","token_ids":[9,10]}],'
           b'"kv_transfer_params":{"remote_block_ids":[1]}}\n\ndata: [DONE]\n\n')
    out, done = first.take(raw)
    assert done and out == b'data: {"id":"a","choices":[{"text":" [DONE]"}]}\n\n'
    # Counted without reading: the KV field made this read's count come from the events themselves.
    assert first.tokens() == 2
    assert first.drain() == raw[:raw.index(b"data: [DONE]")] and first.raw == [] and first.tokens() == 0


def test_the_first_leg_counts_ids_as_it_strips_them_and_text_events_without_ids():
    first = FirstLeg(client_ids=False, chat=True)
    first.take(b'data: {"choices":[{"delta":{"content":"a"},"token_ids":[1,2,3]}]}\n\n')
    assert first.tokens() == 3
    no_ids = FirstLeg(client_ids=False, chat=True)
    no_ids.take(b'data: {"choices":[{"delta":{"content":"ab"}}]}\n\ndata: {"choices":[{"delta":{"content":""}}]}\n\n')
    assert no_ids.tokens() == 1


def test_the_first_leg_relays_the_ids_the_client_asked_for_and_raises_an_error_event():
    asked = FirstLeg(client_ids=True, chat=False)
    raw = b'data: {"choices":[{"text":"a","token_ids":[1]}]}\n\n'
    assert asked.take(raw) == (raw, False) and asked.tokens() == 1
    with pytest.raises(EngineErrorEvent):
        asked.take(b'data: {"error": {"message": "boom"}}\n\n')


def test_the_first_leg_is_due_for_reading_past_its_bound(monkeypatch):
    monkeypatch.setattr("narwhal.serving.continuation.lazy._FOLD_BYTES", 100)
    first = FirstLeg(client_ids=False, chat=False)
    event = b'data: {"choices":[{"text":"a","token_ids":[1]}]}\n\n'
    first.take(event)
    assert not first.full
    first.take(event * 2)
    assert first.full
    first.drain()
    assert not first.full and first.size == 0
