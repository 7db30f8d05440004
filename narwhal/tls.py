"""TLS material: the router's server context and its client context for engines, built from files.

Both are built at startup, where any problem is a ``ConfigError`` naming the
key (missing file, not PEM, key does not match the certificate, an expired
serving certificate), and rebuilt on SIGHUP. Every file is read with
``narwhal.files.read_regular_file``: a FIFO, a device or a file over
``MAX_PEM_BYTES`` is refused, never read. A running router reads them off the
event loop (``TLSContexts.reload``). Holders swap a context by
assigning one attribute: a handshake already done keeps the context it began
with, and the next handshake uses the new one, so a reload never drops a
connection.

The config module never imports this one: ``parse_config`` checks the text,
and the certificates are read where the contexts are built (``Router``, each
worker, ``engine-check``), so a bad file is still a one-line error naming its key.
"""

from __future__ import annotations

import base64
import binascii
import calendar
import dataclasses
import datetime
import logging
import math
import re
import ssl
import time
from collections.abc import Callable
from pathlib import Path

import trio

from narwhal.config import Config, ConfigError, EngineConfig, ServingConfig, resolve_config_path
from narwhal.files import FileRefused, read_regular_file
from narwhal.obs.logs import log_event

__all__ = [
    "MAX_PEM_BYTES",
    "TLS_READ_TIMEOUT_S",
    "CertificateLifetime",
    "ExpiryWatch",
    "TLSContexts",
    "certificate_lifetime",
    "engine_context",
    "expiry_warning_due",
    "server_context",
    "server_context_from_files",
    "tls_reason",
]

# The only protocol either front speaks; ALPN says so to clients that ask.
_ALPN = ["http/1.1"]
# How often a running router looks at its serving certificate's end, and repeats a warning.
_EXPIRY_CHECK_INTERVAL_S = 3600.0
_EXPIRY_REPEAT_S = 86400.0
# A serving certificate is "expiring" in the last third of its life, and at the latest 30 days
# before it ends: cert-manager and ACME clients renew at two thirds, so a warning means a renewal failed.
_EXPIRY_WARNING_MAX_S = 30 * 86400.0
_EXPIRY_WARNING_FRACTION = 1 / 3
# A certificate chain, a key or a CA bundle is a few KiB (a large bundle some hundreds): 1 MiB per file.
MAX_PEM_BYTES = 1024 * 1024
# A reload gives up on the files after this long; they are read in a thread, so the loop never waits on them.
TLS_READ_TIMEOUT_S = 10.0
_PEM_CERTIFICATE = re.compile(rb"-----BEGIN CERTIFICATE-----\s*(.+?)\s*-----END CERTIFICATE-----", re.S)


@dataclasses.dataclass(frozen=True)
class CertificateLifetime:
    """A certificate's validity, in unix seconds."""

    not_before: float
    not_after: float

    def remaining_s(self, now: float) -> float:
        """Seconds until it expires (negative once it has)."""
        return self.not_after - now


def certificate_lifetime(pem: bytes) -> CertificateLifetime:
    """The validity of the first certificate in ``pem`` (the leaf of a chain); ValueError if unreadable.

    Read from the DER by hand: the standard library loads certificates into
    contexts but gives no public way to read a file's dates.
    """
    match = _PEM_CERTIFICATE.search(pem)
    if match is None:
        raise ValueError("no PEM certificate")
    try:
        der = base64.b64decode(b"".join(match.group(1).split()), validate=True)
    except binascii.Error:
        raise ValueError("the PEM certificate is not base64") from None
    # Certificate ::= SEQUENCE { tbsCertificate SEQUENCE { [0] version?, serial, signature,
    #                            issuer, validity SEQUENCE { notBefore, notAfter }, ... } ... }
    _tag, start, _end = _der_item(der, 0)
    _tag, pos, _end = _der_item(der, start)
    tag, _start, end = _der_item(der, pos)
    if tag == 0xA0:  # explicit version
        pos = end
    for _field in ("serial", "signature", "issuer"):
        pos = _der_item(der, pos)[2]
    tag, pos, _end = _der_item(der, pos)
    if tag != 0x30:
        raise ValueError("no validity in the certificate")
    not_before, pos = _der_time(der, pos)
    not_after, _pos = _der_time(der, pos)
    return CertificateLifetime(not_before, not_after)


