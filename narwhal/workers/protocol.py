"""The messages between the controller and its data-plane workers, and their framing.

Envoy's model with processes: the controller owns every decision and sends
workers a ``Snapshot`` of what placement and admission need; workers serve
from it and send back what they observed (``Evidence`` at once, a periodic
``Report`` with in-flight counts, metrics and telemetry samples). Admin and
metrics routes that a worker cannot answer from its snapshot travel as
``Forward``/``ForwardReply``.

Frames are a 4-byte big-endian length and a msgpack-encoded tagged struct. A
frame longer than ``MAX_FRAME_BYTES`` is a protocol error: both ends are our
own processes, so it means a bug, and the link is closed rather than buffered.
"""

from __future__ import annotations

import struct

import msgspec

from narwhal.auth.client_auth import AuthSettings
from narwhal.config import Config, EngineConfig, EngineSpec, FleetConfig, PlacementConfig, TracingConfig
from narwhal.errors import NarwhalError
from narwhal.fleet.placement import IndexRecord
from narwhal.kv_events.feed import FeedSource

__all__ = [
    "CONTROL_APP_TIMEOUT_S",
    "FORWARD_TIMEOUT_S",
    "MAX_FRAME_BYTES",
    "ControllerMessage",
    "Evidence",
    "Forward",
    "ForwardReply",
    "FrameDecoder",
    "FrameError",
    "Hello",
    "HistogramSeries",
    "IndexUpdate",
    "MetricsState",
    "Report",
    "ReloadTLS",
    "RequestSample",
    "Snapshot",
    "Stop",
    "TLSReloaded",
    "Welcome",
    "WorkerMessage",
    "encode_frame",
]

MAX_FRAME_BYTES = 16 * 1024 * 1024
# The controller answers a forwarded request within this (its control app's bound) ...
CONTROL_APP_TIMEOUT_S = 25.0
# ... and a worker waits this much longer for the reply to cross the link before it gives up.
FORWARD_TIMEOUT_S = CONTROL_APP_TIMEOUT_S + 5.0
_LENGTH = struct.Struct(">I")


class _Message(msgspec.Struct, kw_only=True, tag_field="type"):
    pass


# -- controller -> worker ---------------------------------------------------------------


class Welcome(_Message, tag="welcome"):
    """The first message a worker gets: its index and the controller's config, as decoded there."""

    worker: int
    config: Config
    # Where relative certificate and key paths of the config are resolved.
    config_dir: str | None
    # The router's loop-detection token: a request carrying it came back through an engine URL.
    via_token: str


class Snapshot(_Message, tag="snapshot"):
    """What a worker needs to admit and place requests, as the controller last decided.

    Deadlines are CLOCK_MONOTONIC seconds (``time.monotonic()``), which is
    system-wide, so a worker can enforce them on its own clock.
    """

    seq: int
    # Eligible engines by role, every model's together.
    eligible: dict[str, list[str]]
    # Eligible engines by model, then role: what a request for one model is placed on.
    pools: dict[str, dict[str, list[str]]] = {}
    # The fleet's "serving capacity exhausted" reason (no model can serve), or None.
    capacity_problem: str | None = None
    # Each model that cannot serve, with its reason.
    capacity_problems: dict[str, str] = {}
    # Why admission is closed (monitor degraded, standby, fenced, shutdown), or None.
    admission_reason: str | None = None
    # Admission closes by itself at this instant unless a newer snapshot moves it (the lease).
    admit_until: float | None = None
    # The reason a worker gives once ``admit_until`` has passed.
    admit_until_reason: str = "fenced: lease not renewed"
    # The snapshot stops being exact at this instant (a hold deadline): the
    # controller sends a new one by then.
    valid_until: float | None = None
    # When the controller published it: a worker measures the delivery delay.
    published_at: float | None = None
    # Requests in flight per engine over all workers, as last reported: placement
    # balances over the whole router, not one worker's share.
    in_flight: dict[str, int] = {}
    # Every engine the fleet has (a config reload adds and removes them); None: as in the Welcome's config.
    engines: list[EngineSpec] | None = None
    # The reloadable keys the data plane reads (placement, the engine timeouts), as the controller
    # runs them now; None: as in the Welcome's config.
    placement: PlacementConfig | None = None
    engine_config: EngineConfig | None = None
    # The [fleet] keys as the controller runs them (the default model, [[fleet.models]]); None: the Welcome's.
    fleet: FleetConfig | None = None
    # Each prefill engine's KV event publisher (its config's, else its identity's): each worker subscribes.
    kv_sources: dict[str, FeedSource] = {}
    # Client keys, limits and the priority gate's settings ([auth], the keys file as the controller read it).
    auth: AuthSettings | None = None
    # [tracing] as the controller runs it; None: as in the Welcome's config.
    tracing: TracingConfig | None = None


