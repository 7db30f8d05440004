"""End to end over TLS: HTTPS serving, engines behind a private CA, mutual TLS, SIGHUP reload.

Certificates come from trustme; the router and mock engines run as processes
on 127.0.0.1, and every check is what a client or the router's log shows.
"""

from __future__ import annotations

import json
import signal
import socket
import ssl
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trustme

from narwhal.tools.local_fleet import LocalProcess, render_config, start_mock_engine, start_router
from tests.e2e.waiting import wait_until

pytestmark = pytest.mark.e2e

REQUEST = {"model": "mock-model", "prompt": "hello there", "max_tokens": 4}
FAST = {
    "serving": {"count_tokens": False, "shutdown_grace_s": 2.0},
    "engine": {"connect_timeout_s": 1.0, "request_timeout_s": 5.0, "health_timeout_s": 1.0},
    "controller": {"monitor_interval_s": 0.2, "stage_timeout_s": 2.0},
    "recovery": {"eject_after": 2, "liveness_misses": 3, "probe_interval_s": 0.5},
}


class PKI:
    """Two CAs and the PEM files issued from them, written under one directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca = trustme.CA()
        self.other_ca = trustme.CA()
        self.ca_file = self._write("ca.pem", self.ca.cert_pem)
        self.other_ca_file = self._write("other-ca.pem", self.other_ca.cert_pem)
        self.server = self.issue("server", self.ca, "127.0.0.1")
        self.client = self.issue("client", self.ca, "narwhal-router")

    def _write(self, name: str, blob: trustme.Blob) -> str:
        path = self.root / name
        blob.write_to_path(str(path))
        return str(path)

    def issue(self, name: str, ca: trustme.CA, *hosts: str) -> tuple[str, str]:
        """(cert file, key file) of a certificate for ``hosts`` signed by ``ca``."""
        cert = ca.issue_cert(*hosts)
        cert_file = self.root / f"{name}.pem"
        cert_file.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
        key_file = self._write(f"{name}-key.pem", cert.private_key_pem)
        return str(cert_file), key_file

    def client_context(self, *, ca_file: str | None = None,
                       cert: tuple[str, str] | None = None) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=ca_file or self.ca_file)
        if cert is not None:
            context.load_cert_chain(*cert)
        return context


@pytest.fixture
def pki(tmp_path: Path) -> PKI:
    root = tmp_path / "pki"
    root.mkdir()
    return PKI(root)


def tls_args(cert: tuple[str, str], client_ca: str | None = None) -> list[str]:
    args = ["--tls-cert-file", cert[0], "--tls-key-file", cert[1]]
    if client_ca is not None:
        args += ["--tls-client-ca-file", client_ca]
    return args


class Fleet:
    """Processes started by one test, stopped at its end."""

    def __init__(self, nursery: trio.Nursery, tmp_path: Path) -> None:
        self.nursery = nursery
        self.tmp_path = tmp_path
        self.processes: list[LocalProcess] = []
        self.configs = 0

    async def engine(self, role: str, name: str, args: Sequence[str] = ()) -> LocalProcess:
        process = await start_mock_engine(self.nursery, role, engine_id=name, args=args)
        self.processes.append(process)
        return process

    async def router(self, engines: dict[str, LocalProcess], sections: dict[str, dict[str, Any]],
                     ) -> tuple[LocalProcess, Path]:
        self.configs += 1
        merged: dict[str, dict[str, Any]] = {
            "handoff": {"path": str(self.tmp_path / f"handoff-{self.configs}.json")},
            "fleet": {"attestation_key": "narwhal-dev-key"},
        }
        for layer in (FAST, sections):
            for section, values in layer.items():
                merged.setdefault(section, {}).update(values)
        config_path = self.tmp_path / f"narwhal-{self.configs}.toml"
        config_path.write_text(render_config(
            [(name, p.url, "prefill" if name.startswith("p") else "decode") for name, p in engines.items()],
            merged))
        router = await start_router(self.nursery, str(config_path))
        self.processes.append(router)
        return router, config_path

    async def stop(self) -> None:
        with trio.CancelScope(shield=True):
            for process in reversed(self.processes):
                await process.stop(grace_s=10.0)


@pytest.fixture
async def fleet(nursery, tmp_path):
    started = Fleet(nursery, tmp_path)
    yield started
    await started.stop()


async def engines_view(client: httpx.AsyncClient, router: LocalProcess) -> dict[str, dict[str, Any]]:
    response = await client.get(f"{router.url}/admin/engines")
    return {engine["name"]: engine for engine in response.json()["engines"]}


async def raw_exchange(port: int, data: bytes, *, timeout_s: float = 10.0) -> bytes:
    """Send ``data`` over plain TCP and return everything received until the server closes."""
    received = b""
    with trio.fail_after(timeout_s):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        try:
            await stream.send_all(data)
            while len(received) < 65536:
                try:
                    chunk = await stream.receive_some(65536)
                except trio.BrokenResourceError:
                    break
                if not chunk:
                    break
                received += chunk
        finally:
            await stream.aclose()
    return received


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_https_serving_streamed_and_not_and_plain_http_refused(fleet, pki):
    engines = {"p1": await fleet.engine("prefill", "p1"), "d1": await fleet.engine("decode", "d1")}
    admin_port = free_port()
    router, _ = await fleet.router(engines, {
        "serving": {"tls_cert_file": pki.server[0], "tls_key_file": pki.server[1]},
        "admin": {"listen": f"127.0.0.1:{admin_port}"},
    })
    assert router.url.startswith("https://")
    async with httpx.AsyncClient(verify=pki.client_context(), timeout=30.0) as client:
        response = await client.post(f"{router.url}/v1/completions", json={**REQUEST, "stream": True})
        assert response.status_code == 200
        assert response.text.rstrip().endswith("data: [DONE]")
        assert response.text.count("data: {") == 4
        # A TLS client keeps the request task's own relay (the pump writes to plain sockets only).
        await router.wait_event("request", relay="task")
        assert router.events("request", relay="pump") == []
        response = await client.post(f"{router.url}/v1/completions", json=REQUEST)
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 4
        # The control app is served through the same HTTPS front.
        assert (await client.get(f"{router.url}/ready")).status_code == 200
        # The hypercorn admin listener uses the same certificate.
        admin = await client.get(f"https://127.0.0.1:{admin_port}/ready")
        assert admin.status_code == 200
    # Plain HTTP to the HTTPS port is never served: no HTTP bytes come back.
    answer = await raw_exchange(router.port, b"GET /ready HTTP/1.1\r\nhost: x\r\n\r\n")
    assert not answer.startswith(b"HTTP/")
    assert await router.wait_event("tls_handshake_failed")
    # ALPN offers http/1.1 only, even to a client that would prefer h2.
    context = pki.client_context()
    context.set_alpn_protocols(["h2", "http/1.1"])
    with trio.fail_after(10):
        stream = await trio.open_ssl_over_tcp_stream("127.0.0.1", router.port, ssl_context=context)
        await stream.do_handshake()
        assert stream.selected_alpn_protocol() == "http/1.1"
        await stream.aclose()


async def test_router_requires_client_certificates_when_a_client_ca_is_set(fleet, pki):
    engines = {"p1": await fleet.engine("prefill", "p1"), "d1": await fleet.engine("decode", "d1")}
    caller = pki.issue("caller", pki.ca, "caller.example")
    router, _ = await fleet.router(engines, {"serving": {
        "tls_cert_file": pki.server[0], "tls_key_file": pki.server[1], "tls_client_ca_file": pki.ca_file}})
    async with httpx.AsyncClient(verify=pki.client_context(cert=caller), timeout=30.0) as client:
        response = await client.post(f"{router.url}/v1/completions", json=REQUEST)
        assert response.status_code == 200
    async with httpx.AsyncClient(verify=pki.client_context(), timeout=30.0) as client:
        with pytest.raises(httpx.TransportError):
            await client.post(f"{router.url}/v1/completions", json=REQUEST)
    failures = await router.wait_event("tls_handshake_failed")
    assert any("CERTIFICATE" in str(line.get("reason")) for line in failures), failures


async def test_engines_over_tls_with_a_private_ca_keep_connections_alive(fleet, pki):
    engines = {"p1": await fleet.engine("prefill", "p1", tls_args(pki.server)),
               "d1": await fleet.engine("decode", "d1", tls_args(pki.server))}
    assert engines["d1"].url.startswith("https://")
    router, _ = await fleet.router(engines, {"engine": {"tls_ca_file": pki.ca_file}})
    async with httpx.AsyncClient(verify=pki.client_context(), timeout=30.0) as client:
        for stream in (True, False) * 10:
            response = await client.post(f"{router.url}/v1/completions", json={**REQUEST, "stream": stream})
            assert response.status_code == 200, response.text
        stats = (await client.get(f"{engines['d1'].url}/mock/stats")).json()
        # 20 decodes over keep-alive TLS connections: a handful of handshakes, not one per request.
        assert stats["decode"] == 20
        assert stats["connections_opened"] <= 6, stats
        # A TLS engine keeps the request task's own relay (the pump reads plain sockets only). The router batches
        # its log lines: wait for all 20 rather than read what has been written so far.
        async def twenty_logged() -> list[dict[str, Any]]:
            found = router.events("request", status=200)
            return found if len(found) >= 20 else []

        logged = await wait_until(twenty_logged, timeout_s=10.0, what="20 request lines")
        relays = {event["relay"] for event in logged}
        assert relays <= {"task", None} and "task" in relays
        view = await engines_view(client, router)
        assert view["p1"]["eligible"] and view["d1"]["eligible"]
        assert view["d1"]["evidence"].get("connection", 0) == 0


async def test_mtls_engines_with_and_without_a_client_certificate(fleet, pki):
    mtls = tls_args(pki.server, client_ca=pki.ca_file)
    engines = {"p1": await fleet.engine("prefill", "p1", mtls), "d1": await fleet.engine("decode", "d1", mtls)}
    with_cert, _ = await fleet.router(engines, {"engine": {
        "tls_ca_file": pki.ca_file, "tls_cert_file": pki.client[0], "tls_key_file": pki.client[1]}})
    without_cert, _ = await fleet.router(engines, {"engine": {"tls_ca_file": pki.ca_file}})
    async with httpx.AsyncClient(timeout=30.0) as client:
        response = await client.post(f"{with_cert.url}/v1/completions", json={**REQUEST, "stream": True})
        assert response.status_code == 200 and response.text.rstrip().endswith("data: [DONE]")

        response = await client.post(f"{without_cert.url}/v1/completions", json=REQUEST)
        assert response.status_code in (502, 503), response.text
        error = response.json()["error"]
        assert error["code"] in ("connection", "no_eligible_engine", "no_capacity"), error

        async def ejected() -> bool:
            view = await engines_view(client, without_cert)
            return view["p1"]["ejected"] and view["d1"]["ejected"]

        await wait_until(ejected, timeout_s=20.0, what="engines ejected by the router without a certificate")
        view = await engines_view(client, without_cert)
        assert view["d1"]["counters"]["failures"].get("connection", 0) >= 1
        response = await client.post(f"{without_cert.url}/v1/completions", json=REQUEST)
        assert response.status_code == 503 and "error" in response.json()
        # The router with a certificate still has both engines.
        view = await engines_view(client, with_cert)
        assert view["p1"]["eligible"] and view["d1"]["eligible"]
    lines = [line for line in without_cert.lines if line.get("event") in ("engine_failure", "health_check_failed")]
    assert any("CERTIFICATE_REQUIRED" in json.dumps(line) for line in lines), lines


async def test_engine_from_another_ca_and_wrong_hostname_are_connection_failures(fleet, pki):
    wrong_ca = pki.issue("wrong-ca", pki.other_ca, "127.0.0.1")
    wrong_host = pki.issue("wrong-host", pki.ca, "engine.invalid")
    engines = {"p1": await fleet.engine("prefill", "p1", tls_args(pki.server)),
               "d1": await fleet.engine("decode", "d1", tls_args(wrong_ca)),
               "d2": await fleet.engine("decode", "d2", tls_args(wrong_host))}
    # A slow monitor: the requests below, not health checks, are what eject the decoders.
    router, _ = await fleet.router(engines, {"engine": {"tls_ca_file": pki.ca_file},
                                             "controller": {"monitor_interval_s": 60.0}})
    async with httpx.AsyncClient(timeout=30.0) as client:

        async def both_ejected() -> bool:
            view = await engines_view(client, router)
            return view["d1"]["ejected"] and view["d2"]["ejected"]

        for _ in range(12):
            if await both_ejected():
                break
            response = await client.post(f"{router.url}/v1/completions", json={**REQUEST, "stream": True})
            assert response.status_code == 502, response.text
            assert response.json()["error"]["code"] == "connection"
        assert await both_ejected()
        view = await engines_view(client, router)
        assert "connection" in str(view["d1"]["ejected_reason"]) and "connection" in str(view["d2"]["ejected_reason"])
        assert view["p1"]["eligible"]
        # Nothing left to decode with: a 5xx JSON answer, not a hang or a crash.
        response = await client.post(f"{router.url}/v1/completions", json=REQUEST)
        assert response.status_code == 503 and response.json()["error"]["message"]
    failures = {name: await router.wait_event("engine_failure", engine=name) for name in ("d1", "d2")}
    assert all(line["class"] == "connection" for lines in failures.values() for line in lines)
    assert "CERTIFICATE_VERIFY_FAILED" in failures["d1"][0]["message"]
    assert "mismatch" in failures["d2"][0]["message"], failures["d2"][0]
    assert router.process.returncode is None


def live_certificates(pki: PKI, tmp_path: Path) -> tuple[Path, Path]:
    """Copies of the server certificate and key that a test rewrites before a SIGHUP."""
    live = tmp_path / "live"
    live.mkdir()
    cert_file, key_file = live / "cert.pem", live / "key.pem"
    cert_file.write_bytes(Path(pki.server[0]).read_bytes())
    key_file.write_bytes(Path(pki.server[1]).read_bytes())
    return cert_file, key_file


async def test_sighup_reloads_certificates_without_dropping_connections(fleet, pki, tmp_path):
    cert_file, key_file = live_certificates(pki, tmp_path)
    engines = {"p1": await fleet.engine("prefill", "p1"), "d1": await fleet.engine("decode", "d1")}
    router, _ = await fleet.router(engines, {"serving": {"tls_cert_file": str(cert_file),
                                                         "tls_key_file": str(key_file)}})
    old_ca = pki.client_context()
    new_ca = pki.client_context(ca_file=pki.other_ca_file)
    body = json.dumps(REQUEST).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n%s" % (len(body), body))

    async def ask(stream: trio.SSLStream) -> bytes:
        await stream.send_all(request)
        data = b""
        with trio.fail_after(10):
            while b'"usage"' not in data:
                chunk = await stream.receive_some(65536)
                assert chunk, data
                data += chunk
        return data

    # A keep-alive connection made before the reload.
    with trio.fail_after(10):
        before = await trio.open_ssl_over_tcp_stream("127.0.0.1", router.port, ssl_context=old_ca)
    assert (await ask(before)).startswith(b"HTTP/1.1 200")

    # A key that does not match: the reload fails and the old certificate stays.
    cert_file.write_bytes(Path(pki.issue("next", pki.other_ca, "127.0.0.1")[0]).read_bytes())
    router.process.send_signal(signal.SIGHUP)
    failed = await router.wait_event("tls_reload_failed", timeout_s=10.0)
    assert failed and "serving.tls_key_file" in failed[0]["message"]
    key_file.write_bytes(Path(pki.root / "next-key.pem").read_bytes())
    router.process.send_signal(signal.SIGHUP)
    assert await router.wait_event("tls_reloaded", timeout_s=10.0)

    # The old connection goes on; new handshakes get the new certificate.
    assert (await ask(before)).startswith(b"HTTP/1.1 200")
    await before.aclose()
    with trio.fail_after(10):
        stale = await trio.open_ssl_over_tcp_stream("127.0.0.1", router.port, ssl_context=old_ca)
        with pytest.raises(trio.BrokenResourceError):
            await stale.do_handshake()
        await trio.aclose_forcefully(stale)
    with trio.fail_after(10):
        after = await trio.open_ssl_over_tcp_stream("127.0.0.1", router.port, ssl_context=new_ca)
    assert (await ask(after)).startswith(b"HTTP/1.1 200")
    await after.aclose()
    assert router.process.returncode is None


async def test_sighup_with_worker_processes_reloads_every_worker_before_tls_reloaded(fleet, pki, tmp_path):
    # One reload path: the controller logs tls_reloaded once, after each worker answered that it reloaded;
    # workers log no tls_reloaded of their own, and new handshakes on the shared port get the new certificate.
    cert_file, key_file = live_certificates(pki, tmp_path)
    engines = {"p1": await fleet.engine("prefill", "p1"), "d1": await fleet.engine("decode", "d1")}
    router, _ = await fleet.router(engines, {"serving": {"tls_cert_file": str(cert_file),
                                                         "tls_key_file": str(key_file), "workers": 2}})
    assert await router.wait_event("worker_started", timeout_s=10.0, worker=1)
    next_cert, next_key = pki.issue("next", pki.other_ca, "127.0.0.1")
    cert_file.write_bytes(Path(next_cert).read_bytes())
    key_file.write_bytes(Path(next_key).read_bytes())
    router.process.send_signal(signal.SIGHUP)
    reloaded = await router.wait_event("tls_reloaded", timeout_s=20.0)
    assert reloaded and reloaded[0]["workers"] == 2 and "worker" not in reloaded[0]
    assert router.events("tls_reload_failed") == []
    assert len(router.events("tls_reloaded")) == 1
    new_ca = pki.client_context(ca_file=pki.other_ca_file)
    for _ in range(4):  # fresh connections, spread over both workers
        with trio.fail_after(10):
            stream = await trio.open_ssl_over_tcp_stream("127.0.0.1", router.port, ssl_context=new_ca)
            await stream.do_handshake()
            await stream.aclose()


async def test_sighup_reloads_the_engine_ca_and_engines_are_readmitted(fleet, pki, tmp_path):
    ca_file = tmp_path / "engine-ca.pem"
    ca_file.write_bytes(Path(pki.other_ca_file).read_bytes())
    engines = {"p1": await fleet.engine("prefill", "p1", tls_args(pki.server)),
               "d1": await fleet.engine("decode", "d1", tls_args(pki.server))}
    router, _ = await fleet.router(engines, {"engine": {"tls_ca_file": str(ca_file)}})
    async with httpx.AsyncClient(timeout=30.0) as client:

        async def ejected() -> bool:
            view = await engines_view(client, router)
            return view["d1"]["ejected"]

        await wait_until(ejected, timeout_s=20.0, what="d1 ejected while its CA is not trusted")
        ca_file.write_bytes(Path(pki.ca_file).read_bytes())
        router.process.send_signal(signal.SIGHUP)
        reloaded = await router.wait_event("tls_reloaded", timeout_s=10.0)
        assert reloaded and reloaded[0]["engines"] is True

        async def serving() -> bool:
            response = await client.post(f"{router.url}/v1/completions", json=REQUEST)
            return response.status_code == 200

        # Readmission (control pool) and serving (data pool) both use the new CA.
        await wait_until(serving, timeout_s=30.0, what="engines readmitted after the reload")
