"""vLLM's KV event wire: every encoding vLLM has used decodes to the same events; garbage and excess are refused."""

from __future__ import annotations

import msgspec
import pytest

from narwhal.kv_events.wire import (
    MAX_BATCH_TOKENS,
    MAX_EVENTS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvBatch,
    KvWireError,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
)

# Encoded by vLLM 0.32's own structs (vllm.distributed.kv_events.KVEventBatch, msgspec.msgpack.Encoder),
# in the real-vLLM venv: int hashes up to 2**64-1; then bytes hashes with extra_keys, a second (sliding
# window) KV cache group and group_idx/kv_cache_spec_kind, the fields newer vLLM adds.
VLLM_INT = bytes.fromhex(
    "93cb3ff80000000000009388a474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739201cfffffffffff"
    "ffffffb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa626c6f636b5f7369"
    "7a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c083a474797065ac426c6f636b52656d6f"
    "766564ac626c6f636b5f6861736865739101a66d656469756da347505581a474797065b0416c6c426c6f636b73436c656172"
    "6564c0"
)
VLLM_BYTES = bytes.fromhex(
    "93cb4000000000000000938ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391c4200101010101"
    "010101010101010101010101010101010101010101010101010101b1706172656e745f626c6f636b5f68617368c420020202"
    "0202020202020202020202020202020202020202020202020202020202a9746f6b656e5f69647392090aaa626c6f636b5f73"
    "697a6502a76c6f72615f6964c0a66d656469756dc0a96c6f72615f6e616d65c0aa65787472615f6b6579739191a473616c74"
    "a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e8aa4747970"
    "65ab426c6f636b53746f726564ac626c6f636b5f68617368657391c420030303030303030303030303030303030303030303"
    "0303030303030303030303b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647392090aaa626c6f636b5f"
    "73697a6502a76c6f72615f6964c0a66d656469756dc0a96c6f72615f6e616d65c0a967726f75705f69647801b26b765f6361"
    "6368655f737065635f6b696e64ae736c6964696e675f77696e646f7784a474797065ac426c6f636b52656d6f766564ac626c"
    "6f636b5f68617368657391c4200101010101010101010101010101010101010101010101010101010101010101a66d656469"
    "756dc0a967726f75705f6964780000"
)

U64_MAX = 2**64 - 1


def test_vllm_today_int_hashes() -> None:
    batch = decode_batch(VLLM_INT)
    assert batch.ts == 1.5
    assert batch.events == [
        BlockStored([1, U64_MAX], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, medium="GPU"),
        BlockRemoved([1], medium="GPU"),
        AllBlocksCleared(),
    ]


def test_vllm_today_bytes_hashes_extra_keys_and_groups() -> None:
    batch = decode_batch(VLLM_BYTES)
    assert batch.data_parallel_rank == 0
    # The sliding-window group's store is not followed: its blocks say nothing about a prefix.
    assert batch.events == [
        BlockStored([b"\x01" * 32], b"\x02" * 32, [9, 10], 2, extra_keys=True),
        BlockRemoved([b"\x01" * 32]),
    ]