def _der_item(der: bytes, pos: int) -> tuple[int, int, int]:
    """(tag, content start, content end) of the DER item at ``pos``."""
    if pos + 2 > len(der):
        raise ValueError("truncated certificate")
    tag, length = der[pos], der[pos + 1]
    pos += 2
    if length & 0x80:
        count = length & 0x7F
        if not 1 <= count <= 4 or pos + count > len(der):
            raise ValueError("bad length in the certificate")
        length = int.from_bytes(der[pos:pos + count], "big")
        pos += count
    if pos + length > len(der):
        raise ValueError("truncated certificate")
    return tag, pos, pos + length


def _der_time(der: bytes, pos: int) -> tuple[float, int]:
    tag, start, end = _der_item(der, pos)
    text = der[start:end].decode("ascii", "replace")
    try:
        if tag == 0x17:  # UTCTime YYMMDDHHMMSSZ; years 50-99 are 19xx (RFC 5280)
            parsed = datetime.datetime.strptime(text, "%y%m%d%H%M%SZ")
            if parsed.year >= 2050:
                parsed = parsed.replace(year=parsed.year - 100)
        elif tag == 0x18:  # GeneralizedTime YYYYMMDDHHMMSSZ
            parsed = datetime.datetime.strptime(text, "%Y%m%d%H%M%SZ")
        else:
            raise ValueError(f"unknown time tag {tag:#x}")
    except ValueError as exc:
        raise ValueError(f"bad validity time in the certificate: {exc}") from None
    return float(calendar.timegm(parsed.timetuple())), end


def expiry_warning_due(lifetime: CertificateLifetime, now: float) -> bool:
    """True in the last third of the certificate's life (at most its last 30 days), and once expired."""
    window = min(_EXPIRY_WARNING_MAX_S, (lifetime.not_after - lifetime.not_before) * _EXPIRY_WARNING_FRACTION)
    return lifetime.remaining_s(now) <= window


