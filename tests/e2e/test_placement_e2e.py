"""Cache-aware placement end to end: a router (1 or 2 worker processes) in front of mocks that model a prefix cache.

Each of 4 prompt groups shares a long prefix; every request adds a unique
suffix. The mocks count prompt and cached tokens, so the hit rate is the
engines' own account, not the router's. The warm-up waits (by polling the
router's own index size, never a fixed sleep) until the controller has every
group recorded, which with 2 workers means the placements were relayed.
"""

from __future__ import annotations

import functools
import itertools
import re

import httpx
import pytest
import trio

from narwhal.tools.local_fleet import start_mock_engine
from tests.e2e.waiting import engines_body, wait_until

pytestmark = pytest.mark.e2e

GROUPS = 4
PREFIX_WORDS = 256
MOCK_ARGS = ["--tokens", "2", "--prefix-cache-blocks", "400"]
_serial = itertools.count()


def _prompt(group: int) -> str:
    prefix = " ".join(f"g{group}w{i}" for i in range(PREFIX_WORDS))
    n = next(_serial)
    return prefix + " " + " ".join(f"u{n}x{i}" for i in range(16))


def _sample(metrics: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` with exactly ``labels`` (any labels when none are given)."""
    label_text = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name) + (r"\{" + re.escape(label_text) + r"\}" if labels else r"(\{[^}]*\})?") \
        + r" ([0-9.e+-]+)$"
    return sum(float(m.groups()[-1]) for line in metrics.splitlines() if (m := re.match(pattern, line)))


async def _complete(client: httpx.AsyncClient, url: str, group: int) -> None:
    body = {"model": "mock-model", "prompt": _prompt(group), "max_tokens": 2}
    response = await client.post(f"{url}/v1/completions", json=body)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("workers", [1, 2])
async def test_prefixes_stick_to_their_engines_and_load_spreads(start_fleet, workers: int) -> None:
    fleet = await start_fleet(prefill=3, decode=1, mock_args=MOCK_ARGS,
                              sections={"serving": {"workers": workers, "count_tokens": False}})
    await wait_until(lambda: _ready(fleet), timeout_s=20.0, what="router ready")
    # Fresh connections, so requests spread over the worker processes.
    async with httpx.AsyncClient(timeout=30.0, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        async def indexed(groups: int) -> bool:
            body = await engines_body(fleet.client, fleet.url)
            entries = sum(e["prefix_index"]["entries"] for e in body["engines"] if e["role"] == "prefill")
            # Each group's prefix is about 20 blocks of 64 bytes.
            return entries >= groups * 20

        for group in range(GROUPS):
            await _complete(client, fleet.url, group)
            # The controller has it (and relayed it to the other worker) before the next group arrives.
            await wait_until(functools.partial(indexed, group + 1), timeout_s=10.0,
                             what="the warm-up in the controller's index")
        for name in ("p1", "p2", "p3"):
            await fleet.client.post(f"{fleet.engines[name].url}/mock/stats/reset")
        limiter = trio.CapacityLimiter(4)

        async def one(group: int) -> None:
            async with limiter:
                await _complete(client, fleet.url, group)

        async with trio.open_nursery() as nursery:
            for i in range(80):
                nursery.start_soon(one, i % GROUPS)

    stats = [await fleet.engine_stats(name) for name in ("p1", "p2", "p3")]
    prompt = sum(s["prefix_cache"]["prompt_tokens"] for s in stats)
    cached = sum(s["prefix_cache"]["cached_tokens"] for s in stats)
    prefills = [s["prefill"] for s in stats]
    assert sum(prefills) == 80
    # Hits: every group's prefix was cached where its requests went (the suffix never is).
    assert cached / prompt > 0.8, (cached, prompt, prefills)
    # Balance: 4 groups over 3 engines: at most 2 groups on one engine, and (one process, which knows
    # every placement at once) none idle.
    assert max(prefills) <= 0.5 * 80, prefills
    if workers == 1:
        assert min(prefills) > 0, prefills

    async def counted() -> str | None:
        # Worker processes report their counts every 100 ms: wait until all 84 requests are in.
        text = (await fleet.client.get(f"{fleet.url}/metrics")).text
        done = _sample(text, "narwhal_placement_total", role="decode", reason="only_choice", model="mock-model") >= 84
        return text if done and _sample(text, "narwhal_placement_matched_fraction_count") >= 84 else None

    metrics = await wait_until(counted, timeout_s=10.0, what="placement counts reported")
    assert _sample(metrics, "narwhal_placement_index_bytes") > 0
    assert _sample(metrics, "narwhal_placement_total", role="prefill", reason="hit", model="mock-model") >= 70

    async def logged() -> list[dict] | None:
        events = [event for event in fleet.router.events("request") if event.get("prefix_match") is not None]
        return events if len(events) >= 84 else None

    # The request log carries each request's matched share (logs are flushed in batches).
    events = await wait_until(logged, timeout_s=10.0, what="request events")
    assert max(event["prefix_match"] for event in events) > 0.9


async def _ready(fleet) -> bool:
    return (await fleet.client.get(f"{fleet.url}/ready")).status_code == 200


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_prefill_engine_restarted_while_drained_comes_back_with_no_index_entries(
        start_fleet, nursery, workers: int) -> None:
    # No health sweep while p1 is down for its restart: this is about the drain, not an ejection.
    fleet = await start_fleet(prefill=1, decode=1, mock_args=MOCK_ARGS,
                              sections={"serving": {"workers": workers, "count_tokens": False},
                                        "controller": {"monitor_interval_s": 600.0}})
    await wait_until(lambda: _ready(fleet), timeout_s=20.0, what="router ready")

    async def p1_entries() -> int:
        body = await engines_body(fleet.client, fleet.url)
        return next(e["prefix_index"]["entries"] for e in body["engines"] if e["name"] == "p1")

    await _complete(fleet.client, fleet.url, 0)
    await wait_until(p1_entries, timeout_s=10.0, what="p1's prefixes in the controller's index")
    assert (await fleet.client.post(f"{fleet.url}/admin/engines/p1/drain")).status_code == 200
    # The operator restarts the drained engine: a newer process (the mock reports its own start), cache empty.
    old = fleet.engines["p1"]
    await old.stop(grace_s=5.0)
    fleet.engines["p1"] = await start_mock_engine(nursery, "prefill", engine_id="p1", port=old.port,
                                                  args=MOCK_ARGS)
    assert await p1_entries() > 0  # a drain alone keeps them
    try:
        readmitted = await fleet.client.post(f"{fleet.url}/admin/engines/p1/readmit")
        assert readmitted.status_code == 200, readmitted.text
        assert await p1_entries() == 0
        [forgotten] = await fleet.router.wait_event("prefix_index_forgotten", engine="p1")
        assert forgotten["reason"] == "newer_process"
        # Placement records it afresh from here.
        await _complete(fleet.client, fleet.url, 0)
        await wait_until(p1_entries, timeout_s=10.0, what="p1's prefixes recorded again")
    finally:
        with trio.CancelScope(shield=True):
            await fleet.engines["p1"].stop(grace_s=5.0)
