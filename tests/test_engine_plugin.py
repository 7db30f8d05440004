"""The vLLM identity plugin in-process: what it reads from vLLM's command line and environment,
what it answers, and that it hands every other request to the app untouched.

The middleware is driven as a bare ASGI callable (it needs no event loop of its own).
``tests/e2e/test_vllm_plugin_e2e.py`` loads it into a FastAPI app the way vLLM does.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from narwhal import attestation
from narwhal.engine_plugin import (
    IdentityMiddleware,
    PluginSettings,
    VllmArgs,
    kv_roles_for,
    parse_vllm_argv,
    process_started_at,
)

NIXL_BOTH = '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'
ENV = {"NARWHAL_ENGINE_ID": "prefill-0", "NARWHAL_GENERATION": "g7", "NARWHAL_FLEET_KEY": "fleet-secret"}
ARGV = ["/usr/bin/vllm", "serve", "Qwen/Qwen3-0.6B", "--port", "8100", "--kv-transfer-config", NIXL_BOTH,
        "--middleware", "narwhal.engine_plugin.IdentityMiddleware"]


# ----- the command line ------------------------------------------------------------------------

@pytest.mark.parametrize(("argv", "expected"), [
    (ARGV, VllmArgs(model="Qwen/Qwen3-0.6B", kv_role="kv_both")),
    (["vllm", "serve", "/models/llama", "--served-model-name", "llama-8b", "llama", "--port", "1"],
     VllmArgs(model="/models/llama", served_model_name="llama-8b")),
    (["vllm", "serve", "m", "--served_model_name=named", "--kv_transfer_config={\"kv_role\":\"kv_producer\"}"],
     VllmArgs(model="m", served_model_name="named", kv_role="kv_producer")),
    # vLLM's dotted JSON form
    (["vllm", "serve", "m", "--kv-transfer-config.kv_connector", "NixlConnector",
      "--kv-transfer-config.kv_role", "kv_consumer"], VllmArgs(model="m", kv_role="kv_consumer")),
    # python -m vllm.entrypoints.openai.api_server --model M
    (["api_server.py", "--model", "flag-model", "--port", "8000"], VllmArgs(model="flag-model")),
    # the positional model wins over --model, as in vLLM
    (["vllm", "serve", "positional", "--model", "flag"], VllmArgs(model="positional")),
    (["vllm", "serve", "--port", "8000"], VllmArgs()),
    (["vllm", "serve", "m", "--kv-transfer-config", '{"kv_connector":"NixlConnector"}'],
     VllmArgs(model="m", kv_role="")),
    (["vllm", "serve", "m", "--kv-transfer-config", "{not json"],
     VllmArgs(model="m", kv_config_problem="--kv-transfer-config is not JSON "
                                           "(Expecting property name enclosed in double quotes: "
                                           "line 1 column 2 (char 1))")),
])
def test_the_vllm_command_line_names_model_served_name_and_kv_role(argv: list[str], expected: VllmArgs) -> None:
    assert parse_vllm_argv(argv) == expected


@pytest.mark.parametrize(("role", "roles"), [
    ("kv_producer", ("producer",)), ("kv_consumer", ("consumer",)), ("kv_both", ("producer", "consumer")),
    ("producer", ("producer",)), ("consumer", ("consumer",)), ("both", ("producer", "consumer")),
    (" KV_BOTH ", ("producer", "consumer")), ("kv_sideways", None), ("", None),
])
def test_kv_role_maps_to_the_contract_kv_roles(role: str, roles: tuple[str, ...] | None) -> None:
    assert kv_roles_for(role) == roles


def test_settings_come_from_the_environment_and_the_command_line() -> None:
    s = PluginSettings.from_environment(ENV, ARGV, started_at=1700000000.5)
    assert s.problems == ()
    assert s.identity() == {"engine_id": "prefill-0", "model": "Qwen/Qwen3-0.6B", "generation": "g7",
                            "process_started_at": 1700000000.5, "kv_roles": ["producer", "consumer"],
                            "kv_events": None}


def test_served_model_name_wins_over_the_model_and_narwhal_model_over_both() -> None:
    argv = ["vllm", "serve", "/weights", "--served-model-name", "public-name"]
    assert PluginSettings.from_environment(ENV, argv).model == "public-name"
    assert PluginSettings.from_environment({**ENV, "NARWHAL_MODEL": "override"}, argv).model == "override"


def test_narwhal_kv_role_overrides_the_kv_transfer_config() -> None:
    s = PluginSettings.from_environment({**ENV, "NARWHAL_KV_ROLE": "kv_consumer"}, ARGV)
    assert s.kv_roles == ("consumer",) and s.problems == ()


def test_an_engine_without_a_kv_connector_reports_no_kv_roles() -> None:
    s = PluginSettings.from_environment(ENV, ["vllm", "serve", "m"])
    assert s.kv_roles == () and s.problems == ()


@pytest.mark.parametrize(("env", "argv", "problem"), [
    ({k: v for k, v in ENV.items() if k != "NARWHAL_ENGINE_ID"}, ARGV, "NARWHAL_ENGINE_ID is not set"),
    ({**ENV, "NARWHAL_GENERATION": " "}, ARGV, "NARWHAL_GENERATION is not set"),
    (ENV, ["vllm", "serve", "--config", "c.yaml"], "cannot tell the served model from the command line: "
                                                    "set NARWHAL_MODEL"),
    ({**ENV, "NARWHAL_KV_ROLE": "sideways"}, ARGV, "NARWHAL_KV_ROLE='sideways' is not one of"),
    (ENV, ["vllm", "serve", "m", "--kv-transfer-config", '{"kv_role": "kv_sideways"}'],
     "kv_role 'kv_sideways' is not one of kv_producer, kv_consumer, kv_both: set NARWHAL_KV_ROLE"),
    (ENV, ["vllm", "serve", "m", "--kv-transfer-config", "[1]"],
     "--kv-transfer-config is not a JSON object: set NARWHAL_KV_ROLE"),
])
def test_what_the_plugin_cannot_tell_is_named(env: dict[str, str], argv: list[str], problem: str) -> None:
    s = PluginSettings.from_environment(env, argv)
    assert any(problem in p for p in s.problems), s.problems


# ----- KV events: --kv-events-config ------------------------------------------------------------

KV_EVENTS = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", ' \
            '"replay_endpoint": "tcp://*:5558", "topic": "kv"}'


@pytest.mark.parametrize(("flags", "reported"), [
    (["--kv-events-config", KV_EVENTS],
     {"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv"}),
    # vLLM's defaults: publisher "zmq" once enabled, endpoint tcp://*:5557, no replay socket, topic "".
    (['--kv_events_config={"enable_kv_cache_events": true}'],
     {"endpoint": "tcp://*:5557", "replay_endpoint": None, "topic": ""}),
    # the dotted form, its values strings; a host as given (not a wildcard) stays as it is
    (["--kv-events-config.enable_kv_cache_events", "true", "--kv-events-config.endpoint", "tcp://10.0.0.7:6000"],
     {"endpoint": "tcp://10.0.0.7:6000", "replay_endpoint": None, "topic": ""}),
    # a dotted key on top of the JSON
    (["--kv-events-config", KV_EVENTS, "--kv-events-config.topic", "other"],
     {"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "other"}),
    # off: not enabled, the null publisher, no flag at all
    (["--kv-events-config", '{"enable_kv_cache_events": false, "endpoint": "tcp://*:5557"}'], None),
    (["--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "null"}'], None),
    ([], None),
])
def test_the_identity_reports_vllm_kv_events_endpoints(flags: list[str], reported: dict[str, Any] | None) -> None:
    s = PluginSettings.from_environment(ENV, [*ARGV, *flags], started_at=1.0)
    assert s.problems == () and s.kv_events_problem is None
    assert s.identity()["kv_events"] == reported


async def test_the_identity_answer_carries_the_kv_events_object() -> None:
    middleware, _ = plugin(argv=[*ARGV, "--kv-events-config", KV_EVENTS])
    status, _, body = await call(middleware, "GET", "/narwhal/identity")
    assert status == 200
    assert json.loads(body)["kv_events"] == {"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
                                             "topic": "kv"}


def test_an_unreadable_kv_events_config_is_a_warning_not_an_unidentified_engine(
        caplog: pytest.LogCaptureFixture) -> None:
    settings = PluginSettings.from_environment(ENV, [*ARGV, "--kv-events-config", "{oops"], started_at=1.0)
    assert settings.problems == () and settings.identity()["kv_events"] is None
    assert settings.kv_events_problem is not None and "--kv-events-config is not JSON" in settings.kv_events_problem
    with caplog.at_level("WARNING", logger="narwhal.engine_plugin"):
        IdentityMiddleware(InnerApp(), settings)
    assert "cannot report KV events: --kv-events-config is not JSON" in caplog.text


# ----- process_started_at ------------------------------------------------------------------------

def test_process_started_at_is_the_real_start_of_the_process() -> None:
    before = time.time()
    out = subprocess.run([sys.executable, "-c", "import narwhal.engine_plugin as p; print(p.process_started_at())"],
                         capture_output=True, check=True, timeout=60).stdout
    after = time.time()
    started = float(out)
    # /proc/uptime has 1/100 s resolution, and the tick count 1/CLK_TCK.
    assert before - 0.05 <= started <= after


def test_process_started_at_reads_the_kernel_fields(tmp_path: Path) -> None:
    (tmp_path / "self").mkdir()
    # A command name holding ") (" must not shift the fields.
    fields = ["S"] + ["0"] * 18 + ["12345"] + ["0"] * 30
    (tmp_path / "self" / "stat").write_text("4242 (odd) (name) " + " ".join(fields) + "\n")
    (tmp_path / "uptime").write_text("500.25 1000.00\n")
    import os

    ticks = os.sysconf("SC_CLK_TCK")
    assert process_started_at(proc=tmp_path, now=lambda: 10_000.0) == pytest.approx(10_000.0 - 500.25 + 12345 / ticks)


def test_without_proc_the_start_is_when_the_middleware_was_built(tmp_path: Path) -> None:
    assert process_started_at(proc=tmp_path / "missing") is None
    before = time.time()
    settings = PluginSettings.from_environment(ENV, ARGV, proc=tmp_path / "missing")
    assert before <= settings.process_started_at <= time.time()


# ----- the middleware, driven as an ASGI callable ----------------------------------------------

class InnerApp:
    """The app behind the middleware: records what reached it and answers 200 "inner"."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, Any], Any, Any]] = []

    async def __call__(self, scope, receive, send) -> None:
        self.calls.append((scope, receive, send))
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"inner"})


