"""`narwhal admin` against a router serving HTTPS with a private CA, and asking for client certificates."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from tests.e2e.test_tls_e2e import PKI

pytestmark = pytest.mark.e2e


async def admin(url: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    clean = {k: v for k, v in os.environ.items() if k not in ("NARWHAL_ADMIN_CA_FILE", "SSL_CERT_FILE",
                                                                "SSL_CERT_DIR")}
    clean.update(env or {})
    with trio.fail_after(60):
        return await trio.run_process([sys.executable, "-m", "narwhal", "admin", "engines", "--url", url, *args],
                                      capture_stdout=True, capture_stderr=True, check=False, env=clean)


def one_line(result: subprocess.CompletedProcess[bytes]) -> str:
    lines = result.stderr.decode().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


async def test_admin_reaches_an_https_router_behind_a_private_ca_with_client_certificates(start_fleet,
                                                                                             tmp_path: Path):
    root = tmp_path / "pki"
    root.mkdir()
    pki = PKI(root)
    fleet = await start_fleet(sections={"serving": {"tls_cert_file": pki.server[0], "tls_key_file": pki.server[1],
                                                    "tls_client_ca_file": pki.ca_file}})
    url = fleet.router.url
    assert url.startswith("https://")
    cert = ["--cert-file", pki.client[0], "--key-file", pki.client[1]]

    unverified = await admin(url, *cert)
    assert unverified.returncode == 1
    assert "CERTIFICATE_VERIFY_FAILED" in one_line(unverified)
    assert "pass --ca-file or set NARWHAL_ADMIN_CA_FILE" in one_line(unverified)

    no_client_cert = await admin(url, "--ca-file", pki.ca_file)
    assert no_client_cert.returncode == 1
    assert "pass --cert-file and --key-file" in one_line(no_client_cert)

    for args, env in ((["--ca-file", pki.ca_file, *cert], None),
                      (cert, {"NARWHAL_ADMIN_CA_FILE": pki.ca_file}),
                      (cert, {"SSL_CERT_FILE": pki.ca_file})):
        result = await admin(url, *args, env=env)
        assert result.returncode == 0, result.stderr
        table = result.stdout.decode().splitlines()
        assert table[0].split()[:3] == ["NAME", "ROLE", "STATE"]
        assert sorted(line.split()[0] for line in table[1:3]) == ["d1", "p1"]


async def test_an_unreadable_ca_file_is_one_line_and_exit_2(tmp_path: Path):
    result = await admin("https://127.0.0.1:9", "--ca-file", str(tmp_path / "missing.pem"))
    assert result.returncode == 2
    assert one_line(result) == (f"narwhal admin: --ca-file '{tmp_path / 'missing.pem'}': cannot load a CA bundle: "
                                "No such file or directory")
