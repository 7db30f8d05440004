"""``python -m narwhal engine-check`` against real vLLM engines with the plugin: both roles, and the P/D probe."""

from __future__ import annotations

import os
import sys

import pytest
import trio

from tests.real_vllm.fleet import FLEET_KEY, GENERATION, MODEL_NAME, REPO

pytestmark = pytest.mark.real_vllm

EXPECTED = ["health", "models", "identity", "attestation", "model", "generation", "kv_role", "pd_probe"]


async def engine_check(url: str, role: str, peer: str) -> tuple[int, str]:
    env = {**os.environ, "NARWHAL_FLEET_KEY": FLEET_KEY, "PYTHONPATH": str(REPO)}
    env.pop("NARWHAL_FLEET_KEY_FILE", None)
    done = await trio.run_process(
        [sys.executable, "-m", "narwhal", "engine-check", url, "--role", role, "--peer", peer,
         "--model", MODEL_NAME, "--generation", GENERATION, "--timeout-s", "60"],
        capture_stdout=True, capture_stderr=True, check=False, env=env)
    return done.returncode, done.stdout.decode() + done.stderr.decode()


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_engine_check_passes_for_both_roles_with_the_pd_probe(fleet, role) -> None:
    engine = fleet["p1"] if role == "prefill" else fleet["d1"]
    peer = fleet["d1"] if role == "prefill" else fleet["p1"]
    with trio.fail_after(180):
        code, out = await engine_check(engine.url, role, peer.url)
    assert code == 0, out
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines()
            if line.split() and line.split()[0] in EXPECTED}
    assert rows == dict.fromkeys(EXPECTED, "pass"), out


async def test_engine_check_refuses_a_decode_engine_offered_as_prefill(fleet) -> None:
    with trio.fail_after(180):
        code, out = await engine_check(fleet["d1"].url, "prefill", fleet["d2"].url if "d2" in fleet.engines
                                       else fleet["p1"].url)
    assert code == 1, out
    kv_row = next(line for line in out.splitlines() if line.split()[:1] == ["kv_role"])
    assert "FAIL" in kv_row, out
    # vLLM's NixlConnector would run the prefill leg on this kv_consumer: the probe must fail on the role itself.
    probe_row = next(line for line in out.splitlines() if line.split()[:1] == ["pd_probe"])
    assert "FAIL" in probe_row and "a prefill engine needs KV role 'producer'" in probe_row, out