async def call(middleware: IdentityMiddleware, method: str, path: str, body: bytes = b"",
               chunks: list[bytes] | None = None, **scope_extra: Any) -> tuple[int, dict[bytes, bytes], bytes]:
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
                for i, c in enumerate(chunks)] if chunks else [{"type": "http.request", "body": body}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "root_path": "", "headers": [], **scope_extra}
    await middleware(scope, receive, send)
    start = sent[0]
    return start["status"], dict(start["headers"]), b"".join(m.get("body", b"") for m in sent[1:])


def plugin(env: dict[str, str] = ENV, argv: list[str] = ARGV) -> tuple[IdentityMiddleware, InnerApp]:
    inner = InnerApp()
    return IdentityMiddleware(inner, PluginSettings.from_environment(env, argv, started_at=1700000000.25)), inner


async def test_identity_answers_the_contract_fields() -> None:
    middleware, inner = plugin()
    status, headers, body = await call(middleware, "GET", "/narwhal/identity")
    assert status == 200 and headers[b"content-type"] == b"application/json"
    assert json.loads(body) == {"engine_id": "prefill-0", "model": "Qwen/Qwen3-0.6B", "generation": "g7",
                                "process_started_at": 1700000000.25, "kv_roles": ["producer", "consumer"],
                                "kv_events": None}
    assert inner.calls == []


