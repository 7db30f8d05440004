"""The HTTPS side of the front: handshake deadlines and the serving certificate's lifetime.

Certificates come from trustme; servers run on real 127.0.0.1 sockets. Time-based
rules run on trio's MockClock (autojump), so a deadline is read off the clock.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trustme

from narwhal.config import Config, ConfigError, parse_config
from narwhal.http1.server import HTTPServer, Request, Responder
from narwhal.router import Router
from narwhal.tls import (
    CertificateLifetime,
    ExpiryWatch,
    TLSContexts,
    certificate_lifetime,
    expiry_warning_due,
    server_context_from_files,
)


@pytest.fixture
def server_tls() -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A (server, client) context pair from one trustme CA."""
    ca = trustme.CA()
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server)
    client = ssl.create_default_context()
    ca.configure_trust(client)
    return server, client


async def ok(request: Request, responder: Responder) -> None:
    await responder.respond(200, [(b"content-type", b"application/json")], json.dumps({"path": request.path}).encode())


@contextlib.asynccontextmanager
async def https_server(context: ssl.SSLContext, **options: Any) -> AsyncIterator[tuple[HTTPServer, int]]:
    server = HTTPServer(ok, ssl_context=context, **options)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve, "127.0.0.1", 0)
        yield server, port
        server.shutdown(0)


async def read_to_close(stream: trio.abc.ReceiveStream, limit_s: float) -> bytes:
    """Everything the server sends on ``stream`` until it closes it."""
    raw = b""
    with trio.fail_after(limit_s):
        while True:
            try:
                data = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                break
            if not data:
                break
            raw += data
    return raw


async def closed_at(stream: trio.abc.ReceiveStream, limit_s: float) -> float:
    """The (virtual) time at which the server closed ``stream``."""
    await read_to_close(stream, limit_s)
    return trio.current_time()


# A ClientHello's record header and the first bytes of its body: a handshake that never completes.
_HALF_HELLO = bytes.fromhex("16030100c8010000c40303") + b"\x00" * 16


@pytest.mark.parametrize("sent", [b"", _HALF_HELLO], ids=["silent", "half-hello"])
async def test_a_tls_handshake_counts_against_the_header_timeout(
        autojump_clock: Any, server_tls: tuple[ssl.SSLContext, ssl.SSLContext], sent: bytes) -> None:
    """A silent or half-sent ClientHello is closed at header_timeout_s, not idle_timeout_s (issue 19 item 9)."""
    server_context, _ = server_tls
    async with https_server(server_context, header_timeout_s=10.0, idle_timeout_s=600.0) as (server, port):
        start = trio.current_time()
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        if sent:
            await stream.send_all(sent)
        closed = await closed_at(stream, limit_s=1000)
        await stream.aclose()
        open_after = server.statistics().connections_open
    # The watchdog's 1 s ticks may pass between the connect and the accept.
    assert 10.0 <= closed - start <= 12.0
    assert open_after == 0


