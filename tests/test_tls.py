"""TLS configuration and the engine side of TLS: one-line config errors, classification, pooling.

Certificates come from trustme; the engine is the mock, in process, on a real
127.0.0.1 socket.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import trio
import trustme

from narwhal.config import ConfigError, EngineConfig, EngineSpec, load_config, parse_config
from narwhal.errors import EngineFailure, FailureClass
from narwhal.http1.client import TLSFailed
from narwhal.pools import classify
from narwhal.pools.control import ControlPool
from narwhal.pools.data import DataPool
from narwhal.tls import TLSContexts, engine_context
from narwhal.tools.mock.engine import MockSettings, serve_mock

ENGINES = '''
[[engines]]
name = "p1"
url = "{url}"
role = "prefill"
[[engines]]
name = "d1"
url = "{url}"
role = "decode"
'''


def write_pem(path: Path, *blobs: trustme.Blob) -> str:
    path.write_bytes(b"".join(blob.bytes() for blob in blobs))
    return str(path)


@pytest.fixture
def pem(tmp_path: Path) -> dict[str, str]:
    ca, other = trustme.CA(), trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    stranger = other.issue_cert("127.0.0.1")
    misnamed = ca.issue_cert("engine.invalid")
    return {
        "ca": write_pem(tmp_path / "ca.pem", ca.cert_pem),
        "other_ca": write_pem(tmp_path / "other-ca.pem", other.cert_pem),
        "cert": write_pem(tmp_path / "cert.pem", *cert.cert_chain_pems),
        "key": write_pem(tmp_path / "key.pem", cert.private_key_pem),
        "other_key": write_pem(tmp_path / "other-key.pem", stranger.private_key_pem),
        "wrong_host_cert": write_pem(tmp_path / "wrong.pem", *misnamed.cert_chain_pems),
        "wrong_host_key": write_pem(tmp_path / "wrong-key.pem", misnamed.private_key_pem),
        "junk": write_pem(tmp_path / "junk.pem", trustme.Blob(b"not a certificate\n")),
    }


def config_text(serving: str = "", engine: str = "", url: str = "http://127.0.0.1:9") -> str:
    return f"[serving]\n{serving}\n[engine]\n{engine}\n" + ENGINES.format(url=url)


@pytest.mark.parametrize(("serving", "engine", "expected"), [
    ('tls_cert_file = "{cert}"', "", "serving: tls_key_file is required when tls_cert_file is set"),
    ('tls_key_file = "{key}"', "", "serving: tls_cert_file is required when tls_key_file is set"),
    ('tls_client_ca_file = "{ca}"', "", "tls_client_ca_file needs tls_cert_file"),
    ('tls_cert_file = "/nonexistent/cert.pem"\ntls_key_file = "{key}"', "",
     "serving.tls_cert_file: cannot read '/nonexistent/cert.pem': No such file or directory"),
    ('tls_cert_file = "{junk}"\ntls_key_file = "{key}"', "",
     "serving.tls_cert_file: '{junk}' holds no PEM certificate"),
    ('tls_cert_file = "{cert}"\ntls_key_file = "{junk}"', "",
     "serving.tls_key_file: '{junk}' holds no usable PEM private key"),
    ('tls_cert_file = "{cert}"\ntls_key_file = "{other_key}"', "",
     "serving.tls_key_file: the key in '{other_key}' does not match the certificate in serving.tls_cert_file"),
    ('tls_cert_file = "{cert}"\ntls_key_file = "{key}"\ntls_client_ca_file = "{junk}"', "",
     "serving.tls_client_ca_file: '{junk}' holds no PEM certificate"),
    ("", 'tls_ca_file = "/nonexistent/ca.pem"', "engine.tls_ca_file: cannot read '/nonexistent/ca.pem'"),
    ("", 'tls_cert_file = "{cert}"', "engine: tls_key_file is required when tls_cert_file is set"),
    ("", 'tls_cert_file = "{cert}"\ntls_key_file = "{other_key}"',
     "engine.tls_key_file: the key in '{other_key}' does not match the certificate in engine.tls_cert_file"),
])
def test_bad_tls_config_is_one_line_naming_the_key(pem, serving, engine, expected):
    with pytest.raises(ConfigError) as caught:
        # The text is checked by parse_config, the files where the contexts are built.
        TLSContexts(parse_config(config_text(serving.format(**pem), engine.format(**pem))))
    message = str(caught.value)
    assert expected.format(**pem) in message
    assert "\n" not in message


def test_https_engine_urls_default_to_port_443_and_other_schemes_are_refused():
    config = parse_config(config_text(url="https://engine.example"))
    assert config.engines[0].tls and config.engines[0].port == 443
    assert not parse_config(config_text()).engines[0].tls
    with pytest.raises(ConfigError, match="url must be http://HOST"):
        parse_config(config_text(url="ftp://engine.example"))


def test_relative_tls_paths_are_read_from_the_config_files_directory(pem, tmp_path):
    config_path = tmp_path / "narwhal.toml"
    config_path.write_text(config_text('tls_cert_file = "cert.pem"\ntls_key_file = "key.pem"',
                                       'tls_ca_file = "ca.pem"', url="https://127.0.0.1:9"))
    config = load_config(config_path)
    contexts = TLSContexts(config, tmp_path)
    assert contexts.server is not None and contexts.engine is not None
    assert contexts.engine.check_hostname


def test_engine_context_exists_only_when_engines_need_it(pem):
    assert TLSContexts(parse_config(config_text())).engine is None
    assert TLSContexts(parse_config(config_text(url="https://127.0.0.1:9"))).engine is not None
    assert not TLSContexts(parse_config(config_text())).configured


def test_serve_exits_2_with_one_line_on_a_key_that_does_not_match(pem, tmp_path):
    config_path = tmp_path / "narwhal.toml"
    config_path.write_text(config_text(f'tls_cert_file = "{pem["cert"]}"\ntls_key_file = "{pem["other_key"]}"'))
    result = subprocess.run([sys.executable, "-m", "narwhal", "serve", "--config", str(config_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "serving.tls_key_file" in lines[0] and "does not match" in lines[0]


def test_tls_failures_are_connection_failures_with_the_reason():
    failure = classify.transport_failure("d1", TLSFailed("TLS handshake with 127.0.0.1:1 failed: "
                                                         "CERTIFICATE_VERIFY_FAILED: self-signed certificate",
                                                         cause="SSLCertVerificationError"))
    assert failure.failure_class is FailureClass.CONNECTION
    assert "CERTIFICATE_VERIFY_FAILED" in failure.message and failure.cause == "SSLCertVerificationError"


async def start_engine(nursery: trio.Nursery, cert: str, key: str, client_ca: str | None = None) -> str:
    service = await nursery.start(serve_mock, MockSettings(role="decode", tls_cert_file=cert, tls_key_file=key,
                                                           tls_client_ca_file=client_ca))
    return f"https://127.0.0.1:{service.engine.port}"


async def tokenize(pool: DataPool, url: str) -> tuple[int, bytes]:
    spec = EngineSpec(name="d1", url=url, role="decode")
    return await pool.post_json(spec, "/tokenize", b'{"prompt": "a b c"}', request_id="t")


async def test_data_pool_keeps_tls_connections_alive(pem, nursery):
    url = await start_engine(nursery, pem["cert"], pem["key"])
    config = EngineConfig(tls_ca_file=pem["ca"])
    pool = DataPool(max_connections=4, engine_config=config, ssl_context=engine_context(config))
    for _ in range(5):
        status, body = await tokenize(pool, url)
        assert status == 200 and b'"count":3' in body.replace(b" ", b"")
    assert pool.statistics().connections_opened == 1
    await pool.aclose()


@pytest.mark.parametrize(("ca", "cert", "reason"), [
    ("other_ca", "cert", "CERTIFICATE_VERIFY_FAILED"),
    ("ca", "wrong_host_cert", "mismatch"),
])
async def test_untrusted_or_misnamed_engines_are_connection_failures(pem, nursery, ca, cert, reason):
    url = await start_engine(nursery, pem[cert], pem["key"] if cert == "cert" else pem["wrong_host_key"])
    config = EngineConfig(tls_ca_file=pem[ca], connect_timeout_s=2.0)
    context = engine_context(config)
    pool = DataPool(max_connections=4, engine_config=config, ssl_context=context)
    with pytest.raises(EngineFailure) as caught:
        await tokenize(pool, url)
    assert caught.value.failure_class is FailureClass.CONNECTION
    assert reason in caught.value.message
    control = ControlPool(control_connections=2, engine_config=config, ssl_context=context)
    with pytest.raises(EngineFailure) as caught:
        await control.get(EngineSpec(name="d1", url=url, role="decode"), "/health")
    assert caught.value.failure_class is FailureClass.CONNECTION
    await control.aclose()
    await pool.aclose()


async def test_a_silent_tls_stream_still_ends_at_its_deadline(pem, nursery, autojump_clock):
    # A TLS connection's reads wait inside trio, out of the readiness set: the watchdog cancels the stream's scope.
    service = await nursery.start(serve_mock, MockSettings(role="decode", tls_cert_file=pem["cert"],
                                                           tls_key_file=pem["key"], token_delay_s=60.0,
                                                           sse_writes="per-event"))
    spec = EngineSpec(name="d1", url=f"https://127.0.0.1:{service.engine.port}", role="decode")
    config = EngineConfig(tls_ca_file=pem["ca"], stream_silence_s=30.0, first_token_deadline_s=3.0,
                          request_timeout_s=90.0)
    pool = DataPool(max_connections=4, engine_config=config, ssl_context=engine_context(config))
    await nursery.start(pool.run)
    body = b'{"model": "mock-model", "prompt": "a b c", "max_tokens": 4, "stream": true}'
    entered = []
    started = trio.current_time()
    with pytest.raises(EngineFailure) as caught:
        async with pool.stream(spec, "/v1/completions", body, request_id="t") as upstream:
            # The head came: the stream's first read waits for the first token.
            entered.append(upstream.relay_watch)
            await upstream.read()
    assert entered == [None]
    assert caught.value.failure_class is FailureClass.STREAM and caught.value.cause == "DeadlineExpired"
    assert "no first token within 3 s" in caught.value.message
    assert trio.current_time() - started == pytest.approx(3.0, abs=1e-6)
    await pool.aclose()