async def test_attest_signs_engine_id_nonce_and_generation_with_the_fleet_key() -> None:
    middleware, _ = plugin()
    status, _, body = await call(middleware, "POST", "/narwhal/attest", chunks=[b'{"nonce": "ab', b'c123"}'])
    assert status == 200
    answer = json.loads(body)
    expected = hmac.new(b"fleet-secret", b"prefill-0|abc123|g7", hashlib.sha256).hexdigest()
    assert answer == {"engine_id": "prefill-0", "nonce": "abc123", "signature": expected}
    assert attestation.verify(b"fleet-secret", "prefill-0", "abc123", "g7", answer["signature"])
    assert not attestation.verify(b"other-key", "prefill-0", "abc123", "g7", answer["signature"])


async def test_the_key_file_is_read_at_each_attest(tmp_path: Path) -> None:
    key_file = tmp_path / "fleet.key"
    env = {k: v for k, v in ENV.items() if k != "NARWHAL_FLEET_KEY"} | {"NARWHAL_FLEET_KEY_FILE": str(key_file)}
    middleware, _ = plugin(env)

    status, _, body = await call(middleware, "POST", "/narwhal/attest", b'{"nonce": "n1"}')
    assert status == 503
    error = json.loads(body)["error"]
    assert error["code"] == "no_fleet_key" and "cannot read fleet key file" in error["message"]

    key_file.write_text("  first-key\n")
    status, _, body = await call(middleware, "POST", "/narwhal/attest", b'{"nonce": "n1"}')
    assert status == 200
    assert attestation.verify(b"first-key", "prefill-0", "n1", "g7", json.loads(body)["signature"])

    key_file.write_text("rotated-key\n")  # no restart
    _, _, body = await call(middleware, "POST", "/narwhal/attest", b'{"nonce": "n1"}')
    assert attestation.verify(b"rotated-key", "prefill-0", "n1", "g7", json.loads(body)["signature"])


