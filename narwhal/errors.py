"""The vocabulary of engine failure: classes, successes, and the one exception.

Pools are the only place that turn transport errors, status codes and stream
anomalies into an ``EngineFailure``; everything above them reasons in these
terms and never looks at an httpx or socket exception.
"""

from __future__ import annotations

import enum

__all__ = ["ClientGone", "EngineFailure", "FailureClass", "LocalResourceExhausted", "PoolSaturated",
           "StartupError", "SuccessKind", "UpstreamClientError"]


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


class EngineFailure(Exception):
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


class UpstreamClientError(Exception):
    """The engine answered 4xx (not 408/429): the client's request was at fault."""

    def __init__(self, engine: str, status: int, body: bytes) -> None:
        super().__init__(f"{engine}: HTTP {status}")
        self.engine = engine
        self.status = status
        self.body = body


class PoolSaturated(Exception):
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


class StartupError(Exception):
    """The router cannot start; the message is one line naming the cause (the CLI exits 2)."""


class ClientGone(Exception):
    """The client went away or stopped reading; ``reason`` is ``client_disconnected`` or ``client_stalled``."""

    def __init__(self, message: str = "the client has gone", *, reason: str = "client_disconnected") -> None:
        super().__init__(message)
        self.reason = reason
