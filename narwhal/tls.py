"""TLS material: the router's server context and its client context for engines, built from files.

Both are built at startup, where any problem is a ``ConfigError`` naming the
key (missing file, not PEM, key does not match the certificate), and rebuilt
on SIGHUP. Holders swap a context by assigning one attribute: a handshake
already done keeps the context it began with, and the next handshake uses the
new one, so a reload never drops a connection.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from narwhal.config import Config, ConfigError, EngineConfig, ServingConfig, resolve_config_path

__all__ = ["TLSContexts", "engine_context", "server_context", "server_context_from_files", "tls_reason"]

# The only protocol either front speaks; ALPN says so to clients that ask.
_ALPN = ["http/1.1"]


def _readable(key: str, path: Path) -> str:
    try:
        with open(path, "rb") as handle:
            handle.read(1)
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {str(path)!r}: {exc.strerror or exc}") from None
    return str(path)


def _load_ca(context: ssl.SSLContext, key: str, path: Path) -> None:
    cafile = _readable(key, path)
    try:
        context.load_verify_locations(cafile=cafile)
    except ssl.SSLError as exc:
        raise ConfigError(f"{key}: {str(path)!r} holds no PEM certificate ({exc.reason or exc})") from None


def _load_chain(context: ssl.SSLContext, cert_key: str, key_key: str, cert: Path, key: Path) -> None:
    certfile = _readable(cert_key, cert)
    keyfile = _readable(key_key, key)
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


def server_context(serving: ServingConfig, base_dir: Path | None = None) -> ssl.SSLContext | None:
    """The context for HTTPS on ``serving.listen`` (None without a certificate); mTLS with a client CA."""
    if serving.tls_cert_file is None or serving.tls_key_file is None:
        return None
    client_ca = serving.tls_client_ca_file
    return server_context_from_files(
        resolve_config_path(serving.tls_cert_file, base_dir),
        resolve_config_path(serving.tls_key_file, base_dir),
        resolve_config_path(client_ca, base_dir) if client_ca is not None else None,
        names=("serving.tls_cert_file", "serving.tls_key_file", "serving.tls_client_ca_file"))


def server_context_from_files(cert_file: Path, key_file: Path, client_ca_file: Path | None = None, *,
                              names: tuple[str, str, str]) -> ssl.SSLContext:
    """A server context from PEM files; ``names`` (cert, key, client CA) label errors (config keys, options)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(_ALPN)
    _load_chain(context, names[0], names[1], cert_file, key_file)
    if client_ca_file is not None:
        _load_ca(context, names[2], client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


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
    """The process's current contexts; ``reload`` reads the files again and swaps both at once."""

    def __init__(self, config: Config, base_dir: Path | None = None) -> None:
        self._config = config
        self._base_dir = base_dir
        self.server, self.engine = self._build()

    @property
    def configured(self) -> bool:
        """True when there is anything to reload."""
        return self.server is not None or self.engine is not None

    def follower_server_context(self) -> ssl.SSLContext | None:
        """A server context for a listener that builds its context once (hypercorn's admin listener).

        Its SNI callback, which OpenSSL calls on every ClientHello (with or without
        SNI), moves each handshake onto the current context, so reloads reach it too.
        """
        if self.server is None:
            return None
        context = server_context(self._config.serving, self._base_dir)
        assert context is not None

        def follow(ssl_object: ssl.SSLObject, server_name: str | None, _: ssl.SSLContext) -> None:
            if self.server is not None:
                ssl_object.context = self.server

        context.sni_callback = follow
        return context

    def reload(self) -> None:
        """Read every file again; on any problem raise ConfigError and keep the current contexts."""
        self.server, self.engine = self._build()

    def _build(self) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
        server = server_context(self._config.serving, self._base_dir)
        engine = engine_context(self._config.engine, self._base_dir) if _engines_use_tls(self._config) else None
        return server, engine


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