@pytest.mark.parametrize(("key_env", "words"), [
    ({}, "no fleet key: set NARWHAL_FLEET_KEY_FILE (a file holding the key) or NARWHAL_FLEET_KEY"),
    ({"NARWHAL_FLEET_KEY": "  "}, "NARWHAL_FLEET_KEY is empty"),
    ({"NARWHAL_FLEET_KEY": "k", "NARWHAL_FLEET_KEY_FILE": "/k"}, "both NARWHAL_FLEET_KEY_FILE and NARWHAL_FLEET_KEY"),
])
async def test_a_missing_key_is_a_503_never_a_signature_over_an_empty_key(key_env: dict[str, str],
                                                                          words: str) -> None:
    env = {k: v for k, v in ENV.items() if k != "NARWHAL_FLEET_KEY"} | key_env
    middleware, _ = plugin(env)
    # Identity does not need the key.
    assert (await call(middleware, "GET", "/narwhal/identity"))[0] == 200
    status, _, body = await call(middleware, "POST", "/narwhal/attest", b'{"nonce": "n1"}')
    assert status == 503
    error = json.loads(body)["error"]
    assert words in error["message"] and error["type"] == "ServiceUnavailable"
    assert "signature" not in json.loads(body)


async def test_an_unidentified_engine_answers_503_naming_what_is_missing() -> None:
    middleware, _ = plugin({"NARWHAL_FLEET_KEY": "k"})
    for method, path, body in (("GET", "/narwhal/identity", b""), ("POST", "/narwhal/attest", b'{"nonce":"n"}')):
        status, _, raw = await call(middleware, method, path, body)
        assert status == 503
        error = json.loads(raw)["error"]
        assert error["code"] == "engine_unidentified"
        assert "NARWHAL_ENGINE_ID is not set" in error["message"]
        assert "NARWHAL_GENERATION is not set" in error["message"]


@pytest.mark.parametrize(("method", "path", "body", "status", "words"), [
    ("POST", "/narwhal/identity", b"", 405, "use GET"),
    ("GET", "/narwhal/attest", b"", 405, "use POST"),
    ("POST", "/narwhal/attest", b"not json", 400, "must be JSON"),
    ("POST", "/narwhal/attest", b"[" * 4000, 400, "must be JSON"),
    ("POST", "/narwhal/attest", b'{"nonce": ""}', 400, "non-empty string"),
    ("POST", "/narwhal/attest", b'{"nonce": 7}', 400, "non-empty string"),
    ("POST", "/narwhal/attest", b'["n"]', 400, "non-empty string"),
    ("POST", "/narwhal/attest", b'{"nonce": "a|b"}', 400, "without '|'"),
    ("POST", "/narwhal/attest", b'{"nonce": "a\\nb"}', 400, "printable"),
    ("POST", "/narwhal/attest", json.dumps({"nonce": "x" * 257}).encode(), 400, "at most 256"),
    ("POST", "/narwhal/attest", json.dumps({"nonce": "x" * 5000}).encode(), 413, "larger than 4096 bytes"),
])
async def test_bad_requests_get_an_openai_style_error(method: str, path: str, body: bytes, status: int,
                                                      words: str) -> None:
    middleware, inner = plugin()
    got, headers, raw = await call(middleware, method, path, body)
    assert got == status
    error = json.loads(raw)["error"]
    assert words in error["message"] and set(error) == {"message", "type", "code"}
    if status == 405:
        assert headers[b"allow"] in (b"GET", b"POST")
    assert inner.calls == []


async def test_a_client_gone_before_its_attest_body_gets_no_answer() -> None:
    middleware, _ = plugin()
    sent: list[Any] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        sent.append(message)

    await middleware({"type": "http", "method": "POST", "path": "/narwhal/attest"}, receive, send)
    assert sent == []


