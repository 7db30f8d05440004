"""Narwhal's exceptions under one root, and the vocabulary of engine failure.

Every exception Narwhal raises on purpose derives from ``NarwhalError``
(``tests/test_errors.py`` checks each module), so a caller can tell ours from a
library's or a bug. The tree, with the module each class lives in:

    NarwhalError
    ├── ConfigError ................. config: a bad config, one line naming the key (exit status 2)
    ├── EngineFailure ............... an engine call failed; ``failure_class`` says how, ``engine`` who
    ├── UpstreamClientError ......... an engine answered 4xx (not 408/429): the client's request was at fault
    ├── PoolSaturated ............... no slot in our own pool before the deadline: saturation, not failure
    │   └── LocalResourceExhausted .. our own process ran out of fds/memory/buffers reaching an engine
    ├── StartupError ................ the router cannot start: one line naming the cause (exit status 2)
    ├── ClientError ................. serving.request_core: a request refused with its status and JSON error
    ├── ClientGone .................. the client went away or stopped reading (``reason`` says which)
    │   └── ClientDisconnected ...... http1.connection: the client went away before the response was written
    ├── HTTPTransportError .......... http1.client: engine-connection trouble, before the pools classify it
    │   ├── ConnectFailed
    │   ├── ConnectTimeout
    │   ├── WriteTimeout
    │   ├── ReadTimeout
    │   ├── DeadlineExpired
    │   ├── ConnectionClosed
    │   ├── MalformedResponse
    │   ├── ResponseTooLarge ........ a response head or buffered body passed its size bound
    │   ├── TLSFailed ............... the TLS handshake with the engine failed
    │   └── LocalResourceError ...... connecting failed for lack of our own fds/memory/buffers
    ├── HandoffError ................ state.handoff: a handoff document that cannot be used
    │   ├── HandoffMissing
    │   ├── HandoffUnreadable
    │   └── HandoffSchemaMismatch
    ├── FileRefused ................. files: a config or handoff path that is not a regular file, or too large
    ├── HandoffWriteInProgress ...... stages.persistence: the previous pass's write has not finished
    ├── ContractViolation ........... control.contract: an engine's answer breaks the engine contract
    ├── LeaseBackendError ........... lease.backend: the lease store (file lock, etcd) could not answer
    ├── HandoffRejected (ValueError)  wire: a prefill's kv_transfer_params that must not reach a decode
    ├── InvalidTarget (ValueError) .. http1.target: a request target in neither origin nor absolute form
    ├── FleetKeyError ............... attestation: the fleet key cannot be had
    ├── QueryParameterError ......... app.query: an admin query parameter not taken, or not parsable (400)
    ├── FaultError (ValueError) ..... tools.mock.faults: a mock-engine fault that cannot be applied
    ├── CommandTemplateError (ValueError)  tools.bench.fleet: a bench --router-cmd template that cannot run
    ├── EngineErrorEvent (ValueError)  serving.continuation.events: an engine ended its stream with an error event
    ├── EtcdUnavailable ............. discovery.etcd_http: no etcd endpoint answered (refused, timed out, no leader)
    │   └── EtcdRefused ............. etcd understood the request and refused it (HTTP 4xx)
    ├── FrameError .................. workers.protocol: a controller/worker frame no peer of ours would send
    ├── LinkClosed .................. workers.link: the other process of a controller/worker link is gone
    ├── KvWireError ................. kv_events.wire: a KV event message that cannot be read, or past its bounds
    ├── WaitExpired ................. http1.readiness: a socket wait's deadline passed (the client makes it a timeout)
    ├── GateRefused ................. auth.priority: no capacity for the request's priority class (503)
    └── AuthRefused ................. auth.client_auth: a client's request refused (401, 403, 429, 503)

Modules also keep private subclasses for their own control flow (a probe leg
that cannot decide, a refused readmission check); they derive from the root too.

Pools are the only place that turn transport errors, status codes and stream
anomalies into an ``EngineFailure``; everything above them reasons in these
terms and never looks at an httpx or socket exception.
"""

from __future__ import annotations

import enum

__all__ = [
    "ClientGone",
    "EngineFailure",
    "FailureClass",
    "LocalResourceExhausted",
    "NarwhalError",
    "PoolSaturated",
    "StartupError",
    "SuccessKind",
    "UpstreamClientError",
]


class NarwhalError(Exception):
    """The root of every exception Narwhal raises on purpose."""


class FailureClass(enum.StrEnum):
    """The spec's failure classes (the 'Class' column of its failure table)."""

    CONNECTION = "connection"
    TIMEOUT = "timeout"
    STREAM = "stream"
    OVERLOAD = "overload"
    INFERENCE_STATUS = "inference_status"
    KV_HANDOFF = "kv_handoff"


class SuccessKind(enum.StrEnum):
    """The spec's successful responses (rows of 'Clearing failure evidence')."""

    CLIENT_4XX = "client_4xx"
    HEALTH_200 = "health_200"
    PREFILL_HANDOFF = "prefill_handoff"
    DECODE_TERMINAL = "decode_terminal"


class EngineFailure(NarwhalError):
    """An engine call failed; ``failure_class`` says how, ``engine`` says who."""

    def __init__(self, engine: str, failure_class: FailureClass, message: str,
                 *, status: int | None = None, cause: str | None = None) -> None:
        super().__init__(f"{engine}: {failure_class}: {message}")
        self.engine = engine
        self.failure_class = failure_class
        self.message = message
        self.status = status
        # The class name of the underlying exception, for logs ("ConnectError").
        self.cause = cause


class UpstreamClientError(NarwhalError):
    """The engine answered 4xx (not 408/429): the client's request was at fault."""

    def __init__(self, engine: str, status: int, body: bytes) -> None:
        super().__init__(f"{engine}: HTTP {status}")
        self.engine = engine
        self.status = status
        self.body = body


class PoolSaturated(NarwhalError):
    """No slot in our own pool before the deadline: saturation, not engine failure."""


class LocalResourceExhausted(PoolSaturated):
    """Our own process ran out of fds, memory or socket buffers while reaching an engine.

    Like saturation it is no evidence against the engine; ``errno_name`` says which
    (EMFILE, ENFILE, ENOMEM, ENOBUFS) and ``engine`` which engine we were reaching.
    """

    def __init__(self, message: str, *, engine: str, errno_name: str) -> None:
        super().__init__(message)
        self.engine = engine
        self.errno_name = errno_name


class StartupError(NarwhalError):
    """The router cannot start; the message is one line naming the cause (the CLI exits 2)."""


class ClientGone(NarwhalError):
    """The client went away or stopped reading; ``reason`` is ``client_disconnected`` or ``client_stalled``."""

    def __init__(self, message: str = "the client has gone", *, reason: str = "client_disconnected") -> None:
        super().__init__(message)
        self.reason = reason
