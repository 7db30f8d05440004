"""vLLM's own KV events from the tier's prefill engine (CPU build, --kv-events-config): what a router subscribes to.

``p1`` is started with ``--kv-events-config`` (ZeroMQ PUB and replay on a wildcard host); the plugin reports
the endpoints as given. The events are decoded generically (msgspec) and checked against the prompt's token
ids from vLLM's own ``/tokenize``.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import msgspec
import pytest
import trio
import zmq

from tests.real_vllm.conftest import AUTH
from tests.real_vllm.fleet import DEFAULT_START_TIMEOUT_S, MODEL_NAME, VllmFleet, running_fleet

pytestmark = pytest.mark.real_vllm

END = (-1).to_bytes(8, "big", signed=True)


def replay(port: int, start_seq: int) -> list[tuple[int, bytes]]:
    """vLLM's replay protocol from a DEALER: the buffered batches from ``start_seq`` on, up to the end marker."""
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        batches = []
        while True:
            assert dealer.poll(30_000), "no answer from vLLM's replay socket"
            _, _, seq, payload = dealer.recv_multipart()
            if seq == END:
                return batches
            batches.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close()
        context.term()


async def test_the_prefill_engine_publishes_the_blocks_it_stores(fleet) -> None:
    p1 = fleet["p1"]
    async with httpx.AsyncClient(timeout=60) as client:
        identity = (await client.get(f"{p1.url}/narwhal/identity")).json()
        assert identity["kv_events"] == {"endpoint": f"tcp://*:{p1.kv_events_port}",
                                         "replay_endpoint": f"tcp://*:{p1.kv_events_replay_port}", "topic": ""}
        for decode in fleet.of_role("decode"):  # none with NARWHAL_REAL_VLLM_DECODE=0
            assert (await client.get(f"{decode.url}/narwhal/identity")).json()["kv_events"] is None

        before = await trio.to_thread.run_sync(replay, p1.kv_events_replay_port, 0)
        last = before[-1][0] if before else -1
        # Unique to this run (not cached yet), about 550 of the tiny tokenizer's tokens: 4 blocks of 128.
        prompt = f"{trio.current_time():.6f} " + " ".join(f"word{i}" for i in range(100))
        tokens = (await client.post(f"{p1.url}/tokenize", json={"model": MODEL_NAME, "prompt": prompt})).json()
        tokens = tokens["tokens"]
        assert 256 < len(tokens) < 2000
        answer = await client.post(f"{p1.url}/v1/completions",
                                   json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1})
        assert answer.status_code == 200
    decode = msgspec.msgpack.Decoder().decode
    stored: list[dict] = []
    with trio.fail_after(30):
        while not stored:
            for _, payload in await trio.to_thread.run_sync(replay, p1.kv_events_replay_port, last + 1):
                ts, events, *rank = decode(payload)
                assert isinstance(ts, float) and rank in ([], [0])
                stored += [e for e in events if e["type"] == "BlockStored"]
            await trio.sleep(0.2)  # vLLM publishes from its own thread once the step is done
    block_size = stored[0]["block_size"]
    chained = [h for event in stored for h in event["block_hashes"]]
    ids = [t for event in stored for t in event["token_ids"]]
    # The prompt's whole blocks, in order, the first with no parent; hashes unsigned 64-bit ints.
    assert ids == tokens[:len(tokens) // block_size * block_size] and len(chained) == len(tokens) // block_size
    assert stored[0]["parent_block_hash"] is None and stored[0]["medium"] == "GPU"
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in chained)
    print(f"\nvLLM KV events: block_size {block_size}, {len(chained)} blocks stored, fields {sorted(stored[0])}")


async def test_the_routers_view_follows_what_vllm_stored_and_cleared(start_narwhal, fleet) -> None:
    """The router subscribes at the endpoints the plugin reports (no kv_events in its config): its
    /admin/placement counts the blocks vLLM stored for a prompt sent through it, and none once vLLM empties
    its cache."""
    narwhal = await start_narwhal()
    p1 = fleet["p1"]

    async def feed() -> dict:
        response = await narwhal.client.get(f"{narwhal.url}/admin/placement", headers=AUTH)
        assert response.status_code == 200, response.text
        return response.json()["engines"]["p1"]["kv_events"]

    async def wait(what: str, check, timeout_s: float = 60.0) -> dict:
        with trio.move_on_after(timeout_s):
            while not check(state := await feed()):
                await trio.sleep(0.2)
            return state
        raise AssertionError(f"timed out waiting for p1's feed: {what}; last {state}")

    before = await wait("live", lambda state: state["state"] == "live")
    prompt = f"{trio.current_time():.6f} " + " ".join(f"whale{i}" for i in range(100))
    async with httpx.AsyncClient(timeout=60) as client:
        tokens = (await client.post(f"{p1.url}/tokenize", json={"model": MODEL_NAME, "prompt": prompt})).json()
    answer = await narwhal.call(lambda: narwhal.openai.completions.create(model=MODEL_NAME, prompt=prompt,
                                                                          max_tokens=2))
    assert answer.choices[0].text is not None
    whole = len(tokens["tokens"]) // 128
    stored = await wait(f"{whole} more blocks", lambda state: state["blocks"] >= before["blocks"] + whole)
    assert stored["last_seq"] is not None and stored["dropped"] == 0
    # vLLM empties its cache (AllBlocksCleared): the router's view of p1 goes to nothing. The decode may still
    # hold the prompt's blocks for a moment (vLLM then answers success false): asked until it takes.
    async with httpx.AsyncClient(timeout=60) as client:
        with trio.fail_after(60):
            while True:
                reset = await client.post(f"{p1.url}/reset_prefix_cache")
                assert reset.status_code == 200, reset.text
                if not reset.content or reset.json().get("success", True):
                    break
                await trio.sleep(0.5)
    # vLLM publishes the clear with its next scheduler step: one more request makes one.
    await narwhal.call(lambda: narwhal.openai.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1))
    cleared = await wait("cleared", lambda state: state["blocks"] < whole)
    print(f"\nrouter's view of p1: {before['blocks']} -> {stored['blocks']} blocks after the prompt, "
          f"{cleared['blocks']} after /reset_prefix_cache; last_seq {cleared['last_seq']}")