class IndexUpdate(_Message, tag="index_update"):
    """Other workers' placements for the prefix index, and the engines' epochs (a newer one: forget it)."""

    records: list[IndexRecord] = []
    epochs: dict[str, int] = {}


class ForwardReply(_Message, tag="forward_reply"):
    id: int
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


class ReloadTLS(_Message, tag="reload_tls"):
    """Read the certificates and keys again (the controller got SIGHUP); answer with ``TLSReloaded``."""

    id: int = 0


class Stop(_Message, tag="stop"):
    """Stop accepting, let requests in flight finish within ``grace_s``, then exit."""

    grace_s: float


# -- worker -> controller ---------------------------------------------------------------


class Hello(_Message, tag="hello"):
    worker: int
    pid: int


class Evidence(_Message, tag="evidence"):
    """One engine outcome that the fleet rules count: a failure class or a success kind."""

    engine: str
    failure_class: str | None = None
    success_kind: str | None = None


class RequestSample(msgspec.Struct, frozen=True, array_like=True):
    """One finished request, for the controller's telemetry (drift detection) and timeline."""

    prefill: str | None
    decode: str | None
    ttft_s: float | None
    inter_token_s: float | None
    error_engine: str | None
    # The client's status and the request's error class (the timeline's errors by class).
    status: int = 0
    error_class: str | None = None
    # The client saw a failure (an error status, or a stream ended by an error event); else a recovered one.
    failed: bool = False


class HistogramSeries(msgspec.Struct, frozen=True, array_like=True):
    labels: list[str]
    counts: list[int]
    total: float


class MetricsState(msgspec.Struct, frozen=True, kw_only=True):
    """Cumulative counter and histogram values of one worker since it started."""

    counters: dict[str, list[tuple[list[str], float]]] = {}
    histograms: dict[str, list[HistogramSeries]] = {}


class Report(_Message, tag="report"):
    """A worker's periodic account: in-flight counts (absolute), metrics, telemetry samples.

    ``snapshot_seq`` is the newest snapshot the worker had applied when it
    counted ``in_flight``: a count taken before a drain reached the worker
    cannot settle that drain.
    """

    snapshot_seq: int
    in_flight: dict[str, int]
    requests_in_flight: int
    metrics: MetricsState
    samples: list[RequestSample] = []
    # The worker's data pool: connections in use and requests waiting for one.
    data_in_use: int = 0
    data_waiting: int = 0
    # Prompts this worker placed since its last report, for the other workers' prefix indexes.
    placements: list[IndexRecord] = []


class TLSReloaded(_Message, tag="tls_reloaded"):
    """The answer to ``ReloadTLS`` ``id``: ``error`` is None when the new files are in use, else why not."""

    id: int
    error: str | None = None


class Forward(_Message, tag="forward"):
    """A control-app request that a worker received and the controller answers."""

    id: int
    method: bytes
    # The request target as received (path and query, still percent-encoded).
    target: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None = None
    # The client's connection was TLS (the app sees scheme "https").
    secure: bool = False
    http_version: str = "1.1"
    # The client's TLS connection presented a verified client certificate (the cluster's link authenticates by it).
    peer_cert: bool = False


ControllerMessage = Welcome | Snapshot | ForwardReply | ReloadTLS | Stop | IndexUpdate
WorkerMessage = Hello | Evidence | Report | Forward | TLSReloaded


class FrameError(NarwhalError):
    """A frame that no peer of ours would send (too long, undecodable)."""


_encoder = msgspec.msgpack.Encoder()


def encode_frame(message: msgspec.Struct) -> bytes:
    """One length-prefixed frame."""
    payload = _encoder.encode(message)
    if len(payload) > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {len(payload)} bytes exceeds {MAX_FRAME_BYTES}")
    return _LENGTH.pack(len(payload)) + payload


class FrameDecoder:
    """Incremental decoder: ``feed`` bytes, get back every complete message."""

    def __init__(self, message_type: object, *, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._decoder = msgspec.msgpack.Decoder(message_type)
        self._buffer = bytearray()
        self._max = max_frame_bytes

    def feed(self, data: bytes | bytearray) -> list[object]:
        self._buffer += data
        messages: list[object] = []
        buffer = self._buffer
        offset = 0
        while len(buffer) - offset >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(buffer, offset)
            if length > self._max:
                raise FrameError(f"frame of {length} bytes exceeds {self._max}")
            end = offset + _LENGTH.size + length
            if len(buffer) < end:
                break
            try:
                messages.append(self._decoder.decode(buffer[offset + _LENGTH.size:end]))
            except msgspec.DecodeError as exc:
                raise FrameError(f"undecodable frame: {exc}") from exc
            offset = end
        if offset:
            del buffer[:offset]
        return messages
