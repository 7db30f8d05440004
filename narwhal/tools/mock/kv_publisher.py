"""The mock engine's KV event publisher: what its prefix cache stores and evicts, on the wire as vLLM sends it.

As vLLM's ``ZmqEventPublisher``: a PUB socket sends each batch as (topic, 8-byte
big-endian sequence from 0, msgpack batch), and a ROUTER socket answers a replay
request (an 8-byte big-endian ``start_seq``) with every buffered batch from that
sequence on, then (b"", -1 as 8-byte big-endian signed, b""). The replay buffer
keeps the last ``buffer_steps`` batches. One batch per prefill (vLLM publishes
once per scheduler step), removals before stores, as vLLM frees before it fills.

Block hashes are the mock cache's own (sha256, chained): the router must match on
token ids, whatever hash the engine uses. ``hashes="int"`` sends them as vLLM's
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` does (the digest's last 8 bytes, an
unsigned 64-bit int); ``"bytes"`` as the 32-byte digest.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import Literal

import msgspec
import trio
import zmq

from narwhal.kv_events.wire import (
    END_SEQ,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KvBatch,
    KvEvent,
    encode_batch,
)
from narwhal.kv_events.zmq_trio import TrioSocket
from narwhal.wire import KvEventsIdentity

__all__ = ["KvEventsSettings", "KvPublisher"]

# vLLM's defaults: --kv-events-config buffer_steps and hwm.
BUFFER_STEPS = 10_000
_HWM = 100_000
_END = END_SEQ.to_bytes(8, "big", signed=True)


class KvEventsSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Where and how the mock publishes; port 0 picks one."""

    port: int
    replay_port: int | None = None
    topic: str = ""
    encoding: Literal["vllm", "array", "map"] = "vllm"
    hashes: Literal["int", "bytes"] = "int"
    buffer_steps: int = BUFFER_STEPS


class KvPublisher:
    """A ``CacheListener`` that gathers one prefill's events and publishes them as one batch on ``flush``."""

    def __init__(self, settings: KvEventsSettings, host: str, *,
                 clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.host = host
        self.port = settings.port
        self.replay_port = settings.replay_port
        self._clock = clock
        self._pending: list[KvEvent] = []
        self._seq = itertools.count()
        # (sequence, payload): what a replay can still give.
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=settings.buffer_steps)
        self._topic = settings.topic.encode()
        self._pub: TrioSocket | None = None
        self._replay: TrioSocket | None = None
        self.published = 0
        self.dropped = 0

    # ----- the cache's listener -------------------------------------------------------

    def _wire_hash(self, digest: bytes) -> BlockHash:
        return int.from_bytes(digest[-8:], "big") if self.settings.hashes == "int" else digest

    def stored(self, hashes: list[bytes], parent: bytes | None, tokens: list[int], block_size: int) -> None:
        self._pending.append(BlockStored(
            block_hashes=[self._wire_hash(h) for h in hashes],
            parent_block_hash=None if parent is None else self._wire_hash(parent),
            token_ids=tokens, block_size=block_size, medium="GPU"))

    def removed(self, hashes: list[bytes]) -> None:
        self._pending.append(BlockRemoved(block_hashes=[self._wire_hash(h) for h in hashes], medium="GPU"))

    def cleared(self) -> None:
        self._pending.append(AllBlocksCleared())

    # ----- publishing ------------------------------------------------------------------

    def flush(self) -> None:
        """Publish what was gathered since the last flush as one batch (nothing if nothing happened)."""
        if not self._pending:
            return
        batch = KvBatch(ts=self._clock(), events=self._pending, data_parallel_rank=0)
        self._pending = []
        payload = encode_batch(batch, style=self.settings.encoding, hashes=self.settings.hashes)
        seq = next(self._seq)
        self._buffer.append((seq, payload))
        # Like vLLM's PUB past its high-water mark, a batch nobody can take now is lost (replay still has it).
        if self._pub is not None and self._pub.send_multipart_nowait((self._topic, seq.to_bytes(8, "big"), payload)):
            self.published += 1
        else:
            self.dropped += 1

    def identity(self) -> KvEventsIdentity:
        """vLLM's KVEventsConfig names as an operator would pass them: a wildcard host, the bound ports."""
        return KvEventsIdentity(
            endpoint=f"tcp://*:{self.port}",
            replay_endpoint=None if self.replay_port is None else f"tcp://*:{self.replay_port}",
            topic=self.settings.topic)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Bind the sockets, report once bound, then answer replay requests until cancelled."""
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        pub = TrioSocket.open(context, zmq.PUB)
        replay: TrioSocket | None = None
        try:
            pub.socket.setsockopt(zmq.SNDHWM, _HWM)
            self.port = _bind(pub, self.host, self.settings.port)
            if self.settings.replay_port is not None:
                replay = TrioSocket.open(context, zmq.ROUTER)
                self.replay_port = _bind(replay, self.host, self.settings.replay_port)
            self._pub, self._replay = pub, replay
            task_status.started()
            if replay is None:
                await trio.sleep_forever()
            while True:
                await self._serve_replay(replay, await replay.recv_multipart())
        finally:
            self._pub = self._replay = None
            pub.close()
            if replay is not None:
                replay.close()

    async def _serve_replay(self, replay: TrioSocket, frames: list[bytes]) -> None:
        # vLLM's protocol: (client id, b"", start_seq); anything else is ignored, as vLLM logs and ignores it.
        if len(frames) != 3:
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                await replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        await replay.send_multipart((client, b"", b"", _END, b""))


def _bind(socket: TrioSocket, host: str, port: int) -> int:
    """Bind to ``host:port`` (0: any free port) and return the bound port."""
    address = f"[{host}]" if ":" in host else host
    if ":" in host:
        socket.socket.setsockopt(zmq.IPV6, 1)
    try:
        if port:
            socket.socket.bind(f"tcp://{address}:{port}")
            return port
        bound: int = socket.socket.bind_to_random_port(f"tcp://{address}")
    except zmq.ZMQError as exc:
        # An OSError, so the CLI says "cannot listen" in one line, as for its HTTP port.
        raise OSError(exc.errno, f"KV events port {port}: {exc.strerror}") from None
    return bound