SMALL_CACHE_BLOCKS = 48


@pytest.fixture(scope="module")
def small_cache(vllm_fleet: VllmFleet, vllm_environment: tuple[str, str],
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmFleet]:
    """One more prefill engine, ``k-p1``, whose KV cache is 48 blocks of 128 tokens: a few prompts evict."""
    python, model = vllm_environment
    with running_fleet(python, model, tmp_path_factory.mktemp("vllm-k"), prefill=1, decode=0, prefix="k-",
                       cache_blocks=SMALL_CACHE_BLOCKS, timeout_s=DEFAULT_START_TIMEOUT_S) as small:
        vllm_fleet.start_times.extend(small.start_times)
        yield small


async def test_the_routers_view_follows_what_vllm_evicts(start_narwhal, fleet, small_cache) -> None:
    """Prompts through the router fill k-p1's small cache past its size: vLLM evicts (BlockRemoved) and the
    router's count of its blocks stays within the cache, while far more were stored."""
    narwhal = await start_narwhal(engines=["d1"], more_engines=small_cache.described())

    async def feed() -> dict:
        response = await narwhal.client.get(f"{narwhal.url}/admin/placement", headers=AUTH)
        assert response.status_code == 200, response.text
        return response.json()["engines"]["k-p1"]["kv_events"]

    with trio.fail_after(60):
        while (await feed())["state"] != "live":
            await trio.sleep(0.2)
    stored = 0
    seen: list[int] = []
    for serial in range(20):
        prompt = f"{serial} {trio.current_time():.6f} " + " ".join(f"orca{serial}x{i}" for i in range(100))
        answer = await narwhal.call(lambda p=prompt: narwhal.openai.completions.create(
            model=MODEL_NAME, prompt=p, max_tokens=1))
        assert answer.choices
        stored += 4  # each prompt is over 4 blocks of 128 of the tiny tokenizer's tokens (checked above)
        seen.append((await feed())["blocks"])
    with trio.fail_after(30):
        while (state := await feed())["blocks"] > SMALL_CACHE_BLOCKS:
            await trio.sleep(0.2)
    assert stored > 1.5 * SMALL_CACHE_BLOCKS
    assert max(seen) <= SMALL_CACHE_BLOCKS and state["blocks"] > 0, seen
    assert state["dropped"] == 0
    print(f"\nk-p1 ({SMALL_CACHE_BLOCKS} blocks): router's block count after each prompt {seen}")


async def test_the_router_tokenizes_first_and_places_on_the_engine_vllm_says_holds_the_prompt(
        start_narwhal, fleet, small_cache) -> None:
    """Two prefill engines that publish (p1 and k-p1): the router asks vLLM's /tokenize before placing (the
    feeds key blocks by token IDs), and a prompt, completion or chat, sent again goes where vLLM stored it."""
    narwhal = await start_narwhal(engines=["p1", "d1"], more_engines=small_cache.described())

    async def feeds() -> dict:
        response = await narwhal.client.get(f"{narwhal.url}/admin/placement", headers=AUTH)
        assert response.status_code == 200, response.text
        return {name: engine["kv_events"] for name, engine in response.json()["engines"].items()}

    with trio.fail_after(60):
        while {state["state"] for state in (await feeds()).values()} != {"live"}:
            await trio.sleep(0.2)

    async def request_line(count: int) -> dict:
        with trio.fail_after(30):
            while len(lines := narwhal.process.events("request")) < count:
                await trio.sleep(0.1)
        return lines[count - 1]

    stamp = f"{trio.current_time():.6f}"
    text = f"{stamp} " + " ".join(f"narwhal{i}" for i in range(100))
    system = f"{stamp} You are a whale. " + " ".join(f"tusk{i}" for i in range(100))
    sends = [lambda: narwhal.openai.completions.create(model=MODEL_NAME, prompt=text, max_tokens=1),
             lambda: narwhal.openai.chat.completions.create(
                 model=MODEL_NAME, max_tokens=1,
                 messages=[{"role": "system", "content": system}, {"role": "user", "content": "first"}]),
             lambda: narwhal.openai.chat.completions.create(
                 model=MODEL_NAME, max_tokens=1,
                 messages=[{"role": "system", "content": system}, {"role": "user", "content": "second"}])]
    count = 0
    for first, again in ((sends[0], sends[0]), (sends[1], sends[2])):
        before = await feeds()
        await narwhal.call(first)
        count += 1
        holder = (await request_line(count))["prefill"]
        # vLLM publishes the prompt's blocks after its prefill: wait until the router has them.
        with trio.fail_after(30):
            while (await feeds())[holder]["blocks"] <= before[holder]["blocks"]:
                await trio.sleep(0.2)
        await narwhal.call(again)
        count += 1
        line = await request_line(count)
        assert line["prefill"] == holder and line["prefix_match"] and line["prefix_match"] > 0.5, line
