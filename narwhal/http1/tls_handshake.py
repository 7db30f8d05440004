"""The front's TLS handshake: an accepted socket becomes a ``trio.SSLStream``, or is closed unserved."""

from __future__ import annotations

import logging
import ssl

import trio

from narwhal.http1.connection import LINGER_MAX_BYTES, LINGER_S, RECEIVE_SIZE
from narwhal.obs.logs import log_event
from narwhal.tls import tls_reason

__all__ = ["handshake"]


async def handshake(raw: trio.SocketStream, context: ssl.SSLContext, deadline: float, *,
                    header_timeout_s: float) -> trio.SSLStream[trio.SocketStream] | None:
    """The TLS stream once its handshake is done by ``deadline``; None (closed) otherwise.

    The deadline is the head's (``header_timeout_s`` from the accept): a silent or
    half-sent ClientHello holds a connection slot no longer than a slow head does.
    """
    stream = trio.SSLStream(raw, context, server_side=True, https_compatible=True)
    failure: BaseException | None = None
    done = False
    try:
        with trio.move_on_at(deadline):
            try:
                await stream.do_handshake()
                done = True
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                failure = exc
        if done:
            return stream
        peer = _peer(raw)
        # Plain HTTP, an untrusted client certificate or a silent client: closed, never served.
        log_event("tls_handshake_failed", level=logging.WARNING,
                  client=f"{peer[0]}:{peer[1]}" if peer else None,
                  reason=(tls_reason(failure) or str(failure) or type(failure).__name__) if failure
                  else f"no handshake within {header_timeout_s:g} s (the head timeout)")
        if failure is not None:
            await _send_alert(stream, raw)
        return None
    finally:
        if not done:
            # Also when cancelled (shutdown): the socket must not outlive the task.
            raw.socket.close()


async def _send_alert(stream: trio.SSLStream[trio.SocketStream], raw: trio.SocketStream) -> None:
    """Send the TLS alert OpenSSL wrote for a failed handshake, then close gently.

    trio marks the stream broken without sending it; without the alert a client
    refused for its certificate sees only a reset and cannot tell why. The
    attribute is trio's private outgoing buffer (no seam of ours), hence the guard.
    The linger keeps unread client bytes from turning the close into a reset that
    would destroy the alert.
    """
    outgoing = getattr(stream, "_outgoing", None)
    alert = outgoing.read() if isinstance(outgoing, ssl.MemoryBIO) else b""
    if not alert:
        return
    with trio.move_on_after(LINGER_S):
        try:
            await raw.send_all(alert)
            await raw.send_eof()
            drained = 0
            while drained < LINGER_MAX_BYTES:
                data = await raw.receive_some(RECEIVE_SIZE)
                if not data:
                    return
                drained += len(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return


def _peer(raw: trio.SocketStream) -> tuple[str, int] | None:
    try:
        peer = raw.socket.getpeername()
    except OSError:
        return None
    return (peer[0], peer[1])
