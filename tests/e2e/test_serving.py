"""End to end: the router and mock engines as processes, driven over HTTP like a user would."""

from __future__ import annotations

import json
import signal

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.waiting import engines_body, wait_for_in_flight, wait_until

pytestmark = pytest.mark.e2e

COMPLETION = {"model": "mock-model", "prompt": "hello world", "max_tokens": 5}
CHAT = {"model": "mock-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}


def sse_events(text: str) -> list[str]:
    return [block.removeprefix("data: ") for block in text.split("\n\n") if block.strip()]


async def test_streaming_completion_relays_every_token_and_done(start_fleet):
    fleet = await start_fleet(mock_args=["--tokens", "16"])
    response = await fleet.client.post(f"{fleet.url}/v1/completions", json={**COMPLETION, "stream": True},
                                       headers={"x-request-id": "req-e2e-1"})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["x-request-id"] == "req-e2e-1"
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    tokens = [json.loads(e) for e in events[:-1]]
    assert len(tokens) == 5
    assert all(t["object"] == "text_completion" for t in tokens)
    stats = await fleet.engine_stats("d1")
    assert stats["last_request_ids"]["decode"] == "req-e2e-1"
    assert (await fleet.engine_stats("p1"))["last_request_ids"]["prefill"] == "req-e2e-1"


async def test_non_streaming_completion_and_chat(start_fleet):
    fleet = await start_fleet()
    response = await fleet.client.post(f"{fleet.url}/v1/completions", json=COMPLETION)
    assert response.status_code == 200, response.text
    assert response.json()["object"] == "text_completion"
    assert response.headers["x-request-id"]
    # The decode engine answers with "kv_transfer_params": null (as vLLM does): the engines' business only.
    assert "kv_transfer_params" not in response.text
    response = await fleet.client.post(f"{fleet.url}/v1/chat/completions", json=CHAT)
    assert response.status_code == 200, response.text
    assert response.json()["object"] == "chat.completion"
    assert "kv_transfer_params" not in response.text


async def test_streaming_chat(start_fleet):
    fleet = await start_fleet()
    response = await fleet.client.post(f"{fleet.url}/v1/chat/completions", json={**CHAT, "stream": True},
                                       headers={"x-request-id": "chat-tokens"})
    assert response.status_code == 200
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    assert all(json.loads(e)["object"] == "chat.completion.chunk" for e in events[:-1])
    # The first event only names the role; the request line counts the 5 tokens, not 6 events.
    assert json.loads(events[0])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    lines = await fleet.router.wait_event("request", request_id="chat-tokens")
    assert lines and lines[0]["tokens"] == 5


async def test_decode_leg_receives_the_prefills_handoff(start_fleet):
    fleet = await start_fleet()
    response = await fleet.client.post(f"{fleet.url}/v1/completions", json={**COMPLETION, "stream": True})
    assert response.status_code == 200
    prefill = await fleet.engine_stats("p1")
    decode = await fleet.engine_stats("d1")
    sent = prefill["last_prefill_body"]
    assert sent["max_tokens"] == 1 and sent["stream"] is False
    assert sent["kv_transfer_params"]["do_remote_decode"] is True
    handoff = decode["last_kv_transfer_params"]
    assert handoff["remote_engine_id"] == "p1"
    assert handoff["remote_port"] == fleet.engines["p1"].port
    assert handoff["do_remote_prefill"] is True
    assert decode["last_decode_body"]["max_tokens"] == 5


async def test_128_concurrent_streams_all_arrive_intact(start_fleet):
    fleet = await start_fleet(prefill=2, decode=2, mock_args=["--tokens", "32", "--token-delay-s", "0.002"])
    results: list[tuple[int, list[str]]] = []
    limits = httpx.Limits(max_connections=128, max_keepalive_connections=128)
    async with httpx.AsyncClient(timeout=60.0, limits=limits) as client:

        async def one(i: int) -> None:
            response = await client.post(f"{fleet.url}/v1/completions",
                                         json={**COMPLETION, "max_tokens": 32, "stream": True})
            results.append((response.status_code, sse_events(response.text)))

        async with trio.open_nursery() as nursery:
            for i in range(128):
                nursery.start_soon(one, i)
    assert len(results) == 128
    for status, events in results:
        assert status == 200
        assert events[-1] == "[DONE]"
        assert len(events) == 33
        assert all(json.loads(e)["choices"] for e in events[:-1])


@pytest.mark.parametrize(
    ("route", "payload", "status", "code"),
    [
        ("/v1/completions", b"{broken", 400, "invalid_json"),
        ("/v1/completions", b'"just a string"', 400, "invalid_body"),
        ("/v1/completions", json.dumps({**COMPLETION, "model": "gpt-9"}).encode(), 404, "model_not_found"),
        ("/v1/completions", json.dumps({"model": "mock-model"}).encode(), 400, "invalid_prompt"),
        ("/v1/completions", json.dumps({**COMPLETION, "max_tokens": -3}).encode(), 400, "invalid_max_tokens"),
        ("/v1/chat/completions", json.dumps({"model": "mock-model", "messages": "hi"}).encode(), 400,
         "invalid_messages"),
    ],
)
async def test_malformed_requests_get_4xx_json_and_others_keep_flowing(start_fleet, route, payload, status, code):
    fleet = await start_fleet(mock_args=["--tokens", "40", "--token-delay-s", "0.01"])
    async with trio.open_nursery() as nursery:
        good: list[httpx.Response] = []

        async def in_flight() -> None:
            good.append(await fleet.client.post(f"{fleet.url}/v1/completions",
                                                json={**COMPLETION, "max_tokens": 40, "stream": True}))

        nursery.start_soon(in_flight)
        await wait_for_in_flight(fleet.client, fleet.url)
        response = await fleet.client.post(f"{fleet.url}{route}", content=payload,
                                           headers={"content-type": "application/json"})
    assert response.status_code == status
    assert response.json()["error"]["code"] == code
    assert good[0].status_code == 200 and sse_events(good[0].text)[-1] == "[DONE]"


async def test_prompt_longer_than_the_context_is_400(start_fleet):
    fleet = await start_fleet(mock_args=["--max-model-len", "8"])
    response = await fleet.client.post(f"{fleet.url}/v1/completions",
                                       json={**COMPLETION, "prompt": "word " * 50})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


async def test_token_id_prompts_work_and_lists_of_prompts_are_refused_clearly(start_fleet):
    # The mock's /tokenize refuses token IDs as vLLM 0.32's does: the router must count them itself.
    fleet = await start_fleet(mock_args=["--max-model-len", "8"])
    response = await fleet.client.post(f"{fleet.url}/v1/completions",
                                       json={**COMPLETION, "prompt": [43, 395, 295], "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 3
    # The limit learned from an earlier /tokenize answer applies to token IDs too, before any engine call.
    await fleet.client.post(f"{fleet.url}/v1/completions", json={**COMPLETION, "max_tokens": 2})
    prefills = (await fleet.engine_stats("p1"))["prefill"]
    response = await fleet.client.post(f"{fleet.url}/v1/completions",
                                       json={**COMPLETION, "prompt": list(range(9)), "max_tokens": 1})
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert (await fleet.engine_stats("p1"))["prefill"] == prefills
    response = await fleet.client.post(f"{fleet.url}/v1/completions", json={**COMPLETION, "prompt": ["a", "b"]})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "prompt_list_unsupported"
    assert "send each prompt as its own request" in response.json()["error"]["message"]


async def test_client_disconnect_cancels_the_decode_leg(start_fleet):
    fleet = await start_fleet(mock_args=["--tokens", "500", "--token-delay-s", "0.02"])
    payload = json.dumps({**COMPLETION, "max_tokens": 500, "stream": True}).encode()
    stream = await trio.open_tcp_stream("127.0.0.1", fleet.router.port)
    await stream.send_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                          b"content-length: %d\r\n\r\n%s" % (len(payload), payload))
    received = b""
    while b"data: " not in received:
        received += await stream.receive_some(65536)
    assert received.startswith(b"HTTP/1.1 200")
    await stream.aclose()
    # The mock notices the router closing the decode connection well before 500 tokens (10 s).
    with trio.fail_after(5):
        while (await fleet.engine_stats("d1"))["disconnects"] < 1:
            await trio.sleep(0.05)
    # The mock saw the socket close; the router releases the request's counts as its cancellation
    # unwinds, which need not have happened by the time an admin request is served.

    async def nothing_in_flight() -> bool:
        return all(engine["in_flight"] == 0 for engine in (await engines_body(fleet.client, fleet.url))["engines"])

    await wait_until(nothing_in_flight, timeout_s=5.0, what="no request in flight after the client left")


async def test_control_routes(start_fleet):
    fleet = await start_fleet()
    assert (await fleet.client.get(f"{fleet.url}/health")).status_code == 200
    ready = await fleet.client.get(f"{fleet.url}/ready")
    assert ready.status_code == 200
    models = (await fleet.client.get(f"{fleet.url}/v1/models")).json()
    assert models["data"][0]["id"] == "mock-model"
    engines = (await fleet.client.get(f"{fleet.url}/admin/engines")).json()["engines"]
    assert {e["name"] for e in engines} == {"p1", "d1"}
    for engine in engines:
        assert set(engine) >= {"name", "role", "url", "eligible", "ejected", "holds", "evidence",
                               "liveness_misses", "in_flight"}
    # One engine per role: each role is at "critical" consolidation risk.
    body = (await fleet.client.get(f"{fleet.url}/admin/engines")).json()
    assert body["consolidation_risk"] == {"prefill": "critical", "decode": "critical"}
    telemetry = await fleet.client.get(f"{fleet.url}/admin/telemetry")
    assert telemetry.status_code == 200 and "interval_s" in telemetry.json()
    missing = await fleet.client.get(f"{fleet.url}/nope")
    assert missing.status_code == 404 and missing.json()["error"]
    wrong_method = await fleet.client.get(f"{fleet.url}/v1/completions")
    assert wrong_method.status_code == 405


async def test_metrics_parse_with_prometheus_client(start_fleet):
    fleet = await start_fleet()
    await fleet.client.post(f"{fleet.url}/v1/completions", json={**COMPLETION, "stream": True})
    await fleet.client.post(f"{fleet.url}/v1/completions", json={**COMPLETION, "model": "x"})
    text = (await fleet.client.get(f"{fleet.url}/metrics")).text
    families = {family.name: family for family in text_string_to_metric_families(text)}
    assert families["narwhal_requests"].type == "counter"
    requests = {(s.labels["route"], s.labels["status"]): s.value for s in families["narwhal_requests"].samples}
    assert requests[("/v1/completions", "200")] == 1
    assert requests[("/v1/completions", "404")] == 1
    assert "narwhal_time_to_first_token_seconds" in families
    assert "narwhal_inter_token_seconds" in families
    assert "narwhal_requests_in_flight" in families
    assert "narwhal_pool_connections" in families
    risk = {s.labels["role"]: s.value for s in families["narwhal_consolidation_risk"].samples}
    assert risk == {"prefill": 2, "decode": 2}


async def test_request_log_line_per_finished_request(start_fleet):
    fleet = await start_fleet()
    await fleet.client.post(f"{fleet.url}/v1/completions", json={**COMPLETION, "stream": True},
                            headers={"x-request-id": "log-me"})
    with trio.fail_after(5):
        while not [e for e in fleet.router.events("request") if e.get("request_id") == "log-me"]:
            await trio.sleep(0.05)
    line = [e for e in fleet.router.events("request") if e["request_id"] == "log-me"][0]
    assert line["status"] == 200 and line["prefill"] == "p1" and line["decode"] == "d1"
    assert line["tokens"] == 5 and line["ttft_ms"] > 0 and line["duration_ms"] >= line["ttft_ms"]
    assert line["ts"]


async def test_sigterm_lets_a_stream_in_flight_finish(start_fleet):
    fleet = await start_fleet(mock_args=["--tokens", "30", "--token-delay-s", "0.03"])
    async with httpx.AsyncClient(timeout=30.0) as client:
        async with client.stream("POST", f"{fleet.url}/v1/completions",
                                 json={**COMPLETION, "max_tokens": 30, "stream": True}) as response:
            chunks = []
            async for chunk in response.aiter_text():
                if not chunks:
                    fleet.router.process.send_signal(signal.SIGTERM)
                chunks.append(chunk)
    assert sse_events("".join(chunks))[-1] == "[DONE]"
    with trio.fail_after(10):
        assert await fleet.router.process.wait() == 0
    # New connections are refused once it has stopped.
    with pytest.raises(httpx.ConnectError):
        await fleet.client.get(f"{fleet.url}/health")
