"""End to end: the vLLM identity plugin loaded into FastAPI "vLLM" processes, and the router readmitting them.

Each engine is ``tests/fake_vllm.py``: FastAPI on uvicorn with vLLM's routes and
P/D handoff, started with vLLM's command line shape and loading
``--middleware narwhal.engine_plugin.IdentityMiddleware`` the way vLLM does.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from narwhal import attestation
from narwhal.tools.local_fleet import LocalProcess, render_config, start_process, start_router
from tests.e2e.test_readmission_e2e import TOKEN, admin, engine_state
from tests.e2e.waiting import wait_until

pytestmark = pytest.mark.e2e

FAKE_VLLM = str(Path(__file__).resolve().parent.parent / "fake_vllm.py")
PLUGIN = "narwhal.engine_plugin.IdentityMiddleware"
NIXL = {"kv_producer": '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}',
        "kv_consumer": '{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}',
        "kv_both": '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'}
SERVED = "tiny-llm"
GENERATION = "g7"


async def start_fake_vllm(nursery: trio.Nursery, engine_id: str, *, key_file: Path | None,
                          kv_role: str = "kv_both", port: int = 0,
                          extra_env: dict[str, str] | None = None) -> LocalProcess:
    """``vllm serve /models/tiny --served-model-name tiny-llm ... --middleware PLUGIN``, as a process."""
    argv = [sys.executable, FAKE_VLLM, "serve", "/models/tiny", "--served-model-name", SERVED,
            "--host", "127.0.0.1", "--port", str(port), "--kv-transfer-config", NIXL[kv_role],
            "--middleware", PLUGIN]
    env = {k: v for k, v in os.environ.items() if not k.startswith("NARWHAL_")}
    env.update({"NARWHAL_ENGINE_ID": engine_id, "NARWHAL_GENERATION": GENERATION,
                "PYTHONPATH": str(Path(FAKE_VLLM).parent.parent)})
    if key_file is not None:
        env["NARWHAL_FLEET_KEY_FILE"] = str(key_file)
    env.update(extra_env or {})
    return await start_process(nursery, argv, ready="fake_vllm_ready", name=engine_id, env=env, timeout_s=60.0)


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "fleet.key"
    path.write_text("e2e-fleet-key\n")
    return path


@pytest.fixture
async def processes():
    started: list[LocalProcess] = []
    yield started
    with trio.CancelScope(shield=True):
        for process in reversed(started):
            await process.stop(grace_s=10.0)


# ----- the middleware inside FastAPI, loaded as vLLM loads it -------------------------------------

async def test_the_plugin_inside_a_fastapi_vllm_answers_identity_and_attestation_and_passes_streams_through(
        nursery, processes, key_file: Path) -> None:
    before = time.time()
    engine = await start_fake_vllm(nursery, "prefill-0", key_file=key_file)
    ready_at = time.time()
    processes.append(engine)
    async with httpx.AsyncClient(base_url=engine.url, timeout=30.0) as client:
        identity = (await client.get("/narwhal/identity")).json()
        assert {k: v for k, v in identity.items() if k != "process_started_at"} == {
            "engine_id": "prefill-0", "model": SERVED, "generation": GENERATION,
            "kv_roles": ["producer", "consumer"], "kv_events": None}
        # The engine process's own start, from /proc: after we spawned it, before it was ready.
        assert before - 0.05 <= identity["process_started_at"] <= ready_at

        response = await client.post("/narwhal/attest", json={"nonce": "0123abcd"})
        assert response.status_code == 200
        answer = response.json()
        assert answer["engine_id"] == "prefill-0" and answer["nonce"] == "0123abcd"
        assert attestation.verify(b"e2e-fleet-key", "prefill-0", "0123abcd", GENERATION, answer["signature"])

        # Every other route is vLLM's own, untouched.
        models = (await client.get("/v1/models")).json()
        assert [card["id"] for card in models["data"]] == [SERVED]
        missing = await client.get("/narwhal/other")
        assert (missing.status_code, missing.json()) == (404, {"detail": "Not Found"})

        # A streamed completion is not buffered: its first event arrives while the engine still
        # holds back the rest, which it produces only after we have read that first event.
        body = {"model": SERVED, "prompt": "hello", "max_tokens": 3, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body, headers={"x-fake-hold": "1"}) as stream:
            assert stream.status_code == 200
            chunks = stream.aiter_raw()
            first = b""
            with trio.fail_after(20):
                while b"\n\n" not in first:
                    first += await chunks.__anext__()
            assert b'" tok0"' in first and b"[DONE]" not in first
            assert (await client.post("/fake/release")).status_code == 200
            rest = b"".join([chunk async for chunk in chunks])
        events = [e for e in (first + rest).split(b"\n\n") if e]
        assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]] == [" tok0", " tok1", " tok2"]
        assert events[-1] == b"data: [DONE]"


async def test_an_engine_without_a_fleet_key_refuses_to_attest_with_a_clear_503(nursery, processes) -> None:
    engine = await start_fake_vllm(nursery, "decode-0", key_file=None)
    processes.append(engine)
    async with httpx.AsyncClient(base_url=engine.url, timeout=30.0) as client:
        assert (await client.get("/narwhal/identity")).status_code == 200
        response = await client.post("/narwhal/attest", json={"nonce": "n1"})
        assert response.status_code == 503
        error = response.json()["error"]
        assert error["code"] == "no_fleet_key"
        assert "set NARWHAL_FLEET_KEY_FILE" in error["message"]
        # The engine itself keeps serving.
        assert (await client.get("/health")).status_code == 200


# ----- the router with three FastAPI "vLLM" engines ------------------------------------------------

class VllmFleet:
    """The router and its engines; ``url`` and ``client`` as the readmission e2e helpers expect."""

    def __init__(self, router: LocalProcess, engines: dict[str, LocalProcess], client: httpx.AsyncClient) -> None:
        self.router = router
        self.engines = engines
        self.client = client

    @property
    def url(self) -> str:
        return self.router.url

    async def admin(self, *argv: str) -> tuple[int, str, str]:
        return await admin(self, *argv)

    async def engine(self, name: str) -> dict[str, Any]:
        return await engine_state(self, name)


async def start_vllm_fleet(nursery: trio.Nursery, processes: list[LocalProcess], tmp_path: Path,
                           key_file: Path) -> VllmFleet:
    engines = {
        "p1": await start_fake_vllm(nursery, "p1", key_file=key_file, kv_role="kv_producer"),
        "d1": await start_fake_vllm(nursery, "d1", key_file=key_file, kv_role="kv_consumer"),
        "d2": await start_fake_vllm(nursery, "d2", key_file=key_file, kv_role="kv_both"),
    }
    processes.extend(engines.values())
    config = tmp_path / "narwhal.toml"
    config.write_text(render_config(
        [(name, p.url, "prefill" if name.startswith("p") else "decode") for name, p in engines.items()],
        {"fleet": {"model": SERVED, "generation": GENERATION, "attestation_key_file": str(key_file)},
         "admin": {"token": TOKEN},
         "handoff": {"path": str(tmp_path / "handoff.json")},
         "serving": {"shutdown_grace_s": 5.0},
         "engine": {"connect_timeout_s": 0.5, "health_timeout_s": 2.0, "request_timeout_s": 10.0},
         "controller": {"monitor_interval_s": 0.2, "stage_timeout_s": 3.0},
         "recovery": {"liveness_misses": 2, "probe_interval_s": 0.5}}))
    router = await start_router(nursery, str(config))
    processes.append(router)
    return VllmFleet(router, engines, httpx.AsyncClient(timeout=30.0))


async def restart(nursery: trio.Nursery, processes: list[LocalProcess], fleet: VllmFleet, name: str,
                  kv_role: str, key_file: Path) -> None:
    old = fleet.engines[name]
    await old.stop()
    new = await start_fake_vllm(nursery, name, key_file=key_file, kv_role=kv_role, port=old.port)
    processes.append(new)
    fleet.engines[name] = new


async def test_the_router_serves_drains_and_readmits_vllm_engines_through_the_plugin(
        nursery, processes, tmp_path: Path, key_file: Path) -> None:
    fleet = await start_vllm_fleet(nursery, processes, tmp_path, key_file)
    async with fleet.client:
        # P/D through the FastAPI engines.
        body = {"model": SERVED, "prompt": "hello there", "max_tokens": 4, "stream": True}
        response = await fleet.client.post(f"{fleet.router.url}/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.text.rstrip().endswith("data: [DONE]")

        # A drained engine readmits: every check passes against the plugin and vLLM's /v1/models.
        code, out, err = await fleet.admin("drain", "d1")
        assert code == 0, err
        code, out, err = await fleet.admin("readmit", "d1")
        assert code == 0, err
        d1 = await fleet.engine("d1")
        assert d1["eligible"] and d1["holds"] == []
        assert d1["last_readmission"]["passed"] == ["health", "attestation", "model", "generation",
                                                    "kv_role", "final_health"]

        # Maintenance: refused while the same process runs, readmitted once it has restarted.
        code, out, err = await fleet.admin("maintenance", "d1")
        assert code == 0, err
        code, out, err = await fleet.admin("readmit", "d1")
        assert code == 1 and "refused by check newer_process" in err, (out, err)
        await restart(nursery, processes, fleet, "d1", "kv_consumer", key_file)
        code, out, err = await fleet.admin("readmit", "d1")
        assert code == 0, err
        d1 = await fleet.engine("d1")
        assert d1["eligible"] and "newer_process" in d1["last_readmission"]["passed"]

        # An engine holding another key is refused by the router's attestation check.
        wrong_key = tmp_path / "wrong.key"
        wrong_key.write_text("not-the-fleet-key\n")
        code, _, err = await fleet.admin("drain", "d2")
        assert code == 0, err
        await restart(nursery, processes, fleet, "d2", "kv_both", wrong_key)
        code, out, err = await fleet.admin("readmit", "d2")
        assert code == 1, out
        assert "refused by check attestation" in err and "signature does not verify" in err
        d2 = await fleet.engine("d2")
        assert not d2["eligible"] and [h["kind"] for h in d2["holds"]] == ["operator_drain"]


async def test_a_killed_vllm_engine_is_readmitted_automatically_after_it_restarts(
        nursery, processes, tmp_path: Path, key_file: Path) -> None:
    fleet = await start_vllm_fleet(nursery, processes, tmp_path, key_file)
    async with fleet.client:
        port = fleet.engines["d2"].port
        fleet.engines["d2"].kill()

        async def ejected() -> bool:
            return (await fleet.engine("d2"))["ejected"]

        await wait_until(ejected, timeout_s=30.0, what="d2 to be ejected after it was killed")
        processes.append(await start_fake_vllm(nursery, "d2", key_file=key_file, port=port))

        async def back() -> bool:
            return (await fleet.engine("d2"))["eligible"]

        await wait_until(back, timeout_s=60.0, what="d2 to be readmitted automatically")
        last = (await fleet.engine("d2"))["last_readmission"]
        assert (last["outcome"], last["operator"]) == ("readmitted", False)
        assert last["passed"] == ["health", "attestation", "model", "generation", "kv_role", "final_health"]


# ----- engine-check against FastAPI "vLLM" engines -------------------------------------------------

async def engine_check(*argv: str) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NARWHAL_")}
    result = await trio.run_process([sys.executable, "-m", "narwhal", "engine-check", *argv],
                                    capture_stdout=True, capture_stderr=True, check=False, env=env)
    return result.returncode, result.stdout.decode(), result.stderr.decode()


def table(out: str) -> dict[str, tuple[str, str]]:
    """engine-check's rows as {check: (result, detail)}."""
    rows: dict[str, tuple[str, str]] = {}
    for line in out.splitlines()[2:-1]:
        check, rest = line.split(None, 1)
        result, detail = (rest.split(None, 1) + [""])[:2] if not rest.startswith("not run") else (
            "not run", rest[len("not run"):].strip())
        rows[check] = (result, detail)
    return rows


