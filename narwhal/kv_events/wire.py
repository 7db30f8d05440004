"""vLLM's KV event wire (placeholder: only the structs; the full module comes from the "feed" part)."""

from __future__ import annotations

import msgspec

BlockHash = int | bytes


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
