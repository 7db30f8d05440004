"""A real router process against hostile engines: it answers 502, blames the right engine, and stays small.

The engines are trio servers in this test process: /health answers 200 (so
the fleet keeps them), completions answer with bytes that never end. Before
the bounds, the router held such an answer whole (+2.6 GB in 5 s, then
MemoryError); now its peak RSS stays near its idle size.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest
import trio

from narwhal.tools.local_fleet import render_config, start_router

pytestmark = pytest.mark.e2e

# What a hostile engine sends at most; the router must hang up long before.
HOSTILE_BYTES = 1024 * 1024 * 1024
PEAK_RSS_LIMIT_KB = 400 * 1024

Answer = Callable[[trio.SocketStream], Awaitable[None]]


def endless(first: bytes, repeat: bytes) -> Answer:
    async def answer(stream: trio.SocketStream) -> None:
        await stream.send_all(first)
        sent = len(first)
        while sent < HOSTILE_BYTES:
            await stream.send_all(repeat)
            sent += len(repeat)
    return answer


ENDLESS_200_BODY = endless(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n",
                           b"%x\r\n%s\r\n" % (65536, b"[" * 65536))
ENDLESS_HEADERS = endless(b"HTTP/1.1 200 OK\r\n", b"x-junk: " + b"j" * 4000 + b"\r\n")


async def engine_connection(completions: Answer, stream: trio.SocketStream) -> None:
    async with stream:
        try:
            for _ in range(1000):
                head = b""
                while b"\r\n\r\n" not in head:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    head += data
                if head.startswith(b"GET /health"):
                    await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
                    continue
                await completions(stream)
                return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return


async def start_engine(nursery: trio.Nursery, completions: Answer) -> str:
    listeners = await nursery.start(functools.partial(
        trio.serve_tcp, functools.partial(engine_connection, completions), 0, host="127.0.0.1"))
    return f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"


def peak_rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc status")


@pytest.mark.parametrize(("prefill_answer", "code"), [
    (ENDLESS_200_BODY, "kv_handoff"),
    (ENDLESS_HEADERS, "inference_status"),
], ids=["endless-prefill-body", "endless-prefill-headers"])
async def test_a_router_facing_endless_answers_stays_small_and_answers_502(nursery, tmp_path, prefill_answer, code):
    prefill = await start_engine(nursery, prefill_answer)
    # Never reached: the prefill fails first, and a bad handoff never goes on to decode.
    decode = await start_engine(nursery, ENDLESS_200_BODY)
    config = tmp_path / "narwhal.toml"
    config.write_text(render_config([("p1", prefill, "prefill"), ("d1", decode, "decode")], {
        "serving": {"count_tokens": False, "shutdown_grace_s": 2.0},
        "handoff": {"path": str(tmp_path / "handoff.json")},
        "admin": {"token": "t"},
    }))
    router = await start_router(nursery, str(config))
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            for _ in range(3):
                response = await client.post(f"{router.url}/v1/completions",
                                             json={"model": "mock-model", "prompt": "hi", "max_tokens": 2})
                assert response.status_code == 502, response.text
                error = response.json()["error"]
                assert error["code"] == code
                assert error["message"].startswith("prefill engine p1 failed")
            assert (await client.get(f"{router.url}/health")).status_code == 200
        assert peak_rss_kb(router.pid) < PEAK_RSS_LIMIT_KB
    finally:
        await router.stop(grace_s=10.0)
