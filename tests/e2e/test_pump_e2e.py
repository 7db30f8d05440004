"""The relay pump end to end: the real router (one process, and two workers) and mock engines as processes."""

from __future__ import annotations

import json

import httpx
import pytest
import trio

pytestmark = pytest.mark.e2e

PROMPT = "one two three"  # 3 tokens: the numbered answer reads n3 n4 ...
TOKENS = 48


def texts(body: str) -> list[str]:
    events = [block.removeprefix("data: ") for block in body.split("\n\n") if block.strip()]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(event)["choices"][0]["text"] for event in events[:-1]]


async def streams_in_order(fleet, count: int) -> None:
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    answers: list[list[str]] = []
    async with httpx.AsyncClient(timeout=60.0, limits=limits) as client:

        async def one() -> None:
            response = await client.post(f"{fleet.url}/v1/completions", json={
                "model": "mock-model", "prompt": PROMPT, "max_tokens": TOKENS, "stream": True})
            assert response.status_code == 200
            answers.append(texts(response.text))

        async with trio.open_nursery() as nursery:
            for _ in range(count):
                nursery.start_soon(one)
    expected = [f" n{i}" for i in range(3, 3 + TOKENS)]
    assert len(answers) == count
    for answer in answers:
        assert answer == expected


# relay_inline: the hub's rounds run from trio's idle wait while streams are live (the default), or not.
@pytest.mark.parametrize(("workers", "relay_inline"), [(1, True), (2, True), (1, False)])
async def test_paced_streams_go_through_the_pump_whole_and_in_order(start_fleet, workers, relay_inline):
    fleet = await start_fleet(decode=2, mock_args=["--numbered-tokens", "--token-delay-s", "0.003"],
                              sections={"serving": {"workers": workers, "shutdown_grace_s": 10.0,
                                                    "relay_inline": relay_inline}})
    await streams_in_order(fleet, 64)
    with trio.fail_after(10):
        while len(fleet.router.events("request", status=200)) < 64:
            await trio.sleep(0.05)
    relays = {event["relay"] for event in fleet.router.events("request", status=200)}
    assert relays == {"pump"}
    # trio as installed lets the rounds run inline: the router does not say otherwise.
    assert not fleet.router.events("relay_inline_unavailable")


async def test_relay_pump_off_relays_in_the_request_task(start_fleet):
    fleet = await start_fleet(mock_args=["--numbered-tokens", "--token-delay-s", "0.002"],
                              sections={"serving": {"relay_pump": False}})
    await streams_in_order(fleet, 8)
    with trio.fail_after(10):
        while len(fleet.router.events("request", status=200)) < 8:
            await trio.sleep(0.05)
    assert {event["relay"] for event in fleet.router.events("request", status=200)} == {"task"}


async def test_a_client_leaving_mid_stream_closes_the_pumped_engine_stream(start_fleet):
    fleet = await start_fleet(mock_args=["--tokens", "500", "--token-delay-s", "0.02"])
    payload = json.dumps({"model": "mock-model", "prompt": PROMPT, "max_tokens": 500, "stream": True}).encode()
    stream = await trio.open_tcp_stream("127.0.0.1", fleet.router.port)
    await stream.send_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                          b"content-length: %d\r\n\r\n%s" % (len(payload), payload))
    received = b""
    # A few tokens in: the stream is in the pump by now.
    while received.count(b"data: ") < 5:
        received += await stream.receive_some(65536)
    await stream.aclose()
    with trio.fail_after(5):
        while (await fleet.engine_stats("d1"))["disconnects"] < 1:
            await trio.sleep(0.05)
    event = (await fleet.router.wait_event("request", status=499))[0]
    assert event["relay"] == "pump"
    assert event["error"] == "client_disconnected"


@pytest.mark.parametrize("relay_pump", [True, False], ids=["pump", "task-relay"])
async def test_a_decode_body_ending_without_done_ends_the_client_stream_at_once(start_fleet, relay_pump):
    # Paced, the mock writes its last event and the chunked terminator in one write (no [DONE] with no_done):
    # the body's end comes in the read of its last bytes, which the pump once left waiting for the silence
    # deadline (30 s). The mock keeps an idle connection for a minute, so its close does not end that wait.
    fleet = await start_fleet(mock_args=["--token-delay-s", "0.005", "--idle-timeout-s", "60"],
                              sections={"serving": {"relay_pump": relay_pump},
                                        "engine": {"stream_silence_s": 30.0},
                                        "recovery": {"eject_after": 100}})
    tries = 6
    await fleet.set_fault("d1", "no_done", count=tries, legs=["decode"])
    for _ in range(tries):
        started = trio.current_time()
        response = await fleet.client.post(f"{fleet.url}/v1/completions", json={
            "model": "mock-model", "prompt": PROMPT, "max_tokens": 16, "stream": True})
        assert trio.current_time() - started < 3.0
        assert response.status_code == 200
        last = response.text.split("\n\n")[-2].removeprefix("data: ")
        error = json.loads(last)["error"]
        assert "stream ended without data: [DONE]" in error["message"], error
    with trio.fail_after(10):
        while len(fleet.router.events("request", error="stream")) < tries:
            await trio.sleep(0.05)
    assert {event["relay"] for event in fleet.router.events("request")} == {"pump" if relay_pump else "task"}