async def test_the_first_head_after_a_handshake_shares_its_window(
        autojump_clock: Any, server_tls: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    """A handshake and then a silent client: closed at header_timeout_s from the accept."""
    server_context, client_context = server_tls
    async with https_server(server_context, header_timeout_s=10.0, idle_timeout_s=600.0) as (_server, port):
        start = trio.current_time()
        stream = await trio.open_ssl_over_tcp_stream("127.0.0.1", port, ssl_context=client_context)
        await stream.do_handshake()
        closed = await closed_at(stream, limit_s=1000)
        await trio.aclose_forcefully(stream)
    assert 10.0 <= closed - start <= 12.0


async def test_a_prompt_client_is_served_over_tls(server_tls: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    server_context, client_context = server_tls
    async with https_server(server_context, header_timeout_s=10.0) as (_server, port):
        stream = await trio.open_ssl_over_tcp_stream("127.0.0.1", port, ssl_context=client_context)
        await stream.send_all(b"GET /x HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        raw = await read_to_close(stream, limit_s=10)
        await trio.aclose_forcefully(stream)
    assert raw.startswith(b"HTTP/1.1 200") and raw.endswith(b'{"path": "/x"}')


# ---- the serving certificate's lifetime (issue 19 item 10) ----

DAY = 86400.0


def _pem_pair(tmp_path: Path, name: str, ca: trustme.CA, not_before: datetime.datetime,
              not_after: datetime.datetime) -> tuple[Path, Path]:
    leaf = ca.issue_cert("127.0.0.1", not_before=not_before, not_after=not_after)
    cert, key = tmp_path / f"{name}.pem", tmp_path / f"{name}-key.pem"
    cert.write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
    key.write_bytes(leaf.private_key_pem.bytes())
    return cert, key


def _utc(unix: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(unix, datetime.UTC)


def _config(cert: Path, key: Path) -> Config:
    return parse_config(f'[serving]\ntls_cert_file = "{cert}"\ntls_key_file = "{key}"\n' + ENGINES)


ENGINES = """
[[engines]]
name = "p1"
url = "http://127.0.0.1:9"
role = "prefill"
[[engines]]
name = "d1"
url = "http://127.0.0.1:9"
role = "decode"
"""


def test_the_certificate_lifetime_is_read_from_the_pem(tmp_path: Path) -> None:
    start, end = 1_700_000_000.0, 1_700_000_000.0 + 90 * DAY
    cert, _key = _pem_pair(tmp_path, "c", trustme.CA(), _utc(start), _utc(end))
    lifetime = certificate_lifetime(cert.read_bytes())
    assert (lifetime.not_before, lifetime.not_after) == (start, end)
    # Dates past 2049 are GeneralizedTime in the DER.
    late, _ = _pem_pair(tmp_path, "late", trustme.CA(), _utc(start), _utc(2_600_000_000.0))
    assert certificate_lifetime(late.read_bytes()).not_after == 2_600_000_000.0
    with pytest.raises(ValueError):
        certificate_lifetime(b"not a certificate")


def test_an_expired_serving_certificate_is_refused_in_one_line_naming_the_key(tmp_path: Path) -> None:
    now = time.time()
    cert, key = _pem_pair(tmp_path, "old", trustme.CA(), _utc(now - 90 * DAY), _utc(now - DAY))
    with pytest.raises(ConfigError) as caught:
        TLSContexts(_config(cert, key))
    message = str(caught.value)
    assert message.startswith("serving.tls_cert_file: ") and "expired at" in message and "\n" not in message


def test_serve_exits_2_with_one_line_on_an_expired_certificate(tmp_path: Path) -> None:
    now = time.time()
    cert, key = _pem_pair(tmp_path, "old", trustme.CA(), _utc(now - 90 * DAY), _utc(now - DAY))
    config_path = tmp_path / "narwhal.toml"
    config_path.write_text(f'[serving]\ntls_cert_file = "{cert}"\ntls_key_file = "{key}"\n' + ENGINES)
    result = subprocess.run([sys.executable, "-m", "narwhal", "serve", "--config", str(config_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "serving.tls_cert_file" in lines[0] and "expired at" in lines[0], lines


async def test_a_reload_to_an_expired_certificate_keeps_the_old_one_and_says_why(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    now = time.time()
    ca = trustme.CA()
    cert, key = _pem_pair(tmp_path, "live", ca, _utc(now - DAY), _utc(now + 89 * DAY))
    router = Router(_config(cert, key))
    before = router.tls.server
    expired_cert, expired_key = _pem_pair(tmp_path, "old", ca, _utc(now - 90 * DAY), _utc(now - DAY))
    cert.write_bytes(expired_cert.read_bytes())
    key.write_bytes(expired_key.read_bytes())
    assert await router.reload_tls() is False
    assert router.tls.server is before
    [failed] = [e for e in _events(caplog) if e["event"] == "tls_reload_failed"]
    assert "expired at" in failed["message"] and "serving.tls_cert_file" in failed["message"]


@pytest.mark.parametrize(("days_left", "warned"), [(10.0, True), (29.0, True), (70.0, False)])
async def test_a_certificate_near_its_end_is_warned_of_with_the_gauge(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, days_left: float, warned: bool) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    now = time.time()
    cert, key = _pem_pair(tmp_path, "c", trustme.CA(), _utc(now - (90 - days_left) * DAY),
                          _utc(now + days_left * DAY))
    router = Router(_config(cert, key))
    assert router.cert_expiry.check(force=True) is warned
    expiring = [e for e in _events(caplog) if e["event"] == "tls_cert_expiring"]
    assert len(expiring) == int(warned)
    if warned:
        assert expiring[0]["level"] == "warning" and expiring[0]["key"] == "serving.tls_cert_file"
        assert expiring[0]["remaining_s"] == pytest.approx(days_left * DAY, abs=60)
    metrics = router.metrics.render()
    [sample] = [line for line in metrics.splitlines() if line.startswith("narwhal_tls_cert_expiry_seconds ")]
    assert float(sample.split()[1]) == pytest.approx(days_left * DAY, abs=60)


def test_a_short_lived_certificate_is_warned_of_in_its_last_third() -> None:
    lifetime = CertificateLifetime(not_before=0.0, not_after=3 * DAY)
    assert not expiry_warning_due(lifetime, 1.9 * DAY)
    assert expiry_warning_due(lifetime, 2.1 * DAY)


async def test_without_tls_there_is_no_expiry_sample() -> None:
    router = Router(parse_config(ENGINES))
    assert not [line for line in router.metrics.render().splitlines()
                if line.startswith("narwhal_tls_cert_expiry_seconds")]


async def test_a_running_router_warns_hourly_repeats_daily_and_says_expired(
        autojump_clock: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    start = 1_700_000_000.0
    cert, key = _pem_pair(tmp_path, "c", trustme.CA(), _utc(start - 80 * DAY), _utc(start + 10 * DAY))
    contexts = TLSContexts.__new__(TLSContexts)
    contexts._config = _config(cert, key)
    contexts.server_lifetime = certificate_lifetime(cert.read_bytes())
    watch = ExpiryWatch(contexts, wall_clock=lambda: start + trio.current_time())
    with trio.move_on_after(12 * DAY):
        await watch.run()
    expiring = [e for e in _events(caplog) if e["event"] == "tls_cert_expiring"]
    # Hourly checks, one warning a day: days 0..11 (the first after an hour), the last ones past expiry.
    assert len(expiring) == 12
    assert [e["expired"] for e in expiring][-2:] == [True, True] and expiring[-1]["level"] == "error"
    assert not expiring[0]["expired"] and expiring[0]["level"] == "warning"


def _events(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "narwhal.events"]


def test_the_config_module_does_not_import_tls() -> None:
    """The config <-> tls cycle is gone: parse_config checks text; certificates are read by narwhal.tls."""
    code = "import sys, narwhal.config; assert 'narwhal.tls' not in sys.modules, 'narwhal.tls imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    config = parse_config('[serving]\ntls_cert_file = "/nonexistent.pem"\ntls_key_file = "/nonexistent-key.pem"\n'
                          + ENGINES)
    with pytest.raises(ConfigError, match="serving.tls_cert_file: cannot read '/nonexistent.pem'"):
        TLSContexts(config)


# ---- issue 26 breaks 7 and 8: the admin listener follows reloads; a client CA requires certificates ----


def _write_leaf(ca: trustme.CA, cert: Path, key: Path) -> None:
    leaf = ca.issue_cert("127.0.0.1")
    cert.write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
    key.write_bytes(leaf.private_key_pem.bytes())


async def _handshake(port: int, ca: trustme.CA, client_cert: trustme.LeafCert | None = None) -> bool:
    """Whether a client trusting ``ca`` (presenting ``client_cert``) completes a handshake and gets an answer."""
    context = ssl.create_default_context()
    ca.configure_trust(context)
    if client_cert is not None:
        client_cert.configure_cert(context)
    try:
        with trio.fail_after(10):
            stream = await trio.open_ssl_over_tcp_stream("127.0.0.1", port, ssl_context=context)
            try:
                # TLS 1.3 reports a refused client certificate on the first read, not in the handshake.
                await stream.send_all(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                answer = await stream.receive_some(65536)
            finally:
                await trio.aclose_forcefully(stream)
    except (trio.BrokenResourceError, ssl.SSLError, OSError):
        return False
    return answer.startswith(b"HTTP/1.1 200")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_the_admin_listener_serves_reloaded_certificates(tmp_path: Path, nursery: trio.Nursery) -> None:
    old_ca, new_ca = trustme.CA(), trustme.CA()
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    _write_leaf(old_ca, cert, key)
    admin_port = _free_port()
    config = parse_config(f'[serving]\ntls_cert_file = "{cert}"\ntls_key_file = "{key}"\n'
                          f'[admin]\nlisten = "127.0.0.1:{admin_port}"\n[handoff]\npath = "{tmp_path}/h.json"\n'
                          + ENGINES)
    router = Router(config, listen="127.0.0.1:0")
    with trio.fail_after(20):
        port = await nursery.start(router.run)
    try:
        assert await _handshake(admin_port, old_ca) and await _handshake(port, old_ca)
        _write_leaf(new_ca, cert, key)
        assert await router.reload_tls()
        for listener in (admin_port, port):
            assert await _handshake(listener, new_ca), listener
            assert not await _handshake(listener, old_ca), listener
    finally:
        router.shutdown(0)


async def test_a_client_ca_makes_the_server_require_a_client_certificate(tmp_path: Path) -> None:
    server_ca, client_ca = trustme.CA(), trustme.CA()
    cert, key, clients = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "clients.pem"
    _write_leaf(server_ca, cert, key)
    clients.write_bytes(client_ca.cert_pem.bytes())
    context = server_context_from_files(cert, key, clients, names=("c", "k", "ca"))
    assert context.verify_mode == ssl.CERT_REQUIRED
    async with https_server(context) as (_server, port):
        assert await _handshake(port, server_ca, client_ca.issue_cert("caller")) is True
        assert await _handshake(port, server_ca) is False
        assert await _handshake(port, server_ca, trustme.CA().issue_cert("stranger")) is False