@pytest.mark.parametrize("scope", [
    {"type": "http", "method": "POST", "path": "/v1/completions"},
    {"type": "http", "method": "GET", "path": "/narwhal/identityx"},
    {"type": "http", "method": "GET", "path": "/narwhal"},
    {"type": "websocket", "path": "/narwhal/identity"},
    {"type": "lifespan"},
])
async def test_everything_else_reaches_the_app_with_the_same_receive_and_send(scope: dict[str, Any]) -> None:
    middleware, inner = plugin()

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(message: Any) -> None:
        pass

    await middleware(scope, receive, send)
    # The very same callables: nothing wraps (or buffers) the stream.
    assert len(inner.calls) == 1
    got_scope, got_receive, got_send = inner.calls[0]
    assert got_scope is scope and got_receive is receive and got_send is send


async def test_paths_under_vllm_root_path_are_answered() -> None:
    middleware, inner = plugin()
    status, _, body = await call(middleware, "GET", "/api/narwhal/identity", root_path="/api")
    assert status == 200 and json.loads(body)["engine_id"] == "prefill-0"
    assert inner.calls == []


def test_importing_the_plugin_loads_only_the_standard_library() -> None:
    code = (
        "import sys; before = set(sys.modules); import narwhal.engine_plugin; "
        "new = sorted(set(sys.modules) - before); print('\\n'.join(new))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True, text=True,
                         timeout=60).stdout.split()
    narwhal_modules = {name for name in out if name.split(".")[0] == "narwhal"}
    # narwhal.errors (the exception root) imports only enum.
    assert narwhal_modules == {"narwhal", "narwhal.attestation", "narwhal.engine_plugin", "narwhal.errors",
                               "narwhal.plugin_register"}
    foreign = [name for name in out
               if name.split(".")[0] not in sys.stdlib_module_names and name.split(".")[0] != "narwhal"]
    assert foreign == []


def test_the_vllm_guide_stays_true_to_the_plugin_and_the_config(tmp_path: Path) -> None:
    import re

    from narwhal import engine_plugin, plugin_register
    from narwhal.config import parse_config

    guide = (Path(__file__).resolve().parent.parent / "docs" / "vllm.md").read_text()
    # Both vllm serve commands load the plugin by its real dotted path, with NixlConnector in the engine's
    # own KV role (vLLM 0.32 logs kv_both as deprecated with NixlConnector).
    commands = re.findall(r"```bash\n(.*?)```", guide, re.S)
    models_at = guide.index("### Several models behind one router")
    serve = [c for c in re.findall(r"```bash\n(.*?)```", guide[:models_at], re.S) if "vllm serve" in c]
    assert len(serve) == 2
    for command, kv_role in zip(serve, ("kv_producer", "kv_consumer"), strict=True):
        assert "--middleware narwhal.engine_plugin.IdentityMiddleware" in command
        assert f"""--kv-transfer-config '{{"kv_connector":"NixlConnector","kv_role":"{kv_role}"}}'""" in command
        for variable in (engine_plugin.ENGINE_ID_ENV, engine_plugin.GENERATION_ENV, attestation.KEY_FILE_ENV):
            assert f"{variable}=" in command
    # Every variable the plugin reads is in the guide's table.
    for variable in (engine_plugin.ENGINE_ID_ENV, engine_plugin.GENERATION_ENV, engine_plugin.KV_ROLE_ENV,
                     engine_plugin.MODEL_ENV, attestation.KEY_FILE_ENV, attestation.KEY_ENV,
                     plugin_register.REGISTER_ETCD_ENV, plugin_register.REGISTER_URL_ENV,
                     plugin_register.REGISTER_ROLE_ENV, plugin_register.REGISTER_PREFIX_ENV,
                     plugin_register.REGISTER_TTL_ENV):
        assert f"| `{variable}` |" in guide
    # The guide's narwhal.toml is a valid config (its key file swapped for one that exists here).
    # The guide's main narwhal.toml, then the one of "Try it without a GPU".
    toml, models_toml, cpu_toml = re.findall(r"```toml\n(.*?)```", guide, re.S)
    key = tmp_path / "fleet.key"
    key.write_text("k\n")
    config = parse_config(toml.replace("/etc/narwhal/fleet.key", str(key)))
    assert [(e.name, e.role) for e in config.engines] == [("prefill-0", "prefill"), ("decode-0", "decode")]
    # And the same generation and model as the engines' commands.
    assert all(f"NARWHAL_GENERATION={config.fleet.generation}" in c for c in serve)
    assert all(f"vllm serve {config.fleet.model}" in c for c in serve)
    # Several models: the second model's engines load the plugin too, and the config gives each its model.
    [model_b] = [c for c in re.findall(r"```bash\n(.*?)```", guide[models_at:], re.S) if "vllm serve" in c]
    assert "--middleware narwhal.engine_plugin.IdentityMiddleware" in model_b
    two = parse_config(models_toml.replace("/etc/narwhal/fleet.key", str(key)))
    assert [(e.name, e.model) for e in two.engines] == [
        ("prefill-0", config.fleet.model), ("decode-0", config.fleet.model),
        ("prefill-b0", "qwen3-small"), ("decode-b0", "qwen3-small")]
    assert "--served-model-name qwen3-small" in model_b
    # Without a GPU: the same plugin, the same variables, and a valid config for one prefill and two decode.
    [cpu_command] = [c for c in commands if "vllm.entrypoints.openai.api_server" in c]
    assert "--middleware narwhal.engine_plugin.IdentityMiddleware" in cpu_command
    assert all(f"{variable}=" in cpu_command for variable in (engine_plugin.ENGINE_ID_ENV,
                                                               engine_plugin.GENERATION_ENV))
    cpu = parse_config(cpu_toml)
    assert [(e.name, e.role) for e in cpu.engines] == [("p1", "prefill"), ("d1", "decode"), ("d2", "decode")]
    assert f"NARWHAL_GENERATION={cpu.fleet.generation}" in cpu_command
    assert f"--served-model-name {cpu.fleet.model}" in cpu_command


