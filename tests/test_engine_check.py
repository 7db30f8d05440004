"""``engine-check`` in-process: each check's verdict against a fake engine behind httpx.MockTransport,
where the key comes from, and argument errors. The e2e file runs it against FastAPI "vLLM" engines.
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from narwhal import attestation
from narwhal.config import EngineConfig, EngineSpec
from narwhal.pools.control import ControlPool
from narwhal.tools.engine_check import CheckRow, Expectations, add_parser, check_engine, format_table, run_engine_check

URL = "http://127.0.0.1:9100"
KEY = b"fleet-key"


class Engine:
    """A contract engine; attributes are the knobs."""

    def __init__(self) -> None:
        self.identity: dict[str, Any] = {"engine_id": "e1", "model": "m", "generation": "g1",
                                         "process_started_at": 1700000000.0, "kv_roles": ["producer"]}
        self.listed = ["m"]
        self.key = KEY
        self.identity_answer: httpx.Response | None = None

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/health":
            return httpx.Response(200)
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": m} for m in self.listed]})
        if path == "/narwhal/identity":
            return self.identity_answer or httpx.Response(200, json=self.identity)
        if path == "/v1/completions":
            # As vLLM's NixlConnector does: either leg runs whatever kv_role the engine was started with.
            kv = json.loads(request.content)["kv_transfer_params"]
            if kv.get("do_remote_decode"):
                return httpx.Response(200, json={"choices": [{"text": "x"}], "kv_transfer_params": {
                    "remote_engine_id": self.identity["engine_id"], "remote_block_ids": [1],
                    "remote_host": "127.0.0.1", "remote_port": 5600}})
            return httpx.Response(200, content=b'data: {"choices":[{"text":"y"}]}\n\ndata: [DONE]\n\n',
                                  headers={"content-type": "text/event-stream"})
        if path == "/narwhal/attest":
            nonce = json.loads(request.content)["nonce"]
            i = self.identity
            return httpx.Response(200, json={"engine_id": i["engine_id"], "nonce": nonce, "signature":
                                             attestation.sign(self.key, i["engine_id"], nonce, i["generation"])})
        return httpx.Response(404)


async def run(engine: Engine, **expect: Any) -> dict[str, CheckRow]:
    pool = ControlPool(control_connections=2, engine_config=EngineConfig(),
                       transport=httpx.MockTransport(engine.handle))
    try:
        rows = await check_engine(URL, Expectations(key=KEY, key_source="test", **expect), pool=pool)
    finally:
        await pool.aclose()
    return {row.check: row for row in rows}


PEER_URL = "http://127.0.0.1:9200"


async def run_with_peer(engine: Engine, peer: Engine, role: str) -> dict[str, CheckRow]:
    """``run`` with ``--peer``: the engine at URL, the peer at PEER_URL."""
    by_port = {9100: engine, 9200: peer}
    pool = ControlPool(control_connections=2, engine_config=EngineConfig(),
                       transport=httpx.MockTransport(lambda request: by_port[request.url.port].handle(request)))
    try:
        rows = await check_engine(URL, Expectations(key=KEY, key_source="test", role=role, model="m",
                                                    peer=EngineSpec(name="peer", url=PEER_URL, role="decode")),
                                  pool=pool)
    finally:
        await pool.aclose()
    return {row.check: row for row in rows}


def engine_with_roles(engine_id: str, *roles: str) -> Engine:
    engine = Engine()
    engine.identity.update(engine_id=engine_id, kv_roles=list(roles))
    return engine


async def test_the_pd_probe_passes_a_producer_prefill_handing_its_kv_to_a_consumer_decode() -> None:
    for role, engine, peer in (("prefill", engine_with_roles("p1", "producer"), engine_with_roles("d1", "consumer")),
                               ("decode", engine_with_roles("d1", "consumer"), engine_with_roles("p1", "producer"))):
        rows = await run_with_peer(engine, peer, role)
        assert rows["pd_probe"].result == "pass", rows["pd_probe"]
        assert all(not row.failed for row in rows.values()), rows


@pytest.mark.parametrize("role, engine_roles, peer_roles, side, url", [
    # The engine under check is a consumer offered as prefill (kv_role fails too) ...
    ("prefill", ("consumer",), ("consumer",), "prefill", URL),
    # ... or its peer plays the wrong part: only the probe can see that.
    ("decode", ("consumer",), ("consumer",), "prefill", PEER_URL),
    ("prefill", ("producer",), ("producer",), "decode", PEER_URL),
])
async def test_the_pd_probe_fails_a_side_whose_kv_role_is_wrong_though_vllm_would_run_the_legs(
        role, engine_roles, peer_roles, side, url) -> None:
    rows = await run_with_peer(engine_with_roles("e1", *engine_roles), engine_with_roles("e2", *peer_roles), role)
    probe = rows["pd_probe"]
    assert probe.result == "FAIL", probe
    needed = {"prefill": "producer", "decode": "consumer"}[side]
    assert probe.detail.startswith(f"{side} on {url}: a {side} engine needs KV role '{needed}'"), probe.detail
    assert "the router refuses the engine in that role" in probe.detail


async def test_a_good_engine_passes_every_check() -> None:
    rows = await run(Engine(), role="prefill", model="m", generation="g1")
    assert list(rows) == ["health", "models", "identity", "attestation", "model", "generation", "kv_role"]
    assert all(not row.failed for row in rows.values())


async def test_a_plugin_claiming_a_model_vllm_does_not_serve_fails_the_model_check() -> None:
    engine = Engine()
    engine.listed = ["other"]
    rows = await run(engine)
    assert rows["model"].failed
    assert rows["model"].detail == "/narwhal/identity names model 'm'; /v1/models lists ['other']"
    rows = await run(engine, model="m")
    assert rows["models"].detail == "/v1/models lists ['other']; the engine's model 'm' is not among them"


@pytest.mark.parametrize(("knob", "check", "detail"), [
    (lambda e: e.identity.update(generation="g2"), "generation", "engine reports generation 'g2'"),
    (lambda e: e.identity.update(kv_roles=["consumer"]), "kv_role", "needs KV role 'producer'"),
    (lambda e: setattr(e, "key", b"other"), "attestation", "signature does not verify"),
    (lambda e: e.identity.update(model="n"), "model", "names model 'n'"),
])
async def test_each_broken_fact_fails_its_own_check(knob: Any, check: str, detail: str) -> None:
    engine = Engine()
    knob(engine)
    rows = await run(engine, role="prefill", model="m" if check != "model" else None, generation="g1")
    assert [name for name, row in rows.items() if row.failed] == [check]
    assert detail in rows[check].detail


async def test_an_unidentified_engine_shows_the_plugins_own_reason_and_skips_what_needs_identity() -> None:
    engine = Engine()
    engine.identity_answer = httpx.Response(503, json={"error": {
        "message": "narwhal identity plugin is not configured on this engine: NARWHAL_ENGINE_ID is not set",
        "type": "ServiceUnavailable", "code": "engine_unidentified"}})
    rows = await run(engine, role="prefill", generation="g1")
    assert rows["identity"].detail == ("GET /narwhal/identity answered HTTP 503: narwhal identity plugin is not "
                                       "configured on this engine: NARWHAL_ENGINE_ID is not set")
    assert {rows[c].result for c in ("attestation", "model", "generation", "kv_role")} == {"not run"}


async def test_an_engine_without_kv_roles_fails_even_without_role() -> None:
    engine = Engine()
    engine.identity["kv_roles"] = []
    rows = await run(engine)
    assert rows["kv_role"].failed and "no KV connector" in rows["kv_role"].detail


async def test_no_key_fails_attestation_saying_where_a_key_comes_from() -> None:
    pool = ControlPool(control_connections=2, engine_config=EngineConfig(),
                       transport=httpx.MockTransport(Engine().handle))
    try:
        rows = await check_engine(URL, Expectations(key=None, key_source="no fleet key: give --key-file F"),
                                  pool=pool)
    finally:
        await pool.aclose()
    attest = next(row for row in rows if row.check == "attestation")
    assert (attest.result, attest.detail) == ("FAIL", "no fleet key: give --key-file F")


def test_the_table_ends_with_a_summary() -> None:
    text = format_table(URL, [CheckRow("health", "pass", "ok"), CheckRow("identity", "FAIL", "why")])
    assert text.splitlines() == [f"engine-check {URL}", "check     result   detail",
                                 "health    pass     ok", "identity  FAIL     why",
                                 "1 of 2 checks passed; failed or not run: identity"]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["engine-check", *argv])


@pytest.mark.parametrize(("argv", "message"), [
    (["http://127.0.0.1:1/v1"], "URL: url must have no path, query or fragment: 'http://127.0.0.1:1/v1'"),
    (["http://127.0.0.1:1", "--peer", "http://127.0.0.1:2"], "--peer needs --role"),
    (["http://127.0.0.1:1", "--role", "decode", "--peer", "ftp://x"], "peer: url must be http://HOST[:PORT]"),
    (["http://127.0.0.1:1", "--key-file", "/nonexistent/key"], "cannot read fleet key file '/nonexistent/key'"),
    (["http://127.0.0.1:1", "--config", "/nonexistent/narwhal.toml"], "config error: /nonexistent/narwhal.toml"),
    (["http://127.0.0.1:1", "--timeout-s", "0"], "--timeout-s must be a positive number"),
])
def test_bad_arguments_exit_2_with_one_line(argv: list[str], message: str) -> None:
    out, err = io.StringIO(), io.StringIO()
    assert run_engine_check(parse(*argv), out=out, err=err) == 2
    assert out.getvalue() == ""
    assert err.getvalue().startswith("narwhal engine-check: ") and message in err.getvalue()
    assert err.getvalue().count("\n") == 1


def test_the_key_comes_from_the_config_when_no_key_file_is_given(tmp_path: Path, monkeypatch) -> None:
    from narwhal.tools.engine_check import _expectations

    monkeypatch.delenv("NARWHAL_FLEET_KEY", raising=False)
    monkeypatch.delenv("NARWHAL_FLEET_KEY_FILE", raising=False)
    (tmp_path / "fleet.key").write_text("from-config\n")
    config = tmp_path / "narwhal.toml"
    config.write_text('[fleet]\nmodel = "m"\ngeneration = "g9"\nattestation_key_file = "fleet.key"\n'
                      '[[engines]]\nname = "p"\nurl = "http://127.0.0.1:1"\nrole = "prefill"\n'
                      '[[engines]]\nname = "d"\nurl = "http://127.0.0.1:2"\nrole = "decode"\n')
    expect = _expectations(parse("http://127.0.0.1:1", "--config", str(config)))
    assert (expect.key, expect.model, expect.generation) == (b"from-config", "m", "g9")
    monkeypatch.setenv("NARWHAL_FLEET_KEY", "from-env")
    assert _expectations(parse("http://127.0.0.1:1")).key == b"from-env"
    assert _expectations(parse("http://127.0.0.1:1", "--model", "x", "--config", str(config))).model == "x"


def test_an_engine_the_config_lists_under_another_model_is_checked_for_that_model(tmp_path: Path) -> None:
    from narwhal.tools.engine_check import _expectations

    config = tmp_path / "narwhal.toml"
    config.write_text('[fleet]\nmodel = "a"\ngeneration = "g1"\nattestation_key = "k"\n'
                      '[[fleet.models]]\nname = "b"\ngeneration = "g2"\n'
                      '[[engines]]\nname = "p"\nurl = "http://127.0.0.1:1"\nrole = "prefill"\n'
                      '[[engines]]\nname = "d"\nurl = "http://127.0.0.1:2"\nrole = "decode"\n'
                      '[[engines]]\nname = "pb"\nurl = "http://127.0.0.1:3"\nrole = "prefill"\nmodel = "b"\n'
                      '[[engines]]\nname = "db"\nurl = "http://127.0.0.1:4"\nrole = "decode"\nmodel = "b"\n')
    expect = _expectations(parse("http://127.0.0.1:3", "--config", str(config)))
    assert (expect.model, expect.generation) == ("b", "g2")
    expect = _expectations(parse("http://127.0.0.1:2/", "--config", str(config)))
    assert (expect.model, expect.generation) == ("a", "g1")
    # Not listed: the fleet's model.
    assert _expectations(parse("http://127.0.0.1:9", "--config", str(config))).model == "a"


async def test_https_engines_are_verified_with_the_routers_engine_tls_settings(tmp_path: Path, nursery) -> None:
    import trustme

    from narwhal.tools.engine_check import _expectations
    from narwhal.tools.mock.engine import MockSettings, serve_mock

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    (tmp_path / "ca.pem").write_bytes(ca.cert_pem.bytes())
    (tmp_path / "cert.pem").write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    (tmp_path / "key.pem").write_bytes(cert.private_key_pem.bytes())
    service = await nursery.start(serve_mock, MockSettings(role="prefill", engine_id="p1",
                                                           tls_cert_file=str(tmp_path / "cert.pem"),
                                                           tls_key_file=str(tmp_path / "key.pem")))
    url = f"https://127.0.0.1:{service.engine.port}"
    config = tmp_path / "narwhal.toml"
    config.write_text('[fleet]\nmodel = "mock-model"\nattestation_key = "narwhal-dev-key"\n'
                      '[engine]\ntls_ca_file = "ca.pem"\n'
                      f'[[engines]]\nname = "p1"\nurl = "{url}"\nrole = "prefill"\n'
                      f'[[engines]]\nname = "d1"\nurl = "{url}"\nrole = "decode"\n')

    rows = await check_engine(url, _expectations(parse(url, "--role", "prefill", "--config", str(config))))
    assert [row.check for row in rows if row.failed] == []

    # Without the router's CA the engine is not trusted: a connection failure, nothing else runs.
    rows = await check_engine(url, Expectations(role="prefill", key=KEY, key_source="test"), timeout_s=5.0)
    assert rows[0].check == "health" and rows[0].failed and "CERTIFICATE_VERIFY_FAILED" in rows[0].detail
    assert {row.result for row in rows[1:]} == {"not run"}


async def test_a_huge_engine_id_is_refused_and_the_table_stays_small() -> None:
    """An engine reporting a 3.5 MB engine_id: one bounded row, not 10 MB of output (issue 19 item 13)."""
    engine = Engine()
    engine.identity["engine_id"] = "x" * 3_500_000
    engine.listed = ["m"] + ["n" * 5000 for _ in range(50)]
    rows = await run(engine)
    assert rows["identity"].failed and "refused unread" in rows["identity"].detail
    assert "(51 in all)" in rows["models"].detail
    table = format_table(URL, list(rows.values()))
    assert len(table) < 10_000, len(table)


async def test_identity_fields_within_the_bound_but_long_are_shown_cut() -> None:
    engine = Engine()
    engine.identity["model"] = "q" * 1000
    rows = await run(engine)
    assert "(1000 characters)" in rows["identity"].detail
    assert len(rows["model"].detail) < 1100