async def test_engine_check_passes_a_good_engine_and_names_a_wrong_key_a_wrong_role_and_a_dead_url(
        nursery, processes, tmp_path: Path, key_file: Path) -> None:
    prefill = await start_fake_vllm(nursery, "p1", key_file=key_file, kv_role="kv_producer")
    decode = await start_fake_vllm(nursery, "d1", key_file=key_file, kv_role="kv_consumer")
    processes.extend([prefill, decode])

    # A good prefill engine, with the one-token P/D probe through a decode peer.
    code, out, err = await engine_check(prefill.url, "--role", "prefill", "--key-file", str(key_file),
                                        "--peer", decode.url, "--model", SERVED, "--generation", GENERATION)
    assert code == 0, out + err
    rows = table(out)
    assert list(rows) == ["health", "models", "identity", "attestation", "model", "generation", "kv_role",
                          "pd_probe"]
    assert {result for result, _ in rows.values()} == {"pass"}
    assert out.splitlines()[-1] == "8 of 8 checks passed"
    assert "engine_id 'p1'" in rows["identity"][1]

    # The same decode engine checked from the router's own config.
    config = tmp_path / "narwhal.toml"
    config.write_text(render_config([("p1", prefill.url, "prefill"), ("d1", decode.url, "decode")],
                                    {"fleet": {"model": SERVED, "generation": GENERATION,
                                               "attestation_key_file": str(key_file)}}))
    code, out, err = await engine_check(decode.url, "--role", "decode", "--config", str(config),
                                        "--peer", prefill.url)
    assert code == 0, out + err

    # A wrong key: attestation fails, the rest still passes.
    wrong = tmp_path / "wrong.key"
    wrong.write_text("not-the-fleet-key")
    code, out, _ = await engine_check(prefill.url, "--role", "prefill", "--key-file", str(wrong))
    assert code == 1
    rows = table(out)
    assert rows["attestation"] == ("FAIL", "attestation signature does not verify with the fleet attestation key")
    assert [c for c, (r, _) in rows.items() if r != "pass"] == ["attestation"]

    # A wrong role: a KV consumer checked as a prefill engine fails kv_role and the P/D probe.
    code, out, _ = await engine_check(decode.url, "--role", "prefill", "--key-file", str(key_file),
                                      "--peer", prefill.url)
    assert code == 1
    rows = table(out)
    assert rows["kv_role"][0] == "FAIL" and "needs KV role 'producer'" in rows["kv_role"][1]
    # The probe names the side before running a leg (real vLLM would run it on the wrong role).
    assert rows["pd_probe"][0] == "FAIL"
    assert rows["pd_probe"][1].startswith(f"prefill on {decode.url}: a prefill engine needs KV role 'producer'")
    assert rows["attestation"][0] == "pass"

    # A dead URL: health fails for the connection, nothing else runs.
    dead = trio.socket.socket()
    await dead.bind(("127.0.0.1", 0))
    dead_port = dead.getsockname()[1]
    dead.close()
    code, out, _ = await engine_check(f"http://127.0.0.1:{dead_port}", "--key-file", str(key_file))
    assert code == 1
    rows = table(out)
    assert rows["health"][0] == "FAIL" and rows["health"][1].startswith("connection:")
    assert {result for check, (result, _) in rows.items() if check != "health"} == {"not run"}

    # Bad arguments: exit 2 with one line.
    code, out, err = await engine_check(prefill.url, "--peer", decode.url)
    assert (code, out) == (2, "") and err == "narwhal engine-check: --peer needs --role: the role of URL " \
                                            "(the peer has the other one)\n"


