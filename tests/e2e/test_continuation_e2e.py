"""Stream continuation end to end: the router and numbered mock engines as processes.

A decode engine closes the stream's connection halfway (the mock's ``cut`` fault);
the client must still read one whole answer: consecutive ``nP`` tokens, one id,
one finish, summed usage, one [DONE].
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest
import trio

from tests.e2e.waiting import wait_until

pytestmark = pytest.mark.e2e

BOUNDED = {"serving": {"policy": "bounded", "max_attempts": 3, "shutdown_grace_s": 5.0},
           # Cut streams must not eject the engines mid-test: this test is about the client's view.
           "recovery": {"eject_after": 1000}}
MOCK = ["--numbered-tokens"]
NUMBERED = re.compile(r" n(\d+)")


async def stream_events(client: httpx.AsyncClient, url: str, route: str, body: dict[str, Any]) -> list[Any]:
    async with client.stream("POST", f"{url}{route}", json=body) as response:
        assert response.status_code == 200, await response.aread()
        raw = (await response.aread()).decode()
    events: list[Any] = []
    for block in raw.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            payload = block[6:]
            events.append("[DONE]" if payload == "[DONE]" else json.loads(payload))
    return events


def assert_one_answer(events: list[Any], *, chat: bool, prompt_tokens: int, max_tokens: int) -> None:
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = events[:-1]
    assert all("error" not in chunk for chunk in chunks), chunks[-1]
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    text = "".join((ch["delta"].get("content") or "") if chat else ch["text"]
                   for c in chunks for ch in c["choices"])
    assert [int(n) for n in NUMBERED.findall(text)] == list(range(prompt_tokens, prompt_tokens + max_tokens))
    assert len([ch for c in chunks for ch in c["choices"] if ch.get("finish_reason")]) == 1
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert usage == [{"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens,
                      "total_tokens": prompt_tokens + max_tokens}]
    for chunk in chunks:
        assert "prompt_token_ids" not in chunk
        assert all("token_ids" not in ch for ch in chunk["choices"])


async def count_from_here(fleet: Any, route: str, **extra: Any) -> None:
    """Stream a 12-token answer to "count from here" and check the client got it whole."""
    chat = route == "/v1/chat/completions"
    body: dict[str, Any] = {"model": "mock-model", "max_tokens": 12, "stream": True,
                            "stream_options": {"include_usage": True}, **extra}
    if chat:
        body["messages"] = [{"role": "user", "content": "count from here"}]
    else:
        body["prompt"] = "count from here"
    events = await stream_events(fleet.client, fleet.url, route, body)
    # The mock's tokenizer: a token per word, plus one per chat message for its role.
    assert_one_answer(events, chat=chat, prompt_tokens=4 if chat else 3, max_tokens=12)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
async def test_a_stream_cut_twice_reaches_the_client_whole(start_fleet, route):
    fleet = await start_fleet(prefill=1, decode=2, sections=BOUNDED, mock_args=MOCK)
    # Each decode engine cuts its next stream after 4 tokens: leg 1 on one, its continuation on the
    # other (cut again), the second continuation back on the first, which now finishes.
    for name in ("d1", "d2"):
        await fleet.set_fault(name, "cut", after_tokens=4, count=1)
    await count_from_here(fleet, route)

    request = (await fleet.router.wait_event("request", route=route))[0]
    assert request["continuations"] == 2 and request["attempts"] == 3 and request["tokens"] == 12
    # Every leg went through the process's relay pump (serving.relay_pump is on by default).
    assert request["relay"] == "pump"
    # The client got the whole answer: no error for the request, the failure it was continued after noted.
    assert request["status"] == 200 and request["error"] is None and request["continued_after"] == "stream"
    # Evidence per failed engine: today's one stream failure each, nothing more.
    failures = fleet.router.events("engine_failure")
    assert sorted((f["engine"], f["class"]) for f in failures) == [("d1", "stream"), ("d2", "stream")]
    metrics = (await fleet.client.get(f"{fleet.url}/metrics")).text
    assert 'narwhal_continuations_total{outcome="completed",model="mock-model"} 1' in metrics
    assert 'narwhal_continuations_total{outcome="failed",model="mock-model"} 1' in metrics
    assert 'narwhal_continuation_join_gap_seconds_count{model="mock-model"} 2' in metrics
    # The second continuation is an exact join: a token-ID prompt on the completions route.
    stats = await fleet.engine_stats(request["decode"])
    assert isinstance(stats["last_decode_body"]["prompt"], list)


@pytest.mark.parametrize(("route", "cut_after"), [("/v1/completions", 3), ("/v1/chat/completions", 2)])
async def test_a_join_inside_a_character_under_a_stop_string_reaches_the_client_whole(start_fleet, route, cut_after):
    # Engines that stream as vLLM does with a byte-level tokenizer: every third position is the first half of a
    # character (no text until the next token), and a token-ID prompt ending on one makes the engine echo its whole
    # prompt. The engine dies right after a first half, while a stop string holds back 3 characters of text.
    fleet = await start_fleet(prefill=1, decode=2, sections=BOUNDED, mock_args=[*MOCK, "--split-chars-every", "3"])
    for name in ("d1", "d2"):
        await fleet.set_fault(name, "cut", after_tokens=cut_after, count=1)
    chat = route == "/v1/chat/completions"
    await count_from_here(fleet, route, stop=["@@@@"])
    request = (await fleet.router.wait_event("request", route=route))[0]
    assert request["continuations"] >= 1 and request["tokens"] == 12
    # The join went back to a whole character, before the held-back text: the next engine generated those
    # tokens again and the client got each once.
    assert request["regenerated_tokens"] >= 1
    stats = await fleet.engine_stats(request["decode"])
    prompt = stats["last_decode_body"]["prompt"]
    assert isinstance(prompt, list) and len(prompt) < (4 if chat else 3) + cut_after


async def test_every_worker_continues_streams(start_fleet):
    sections = {**BOUNDED, "serving": {**BOUNDED["serving"], "workers": 2}}
    fleet = await start_fleet(prefill=1, decode=2, sections=sections, mock_args=MOCK)

    async def ready() -> bool:
        return (await fleet.client.get(f"{fleet.url}/ready")).status_code == 200

    await wait_until(ready, what="the workers to serve")
    # d1 cuts every stream after 3 tokens; d2 serves: any request that lands on d1 is continued on d2.
    await fleet.set_fault("d1", "cut", after_tokens=3)
    body = {"model": "mock-model", "prompt": "a b", "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True}}
    answers: list[list[Any]] = []

    def continued_by() -> set[int]:
        return {line["worker"] for line in fleet.router.events("request") if line["continuations"]}

    # Fresh connections spread over the workers waiting in accept(), though not evenly: batches go
    # out until each worker has continued a stream (at most 20 batches).
    async with httpx.AsyncClient(timeout=30.0, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        for _ in range(20):
            async with trio.open_nursery() as nursery:
                for _ in range(16):
                    nursery.start_soon(_collect, client, fleet.url, body, answers)

            async def logged() -> bool:
                return len(fleet.router.events("request")) >= len(answers)

            await wait_until(logged, what="a request line per answer")
            if continued_by() == {0, 1}:
                break
    for events in answers:
        assert_one_answer(events, chat=False, prompt_tokens=2, max_tokens=8)
    assert continued_by() == {0, 1}
    assert all(line["status"] == 200 for line in fleet.router.events("request"))


async def _collect(client: httpx.AsyncClient, url: str, body: dict[str, Any], answers: list[list[Any]]) -> None:
    answers.append(await stream_events(client, url, "/v1/completions", body))