# Older vLLM (0.9-0.10): events were tagged arrays (KVCacheEvent array_like=True, tag=True), before
# lora_name/extra_keys existed; the earliest had no medium either.
class _OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class _OldStored(_OldEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class _OldStoredMedium(_OldEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class _OldRemoved(_OldEvent, tag="BlockRemoved"):
    block_hashes: list[int]


class _OldCleared(_OldEvent, tag="AllBlocksCleared"):
    pass


class _OldBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[_OldStored | _OldRemoved | _OldCleared]


class _OldBatchMedium(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[_OldStoredMedium | _OldRemoved | _OldCleared]
    data_parallel_rank: int | None = None


def test_older_vllm_tagged_arrays() -> None:
    payload = msgspec.msgpack.encode(_OldBatch(3.0, [_OldStored([5, U64_MAX], 7, [1, 2, 3, 4], 2, None),
                                                      _OldRemoved([5]), _OldCleared()]))
    assert decode_batch(payload) == KvBatch(3.0, [BlockStored([5, U64_MAX], 7, [1, 2, 3, 4], 2),
                                                  BlockRemoved([5]), AllBlocksCleared()])
    payload = msgspec.msgpack.encode(_OldBatchMedium(3.0, [_OldStoredMedium([5], None, [1, 2], 2, 3, "CPU")], 1))
    assert decode_batch(payload) == KvBatch(3.0, [BlockStored([5], None, [1, 2], 2, medium="CPU", lora=True)], 1)


def test_map_batch_and_map_events_with_unknown_fields() -> None:
    payload = msgspec.msgpack.encode({
        "ts": 4.0, "future_field": {"x": 1}, "data_parallel_rank": 2,
        "events": [
            {"block_size": 2, "type": "BlockStored", "block_hashes": [1], "token_ids": [3, 4],
             "parent_block_hash": None, "brand_new": [1, 2, 3]},
            {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "later": "x"},
        ]})
    assert decode_batch(payload) == KvBatch(4.0, [BlockStored([1], None, [3, 4], 2),
                                                  BlockRemoved([1], medium="GPU")], 2)


def test_trailing_fields_in_arrays_are_ignored() -> None:
    payload = msgspec.msgpack.encode([5.0, [["BlockStored", [1], None, [3, 4], 2, None, "GPU", None, None, 0,
                                             "full_attention", None, "LOCAL", "x", "s", "more", 1],
                                            ["BlockRemoved", [1], None, 0, "LOCAL", None, "more"],
                                            ["AllBlocksCleared", "more"]], 0, "trailing"])
    assert decode_batch(payload) == KvBatch(5.0, [BlockStored([1], None, [3, 4], 2, medium="GPU"),
                                                  BlockRemoved([1]), AllBlocksCleared()], 0)


def test_unknown_event_types_are_skipped() -> None:
    payload = msgspec.msgpack.encode([6.0, [{"type": "BlockPinned", "block_hashes": [1]},
                                            ["SomethingNew", 1, 2], {"type": "AllBlocksCleared"}]])
    assert decode_batch(payload).events == [AllBlocksCleared()]


@pytest.mark.parametrize("style", ["vllm", "array", "map"])
@pytest.mark.parametrize("hashes", ["int", "bytes"])
def test_encode_round_trips(style, hashes) -> None:
    batch = KvBatch(7.25, [BlockStored([0, U64_MAX], 12, [1, 2, 3, 4], 2, medium="GPU", lora=True, extra_keys=True),
                           BlockStored([9], None, [5, 6], 2),
                           BlockRemoved([U64_MAX], medium=None), AllBlocksCleared()], data_parallel_rank=1)
    decoded = decode_batch(encode_batch(batch, style=style, hashes=hashes))
    if hashes == "int":
        assert decoded == batch
    else:
        first, second, removed, cleared = decoded.events
        assert isinstance(first, BlockStored) and isinstance(removed, BlockRemoved)
        assert first.block_hashes == [(0).to_bytes(32, "big"), U64_MAX.to_bytes(32, "big")]
        assert first.parent_block_hash == (12).to_bytes(32, "big")
        assert removed.block_hashes == [U64_MAX.to_bytes(32, "big")]
        assert (first.lora, first.extra_keys, first.medium) == (True, True, "GPU")


def test_vllm_style_is_what_vllm_sends() -> None:
    batch = KvBatch(1.5, [BlockStored([1, U64_MAX], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, medium="GPU"),
                          BlockRemoved([1], medium="GPU"), AllBlocksCleared()])
    # As vLLM 0.32's CPU build publishes at run time (its scheduler sets extra_keys, one None per block,
    # group_idx and kv_cache_spec_kind, which the structs above leave at their defaults): the same fields in
    # vLLM's order; it reads back as the batch.
    encoded = msgspec.msgpack.decode(encode_batch(batch))
    stored, removed, cleared = encoded[1]
    assert list(stored) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                            "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"]
    assert stored["extra_keys"] == [None, None] and stored["kv_cache_spec_kind"] == "full_attention"
    assert list(removed) == ["type", "block_hashes", "medium", "group_idx"] and cleared == {"type": "AllBlocksCleared"}
    vllm_fields = msgspec.msgpack.decode(VLLM_INT)[1][0]
    assert list(vllm_fields) == list(stored)[:len(vllm_fields)]
    assert decode_batch(encode_batch(batch)) == batch


def test_hashes_of_the_wrong_type_or_too_long() -> None:
    # msgpack has no integer past 2**64-1: the largest hash vLLM can send is read whole.
    assert decode_batch(msgspec.msgpack.encode([1.0, [["BlockRemoved", [U64_MAX]]]])).events == [
        BlockRemoved([U64_MAX])]
    # Older vLLM hashed with Python's hash(), which can be negative: read as it is, a key like any other.
    assert decode_batch(msgspec.msgpack.encode([1.0, [["BlockRemoved", [-5]]]])).events == [BlockRemoved([-5])]
    for bad in ("abc", 1.5, [1], {"a": 1}, b"x" * 65):
        with pytest.raises(KvWireError):
            decode_batch(msgspec.msgpack.encode([1.0, [["BlockRemoved", [bad]]]]))


@pytest.mark.parametrize("payload", [
    b"", b"\xc1", b"\x00", b"garbage", b"\x92\xcb", msgspec.msgpack.encode([1.0]),
    msgspec.msgpack.encode(["ts", []]), msgspec.msgpack.encode([1.0, [1]]), msgspec.msgpack.encode([1.0, [[1]]]),
    msgspec.msgpack.encode([1.0, [{"no": "type"}]]), msgspec.msgpack.encode({"events": []}),
    msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1, 2, 3], 2]]]),  # 3 tokens for one block of 2
    msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [], 0]]]),
    msgspec.msgpack.encode([1.0, [["BlockStored", [1]]]]),
    msgspec.msgpack.encode([1.0, []]) + b"\x00",
])
def test_garbage_raises_kv_wire_error(payload) -> None:
    with pytest.raises(KvWireError):
        decode_batch(payload)


def test_over_bound_batches_raise() -> None:
    with pytest.raises(KvWireError):
        decode_batch(msgspec.msgpack.encode([1.0, [["AllBlocksCleared"]] * (MAX_EVENTS + 1)]))
    # Each event in bounds, the batch past them.
    per_event = MAX_BATCH_TOKENS // 4
    stored = ["BlockStored", list(range(per_event // 16)), None, [1] * per_event, 16]
    with pytest.raises(KvWireError):
        decode_batch(msgspec.msgpack.encode([1.0, [stored] * 5]))
    assert len(decode_batch(msgspec.msgpack.encode([1.0, [stored] * 4])).events) == 4
    with pytest.raises(KvWireError):
        decode_batch(msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1] * 2**17, 2**17]]]))


def test_sequence_frames() -> None:
    assert decode_seq((5).to_bytes(8, "big")) == 5
    assert decode_seq(encode_seq(-1)) == -1
    assert encode_seq(-1) == (-1).to_bytes(8, "big", signed=True)
    with pytest.raises(KvWireError):
        decode_seq(b"\x00" * 4)
