"""Narwhal's configuration: a TOML file decoded into frozen msgspec structs.

Every struct forbids unknown fields, so a typo in a key fails loudly with the
key's path. ``load_config`` turns every problem (unreadable file, bad TOML,
unknown key, wrong type, cross-field rule) into one ``ConfigError`` whose
message names the key and the problem; the CLI prints it and exits non-zero.
"""

from __future__ import annotations

import re
import urllib.parse
from pathlib import Path
from typing import Literal

import msgspec

__all__ = [
    "AdminConfig",
    "Config",
    "ConfigError",
    "ControllerConfig",
    "EngineConfig",
    "EngineSpec",
    "FleetConfig",
    "HandoffConfig",
    "LeaseConfig",
    "RecoveryConfig",
    "ServingConfig",
    "TelemetryConfig",
    "load_config",
    "parse_config",
    "parse_listen",
]


class ConfigError(Exception):
    """A configuration problem, with a message fit to show an operator as is."""


def _positive(name: str, value: float | int) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")


def parse_listen(value: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[v6]:PORT`` too) into its parts, or raise ValueError."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    host = host.strip("[]")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"port must be a number in {value!r}") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"port out of range in {value!r}")
    return host, port


class _Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class ServingConfig(_Section, frozen=True):
    listen: str = "127.0.0.1:8000"
    # The data pool: prefill, decode and token counting share this bound.
    max_connections: int = 256
    request_deadline_s: float = 300.0
    max_body_bytes: int = 4 * 1024 * 1024
    max_header_bytes: int = 16 * 1024
    idle_timeout_s: float = 60.0
    shutdown_grace_s: float = 30.0
    count_tokens: bool = True
    policy: Literal["saturate", "bounded"] = "saturate"
    # Bounded policy only: attempts per request, all within request_deadline_s.
    max_attempts: int = 3

    def __post_init__(self) -> None:
        parse_listen(self.listen)
        for name in ("max_connections", "request_deadline_s", "max_body_bytes",
                     "max_header_bytes", "idle_timeout_s", "max_attempts"):
            _positive(name, getattr(self, name))
        if self.shutdown_grace_s < 0:
            raise ValueError("shutdown_grace_s must be >= 0")


class EngineConfig(_Section, frozen=True):
    # The control pool: health checks, suspect verification, readmission.
    control_connections: int = 16
    connect_timeout_s: float = 2.0
    # Transport timeout for one read or write on an engine connection.
    request_timeout_s: float = 60.0
    first_token_deadline_s: float = 30.0
    stream_silence_s: float = 30.0
    health_timeout_s: float = 2.0
    # Idle engine connections are closed before the engine's own keep-alive
    # (vLLM/uvicorn: 5 s) closes them under us.
    pool_idle_s: float = 4.0

    def __post_init__(self) -> None:
        for name in ("control_connections", "connect_timeout_s", "request_timeout_s",
                     "first_token_deadline_s", "stream_silence_s", "health_timeout_s",
                     "pool_idle_s"):
            _positive(name, getattr(self, name))


class FleetConfig(_Section, frozen=True):
    model: str = "mock-model"
    generation: str = "g1"
    attestation_key: str | None = None
    attestation_key_file: str | None = None

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must not be empty")
        if self.attestation_key is not None and self.attestation_key_file is not None:
            raise ValueError("set attestation_key or attestation_key_file, not both")


class ControllerConfig(_Section, frozen=True):
    monitor_interval_s: float = 1.0
    monitor_failure_limit: int = 3
    stage_timeout_s: float = 2.0
    drift_factor: float = 3.0
    drift_intervals: int = 3

    def __post_init__(self) -> None:
        for name in ("monitor_interval_s", "monitor_failure_limit", "stage_timeout_s",
                     "drift_intervals"):
            _positive(name, getattr(self, name))
        if self.drift_factor <= 1:
            raise ValueError(f"drift_factor must be > 1, got {self.drift_factor}")


class TelemetryConfig(_Section, frozen=True):
    interval_s: float = 10.0
    keep_intervals: int = 30

    def __post_init__(self) -> None:
        _positive("interval_s", self.interval_s)
        _positive("keep_intervals", self.keep_intervals)


class RecoveryConfig(_Section, frozen=True):
    eject_after: int = 3
    liveness_misses: int = 3
    failure_quarantine_s: float | None = None
    probe_interval_s: float = 5.0

    def __post_init__(self) -> None:
        _positive("eject_after", self.eject_after)
        _positive("liveness_misses", self.liveness_misses)
        _positive("probe_interval_s", self.probe_interval_s)
        if self.failure_quarantine_s is not None:
            _positive("failure_quarantine_s", self.failure_quarantine_s)


class HandoffConfig(_Section, frozen=True):
    path: str = "narwhal-handoff.json"


