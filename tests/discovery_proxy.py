"""A TCP proxy in front of etcd that a test can cut, close, stall, and point at a restarted etcd."""

from __future__ import annotations

from typing import Any

import trio

__all__ = ["CuttableProxy"]


class CuttableProxy:
    """Forwards 127.0.0.1:``port`` to 127.0.0.1:``target_port``."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.connections = 0  # accepted so far
        self._scopes: set[trio.CancelScope] = set()
        self._live: set[trio.SocketStream] = set()
        self._stalled: set[trio.SocketStream] = set()
        self._nursery: trio.Nursery
        self._listening: trio.CancelScope

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, nursery: trio.Nursery) -> CuttableProxy:
        self._nursery = nursery
        await self.listen()
        return self

    async def listen(self) -> None:
        """Accept connections (again, on the same port)."""
        self._listening = await self._nursery.start(self._serve)

    async def _serve(self, *, task_status: Any) -> None:
        with trio.CancelScope() as scope:
            listeners = await trio.open_tcp_listeners(self.port, host="127.0.0.1")
            self.port = listeners[0].socket.getsockname()[1]
            task_status.started(scope)
            await trio.serve_listeners(self._handle, listeners)

    def refuse(self) -> None:
        """Stop listening and drop every connection: etcd down, as a client sees it."""
        self._listening.cancel()
        self.cut()

    def cut(self) -> None:
        """Drop every connection open now (the watch stream among them)."""
        for scope in list(self._scopes):
            scope.cancel()

    def stall(self) -> None:
        """Connections open now stop carrying bytes, without a word (a proxy that lost them); new ones work."""
        self._stalled.update(self._live)

    async def _handle(self, client: trio.SocketStream) -> None:
        self.connections += 1
        self._live.add(client)
        with trio.CancelScope() as scope:
            self._scopes.add(scope)
            try:
                try:
                    upstream = await trio.open_tcp_stream("127.0.0.1", self.target_port)
                except OSError:
                    return
                async with upstream, trio.open_nursery() as nursery:
                    nursery.start_soon(self._pump, client, client, upstream, nursery.cancel_scope)
                    nursery.start_soon(self._pump, client, upstream, client, nursery.cancel_scope)
            finally:
                self._scopes.discard(scope)
                self._live.discard(client)
        await client.aclose()

    async def _pump(self, client: trio.SocketStream, source: trio.SocketStream, sink: trio.SocketStream,
                    scope: trio.CancelScope) -> None:
        try:
            async for data in source:
                if client in self._stalled:
                    await trio.sleep_forever()
                await sink.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        scope.cancel()  # one side closed: close both
