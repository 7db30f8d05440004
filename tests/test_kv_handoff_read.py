"""A prefill answer's kv_transfer_params as the router reads it: the engine's own bytes, checked and bounded."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from narwhal.wire import MAX_HANDOFF_DEPTH, HandoffRejected, extract_handoff, read_handoff

KV_JSON = (b'{"remote_port": 9001,  "tp_size": 1, "remote_block_ids": [3, [4, 5]], "remote_engine_id": "p1",\n'
           b' "remote_host": "10.0.0.1", "do_remote_prefill": true, "scale": 1.50, "remote_request_id": "r-\\u00e9"}')


def answer(kv: bytes) -> bytes:
    return b'{"id": "cmpl-1", "choices": [{"text": "a", "logprobs": null}], "kv_transfer_params": ' + kv + b"}"


def nested(levels: int) -> Any:
    value: Any = 1
    for i in range(levels):
        value = {"n": value} if i % 2 else [value]
    return value


def kv_with(**extra: Any) -> bytes:
    base = {"remote_engine_id": "p1", "remote_block_ids": [1], "remote_host": "h", "remote_port": 1}
    return msgspec.json.encode({**base, **extra})


def test_the_handoff_is_the_engines_own_bytes_key_order_spacing_numbers_and_escapes_kept():
    kv = read_handoff(answer(KV_JSON))
    assert isinstance(kv, msgspec.Raw)
    assert bytes(kv) == KV_JSON
    # What the decode is sent: the same bytes inside the body, not a re-encoding of them.
    assert msgspec.json.encode({"prompt": "x", "kv_transfer_params": kv}) == b'{"prompt":"x","kv_transfer_params":' \
        + KV_JSON + b"}"


@pytest.mark.parametrize("levels", [MAX_HANDOFF_DEPTH - 1, MAX_HANDOFF_DEPTH])
def test_an_extra_key_may_nest_up_to_the_bound_counting_the_handoff_itself(levels):
    # The handoff object is level 1: an extra value nesting `levels - 1` more stays within `levels`.
    raw = answer(kv_with(extra=nested(levels - 1)))
    assert msgspec.json.decode(read_handoff(raw))["extra"] == nested(levels - 1)


@pytest.mark.parametrize("levels", [MAX_HANDOFF_DEPTH + 1, 40])
def test_an_extra_key_nesting_past_the_bound_is_rejected(levels):
    with pytest.raises(HandoffRejected, match=f"nests deeper than {MAX_HANDOFF_DEPTH} levels"):
        read_handoff(answer(kv_with(extra=nested(levels - 1))))


def test_many_brackets_that_do_not_nest_are_no_depth():
    # Brackets in strings and side by side: counted by the quick look, cleared by the full one.
    raw = answer(kv_with(extra="[" * 40 + "{" * 40, flat=[[1], [2], [3], [4]] * 10))
    assert msgspec.json.decode(read_handoff(raw))["extra"] == "[" * 40 + "{" * 40


def test_a_deep_typed_field_is_the_types_problem():
    with pytest.raises(HandoffRejected, match=r"kv_transfer_params: .*remote_block_ids"):
        read_handoff(answer(kv_with(remote_block_ids=[[[1]]])))


@pytest.mark.parametrize(("raw", "message"), [
    (b"not json", "is not JSON"),
    (b'{"kv_transfer_params": {"remote_port": 1', "is not JSON"),
    (b"[1, 2]", "carries no kv_transfer_params object"),
    (b'{"choices": []}', "carries no kv_transfer_params object"),
    (b'{"kv_transfer_params": null}', "carries no kv_transfer_params object"),
    (b'{"kv_transfer_params": [1]}', "carries no kv_transfer_params object"),
    (b'{"kv_transfer_params": "x"}', "carries no kv_transfer_params object"),
    (b'{"kv_transfer_params": {"remote_engine_id": "e"}}', "kv_transfer_params: Object missing required field"),
    (answer(kv_with(remote_port="1")), r"kv_transfer_params: Expected `int`, got `str` - at `\$.remote_port`"),
    (answer(kv_with(note="\xff").replace(b"\xc3\xbf", b"\xff")), "not valid UTF-8"),
    (b'{"kv_transfer_params": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests too deep"),
])
def test_what_is_no_handoff_says_why(raw, message):
    with pytest.raises(HandoffRejected, match=message):
        read_handoff(raw)
    assert extract_handoff(raw) is None


def test_invalid_utf8_elsewhere_in_the_answer_is_not_the_handoffs():
    # Only the handoff is forwarded; the rest of the answer is skipped unread.
    raw = answer(KV_JSON).replace(b'"a"', b'"\xff"')
    assert bytes(read_handoff(raw)) == KV_JSON


def test_the_size_bound_counts_the_bytes_forwarded():
    kv = kv_with(pad="p" * 1000)
    assert bytes(read_handoff(answer(kv), max_bytes=len(kv))) == kv
    with pytest.raises(HandoffRejected, match=f"is {len(kv)} bytes, over the {len(kv) - 1} byte bound"):
        read_handoff(answer(kv), max_bytes=len(kv) - 1)
    # Whitespace the engine sent is forwarded, so it counts.
    spaced = kv.replace(b",", b",    ")
    with pytest.raises(HandoffRejected, match="over the"):
        read_handoff(answer(spaced), max_bytes=len(kv))
