"""The mock engine's KV events: its prefix cache's stores and evictions on vLLM's wire, and vLLM's replay.

vLLM's own msgspec classes are not importable here (vLLM lives in the real tier's
venv), so payloads are decoded generically and checked against vLLM's field names
and shapes (vllm/distributed/kv_events.py, 0.32: the batch an array
``[ts, events, data_parallel_rank]``, events maps tagged ``type``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import pytest
import trio
import zmq

from narwhal.kv_events.zmq_trio import TrioSocket
from narwhal.tools.mock.engine import MockService, MockSettings, serve_mock, tokenize
from narwhal.tools.mock.kv_publisher import KvEventsSettings
from narwhal.tools.mock.prefix_cache import PrefixCache, block_hash

END = (-1).to_bytes(8, "big", signed=True)
# What vLLM 0.32's CPU build sends (seen from a real engine with --kv-events-config).
STORED_FIELDS = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                 "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"}
PREFILL_KV = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}
decode = msgspec.msgpack.Decoder().decode


def words(prefix: str, n: int) -> str:
    return " ".join(f"{prefix}{i}" for i in range(n))


# ----- the prefix cache reports what it stored and evicted ---------------------------------------

class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def stored(self, hashes: list[bytes], parent: bytes | None, tokens: list[int], block_size: int) -> None:
        self.events.append(("stored", hashes, parent, tokens, block_size))

    def removed(self, hashes: list[bytes]) -> None:
        self.events.append(("removed", hashes))

    def cleared(self) -> None:
        self.events.append(("cleared",))


def test_the_cache_reports_stored_blocks_with_its_own_chained_hashes_and_evicts_tails_first() -> None:
    recorder = Recorder()
    cache = PrefixCache(capacity_blocks=4, block_tokens=4, listener=recorder)
    a = list(range(14))  # 3 whole blocks and 2 tokens
    cache.prefill(a)
    h0 = block_hash(None, a[0:4])
    h1, h2 = block_hash(h0, a[4:8]), block_hash(block_hash(h0, a[4:8]), a[8:12])
    assert recorder.events == [("stored", [h0, h1, h2], None, a[:12], 4)]
    assert len(h0) == 32 and h0 != block_hash(None, a[1:5])
    # The same prompt again stores nothing; one more block stores it alone, chained to its parent.
    recorder.events.clear()
    cache.prefill(a)
    cache.prefill(a[:12] + [50, 51, 52, 53])
    h3 = block_hash(h2, [50, 51, 52, 53])
    assert recorder.events == [("stored", [h3], h2, [50, 51, 52, 53], 4)]
    # Full (4 of 4): a new 2-block prompt evicts the oldest blocks, the tails, before it is stored.
    recorder.events.clear()
    b = [90, 91, 92, 93, 94, 95, 96, 97]
    assert cache.prefill(b) == 0
    b0 = block_hash(None, b[:4])
    assert recorder.events == [("removed", [h3, h2]), ("stored", [b0, block_hash(b0, b[4:])], None, b, 4)]
    assert cache.prefill(a) == 8  # its prefix outlived its tail
    recorder.events.clear()
    cache.clear()
    assert recorder.events == [("cleared",)] and cache.describe()["blocks"] == 0


def test_a_prompt_longer_than_the_cache_keeps_its_first_blocks() -> None:
    recorder = Recorder()
    cache = PrefixCache(capacity_blocks=2, block_tokens=2, listener=recorder)
    cache.prefill(list(range(10)))
    h0 = block_hash(None, [0, 1])
    assert recorder.events == [("stored", [h0, block_hash(h0, [2, 3])], None, [0, 1, 2, 3], 2)]
    assert cache.prefill(list(range(10))) == 4


# ----- an engine served in-process, a pyzmq SUB and DEALER against it ----------------------------

class Feed:
    """A SUB on the engine's publisher and a DEALER on its replay socket."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], pub_port: int, replay_port: int) -> None:
        self.sub = TrioSocket.open(context, zmq.SUB)
        self.sub.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.socket.connect(f"tcp://127.0.0.1:{pub_port}")
        self.dealer = TrioSocket.open(context, zmq.DEALER)
        self.dealer.socket.connect(f"tcp://127.0.0.1:{replay_port}")

    async def next(self) -> tuple[bytes, int, Any, bytes]:
        with trio.fail_after(5):
            topic, seq, payload = await self.sub.recv_multipart()
        return topic, int.from_bytes(seq, "big"), decode(payload), payload

    async def replay(self, start_seq: int) -> list[list[bytes]]:
        await self.dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        frames: list[list[bytes]] = []
        with trio.fail_after(5):
            while True:
                message = await self.dealer.recv_multipart()
                frames.append(message)
                if message[2] == END:
                    return frames

    def close(self) -> None:
        self.sub.close()
        self.dealer.close()


