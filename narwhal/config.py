"""Narwhal's configuration: a TOML file decoded into frozen msgspec structs.

Every struct forbids unknown fields, so a typo in a key fails loudly with the
key's path. ``load_config`` turns every problem (unreadable file, bad TOML,
unknown key, wrong type, cross-field rule) into one ``ConfigError`` whose
message names the key and the problem; the CLI prints it and exits non-zero.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import socket
import tomllib
import typing
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Literal, Protocol

import msgspec

from narwhal.errors import NarwhalError
from narwhal.files import FileRefused, read_regular_file

__all__ = [
    "AdminConfig",
    "Config",
    "ConfigError",
    "ControllerConfig",
    "DiscoveryConfig",
    "EngineConfig",
    "ENGINE_TIMEOUT_KEYS",
    "EngineSpec",
    "FleetConfig",
    "HandoffConfig",
    "LeaseConfig",
    "ModelConfig",
    "PlacementConfig",
    "Reconfigurable",
    "RecoveryConfig",
    "RunningConfig",
    "ServingConfig",
    "TelemetryConfig",
    "TracingConfig",
    "admin_token_problem",
    "host_name_problem",
    "load_config",
    "otlp_endpoint_problem",
    "parse_config",
    "parse_listen",
    "zmq_endpoint_problem",
    "resolve_config_path",
]


class ConfigError(NarwhalError):
    """A configuration problem, with a message fit to show an operator as is."""


def _finite(name: str, value: float | int) -> None:
    # TOML has nan and inf; every comparison with nan is False, so it would pass any "> 0" check.
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")


def _positive(name: str, value: float | int) -> None:
    _finite(name, value)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")


def _at_least(name: str, value: float | int, minimum: float | int) -> None:
    _finite(name, value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum:g}, got {value}")


# Floors for periods: below them a loop spins rather than paces (see docs/configuration.md).
MIN_MONITOR_INTERVAL_S = 0.05
MIN_STAGE_TIMEOUT_S = 0.01
MIN_PROBE_INTERVAL_S = 0.05
# Out engines are health-checked this often by default: a restart is noticed within it.
DEFAULT_RECHECK_INTERVAL_S = 0.1
MIN_TELEMETRY_INTERVAL_S = 0.05


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


def join_listen(host: str, port: int) -> str:
    """``HOST:PORT`` as ``parse_listen`` reads it: an IPv6 host in brackets (``[::1]:8000``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _listen(name: str, value: str) -> None:
    # "name: problem": _explain makes the field part of the key (serving.listen: port out of range ...).
    try:
        parse_listen(value)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _pair(first: str, first_value: str | None, second: str, second_value: str | None) -> None:
    for name, value in ((first, first_value), (second, second_value)):
        if value is not None and not value:
            raise ValueError(f"{name} must not be empty")
    if (first_value is None) != (second_value is None):
        missing = second if first_value is not None else first
        present = first if first_value is not None else second
        raise ValueError(f"{missing} is required when {present} is set")


def admin_token_problem(token: str) -> str | None:
    """Why ``token`` cannot be an HTTP bearer token (empty, not printable ASCII), or None."""
    if not token:
        return "must not be empty when set"
    if not all("!" <= ch <= "~" for ch in token):
        return "must be printable ASCII without spaces (it travels in an HTTP header)"
    return None


# A DNS name as a Host header carries it: letters, digits, hyphens, underscores, dots.
_HOST_NAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?\.?")


def host_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be an ``[admin] allowed_hosts`` entry (a bare DNS name: no scheme, port or path)."""
    if not _HOST_NAME.fullmatch(name):
        return f"must be a host name without scheme, port or path (e.g. \"router.internal\"), got {name!r}"
    return None


class _Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


# More workers than this is a typo, not a machine.
MAX_WORKERS = 256


class ServingConfig(_Section, frozen=True):
    listen: str = "127.0.0.1:8000"
    # The data pool: prefill, decode and token counting share this bound.
    max_connections: int = 256
    request_deadline_s: float = 300.0
    max_body_bytes: int = 4 * 1024 * 1024
    max_header_bytes: int = 16 * 1024
    idle_timeout_s: float = 60.0
    # Hostile clients: the whole head, the whole body and each write to the client are bounded.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    client_write_timeout_s: float = 30.0
    # Unset: sized from the fd limit (RLIMIT_NOFILE) less what the engine pools need.
    max_client_connections: int | None = None
    shutdown_grace_s: float = 30.0
    count_tokens: bool = True
    policy: Literal["saturate", "bounded"] = "saturate"
    # Bounded policy only: attempts per request, all within request_deadline_s.
    max_attempts: int = 3
    # Bounded policy only: a decode that fails after the client has bytes is continued on
    # another engine into the same stream (each continuation is one of max_attempts).
    continue_streams: bool = True
    # One pump per process reads every live decode stream and writes it to its client
    # (plain sockets; TLS keeps the request task's own relay). false: every stream relays in its own task.
    relay_pump: bool = True
    # Pumped streams' engine sockets sit in the hub's pump set, served from trio's own waits instead of trio
    # waking the hub task per batch (narwhal/http1/idle_rounds.py), and trio's loop runs a hub's round before its
    # task's step (narwhal/http1/early_rounds.py). false: the hub task wakes each time and does its own rounds.
    relay_inline: bool = True
    # Bounded policy only: requests waiting for capacity at most (the lowest priority class is shed first).
    max_queue: int = 256
    # Data-plane processes. 1: one process does everything. N > 1: this process
    # is the controller and N workers serve the data plane on the same port.
    workers: int = 1
    # HTTPS on `listen` (both fronts; and [admin] listen) when both are set;
    # a client CA makes callers present a certificate it signed.
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None

    def __post_init__(self) -> None:
        _listen("listen", self.listen)
        if not 1 <= self.workers <= MAX_WORKERS:
            raise ValueError(f"workers must be between 1 and {MAX_WORKERS}")
        _pair("tls_cert_file", self.tls_cert_file, "tls_key_file", self.tls_key_file)
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file needs tls_cert_file and tls_key_file (client certificates "
                             "are only asked for over HTTPS)")
        for name in ("max_connections", "request_deadline_s", "max_body_bytes",
                     "max_header_bytes", "idle_timeout_s", "max_attempts", "header_timeout_s",
                     "body_timeout_s", "client_write_timeout_s", "max_queue"):
            _positive(name, getattr(self, name))
        if self.max_client_connections is not None:
            _positive("max_client_connections", self.max_client_connections)
        _at_least("shutdown_grace_s", self.shutdown_grace_s, 0)


# The [engine] keys a running router takes from a reloaded file: calls and streams started
# after the reload use them (the pools' sizes and memory bounds stay as built).
ENGINE_TIMEOUT_KEYS = ("connect_timeout_s", "request_timeout_s", "first_token_deadline_s", "stream_silence_s",
                       "health_timeout_s", "pool_idle_s")


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
    # For https:// engines: the CA bundle that verifies them (the system store
    # when unset) and the router's client certificate for engines requiring mTLS.
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    # Bounds on what an engine sends back that the router holds in memory: every
    # buffered body (prefill, token count, non-streamed decode, error and control
    # answers) and every response head. Streamed decode bodies are relayed, not held.
    max_response_bytes: int = 8 * 1024 * 1024
    max_response_header_bytes: int = 64 * 1024
    # The prefill's kv_transfer_params as forwarded to decode (JSON bytes).
    max_handoff_bytes: int = 1024 * 1024

    def __post_init__(self) -> None:
        _pair("tls_cert_file", self.tls_cert_file, "tls_key_file", self.tls_key_file)
        for name in ("control_connections", "connect_timeout_s", "request_timeout_s",
                     "first_token_deadline_s", "stream_silence_s", "health_timeout_s",
                     "pool_idle_s"):
            _positive(name, getattr(self, name))
        _at_least("max_response_bytes", self.max_response_bytes, 1024)
        _at_least("max_response_header_bytes", self.max_response_header_bytes, 1024)
        _at_least("max_handoff_bytes", self.max_handoff_bytes, 256)

    def with_timeouts_of(self, other: EngineConfig) -> EngineConfig:
        """This config with ``other``'s ``ENGINE_TIMEOUT_KEYS`` (a reload), every other key kept."""
        return msgspec.structs.replace(self, **{key: getattr(other, key) for key in ENGINE_TIMEOUT_KEYS})


class ModelConfig(_Section, frozen=True):
    """One ``[[fleet.models]]`` entry: a served model's own keys (each unset one is the fleet's or serving's)."""

    name: str
    generation: str | None = None
    # Other names clients may send for this model; the engines get ``name``.
    aliases: list[str] = []
    max_attempts: int | None = None
    request_deadline_s: float | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name must not be empty")
        if self.generation is not None and not self.generation:
            raise ValueError("generation must not be empty when set")
        for index, alias in enumerate(self.aliases):
            if not alias:
                raise ValueError(f"aliases[{index}] must not be empty")
        if self.max_attempts is not None:
            _positive("max_attempts", self.max_attempts)
        if self.request_deadline_s is not None:
            _positive("request_deadline_s", self.request_deadline_s)


class FleetConfig(_Section, frozen=True):
    # The model of every [[engines]] entry that names none, and the one a request without `model` gets
    # when it is the only model served.
    model: str = "mock-model"
    generation: str = "g1"
    attestation_key: str | None = None
    attestation_key_file: str | None = None
    # Per-model keys (generation, aliases, max_attempts, request_deadline_s); a model without an entry
    # takes the fleet's and serving's values.
    models: list[ModelConfig] = []

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must not be empty")
        if not self.generation:
            raise ValueError("generation must not be empty")

    def generation_of(self, model: str) -> str:
        """The generation engines of ``model`` must report: its ``[[fleet.models]]`` entry's, else ``generation``."""
        for entry in self.models:
            if entry.name == model and entry.generation is not None:
                return entry.generation
        return self.generation
        if self.attestation_key is not None and self.attestation_key_file is not None:
            raise ValueError("set attestation_key or attestation_key_file, not both")


class ControllerConfig(_Section, frozen=True):
    monitor_interval_s: float = 1.0
    monitor_failure_limit: int = 3
    stage_timeout_s: float = 2.0
    drift_factor: float = 3.0
    drift_intervals: int = 3

    def __post_init__(self) -> None:
        for name in ("monitor_failure_limit", "drift_intervals"):
            _positive(name, getattr(self, name))
        _at_least("monitor_interval_s", self.monitor_interval_s, MIN_MONITOR_INTERVAL_S)
        _at_least("stage_timeout_s", self.stage_timeout_s, MIN_STAGE_TIMEOUT_S)
        _finite("drift_factor", self.drift_factor)
        if self.drift_factor <= 1:
            raise ValueError(f"drift_factor must be > 1, got {self.drift_factor}")


class TelemetryConfig(_Section, frozen=True):
    interval_s: float = 10.0
    keep_intervals: int = 30

    def __post_init__(self) -> None:
        _at_least("interval_s", self.interval_s, MIN_TELEMETRY_INTERVAL_S)
        _positive("keep_intervals", self.keep_intervals)


class RecoveryConfig(_Section, frozen=True):
    eject_after: int = 3
    liveness_misses: int = 3
    failure_quarantine_s: float | None = None
    probe_interval_s: float = 5.0
    # How often the engines that are out (ejected, or quarantined) are health-checked
    # between monitor passes; the first backoff step after a refused readmission.
    # None: DEFAULT_RECHECK_INTERVAL_S, or probe_interval_s when that is shorter.
    recheck_interval_s: float | None = None

    def __post_init__(self) -> None:
        _positive("eject_after", self.eject_after)
        _positive("liveness_misses", self.liveness_misses)
        _at_least("probe_interval_s", self.probe_interval_s, MIN_PROBE_INTERVAL_S)
        if self.failure_quarantine_s is not None:
            _positive("failure_quarantine_s", self.failure_quarantine_s)
        if self.recheck_interval_s is not None:
            _at_least("recheck_interval_s", self.recheck_interval_s, MIN_PROBE_INTERVAL_S)
            if self.recheck_interval_s > self.probe_interval_s:
                raise ValueError(f"recheck_interval_s ({self.recheck_interval_s:g}) must be <= probe_interval_s "
                                 f"({self.probe_interval_s:g}): it is the faster cadence")

    @property
    def recheck_period_s(self) -> float:
        """``recheck_interval_s`` as set, else the default capped at ``probe_interval_s``."""
        if self.recheck_interval_s is not None:
            return self.recheck_interval_s
        return min(DEFAULT_RECHECK_INTERVAL_S, self.probe_interval_s)


HANDOFF_FILE = "narwhal-handoff.json"

# A config of a thousand engines is about 100 KB; a bigger file is a mistake, refused before it is read.
MAX_CONFIG_BYTES = 1024 * 1024
# The fleet key file holds one key.
MAX_KEY_FILE_BYTES = 64 * 1024


def resolve_config_path(path: str, config_dir: Path | None) -> Path:
    """A path given in the config: ``~`` expanded, and a relative one taken from the config file's directory."""
    resolved = Path(path).expanduser()
    if config_dir is not None and not resolved.is_absolute():
        resolved = config_dir / resolved
    return resolved


def default_handoff_path(env: Mapping[str, str] | None = None, identity: str | None = None) -> Path:
    """``$XDG_STATE_HOME/narwhal/narwhal-handoff-<identity>.json``, else under ``~/.local/state``.

    Never relative to the working directory: a router started from a source
    tree must not leave its state there. A relative ``XDG_STATE_HOME`` is
    ignored, as the XDG base directory spec says. Without ``identity``: the
    bare ``narwhal-handoff.json``.
    """
    env = os.environ if env is None else env
    state = env.get("XDG_STATE_HOME", "")
    if state and Path(state).is_absolute():
        base = Path(state)
    else:
        home = env.get("HOME")
        base = (Path(home) if home else Path.home()) / ".local" / "state"
    name = HANDOFF_FILE if identity is None else f"narwhal-handoff-{_file_safe(identity)}.json"
    return base / "narwhal" / name


def _file_safe(text: str) -> str:
    # An identity becomes part of a file name: nothing that is a path separator or hidden-file dot.
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text).lstrip(".") or "_"


