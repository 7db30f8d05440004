"""``bench --tls``: a private CA and a certificate for 127.0.0.1, made with trustme for one run.

The mock engines serve HTTPS with the certificate, Narwhal serves HTTPS with
it and verifies the engines against the CA, and the load generator (and the
benchmark's own httpx client) trust the CA: every hop is TLS.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

__all__ = ["BenchTLS"]


class BenchTLS:
    """The PEM files of one run, written into its scratch directory."""

    def __init__(self, workdir: Path) -> None:
        try:
            import trustme
        except ImportError:
            raise RuntimeError("--tls needs trustme to make its certificates (pip install trustme)") from None
        ca = trustme.CA()
        cert = ca.issue_cert("127.0.0.1", "localhost")
        self.ca_file = workdir / "bench-ca.pem"
        self.cert_file = workdir / "bench-cert.pem"
        self.key_file = workdir / "bench-key.pem"
        ca.cert_pem.write_to_path(str(self.ca_file))
        self.cert_file.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
        cert.private_key_pem.write_to_path(str(self.key_file))

    @property
    def mock_args(self) -> list[str]:
        """The mock engine's options to serve HTTPS."""
        return ["--tls-cert-file", str(self.cert_file), "--tls-key-file", str(self.key_file)]

    def sections(self) -> dict[str, dict[str, Any]]:
        """Narwhal's config: HTTPS on its port, engines verified against the run's CA."""
        return {"serving": {"tls_cert_file": str(self.cert_file), "tls_key_file": str(self.key_file)},
                "engine": {"tls_ca_file": str(self.ca_file)}}

    def client_context(self) -> ssl.SSLContext:
        """What the load generator and the benchmark's httpx client verify with."""
        return ssl.create_default_context(cafile=str(self.ca_file))