@pytest.fixture
async def publishing(nursery: trio.Nursery) -> AsyncIterator[tuple[MockService, httpx.AsyncClient, Feed]]:
    settings = MockSettings(role="prefill", engine_id="p1", prefix_cache_blocks=4,
                            kv_events=KvEventsSettings(port=0, replay_port=0, topic="kv", buffer_steps=3))
    service = await nursery.start(serve_mock, settings)
    publisher = service.engine.kv_publisher
    assert publisher is not None
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    feed = Feed(context, publisher.port, publisher.replay_port or 0)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.engine.port}", timeout=5) as client:
        # A SUB misses what is published before its subscription arrives: clear (an empty cache) until it hears.
        with trio.fail_after(10):
            while True:
                assert (await client.post("/reset_prefix_cache")).json() == {"success": True}
                with trio.move_on_after(0.2):
                    await feed.sub.recv_multipart()
                    break
        while feed.sub.try_recv_multipart() is not None:
            pass
        yield service, client, feed
    feed.close()
    context.destroy(linger=0)
    service.stop(0)


async def prefill(client: httpx.AsyncClient, prompt: str) -> None:
    body = {"model": "mock-model", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": PREFILL_KV}
    assert (await client.post("/v1/completions", json=body)).status_code == 200


async def test_stored_and_removed_events_follow_prompts_and_eviction_on_vllms_wire(publishing: Any) -> None:
    service, client, feed = publishing
    a = words("a", 40)  # 2 whole 16-token blocks
    await prefill(client, a)
    topic, seq, batch, _ = await feed.next()
    assert topic == b"kv"
    ts, events, rank = batch
    assert isinstance(ts, float) and rank == 0
    [stored] = events
    assert set(stored) == STORED_FIELDS and stored["type"] == "BlockStored"
    assert stored["token_ids"] == tokenize(a)[:32] and stored["block_size"] == 16
    assert stored["parent_block_hash"] is None and stored["medium"] == "GPU"
    assert stored["lora_id"] is None and stored["lora_name"] is None and stored["extra_keys"] == [None, None]
    assert stored["group_idx"] == 0 and stored["kv_cache_spec_kind"] == "full_attention"
    a0, a1 = stored["block_hashes"]
    # vLLM's int hashes: unsigned 64-bit, here the digest's last 8 bytes (the mock's own hash, not the router's).
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in (a0, a1))
    assert a0 == int.from_bytes(block_hash(None, tokenize(a)[:16])[-8:], "big")

    # A longer prompt with the same start stores one block, its parent the last one held.
    await prefill(client, a + " " + words("x", 10))
    _, seq2, (_, [more], _), _ = await feed.next()
    assert seq2 == seq + 1 and more["parent_block_hash"] == a1 and len(more["block_hashes"]) == 1
    a2 = more["block_hashes"][0]
    assert more["token_ids"] == tokenize(a + " " + words("x", 10))[32:48]

    # The cache holds 4 blocks: 2 more evict the oldest (the tails), removed before the new blocks are stored.
    await prefill(client, words("b", 32))
    _, _, (_, [removed, stored_b], _), _ = await feed.next()
    assert removed == {"type": "BlockRemoved", "block_hashes": [a2], "medium": "GPU", "group_idx": 0}
    assert stored_b["type"] == "BlockStored" and len(stored_b["block_hashes"]) == 2
    assert (await client.get("/mock/stats")).json()["prefix_cache"]["blocks"] == 4

    # /reset_prefix_cache (vLLM's route): AllBlocksCleared.
    assert (await client.post("/reset_prefix_cache")).json() == {"success": True}
    _, last, (_, cleared, _), _ = await feed.next()
    assert cleared == [{"type": "AllBlocksCleared"}]
    assert (await client.get("/mock/stats")).json()["prefix_cache"]["blocks"] == 0


async def test_replay_answers_the_batches_since_start_seq_then_the_end_marker(publishing: Any) -> None:
    service, client, feed = publishing
    seen = []
    for i in range(4):
        await prefill(client, words(f"r{i}-", 20))
        seen.append(await feed.next())
    first, last = seen[0][1], seen[-1][1]
    replayed = await feed.replay(last - 1)
    # DEALER frames: b"" (the ROUTER's delimiter), then topic, sequence, payload; the end is (b"", -1, b"").
    assert replayed == [[b"", b"kv", (last - 1).to_bytes(8, "big"), seen[-2][3]],
                        [b"", b"kv", last.to_bytes(8, "big"), seen[-1][3]], [b"", b"", END, b""]]
    # The buffer holds the last 3 batches: an older start gets what is left, the first sequence past it.
    replayed = await feed.replay(first)
    assert [int.from_bytes(m[2], "big", signed=True) for m in replayed] == [last - 2, last - 1, last, -1]
    # Nothing since: only the end marker.
    assert await feed.replay(last + 1) == [[b"", b"", END, b""]]
    # A malformed request (no delimiter frame) is ignored, as vLLM ignores it; the next one is answered.
    await feed.dealer.send_multipart([(0).to_bytes(8, "big")])
    assert (await feed.replay(last))[-1] == [b"", b"", END, b""]


