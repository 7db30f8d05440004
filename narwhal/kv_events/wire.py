"""vLLM's KV event wire (``--kv-events-config``), decoded with msgspec in every encoding vLLM versions have used.

A message is (topic, 8-byte big-endian sequence, msgpack batch). The batch is an array ``[ts, events]`` /
``[ts, events, dp_rank]`` (vLLM's ``EventBatch`` is array-like) or, from some publishers, a map. Events are
maps tagged ``type`` (vLLM today) or tagged arrays ``["BlockStored", ...]`` (older vLLM). Fields vLLM added
later (lora_name, extra_keys, group_idx, ...) are read when there and ignored when not; event types we do
not know are skipped, so a newer vLLM does not stop the feed.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from narwhal.errors import NarwhalError

__all__ = [
    "END_SEQ",
    "MAX_BATCH_BLOCKS",
    "MAX_BATCH_TOKENS",
    "MAX_BLOCK_SIZE",
    "MAX_EVENTS",
    "MAX_HASH_BYTES",
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "KvBatch",
    "KvEvent",
    "KvWireError",
    "decode_batch",
    "decode_seq",
    "encode_batch",
    "encode_seq",
]

END_SEQ = -1
"""The replay's end marker, sent as an 8-byte big-endian signed sequence with an empty payload."""

# Bounds on one batch. A vLLM batch is one scheduler step: thousands of blocks at most (a 1M-token prompt
# prefilled in one step is 1M tokens). Past these the batch is refused whole, so a hostile publisher
# cannot make one message cost more than these in decoded objects.
MAX_EVENTS = 65_536
MAX_BATCH_BLOCKS = 262_144
MAX_BATCH_TOKENS = 1 << 20
MAX_BLOCK_SIZE = 65_536
MAX_HASH_BYTES = 64  # vLLM's bytes hashes are 32-byte sha256 digests

BlockHash = int | bytes
"""vLLM's ExternalBlockHash: an unsigned 64-bit integer (up to 2**64-1) or bytes."""

_U64 = (1 << 64) - 1


class KvWireError(NarwhalError):
    """A KV event message that cannot be read: malformed, of the wrong shape, or past the bounds."""


class BlockStored(msgspec.Struct, frozen=True):
    """Blocks the engine cached: their hashes, the parent's hash, all their tokens in order, the block size."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None
    lora: bool = False
    extra_keys: bool = False


class BlockRemoved(msgspec.Struct, frozen=True):
    """Blocks the engine evicted."""

    block_hashes: list[BlockHash]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, frozen=True):
    """The engine dropped its whole prefix cache."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KvBatch(msgspec.Struct, frozen=True):
    """One published batch: its timestamp, events in order, and the data-parallel rank if given."""

    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None


# --- decoding -------------------------------------------------------------------------------------------

_Hash = int | Annotated[bytes, msgspec.Meta(max_length=MAX_HASH_BYTES)]
_Hashes = Annotated[list[_Hash], msgspec.Meta(max_length=MAX_BATCH_BLOCKS)]
_Tokens = Annotated[list[int], msgspec.Meta(max_length=MAX_BATCH_TOKENS)]
_Events = Annotated[list[msgspec.Raw], msgspec.Meta(max_length=MAX_EVENTS)]
_NIL = msgspec.Raw(b"\xc0")


class _ArrayBatch(msgspec.Struct, array_like=True):
    ts: float
    events: _Events
    data_parallel_rank: int | None = None


class _MapBatch(msgspec.Struct):
    ts: float
    events: _Events
    data_parallel_rank: int | None = None


class _ArrayTag(msgspec.Struct, array_like=True):
    type: str


class _MapTag(msgspec.Struct):
    type: str


# Stored/removed as vLLM wrote them. lora_id, lora_name and extra_keys are kept raw: only whether they
# are set matters, and a newer vLLM may change their types.
class _ArrayStored(msgspec.Struct, array_like=True):
    type: str
    block_hashes: _Hashes
    parent_block_hash: _Hash | None
    token_ids: _Tokens
    block_size: int
    lora_id: msgspec.Raw = _NIL
    medium: str | None = None
    lora_name: msgspec.Raw = _NIL
    extra_keys: msgspec.Raw = _NIL
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class _MapStored(msgspec.Struct):
    block_hashes: _Hashes
    token_ids: _Tokens
    block_size: int
    parent_block_hash: _Hash | None = None
    lora_id: msgspec.Raw = _NIL
    medium: str | None = None
    lora_name: msgspec.Raw = _NIL
    extra_keys: msgspec.Raw = _NIL
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class _ArrayRemoved(msgspec.Struct, array_like=True):
    type: str
    block_hashes: _Hashes
    medium: str | None = None
    group_idx: int | None = None