def _iso(unix: float) -> str:
    return datetime.datetime.fromtimestamp(unix, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _read_pem(key: str, path: Path) -> bytes:
    """The file's bytes; ConfigError naming ``key`` when it is missing, not a regular file or over the bound."""
    try:
        return read_regular_file(path, MAX_PEM_BYTES)
    except FileRefused as exc:
        raise ConfigError(f"{key}: cannot read {str(path)!r}: {exc}") from None
    except (OSError, ValueError) as exc:  # ValueError: a path the OS cannot take (NUL byte)
        raise ConfigError(f"{key}: cannot read {str(path)!r}: {getattr(exc, 'strerror', None) or exc}") from None


def _load_ca(context: ssl.SSLContext, key: str, path: Path) -> None:
    # Checked before the ssl module opens it (it takes only paths): a FIFO there would block its open.
    _read_pem(key, path)
    cafile = str(path)
    try:
        context.load_verify_locations(cafile=cafile)
    except ssl.SSLError as exc:
        raise ConfigError(f"{key}: {str(path)!r} holds no PEM certificate ({exc.reason or exc})") from None


def _load_chain(context: ssl.SSLContext, cert_key: str, key_key: str, cert: Path, key: Path) -> bytes:
    """Load the pair into ``context``; the certificate file's bytes (checked as ``_read_pem`` does)."""
    cert_pem = _read_pem(cert_key, cert)
    _read_pem(key_key, key)
    certfile, keyfile = str(cert), str(key)
    # Parsed as a CA bundle first in a throwaway context: it tells a bad certificate
    # file apart from a bad key file, which load_cert_chain reports alike.
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        probe.load_verify_locations(cafile=certfile)
    except ssl.SSLError:
        raise ConfigError(f"{cert_key}: {str(cert)!r} holds no PEM certificate") from None
    try:
        # A password callback that gives nothing makes an encrypted key fail here
        # instead of prompting on the terminal.
        context.load_cert_chain(certfile, keyfile, password=lambda: b"")
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise ConfigError(f"{key_key}: the key in {str(key)!r} does not match the certificate in "
                              f"{cert_key}") from None
        raise ConfigError(f"{key_key}: {str(key)!r} holds no usable PEM private key "
                          f"(unencrypted keys only)") from None
    return cert_pem


def server_context(serving: ServingConfig, base_dir: Path | None = None,
                   now: float | None = None) -> ssl.SSLContext | None:
    """The context for HTTPS on ``serving.listen`` (None without a certificate); mTLS with a client CA."""
    served = _serving(serving, base_dir, now)
    return None if served is None else served[0]


def _serving(serving: ServingConfig, base_dir: Path | None,
             now: float | None) -> tuple[ssl.SSLContext, CertificateLifetime] | None:
    """``server_context`` and the validity of the certificate it serves (read once, from the same bytes)."""
    if serving.tls_cert_file is None or serving.tls_key_file is None:
        return None
    client_ca = serving.tls_client_ca_file
    return _server_context_and_lifetime(
        resolve_config_path(serving.tls_cert_file, base_dir),
        resolve_config_path(serving.tls_key_file, base_dir),
        resolve_config_path(client_ca, base_dir) if client_ca is not None else None,
        names=("serving.tls_cert_file", "serving.tls_key_file", "serving.tls_client_ca_file"), now=now)


def server_context_from_files(cert_file: Path, key_file: Path, client_ca_file: Path | None = None, *,
                              names: tuple[str, str, str], now: float | None = None) -> ssl.SSLContext:
    """A server context from PEM files; ``names`` (cert, key, client CA) label errors (config keys, options).

    An expired certificate is refused: every handshake with it would fail (``now``: unix seconds).
    """
    return _server_context_and_lifetime(cert_file, key_file, client_ca_file, names=names, now=now)[0]


def _server_context_and_lifetime(cert_file: Path, key_file: Path, client_ca_file: Path | None, *,
                                 names: tuple[str, str, str],
                                 now: float | None) -> tuple[ssl.SSLContext, CertificateLifetime]:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(_ALPN)
    cert_pem = _load_chain(context, names[0], names[1], cert_file, key_file)
    try:
        lifetime = certificate_lifetime(cert_pem)
    except ValueError as exc:
        raise ConfigError(f"{names[0]}: cannot read the validity of {str(cert_file)!r}: {exc}") from None
    now = time.time() if now is None else now
    if lifetime.not_after <= now:
        raise ConfigError(f"{names[0]}: the certificate in {str(cert_file)!r} expired at "
                          f"{_iso(lifetime.not_after)}: renew it")
    if client_ca_file is not None:
        _load_ca(context, names[2], client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context, lifetime


def engine_context(engine: EngineConfig, base_dir: Path | None = None) -> ssl.SSLContext:
    """The client context for ``https://`` engines: verifies them (system store without a CA file)."""
    if engine.tls_ca_file is not None:
        # A private CA replaces the system store: only engines it signed are trusted.
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        _load_ca(context, "engine.tls_ca_file", resolve_config_path(engine.tls_ca_file, base_dir))
    else:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    # Both already default to these; stated because the engine contract depends on them.
    context.check_hostname = True
    context.verify_mode = ssl.CERT_REQUIRED
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(_ALPN)
    if engine.tls_cert_file is not None and engine.tls_key_file is not None:
        _load_chain(context, "engine.tls_cert_file", "engine.tls_key_file",
                    resolve_config_path(engine.tls_cert_file, base_dir),
                    resolve_config_path(engine.tls_key_file, base_dir))
    return context


def _engines_use_tls(config: Config) -> bool:
    return any(spec.tls for spec in config.engines) or any(
        value is not None for value in (config.engine.tls_ca_file, config.engine.tls_cert_file))


class TLSContexts:
    """The process's current contexts; ``reload`` reads the files again and swaps both at once.

    Built at startup by reading the files where it is called (blocking, bounded:
    startup has no streams to stall); ``reload`` reads them in a thread.
    """

    def __init__(self, config: Config, base_dir: Path | None = None) -> None:
        self._config = config
        self._base_dir = base_dir
        self.server: ssl.SSLContext | None
        self.engine: ssl.SSLContext | None
        # The validity of the certificate ``server`` serves (None without TLS); swapped with it.
        self.server_lifetime: CertificateLifetime | None
        self.server, self.engine, self.server_lifetime = self._build()

    @property
    def configured(self) -> bool:
        """True when there is anything to reload."""
        return self.server is not None or self.engine is not None

    async def reload(self, timeout_s: float = TLS_READ_TIMEOUT_S) -> None:
        """Read every file again off the event loop; on any problem raise ConfigError, keeping the contexts.

        The files are checked before they are opened to read (a FIFO is refused
        at once); should an open still hang (a path swapped for a FIFO between
        the check and the ssl module's open), the reload fails after
        ``timeout_s`` and the thread is left to finish on its own.
        """
        with trio.move_on_after(timeout_s):
            built = await trio.to_thread.run_sync(self._build, abandon_on_cancel=True)
            self.server, self.engine, self.server_lifetime = built
            return
        raise ConfigError(f"the TLS files were not read within {timeout_s:g} s")

    def reload_blocking(self) -> None:
        """``reload`` where there is no thread to run it in (a worker process): checked and bounded the same."""
        self.server, self.engine, self.server_lifetime = self._build()

    def expiry_warning(self, now: float) -> dict[str, object] | None:
        """The fields of a ``tls_cert_expiring`` event when the serving certificate is near its end, else None."""
        lifetime = self.server_lifetime
        if lifetime is None or not expiry_warning_due(lifetime, now):
            return None
        return {"key": "serving.tls_cert_file", "file": self._config.serving.tls_cert_file,
                "expires_at": _iso(lifetime.not_after), "remaining_s": round(lifetime.remaining_s(now))}

    def _build(self) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None, CertificateLifetime | None]:
        """The server context, the engine context and the served certificate's validity (blocking file reads)."""
        served = _serving(self._config.serving, self._base_dir, None)
        engine = engine_context(self._config.engine, self._base_dir) if _engines_use_tls(self._config) else None
        return (None, engine, None) if served is None else (served[0], engine, served[1])


def tls_reason(exc: BaseException) -> str | None:
    """The TLS reason beneath a trio error (trio wraps ssl errors), as one line; None when it is not TLS."""
    seen: BaseException | None = exc
    for _ in range(8):  # a cause chain is short; bounded all the same
        if seen is None:
            return None
        if isinstance(seen, ssl.SSLCertVerificationError):
            return f"{seen.reason}: {seen.verify_message}" if seen.verify_message else str(seen)
        if isinstance(seen, ssl.SSLError):
            return str(seen.reason or seen)
        seen = seen.__cause__ or seen.__context__
    return None


class ExpiryWatch:
    """Warns before the serving certificate ends: ``tls_cert_expiring``, and the gauge's value.

    ``check`` runs at start, after each reload and hourly; a warning is repeated
    at most daily (at once after a reload). ``gauge`` feeds
    ``narwhal_tls_cert_expiry_seconds`` (no sample without TLS).
    """

    def __init__(self, contexts: TLSContexts, *, wall_clock: Callable[[], float] = time.time,
                 clock: Callable[[], float] = trio.current_time) -> None:
        self._contexts = contexts
        self._wall_clock = wall_clock
        self._clock = clock
        self._warned_at = -math.inf

    def gauge(self) -> dict[tuple[str, ...], float]:
        """Seconds until the serving certificate expires, negative once it has."""
        lifetime = self._contexts.server_lifetime
        return {} if lifetime is None else {(): round(lifetime.remaining_s(self._wall_clock()), 3)}

    def check(self, *, force: bool = False) -> bool:
        """Log ``tls_cert_expiring`` when the certificate is near its end (and not warned of lately)."""
        wall = self._wall_clock()
        warning = self._contexts.expiry_warning(wall)
        now = self._clock()
        lifetime = self._contexts.server_lifetime
        if warning is None or lifetime is None or (not force and now - self._warned_at < _EXPIRY_REPEAT_S):
            return False
        self._warned_at = now
        expired = lifetime.remaining_s(wall) <= 0
        log_event("tls_cert_expiring", level=logging.ERROR if expired else logging.WARNING, expired=expired,
                  **warning)
        return True

    async def run(self) -> None:
        """Check hourly, for as long as the router runs."""
        while True:
            await trio.sleep(_EXPIRY_CHECK_INTERVAL_S)
            self.check()