class LeaseConfig(_Section, frozen=True):
    backend: Literal["none", "file", "etcd"] = "none"
    router_id: str | None = None
    path: str | None = None
    endpoints: list[str] = []
    key: str = "/narwhal/lease"
    ttl_s: float = 10.0
    renew_interval_s: float = 3.0
    fence_margin_s: float = 2.0
    takeover_ready_failures: int = 3
    # Where a standby polls this router's /ready; default: from serving.listen.
    advertise_url: str | None = None

    def __post_init__(self) -> None:
        for name in ("ttl_s", "renew_interval_s", "fence_margin_s", "takeover_ready_failures"):
            _positive(name, getattr(self, name))
        # client-go's rule of thumb: two renewals may fail before the holder must fence.
        if not self.ttl_s > self.fence_margin_s + 2 * self.renew_interval_s:
            raise ValueError(
                f"ttl_s ({self.ttl_s:g}) must be > fence_margin_s ({self.fence_margin_s:g}) "
                f"+ 2 x renew_interval_s ({self.renew_interval_s:g})")
        if self.router_id is not None and not self.router_id:
            raise ValueError("router_id must not be empty when set")
        for i, endpoint in enumerate(self.endpoints):
            parts = urllib.parse.urlsplit(endpoint)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"endpoints[{i}] must be http(s)://HOST:PORT, got {endpoint!r}")
        if self.advertise_url is not None:
            parts = urllib.parse.urlsplit(self.advertise_url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"advertise_url must be http(s)://HOST[:PORT], got {self.advertise_url!r}")
        if not self.key.startswith("/"):
            raise ValueError(f"key must start with '/', got {self.key!r}")


class AdminConfig(_Section, frozen=True):
    token: str | None = None
    listen: str | None = None

    def __post_init__(self) -> None:
        if self.listen is not None:
            parse_listen(self.listen)
        if self.token is not None and not self.token:
            raise ValueError("token must not be empty when set")


class EngineSpec(_Section, frozen=True):
    name: str
    url: str
    role: Literal["prefill", "decode"]

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name must not be empty")
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"url must be http://HOST[:PORT], got {self.url!r}")
        try:
            _ = parts.port  # urlsplit parses the port lazily: reading it validates it
        except ValueError:
            raise ValueError(f"url has a bad port: {self.url!r}") from None
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError(f"url must have no path, query or fragment: {self.url!r}")

    @property
    def host(self) -> str:
        return urllib.parse.urlsplit(self.url).hostname or ""

    @property
    def port(self) -> int:
        return urllib.parse.urlsplit(self.url).port or 80

    @property
    def base_url(self) -> str:
        return self.url.rstrip("/")


class Config(_Section, frozen=True):
    serving: ServingConfig = ServingConfig()
    engine: EngineConfig = EngineConfig()
    fleet: FleetConfig = FleetConfig()
    controller: ControllerConfig = ControllerConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    recovery: RecoveryConfig = RecoveryConfig()
    handoff: HandoffConfig = HandoffConfig()
    lease: LeaseConfig = LeaseConfig()
    admin: AdminConfig = AdminConfig()
    engines: list[EngineSpec] = []

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for i, engine in enumerate(self.engines):
            if engine.name in seen:
                raise ValueError(f"duplicate engine name {engine.name!r} - at `$.engines[{i}].name`")
            seen.add(engine.name)
        roles = {engine.role for engine in self.engines}
        for role in ("prefill", "decode"):
            if role not in roles:
                raise ValueError(f"no {role} engine configured (need at least one [[engines]] with role = \"{role}\")")
        if self.lease.backend == "file" and not self.lease.path:
            raise ValueError("lease.path is required when lease.backend = \"file\"")
        if self.lease.backend == "etcd" and not self.lease.endpoints:
            raise ValueError("lease.endpoints is required when lease.backend = \"etcd\"")

    def engine_spec(self, name: str) -> EngineSpec:
        for spec in self.engines:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def attestation_key_bytes(self, base_dir: Path | None = None) -> bytes | None:
        """The fleet's HMAC key, read from the file when one is named."""
        if self.fleet.attestation_key is not None:
            return self.fleet.attestation_key.encode()
        if self.fleet.attestation_key_file is not None:
            path = Path(self.fleet.attestation_key_file)
            if base_dir is not None and not path.is_absolute():
                path = base_dir / path
            return path.read_bytes().strip()
        return None


def _explain(exc: msgspec.ValidationError) -> str:
    # msgspec says "... - at `$.serving.listen`"; operators think in TOML keys.
    text = str(exc)
    message, sep, where = text.rpartition(" - at `")
    if not sep:
        message, where = text, ""
    key = where.rstrip("`").removeprefix("$").lstrip(".")
    unknown = re.fullmatch(r"Object contains unknown field `(.+)`", message)
    if unknown:
        key = f"{key}.{unknown.group(1)}" if key else unknown.group(1)
        return f"{key}: unknown key"
    return f"{key}: {message}" if key else message


def parse_config(data: bytes | str, source: str = "<config>") -> Config:
    """Decode TOML text into a ``Config``, raising ``ConfigError`` on any problem."""
    try:
        config = msgspec.toml.decode(data, type=Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {_explain(exc)}") from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    if config.fleet.attestation_key_file is not None:
        key_path = Path(config.fleet.attestation_key_file)
        if not key_path.is_absolute() and source != "<config>":
            key_path = Path(source).parent / key_path
        try:
            key_path.read_bytes()
        except OSError as exc:
            raise ConfigError(
                f"{source}: fleet.attestation_key_file: cannot read {str(key_path)!r}: {exc.strerror}"
            ) from None
    return config


def load_config(path: str | Path) -> Config:
    """Read and decode the config file at ``path``."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror or exc}") from None
    return parse_config(data, source=str(path))

