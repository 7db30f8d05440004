"""A prompt as chained hashed blocks: the key cache-aware placement matches on.

Block ``i``'s hash covers blocks ``0..i`` (one running hash over the prompt,
read out after each block), so equal hashes mean equal prefixes, as in an
engine's prefix cache. Only whole blocks count: an engine caches whole blocks.

- Token-ID prompts (a list of ints): blocks of ``block_tokens`` ids.
- Text prompts: blocks of ``4 * block_tokens`` UTF-8 bytes (about four bytes a
  token), since the router does not tokenize.
- Chat: the whole conversation in order, every message's role and content,
  joined with separators that JSON text cannot contain unescaped, so a turn
  appended to a conversation extends its key and keeps the earlier blocks.

Hashes are blake2b, not Python's ``hash``: worker processes must agree on them.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import Any

import msgspec

__all__ = ["BYTES_PER_TOKEN", "MAX_BLOCKS", "chat_text", "prompt_blocks"]

# A text block is this many bytes per token of ``block_tokens``.
BYTES_PER_TOKEN = 4
# Hashing is bounded per request: prompts longer than this many blocks are keyed on their first blocks only.
MAX_BLOCKS = 1024

_encode = msgspec.json.Encoder().encode
_MESSAGE_END = b"\x1e"
_ROLE_END = b"\x1f"


def _chain(data: bytes | memoryview, size: int) -> list[int]:
    # One running hash over the prompt, read out after each block: block i's hash covers blocks 0..i.
    # (hashlib's digest() leaves the running hash as it was: no copy per block.)
    blocks: list[int] = []
    end = min(len(data) // size, MAX_BLOCKS) * size
    if not end:
        return blocks
    view = memoryview(data)
    hasher = hashlib.blake2b(digest_size=8)
    update, digest, from_bytes = hasher.update, hasher.digest, int.from_bytes
    for offset in range(0, end, size):
        update(view[offset:offset + size])
        blocks.append(from_bytes(digest(), "little"))
    return blocks


def chat_text(messages: Sequence[Any]) -> bytes:
    """Every message of a conversation, role and content, in order, as bytes."""
    parts: list[bytes] = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        content = message.get("content")
        parts.append(role.encode("utf-8", "replace") if isinstance(role, str) else _encode(role))
        parts.append(_ROLE_END)
        if isinstance(content, str):
            parts.append(content.encode("utf-8", "replace"))
        elif content is not None:
            # Multi-part content (text, images): its JSON, stable for the same client's same turn.
            parts.append(_encode(content))
        parts.append(_MESSAGE_END)
    return b"".join(parts)


def prompt_blocks(request: dict[str, Any], *, chat: bool, block_tokens: int) -> list[int]:
    """The request's prompt as chained block hashes (whole blocks only, at most ``MAX_BLOCKS``)."""
    if chat:
        messages = request.get("messages")
        return _chain(chat_text(messages), block_tokens * BYTES_PER_TOKEN) if isinstance(messages, list) else []
    prompt = request.get("prompt")
    if isinstance(prompt, str):
        return _chain(prompt.encode("utf-8", "replace"), block_tokens * BYTES_PER_TOKEN)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        try:
            ids = array("q", prompt)
        except OverflowError:
            return _chain(_encode(prompt), block_tokens * BYTES_PER_TOKEN)
        return _chain(ids.tobytes(), block_tokens * ids.itemsize)
    if prompt is None:
        return []
    # Any other shape the engine will judge; its JSON still groups equal prompts.
    return _chain(_encode(prompt), block_tokens * BYTES_PER_TOKEN)
