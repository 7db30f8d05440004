"""A reload adds an engine to a running router in front of real vLLM: it enters through the plugin's readmission
chain (health, attestation, model, generation, KV role, final health) and serves.

The router starts with the prefill engine and one decode engine of the session's fleet; the second decode
engine is added by editing the config file and SIGHUP, as an operator scaling up would.
"""

from __future__ import annotations

import signal

import pytest
import trio

from tests.real_vllm.conftest import AUTH, Narwhal, metric
from tests.real_vllm.fleet import MODEL_NAME

pytestmark = pytest.mark.real_vllm


async def test_a_decode_engine_added_by_sighup_is_readmitted_through_the_plugin_chain_and_serves(
        start_narwhal) -> None:
    narwhal: Narwhal = await start_narwhal(engines=["p1", "d1"])
    added = narwhal.fleet["d2"]
    answer = await narwhal.call(lambda: narwhal.openai.completions.create(
        model=MODEL_NAME, prompt="before the reload", max_tokens=4, temperature=0))
    assert answer.usage.completion_tokens == 4
    assert (await narwhal.client.get(f"{narwhal.url}/admin/engines/d2", headers=AUTH)).status_code == 404

    narwhal.config_path.write_text(narwhal.config_path.read_text()
                                   + f'[[engines]]\nname = "d2"\nurl = "{added.url}"\nrole = "decode"\n')
    narwhal.process.process.send_signal(signal.SIGHUP)
    [event] = await narwhal.process.wait_event("config_reloaded", timeout_s=10)
    assert event["engines_added"] == ["d2"] and event["keys_needing_restart"] == []
    state = await narwhal.wait_engine("d2", lambda e: e["eligible"], what="readmitted after the reload",
                                      timeout_s=60)
    last = state["last_readmission"]
    assert (last["outcome"], last["operator"]) == ("readmitted", False), last
    # Every check of the chain ran against the engine's plugin, in order.
    assert last["passed"] == ["health", "attestation", "model", "generation", "kv_role", "final_health"], last
    assert state["counters"]["ejections"] == 0

    # d1 drained: the next answer can only come from d2, with its KV read over NIXL from p1.
    response = await narwhal.client.post(f"{narwhal.url}/admin/engines/d1/drain", headers=AUTH)
    assert response.status_code == 200, response.text
    before = await metric(narwhal.client, added.url, "vllm:nixl_xfer_time_seconds_count")
    answer = await narwhal.call(lambda: narwhal.openai.completions.create(
        model=MODEL_NAME, prompt="after the reload", max_tokens=4, temperature=0))
    assert answer.usage.completion_tokens == 4
    assert await narwhal.process.wait_event("request", timeout_s=5, decode="d2", status=200)
    # vLLM publishes a step's connector stats with its outputs: give /metrics a moment to show the read.
    with trio.move_on_after(10):
        while await metric(narwhal.client, added.url, "vllm:nixl_xfer_time_seconds_count") < before + 1:
            await trio.sleep(0.1)
    assert await metric(narwhal.client, added.url, "vllm:nixl_xfer_time_seconds_count") >= before + 1
