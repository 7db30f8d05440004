"""HTTP/1.1 on trio + httptools: the data-plane server, the keep-alive engine client, and an ASGI adapter.

The server is generic: it parses requests, hands each one with a ``Responder``
to a handler, and knows nothing of routes. ``call_asgi`` lets a handler pass a
request on to an ASGI app (the quart-trio control API) on the same port.
"""

from narwhal.http1.asgi import ASGILifespan, call_asgi
from narwhal.http1.server import (
    ClientDisconnected,
    Handler,
    HTTPServer,
    Request,
    Responder,
    ServerStatistics,
)

__all__ = [
    "ASGILifespan",
    "ClientDisconnected",
    "HTTPServer",
    "Handler",
    "Request",
    "Responder",
    "ServerStatistics",
    "call_asgi",
]