class HandoffConfig(_Section, frozen=True):
    # None: Config.handoff_path()'s default; a relative path is relative to the config file's directory.
    path: str | None = None

    def __post_init__(self) -> None:
        if self.path is not None and not self.path.strip():
            raise ValueError("path must not be empty (leave it out for the state directory)")


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
    # "standby": the holder serves, the others wait. "replicas": every router serves; the holder decides.
    mode: Literal["standby", "replicas"] = "standby"
    # A replica that cannot read etcd serves on its last view this long, then stops admitting.
    replica_stale_s: float = 30.0
    # The shared secret of the routers' link (POST /cluster/evidence), when not mutual TLS.
    cluster_token_file: str | None = None

    def __post_init__(self) -> None:
        for name in ("ttl_s", "renew_interval_s", "fence_margin_s", "takeover_ready_failures", "replica_stale_s"):
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


# A Kubernetes port name (IANA_SVC_NAME): at most 15 lowercase letters, digits and '-', with a letter.
_PORT_NAME = re.compile(r"^(?=.*[a-z])[a-z0-9]([a-z0-9-]{0,13}[a-z0-9])?$")


class DiscoveryConfig(_Section, frozen=True):
    """Engines that register themselves: in etcd, or as Kubernetes pods (``narwhal.control.discovery``)."""

    backend: Literal["none", "etcd", "kubernetes"] = "none"
    # etcd: client URLs (default: [lease] endpoints) and the key prefix engines register under.
    endpoints: list[str] = []
    prefix: str = "/narwhal/engines/"
    # kubernetes: the pods the selectors select in namespace (default: the service account's).
    namespace: str | None = None
    prefill_selector: str | None = None
    decode_selector: str | None = None
    # The engine's port on the pod: a number, or the name of a container port.
    port: int | str = 8000
    # A pod label naming the pod's model (default: [fleet] model).
    model_label: str | None = None
    # The API server (default: in-cluster, KUBERNETES_SERVICE_HOST/PORT) and its credentials.
    api_url: str | None = None
    token_file: str | None = None
    ca_file: str | None = None

    def __post_init__(self) -> None:
        for i, endpoint in enumerate(self.endpoints):
            parts = urllib.parse.urlsplit(endpoint)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"endpoints[{i}] must be http(s)://HOST:PORT, got {endpoint!r}")
        if not self.prefix.startswith("/") or not self.prefix.endswith("/") or len(self.prefix) < 2:
            raise ValueError(f"prefix must start and end with '/' (engines register as <prefix><name>), "
                             f"got {self.prefix!r}")
        for name in ("namespace", "prefill_selector", "decode_selector", "model_label", "token_file", "ca_file"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ValueError(f"{name} must not be empty when set")
        if self.namespace is not None and not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", self.namespace):
            raise ValueError(f"namespace must be a Kubernetes namespace name (lowercase letters, digits, '-'), "
                             f"got {self.namespace!r}")
        if isinstance(self.port, bool) or (isinstance(self.port, int) and not 1 <= self.port <= 65535):
            raise ValueError(f"port must be 1-65535 or a container port's name, got {self.port!r}")
        if isinstance(self.port, str) and not _PORT_NAME.match(self.port):
            raise ValueError(f"port must be a number or a container port's name (at most 15 lowercase letters, "
                             f"digits and '-'), got {self.port!r}")
        if self.api_url is not None:
            parts = urllib.parse.urlsplit(self.api_url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"api_url must be https://HOST[:PORT] (or http:// for kubectl proxy), "
                                 f"got {self.api_url!r}")
        if self.backend == "kubernetes" and self.prefill_selector is None and self.decode_selector is None:
            raise ValueError("backend = \"kubernetes\" needs prefill_selector or decode_selector (or both)")

    @property
    def enabled(self) -> bool:
        return self.backend != "none"


class PlacementConfig(_Section, frozen=True):
    # cache_aware: prefill on the engine that holds the prompt's prefix, within the balance bound;
    # least_outstanding: the engine with the fewest requests in flight. Decode is least outstanding either way.
    policy: Literal["cache_aware", "least_outstanding"] = "cache_aware"
    # A match wins only on an engine whose load is at most max(least + balance_abs, least * balance_rel).
    balance_abs: int = 8
    balance_rel: float = 1.5
    # The prefix index's memory bound (all prefill engines together).
    max_index_mb: float = 64.0
    # Tokens per hashed block (a text block is 4 bytes a token).
    block_tokens: int = 16
    # The engines' own KV events (vLLM's --kv-events-config): "auto" subscribes to each prefill engine's
    # publisher where one is known and scores it from its feed; "required" also keeps an engine without a
    # live feed out of prefill; "off" places on the approximate index only.
    kv_events: Literal["off", "auto", "required"] = "auto"

    def __post_init__(self) -> None:
        _at_least("balance_abs", self.balance_abs, 0)
        _at_least("balance_rel", self.balance_rel, 1)
        _positive("max_index_mb", self.max_index_mb)
        _positive("block_tokens", self.block_tokens)


class AuthConfig(_Section, frozen=True):
    """Client keys on the completion routes (``narwhal.auth``): who may call, how much, and in which class."""

    # A TOML file of [[keys]] (narwhal keys add); relative to the config file. Unset: no client auth.
    keys_file: str | None = None
    # The share of the data pool kept for high priority: floor(max_connections * reserve_high), at least 1.
    reserve_high: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.reserve_high < 1.0:
            raise ValueError(f"reserve_high must be at least 0 and below 1, got {self.reserve_high:g}")
        if self.keys_file is not None and not self.keys_file:
            raise ValueError("keys_file must not be empty when set")


class TracingConfig(_Section, frozen=True):
    """OpenTelemetry traces (``narwhal.tracing``): one trace per request, exported over OTLP/HTTP (protobuf)."""

    # The collector's OTLP/HTTP base URL (spans go to <otlp_endpoint>/v1/traces). Unset: no tracing, no cost.
    otlp_endpoint: str | None = None
    service_name: str = "narwhal"
    # Parent-based: a client's sampled traceparent is always followed; a new trace is kept at this ratio.
    sample_ratio: float = 1.0
    # Sent with every export (e.g. a collector's API key).
    headers: dict[str, str] = {}

    def __post_init__(self) -> None:
        if self.otlp_endpoint is not None:
            problem = otlp_endpoint_problem(self.otlp_endpoint)
            if problem is not None:
                raise ValueError(f"otlp_endpoint: {problem}")
        if not self.service_name or not _PRINTABLE.fullmatch(self.service_name):
            raise ValueError("service_name: must be non-empty printable ASCII")
        if not (0.0 <= self.sample_ratio <= 1.0):
            raise ValueError(f"sample_ratio: must be between 0 and 1, got {self.sample_ratio:g}")
        for name, value in self.headers.items():
            if not _TOKEN.fullmatch(name):
                raise ValueError(f"headers: {name!r} is not a valid header name")
            if not _PRINTABLE.fullmatch(value):
                raise ValueError(f"headers: the value of {name!r} must be printable ASCII")

    @property
    def enabled(self) -> bool:
        return self.otlp_endpoint is not None


# A header name (RFC 9110 token) and a value of printable ASCII (and spaces): what can go on the wire as is.
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_PRINTABLE = re.compile(r"[\x20-\x7e]*")


def otlp_endpoint_problem(url: str) -> str | None:
    """Why ``url`` is not an OTLP/HTTP base URL (http or https, a host, no query), or None."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 -- raises on a bad port
    except ValueError as exc:
        return f"is not a URL: {exc}"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"must be an http(s)://HOST:PORT URL, got {url!r}"
    if parts.query or parts.fragment:
        return f"must have no query or fragment, got {url!r}"
    return None


class AdminConfig(_Section, frozen=True):
    token: str | None = None
    # A reload may take the token away (open the admin API) only when the new file says so here.
    allow_unauthenticated: bool = False
    listen: str | None = None
    # The admin listener's own bounds, so a flood on it cannot take the controller's file
    # descriptors: connections at once (16 more may ask for /health), and the time for a head.
    max_connections: int = 64
    header_timeout_s: float = 5.0
    # Without a token: host names (beyond loopback names and IP addresses) the admin API answers as Host.
    allowed_hosts: list[str] = []

    def __post_init__(self) -> None:
        if self.listen is not None:
            _listen("listen", self.listen)
        for index, name in enumerate(self.allowed_hosts):
            problem = host_name_problem(name)
            if problem is not None:
                raise ValueError(f"allowed_hosts[{index}] {problem}")
        if self.token is not None:
            problem = admin_token_problem(self.token)
            if problem is not None:
                raise ValueError(f"token {problem}")
        _positive("max_connections", self.max_connections)
        _positive("header_timeout_s", self.header_timeout_s)


# urlsplit's own cache holds 128 URLs, fewer than a large fleet's: past it every request parsed its engines' URLs
# again. Bounded: a config reload adds URLs, and the cache starts over past this many.
_SPLITS: dict[str, tuple[str, int, bytes, bool]] = {}
_MAX_SPLITS = 4096


def engine_endpoint(url: str) -> tuple[str, int, bytes, bool]:
    """(host, port, Host header, https) of an engine URL, parsed once per URL, not on every call."""
    endpoint = _SPLITS.get(url)
    if endpoint is None:
        if len(_SPLITS) >= _MAX_SPLITS:
            _SPLITS.clear()
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or ""
        tls = parts.scheme == "https"  # urlsplit lowercases the scheme: HTTPS:// too
        port = parts.port or (443 if tls else 80)
        shown = f"[{host}]" if ":" in host else host
        endpoint = _SPLITS[url] = (host, port, f"{shown}:{port}".encode("ascii"), tls)
    return endpoint


def zmq_endpoint_problem(value: str | None) -> str | None:
    """Why ``value`` is not a ``tcp://HOST:PORT`` a subscriber can connect to (None when it is, or unset)."""
    if value is None:
        return None
    parts = urllib.parse.urlsplit(value)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or not parts.hostname or port is None or port == 0 or parts.path \
            or parts.query or parts.fragment:
        return f"must be tcp://HOST:PORT (a port above 0), got {value!r}"
    if parts.hostname in ("*", "0.0.0.0", "::"):
        return f"names no host to connect to ({value!r}): give the engine's address"
    return None


class EngineSpec(_Section, frozen=True):
    name: str
    url: str
    role: Literal["prefill", "decode"]
    # The model the engine serves; None: [fleet] model (a parsed Config sets it on every engine).
    model: str | None = None
    # Its KV event publisher and replay socket (vLLM's --kv-events-config endpoint and replay_endpoint, as
    # reached from the router), and the topic to take (None: every topic). Unset: its identity says.
    kv_events: str | None = None
    kv_events_replay: str | None = None
    kv_events_topic: str | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name must not be empty")
        if self.model is not None and not self.model:
            raise ValueError("model must not be empty when set (leave it out for [fleet] model)")
        for key in ("kv_events", "kv_events_replay"):
            problem = zmq_endpoint_problem(getattr(self, key))
            if problem is not None:
                raise ValueError(f"{key} {problem}")
        if self.kv_events_replay is not None and self.kv_events is None:
            raise ValueError("kv_events_replay needs kv_events (the publisher it replays)")
        if self.role != "prefill" and (self.kv_events or self.kv_events_topic is not None):
            raise ValueError("kv_events is for prefill engines: only a prefill engine's cache places requests")
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url must be http://HOST[:PORT] or https://HOST[:PORT], got {self.url!r}")
        try:
            _ = parts.port  # urlsplit parses the port lazily: reading it validates it
        except ValueError:
            raise ValueError(f"url has a bad port: {self.url!r}") from None
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError(f"url must have no path, query or fragment: {self.url!r}")

    @property
    def host(self) -> str:
        return engine_endpoint(self.url)[0]

    @property
    def tls(self) -> bool:
        """True for an ``https://`` engine."""
        return engine_endpoint(self.url)[3]

    @property
    def port(self) -> int:
        return engine_endpoint(self.url)[1]

    @property
    def base_url(self) -> str:
        return self.url.rstrip("/")

    @property
    def address(self) -> tuple[str, str, int]:
        """Scheme, host and port, normalised (case, default port, trailing slash); names are not resolved."""
        return ("https" if self.tls else "http"), self.host.lower(), self.port


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
    placement: PlacementConfig = PlacementConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    auth: AuthConfig = AuthConfig()
    tracing: TracingConfig = TracingConfig()
    engines: list[EngineSpec] = []

    def __post_init__(self) -> None:
        seen: set[str] = set()
        by_address: dict[tuple[str, str, int, str], EngineSpec] = {}
        for i, engine in enumerate(self.engines):
            if engine.name in seen:
                raise ValueError(f"duplicate engine name {engine.name!r} - at `$.engines[{i}].name`")
            seen.add(engine.name)
            # One engine listed twice for a role would pass readmission twice and take a double share.
            first = by_address.setdefault((*engine.address, engine.role), engine)
            if first is not engine:
                raise ValueError(f"{engine.url} is also engine {json.dumps(first.name)}'s url ({first.url}), "
                                 f"both {engine.role}: one engine listed twice would get a double share of "
                                 f"placement - at `$.engines[{i}].url`")
        _check_models(self)
        # Every engine names its model from here on (a reload compares and moves engines by it).
        for engine in self.engines:
            if engine.model is None:
                msgspec.structs.force_setattr(engine, "model", self.fleet.model)
        if self.lease.backend == "file" and not self.lease.path:
            raise ValueError("lease.path is required when lease.backend = \"file\"")
        if self.lease.backend == "etcd" and not self.lease.endpoints:
            raise ValueError("lease.endpoints is required when lease.backend = \"etcd\"")
        if self.discovery.backend == "etcd" and not self.discovery_endpoints:
            raise ValueError("discovery.endpoints is required when discovery.backend = \"etcd\" and [lease] has "
                             "no endpoints")
        if self.lease.mode == "replicas":
            if self.lease.backend != "etcd":
                raise ValueError(f"lease.mode = \"replicas\" needs lease.backend = \"etcd\" (the routers share the "
                                 f"fleet through etcd), got {json.dumps(self.lease.backend)}")
            if self.lease.cluster_token_file is None and self.serving.tls_client_ca_file is None:
                raise ValueError("lease.mode = \"replicas\" needs the routers' link authenticated: set "
                                 "lease.cluster_token_file, or serving.tls_client_ca_file for mutual TLS")

    @property
    def discovery_endpoints(self) -> list[str]:
        """etcd's client URLs for discovery: ``[discovery] endpoints``, else ``[lease] endpoints``."""
        return self.discovery.endpoints or self.lease.endpoints

    def model_of(self, engine: EngineSpec) -> str:
        """The model ``engine`` serves: its own ``model``, else ``[fleet] model``."""
        return engine.model if engine.model is not None else self.fleet.model

    def engine_spec(self, name: str) -> EngineSpec:
        for spec in self.engines:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def handoff_path(self, config_dir: Path | None = None, env: Mapping[str, str] | None = None,
                     listen: str | None = None) -> Path:
        """Where the handoff lives: ``[handoff] path`` (relative to ``config_dir``), else from the router's identity.

        The default is never one file for every router on a host: with a file
        lease it is the pair's, beside the lease file (both routers of a pair
        read and write it); otherwise it is in the state directory, named after
        ``[lease] router_id``, else the serving address (``listen``, default
        ``serving.listen``), which no two routers on one host share.
        """
        if self.handoff.path is not None:
            return resolve_config_path(self.handoff.path, config_dir)
        if self.lease.backend == "file" and self.lease.path:
            lease = resolve_config_path(self.lease.path, config_dir)
            return lease.with_name(f"{lease.stem}.handoff.json")
        return default_handoff_path(env, identity=self.router_identity(listen))

    def router_identity(self, listen: str | None = None) -> str:
        """What names this router on its host: ``[lease] router_id``, else ``HOST-PORT`` of its serving address.

        A router on port 0 has no stable address: its process (host name and pid) names it.
        """
        if self.lease.router_id:
            return self.lease.router_id
        host, port = parse_listen(listen or self.serving.listen)
        if port == 0:
            return f"{socket.gethostname()}-{os.getpid()}"
        return f"{host}-{port}"


    def cluster_token(self, base_dir: Path | None = None) -> str | None:
        """The routers' link secret from ``lease.cluster_token_file``, when one is named."""
        if self.lease.cluster_token_file is None:
            return None
        path = resolve_config_path(self.lease.cluster_token_file, base_dir)
        try:
            token = read_regular_file(path, MAX_KEY_FILE_BYTES).strip()
        except FileRefused as exc:
            raise ConfigError(f"lease.cluster_token_file: cannot read {str(path)!r}: {exc}") from None
        if not token or any(byte <= 0x20 or byte >= 0x7f for byte in token):
            raise ConfigError(f"lease.cluster_token_file: {str(path)!r} must hold one token of printable ASCII "
                              "without spaces")
        return token.decode()

    def attestation_key_bytes(self, base_dir: Path | None = None) -> bytes | None:
        """The fleet's HMAC key, read from the file when one is named."""
        if self.fleet.attestation_key is not None:
            return self.fleet.attestation_key.encode()
        if self.fleet.attestation_key_file is not None:
            path = resolve_config_path(self.fleet.attestation_key_file, base_dir)
            try:
                return read_regular_file(path, MAX_KEY_FILE_BYTES).strip()
            except FileRefused as exc:
                raise ConfigError(f"fleet.attestation_key_file: cannot read {str(path)!r}: {exc}") from None
        return None


def _check_models(config: Config) -> None:
    """Every served model has a prefill and a decode engine; names and aliases name one model each."""
    fleet = config.fleet
    roles: dict[str, set[str]] = {}
    for engine in config.engines:
        roles.setdefault(config.model_of(engine), set()).add(engine.role)
    for entry in fleet.models:
        roles.setdefault(entry.name, set())
    single = len(roles) <= 1 and not fleet.models and all(engine.model is None for engine in config.engines)
    for name, present in roles.items():
        for role in ("prefill", "decode"):
            # With discovery on, engines may come from the store alone: /ready says 503 until they do.
            if role not in present and not config.discovery.enabled:
                if single:
                    raise ValueError(f"no {role} engine configured (need at least one [[engines]] with "
                                     f"role = \"{role}\")")
                raise ValueError(f"model {name!r} has no {role} engine (each served model needs at least one "
                                 f"[[engines]] with model = {json.dumps(name)} and role = \"{role}\")")
    owner: dict[str, str] = {}
    for index, model in enumerate(fleet.models):
        for name in (model.name, *model.aliases):
            first = owner.setdefault(name, model.name)
            if first != model.name:
                raise ValueError(f"{name!r} names two models ({first!r} and {model.name!r}): model names and "
                                 f"aliases must be unique across models - at `$.fleet.models[{index}]`")
        seen = [model.name, *model.aliases]
        if len(set(seen)) != len(seen):
            raise ValueError(f"model {model.name!r} lists a name twice among its name and aliases - at "
                             f"`$.fleet.models[{index}].aliases`")
    names = [model.name for model in fleet.models]
    if len(set(names)) != len(names):
        twice = next(name for name in names if names.count(name) > 1)
        raise ValueError(f"model {twice!r} has two [[fleet.models]] entries - at `$.fleet.models`")
    for served in roles:
        alias_of = owner.get(served)
        if alias_of is not None and alias_of != served:
            raise ValueError(f"{served!r} is both a served model and an alias of {alias_of!r}: model names and "
                             "aliases must be unique across models - at `$.fleet.models`")


def _key_type(key: str, root: type[msgspec.Struct] = Config) -> object:
    """The declared type at a dotted key (``engines[1].role``) of ``root``, or None when the path leaves the schema."""
    current: object = root
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", key):
        if part.startswith("["):
            args = typing.get_args(current)
            if typing.get_origin(current) is not list or not args:
                return None
            current = args[0]
            continue
        if not (isinstance(current, type) and issubclass(current, msgspec.Struct)):
            return None
        fields = {f.name: f.type for f in msgspec.structs.fields(current)}
        if part not in fields:
            return None
        current = fields[part]
    return current


def _engine_names(data: bytes | str) -> list[object]:
    """Each ``[[engines]]`` table's name as written (anything), for messages; [] when the TOML does not parse."""
    try:
        raw = tomllib.loads(data.decode() if isinstance(data, bytes) else data)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        return []
    engines = raw.get("engines")
    if not isinstance(engines, list):
        return []
    return [engine.get("name") if isinstance(engine, dict) else None for engine in engines]


def _engine_by_name(key: str, names: list[object]) -> str:
    """``engines[1].role`` as ``engine "d1".role`` when that engine has a name of its own (unique, non-empty)."""
    match = re.match(r"engines\[(\d+)\]", key)
    if not match:
        return key
    index = int(match.group(1))
    name = names[index] if index < len(names) else None
    if not isinstance(name, str) or not name or names.count(name) > 1:
        return key
    return f"engine {json.dumps(name)}{key[match.end():]}"


def _did_you_mean(section: str, name: str, root: type[msgspec.Struct] = Config) -> str:
    """``" (did you mean 'workers'?)"`` when ``name`` is close to a key of the struct at ``section``."""
    owner = _key_type(section, root) if section else root
    if not (isinstance(owner, type) and issubclass(owner, msgspec.Struct)):
        return ""
    close = difflib.get_close_matches(name, [f.name for f in msgspec.structs.fields(owner)], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _explain(exc: msgspec.ValidationError, data: bytes | str = "", root: type[msgspec.Struct] = Config) -> str:
    # msgspec says "... - at `$.serving.listen`"; operators think in TOML keys. ``root``: the file's schema
    # (the keys file's messages are made here too).
    text = str(exc)
    message, sep, where = text.rpartition(" - at `")
    if not sep:
        message, where = text, ""
    key = where.rstrip("`").removeprefix("$").lstrip(".")
    unknown = re.fullmatch(r"Object contains unknown field `(.+)`", message)
    if unknown:
        message = "unknown key" + _did_you_mean(key, unknown.group(1), root)
        key = f"{key}.{unknown.group(1)}" if key else unknown.group(1)
    enum = re.fullmatch(r"Invalid enum value (.+)", message)
    allowed = typing.get_args(_key_type(key, root)) if enum else ()
    if enum and allowed:
        message = f"must be one of {', '.join(json.dumps(v) for v in allowed)}; got {enum.group(1)}"
    # A struct's own check that names its field ("listen: port out of range") belongs to that field's key.
    field = re.match(r"([a-z_][a-z0-9_]*): ", message)
    own = _key_type(key, root)
    if field and isinstance(own, type) and issubclass(own, msgspec.Struct) and \
            field.group(1) in {f.name for f in msgspec.structs.fields(own)}:
        key = f"{key}.{field.group(1)}" if key else field.group(1)
        message = message[field.end():]
    if not key:
        return message
    key = _engine_by_name(key, _engine_names(data)) if key.startswith("engines[") else key
    return f"{key}: {message}"


def parse_config(data: bytes | str, source: str = "<config>") -> Config:
    """Decode TOML text into a ``Config``, raising ``ConfigError`` on any problem."""
    try:
        config = msgspec.toml.decode(data, type=Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {_explain(exc, data)}") from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    if config.fleet.attestation_key_file is not None:
        key_path = resolve_config_path(config.fleet.attestation_key_file,
                                       None if source == "<config>" else Path(source).parent)
        try:
            read_regular_file(key_path, MAX_KEY_FILE_BYTES)
        except (OSError, FileRefused) as exc:
            raise ConfigError(f"{source}: fleet.attestation_key_file: cannot read {str(key_path)!r}: "
                              f"{getattr(exc, 'strerror', None) or exc}") from None
    # Certificates and keys are read where their contexts are built (narwhal.tls), not here.
    return config


def load_config(path: str | Path) -> Config:
    """Read and decode the config file at ``path``: a regular file of at most ``MAX_CONFIG_BYTES``.

    Blocking file I/O: a running router calls it off the event loop (``Router.reload``).
    """
    path = Path(path)
    try:
        data = read_regular_file(path, MAX_CONFIG_BYTES)
    except (OSError, FileRefused) as exc:
        raise ConfigError(f"{path}: cannot read config file: {getattr(exc, 'strerror', None) or exc}") from None
    return parse_config(data, source=str(path))



class RunningConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The config a router runs on and the fleet key it names, read together: what a reload replaces."""

    config: Config
    attestation_key: bytes | None = None


class Reconfigurable(Protocol):
    """A part that reads a reloadable key (``narwhal.config_diff``): a reload hands it the new running config."""

    def configure(self, running: RunningConfig) -> None: ...