async def test_identity_and_stats_name_the_publisher(publishing: Any) -> None:
    service, client, _ = publishing
    publisher = service.engine.kv_publisher
    identity = (await client.get("/narwhal/identity")).json()
    assert identity["kv_events"] == {"endpoint": f"tcp://*:{publisher.port}",
                                     "replay_endpoint": f"tcp://*:{publisher.replay_port}", "topic": "kv"}
    stats = (await client.get("/mock/stats")).json()
    assert stats["kv_events"]["endpoint"] == identity["kv_events"]["endpoint"]
    assert stats["prefix_cache"]["capacity_blocks"] == 4


# ----- the CLI: encodings of older vLLM versions, bytes hashes, a process ---------------------------

@pytest.mark.parametrize(("encoding", "hashes"), [("array", "bytes"), ("map", "int"), ("vllm", "bytes")])
def test_the_process_publishes_in_the_encoding_and_hash_asked_for(encoding: str, hashes: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    command = [sys.executable, "-m", "narwhal.tools.mock", "--role", "prefill", "--port", "0", "--cache-blocks", "8",
               "--kv-events", "0", "--kv-events-replay", "0", "--kv-events-encoding", encoding,
               "--kv-events-hash", hashes]
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True) as process:
        assert process.stdout is not None and process.stderr is not None
        try:
            ready = json.loads(process.stdout.readline())
            endpoint = ready["kv_events"]["endpoint"]
            assert endpoint.startswith("tcp://*:") and ready["kv_events"]["topic"] == ""
            port = int(endpoint.rsplit(":", 1)[1])
            sub = context.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.LINGER, 0)
            sub.connect(f"tcp://127.0.0.1:{port}")
            prompt = words("p", 20)
            with httpx.Client(base_url=f"http://127.0.0.1:{ready['port']}", timeout=5) as client:
                # Until the subscription has arrived, a batch is lost: prompt (and clear) until one is heard.
                for _ in range(50):
                    client.post("/reset_prefix_cache")
                    client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1,
                                                         "kv_transfer_params": PREFILL_KV})
                    if sub.poll(200):
                        break
                batches = []
                while sub.poll(200):
                    batches.append(decode(sub.recv_multipart()[2]))
            stored_batch = next(b for b in batches if "BlockStored" in json.dumps(b, default=repr))
            if encoding == "map":
                assert set(stored_batch) == {"ts", "events", "data_parallel_rank"}
                events = stored_batch["events"]
            else:
                assert len(stored_batch) == 3 and stored_batch[2] == 0
                events = stored_batch[1]
            event = events[-1]
            if encoding == "array":
                # ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
                assert event[0] == "BlockStored" and event[3] == tokenize(prompt)[:16] and event[4] == 16
                [block] = event[1]
                assert event[2] is None and event[5:] == [None, "GPU"]
            else:
                assert event["type"] == "BlockStored" and event["token_ids"] == tokenize(prompt)[:16]
                [block] = event["block_hashes"]
            digest = block_hash(None, tokenize(prompt)[:16])
            assert block == (digest if hashes == "bytes" else int.from_bytes(digest[-8:], "big"))
            sub.close()
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=10) == 0
        finally:
            if process.poll() is None:
                process.kill()
            context.destroy(linger=0)
        assert "Traceback" not in process.stderr.read()


def test_a_fleet_process_gives_each_engine_its_own_publisher(tmp_path: Any) -> None:
    listed = tmp_path / "engines.json"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    command = [sys.executable, "-m", "narwhal", "mock-engine", "--port", "0", "--engines", "3",
               "--prefill-engines", "2", "--engines-file", str(listed), "--cache-blocks", "8",
               "--kv-events", "0", "--kv-events-replay", "0", "--kv-events-topic", "t"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True) as process:
        assert process.stdout is not None and process.stderr is not None
        try:
            *ready, _ = [json.loads(process.stdout.readline()) for _ in range(4)]
            written = json.loads(listed.read_text())["engines"]
            assert [e["kv_events"] for e in written] == [line["kv_events"] for line in ready]
            endpoints = {e["kv_events"]["endpoint"] for e in written} | \
                {e["kv_events"]["replay_endpoint"] for e in written}
            assert len(endpoints) == 6 and all(e["kv_events"]["topic"] == "t" for e in written)
            for line in ready:
                with httpx.Client(base_url=f"http://127.0.0.1:{line['port']}", timeout=5) as client:
                    assert client.get("/narwhal/identity").json()["kv_events"] == line["kv_events"]
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=10) == 0
        finally:
            if process.poll() is None:
                process.kill()
        assert "Traceback" not in process.stderr.read()


def test_kv_events_need_a_cache_and_replay_needs_events(capsys: pytest.CaptureFixture[str]) -> None:
    from narwhal.tools.mock.engine import main

    for argv, message in ((["--role", "prefill", "--kv-events", "0"], "--kv-events needs a prefix cache"),
                          (["--role", "prefill", "--kv-events-replay", "0"], "--kv-events-replay needs --kv-events")):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2 and message in capsys.readouterr().err


def test_a_taken_kv_events_port_is_one_line_and_exit_2() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "narwhal.tools.mock", "--role", "prefill", "--cache-blocks", "4",
                               "--kv-events", str(port)], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"KV events port {port}: Address already in use" in done.stderr