# ----- registering itself in etcd, inside FastAPI on uvicorn -------------------------------------

async def test_the_plugin_registers_its_engine_in_etcd_and_revokes_at_sigterm(nursery, processes,
                                                                               tmp_path: Path) -> None:
    """uvicorn's lifespan reaches the middleware: the key appears once /health answers, SIGTERM revokes it."""
    import base64

    from tests.etcd_server import _free_port, start_etcd

    etcd = await start_etcd(tmp_path / "etcd")
    try:
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        engine = await start_fake_vllm(nursery, "decode-r", key_file=None, kv_role="kv_consumer", port=port,
                                       extra_env={"NARWHAL_REGISTER_ETCD": etcd.url, "NARWHAL_REGISTER_URL": url,
                                                  "NARWHAL_REGISTER_TTL_S": "5"})
        processes.append(engine)
        key = {"key": base64.b64encode(b"/narwhal/engines/decode-r").decode()}
        async with httpx.AsyncClient(timeout=5.0) as client:

            async def registered() -> dict[str, Any] | None:
                kvs = (await client.post(f"{etcd.url}/v3/kv/range", json=key)).json().get("kvs") or []
                return json.loads(base64.b64decode(kvs[0]["value"])) if kvs else None

            with trio.fail_after(10.0):
                while (value := await registered()) is None:
                    await trio.sleep(0.1)
            assert value == {"url": url, "role": "decode", "model": SERVED}
            # uvicorn shuts down gracefully (lifespan shutdown included), then re-raises SIGTERM: -15.
            assert await engine.stop(grace_s=10.0) == -15
            assert await registered() is None  # revoked at shutdown, not left to its 5 s TTL
    finally:
        with trio.CancelScope(shield=True):
            await etcd.stop()