class _MapRemoved(msgspec.Struct):
    block_hashes: _Hashes
    medium: str | None = None
    group_idx: int | None = None


_DECODE_ARRAY_BATCH = msgspec.msgpack.Decoder(_ArrayBatch)
_DECODE_MAP_BATCH = msgspec.msgpack.Decoder(_MapBatch)
_DECODE_ARRAY_TAG = msgspec.msgpack.Decoder(_ArrayTag)
_DECODE_MAP_TAG = msgspec.msgpack.Decoder(_MapTag)
_DECODE_ARRAY_STORED = msgspec.msgpack.Decoder(_ArrayStored)
_DECODE_MAP_STORED = msgspec.msgpack.Decoder(_MapStored)
_DECODE_ARRAY_REMOVED = msgspec.msgpack.Decoder(_ArrayRemoved)
_DECODE_MAP_REMOVED = msgspec.msgpack.Decoder(_MapRemoved)
_DECODE_EXTRA_KEYS = msgspec.msgpack.Decoder(list[msgspec.Raw] | None)

# Kinds of KV cache group whose blocks are keyed by every token before them. A sliding-window or Mamba
# group drops leading blocks that the prompt still needs, so its events say nothing about a prefix hit.
_PREFIX_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})


def _is_array(payload: bytes | msgspec.Raw) -> bool | None:
    """True for a msgpack array, False for a map, None for anything else (by the first byte)."""
    view = memoryview(payload)
    if not view:
        return None
    first = view[0]
    if 0x90 <= first <= 0x9F or first in (0xDC, 0xDD):
        return True
    if 0x80 <= first <= 0x8F or first in (0xDE, 0xDF):
        return False
    return None


def _is_set(raw: msgspec.Raw) -> bool:
    return memoryview(raw) != b"\xc0"


def _has_extra_keys(raw: msgspec.Raw) -> bool:
    # vLLM sends one entry per block: None, or the block's extra keys (an empty tuple keys nothing).
    if memoryview(raw) in (b"\xc0", b"\x90"):
        return False
    entries = _DECODE_EXTRA_KEYS.decode(raw)
    return entries is not None and any(memoryview(entry) not in (b"\xc0", b"\x90") for entry in entries)


def _stored(ev: _ArrayStored | _MapStored) -> BlockStored | None:
    if ev.group_idx not in (None, 0) or (ev.kv_cache_spec_kind is not None
                                         and ev.kv_cache_spec_kind not in _PREFIX_KINDS):
        # Hybrid models publish one event per KV cache group; the first group is the one followed
        # (its removes are followed too, so the view stays consistent).
        return None
    if not 0 < ev.block_size <= MAX_BLOCK_SIZE:
        raise KvWireError(f"BlockStored with block_size {ev.block_size}")
    if len(ev.token_ids) != ev.block_size * len(ev.block_hashes):
        raise KvWireError(f"BlockStored with {len(ev.token_ids)} tokens for {len(ev.block_hashes)} blocks "
                          f"of {ev.block_size}")
    return BlockStored(ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size, ev.medium,
                       lora=_is_set(ev.lora_id) or _is_set(ev.lora_name), extra_keys=_has_extra_keys(ev.extra_keys))


def _event(raw: msgspec.Raw) -> KvEvent | None:
    shape = _is_array(raw)
    if shape is None:
        raise KvWireError("an event that is neither an array nor a map")
    tag = (_DECODE_ARRAY_TAG if shape else _DECODE_MAP_TAG).decode(raw).type
    if tag == "BlockStored":
        return _stored(_DECODE_ARRAY_STORED.decode(raw) if shape else _DECODE_MAP_STORED.decode(raw))
    if tag == "BlockRemoved":
        removed = _DECODE_ARRAY_REMOVED.decode(raw) if shape else _DECODE_MAP_REMOVED.decode(raw)
        if removed.group_idx not in (None, 0):
            return None
        return BlockRemoved(removed.block_hashes, removed.medium)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None  # a kind of event this router does not know: skipped, not an error