@pytest.mark.parametrize("length", [1, 255, 256])
async def test_a_nonce_of_1_to_256_printable_characters_is_signed(length: int) -> None:
    """The docs promise nonces of 1-256 characters (issue 26 break 9: the 256th was refused)."""
    middleware, _ = plugin()
    nonce = "n" * length
    status, _, body = await call(middleware, "POST", "/narwhal/attest", json.dumps({"nonce": nonce}).encode())
    assert status == 200
    answer = json.loads(body)
    assert answer["nonce"] == nonce
    assert answer["signature"] == attestation.sign(b"fleet-secret", "prefill-0", nonce, "g7")


def test_identity_fields_a_router_would_refuse_are_a_problem_here() -> None:
    """An engine_id over 256 characters is refused by every router (issue 19 item 13): the plugin says so."""
    s = PluginSettings.from_environment({**ENV, "NARWHAL_ENGINE_ID": "e" * 257}, ARGV, started_at=1.0)
    assert s.problems == ("engine_id is 257 characters long, more than 256 (set NARWHAL_ENGINE_ID)",)
    assert not PluginSettings.from_environment({**ENV, "NARWHAL_ENGINE_ID": "e" * 256}, ARGV, started_at=1.0).problems


_LOG_PROBE = """
import json, logging, sys
from narwhal.engine_plugin import IdentityMiddleware, PluginSettings
env, argv, configure_root = json.loads(sys.argv[1])
if configure_root:
    logging.basicConfig(level=logging.INFO, format="ROOT %(name)s %(message)s")
IdentityMiddleware(lambda scope, receive, send: None, PluginSettings.from_environment(env, argv, started_at=1.0))
logging.getLogger("narwhal.engine_plugin").info("narwhal registration: registered key=k lease=1 reason=started")
"""


@pytest.mark.parametrize("configure_root", [False, True], ids=["stock-vllm", "logging-configured"])
def test_the_plugins_info_lines_reach_stderr_once_in_a_process_that_configured_no_logging(configure_root) -> None:
    """Stock vLLM configures only its ``vllm`` logger: the plugin's INFO lines (identity, registration) must still
    show, once; where the process configured logging itself, they go its way."""
    result = subprocess.run([sys.executable, "-c", _LOG_PROBE, json.dumps([ENV, ARGV, configure_root])],
                            capture_output=True, text=True, timeout=60, check=True)
    lines = result.stderr.splitlines()
    identity = [line for line in lines if "narwhal identity plugin: engine_id=prefill-0" in line]
    registered = [line for line in lines if "narwhal registration: registered key=k" in line]
    assert len(identity) == 1 and len(registered) == 1, result.stderr
    if configure_root:
        assert identity[0].startswith("ROOT narwhal.engine_plugin "), identity
    else:
        assert identity[0].startswith("INFO ") and "[narwhal.engine_plugin]" in identity[0], identity
