"""vLLM's KV event wire: the batch and event structs, and the encoder the mock engine and tests use.

A message is multipart (topic, 8-byte big-endian sequence, msgpack batch). Today's
vLLM sends the batch as an array ``[ts, events, data_parallel_rank]`` and each
event as a map tagged ``type`` with vLLM's field names; older versions sent events
as tagged arrays. (Minimal version written beside the mock engine; decoding is the
feed's.)
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

__all__ = ["END_SEQ", "AllBlocksCleared", "BlockHash", "BlockRemoved", "BlockStored", "KvBatch", "KvEvent",
           "encode_batch"]

BlockHash = int | bytes
END_SEQ = -1


class BlockStored(msgspec.Struct, frozen=True):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None
    lora: bool = False
    extra_keys: bool = False


class BlockRemoved(msgspec.Struct, frozen=True):
    block_hashes: list[BlockHash]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, frozen=True):
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KvBatch(msgspec.Struct, frozen=True):
    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()


def _hash(value: BlockHash, hashes: Literal["int", "bytes"]) -> BlockHash:
    # vLLM's ExternalBlockHash is the hash itself as bytes, or an unsigned 64-bit int of its last 8 bytes.
    if hashes == "int" and isinstance(value, bytes):
        return int.from_bytes(value[-8:], "big")
    if hashes == "bytes" and isinstance(value, int):
        return value.to_bytes(8, "big")
    return value


def _event_map(event: KvEvent, hashes: Literal["int", "bytes"]) -> dict[str, Any]:
    # vLLM 0.32's KVCacheEvent (tag=True, omit_defaults=True), fields as seen from its CPU build: lora_id,
    # medium, lora_name always sent; extra_keys one entry per block (None: tokens alone key it), group_idx and
    # kv_cache_spec_kind set by its scheduler.
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        return {"type": "BlockStored", "block_hashes": [_hash(h, hashes) for h in event.block_hashes],
                "parent_block_hash": None if parent is None else _hash(parent, hashes),
                "token_ids": event.token_ids, "block_size": event.block_size,
                "lora_id": 1 if event.lora else None, "medium": event.medium,
                "lora_name": "lora" if event.lora else None,
                "extra_keys": [("salt",) if event.extra_keys else None for _ in event.block_hashes],
                "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": [_hash(h, hashes) for h in event.block_hashes],
                "medium": event.medium, "group_idx": 0}
    return {"type": "AllBlocksCleared"}


def _event_array(event: KvEvent, hashes: Literal["int", "bytes"]) -> list[Any]:
    # Older vLLM (array_like events): the tag, then BlockStored(block_hashes, parent_block_hash, token_ids,
    # block_size, lora_id, medium), BlockRemoved(block_hashes, medium).
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        return ["BlockStored", [_hash(h, hashes) for h in event.block_hashes],
                None if parent is None else _hash(parent, hashes), event.token_ids, event.block_size,
                1 if event.lora else None, event.medium]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", [_hash(h, hashes) for h in event.block_hashes], event.medium]
    return ["AllBlocksCleared"]


def encode_batch(batch: KvBatch, *, style: Literal["vllm", "array", "map"] = "vllm",
                 hashes: Literal["int", "bytes"] = "int") -> bytes:
    """The msgpack payload of ``batch`` as a vLLM version would send it (see the module docstring)."""
    if style == "array":
        events: list[Any] = [_event_array(event, hashes) for event in batch.events]
    else:
        events = [_event_map(event, hashes) for event in batch.events]
    if style == "map":
        body: Any = {"ts": batch.ts, "events": events}
        if batch.data_parallel_rank is not None:
            body["data_parallel_rank"] = batch.data_parallel_rank
    else:
        # array_like with omit_defaults: a trailing None rank is left off, as vLLM does.
        body = [batch.ts, events] + ([] if batch.data_parallel_rank is None else [batch.data_parallel_rank])
    return _encoder.encode(body)