def decode_batch(payload: bytes) -> KvBatch:
    """The batch in ``payload``; KvWireError on anything unreadable or past the bounds."""
    shape = _is_array(payload)
    if shape is None:
        raise KvWireError("a batch that is neither an array nor a map")
    try:
        batch = _DECODE_ARRAY_BATCH.decode(payload) if shape else _DECODE_MAP_BATCH.decode(payload)
        events: list[KvEvent] = []
        blocks = tokens = 0
        for raw in batch.events:
            event = _event(raw)
            if event is None:
                continue
            if isinstance(event, BlockStored | BlockRemoved):
                blocks += len(event.block_hashes)
            if isinstance(event, BlockStored):
                tokens += len(event.token_ids)
            if blocks > MAX_BATCH_BLOCKS or tokens > MAX_BATCH_TOKENS:
                raise KvWireError(f"a batch past the bounds ({blocks} blocks, {tokens} tokens)")
            events.append(event)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise KvWireError(str(exc)) from None
    return KvBatch(batch.ts, events, batch.data_parallel_rank)


def decode_seq(frame: bytes) -> int:
    """A sequence frame (8-byte big-endian, signed so that END_SEQ reads as -1); KvWireError otherwise."""
    if len(frame) != 8:
        raise KvWireError(f"a sequence frame of {len(frame)} bytes")
    return int.from_bytes(frame, "big", signed=True)


def encode_seq(seq: int) -> bytes:
    """The 8-byte big-endian sequence frame vLLM sends (END_SEQ as -1)."""
    return seq.to_bytes(8, "big", signed=True)


# --- encoding (the mock engine and tests) ---------------------------------------------------------------


def _hash_out(value: BlockHash, hashes: Literal["int", "bytes"]) -> BlockHash:
    if hashes == "int":
        # As vLLM's maybe_convert_block_hash (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES): the low 64 bits.
        return value if isinstance(value, int) else int.from_bytes(value, "big") & _U64
    return value if isinstance(value, bytes) else (value & _U64 if value < 0 else value).to_bytes(32, "big")


def _event_out(event: KvEvent, arrays: bool, hashes: Literal["int", "bytes"]) -> Any:
    fields: dict[str, Any]
    if isinstance(event, BlockStored):
        fields = {
            "type": "BlockStored",
            "block_hashes": [_hash_out(h, hashes) for h in event.block_hashes],
            "parent_block_hash": None if event.parent_block_hash is None else _hash_out(event.parent_block_hash,
                                                                                        hashes),
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": 1 if event.lora else None,
            "medium": event.medium,
            "lora_name": "lora" if event.lora else None,
        }
        if arrays and not event.extra_keys and not event.lora:
            # Older vLLM's array_like BlockStored ended at medium (lora_name came later).
            del fields["lora_name"]
        if not arrays:
            # vLLM 0.32 as its CPU build sends them: one extra_keys entry per block (None: tokens alone key
            # it), and the KV cache group with its kind.
            fields["extra_keys"] = [["salt"] if event.extra_keys else None for _ in event.block_hashes]
            fields["group_idx"] = 0
            fields["kv_cache_spec_kind"] = "full_attention"
        elif event.extra_keys:
            fields["extra_keys"] = [["salt"] for _ in event.block_hashes]
    elif isinstance(event, BlockRemoved):
        fields = {"type": "BlockRemoved", "block_hashes": [_hash_out(h, hashes) for h in event.block_hashes],
                  "medium": event.medium}
        if not arrays:
            fields["group_idx"] = 0
    else:
        fields = {"type": "AllBlocksCleared"}
    return list(fields.values()) if arrays else fields


def encode_batch(batch: KvBatch, *, style: Literal["vllm", "array", "map"] = "vllm",
                 hashes: Literal["int", "bytes"] = "int") -> bytes:
    """msgpack bytes for ``batch``: "vllm" (array batch, events maps tagged "type"), "array" or "map" all through."""
    events = [_event_out(event, style == "array", hashes) for event in batch.events]
    if style == "map":
        body: Any = {"ts": batch.ts, "events": events, "data_parallel_rank": batch.data_parallel_rank}
    else:
        body = [batch.ts, events] if batch.data_parallel_rank is None else [batch.ts, events,
                                                                              batch.data_parallel_rank]
    return msgspec.msgpack.encode(body)
