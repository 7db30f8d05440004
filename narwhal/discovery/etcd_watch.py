"""Watch the engines registered in etcd: list the prefix, then watch it from the next revision, forever.

The watch resumes from the last revision it applied after a dropped
connection, lists again and applies the difference when etcd compacted past
it (or went back in time: a restore), and lists again every
``resync_interval_s`` anyway, so a watch that went quietly stale costs at most
that long. A watch quiet for ``idle_s`` is reopened (a proxy may have dropped
it without a word). While etcd cannot be reached the last known view stands:
it is never emptied for an outage; ``on_update`` hears ``degraded`` once and
``recovered`` when etcd answers again. Retries back off from ``retry_min_s`` to
``retry_max_s``; ``retry_now()`` (another part of the router reached etcd again)
ends the current backoff at once, so an outage's end is not waited out.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol

import httpx
import msgspec
import trio

from narwhal.config import EngineSpec
from narwhal.discovery.etcd_http import (
    EtcdHttp,
    EtcdRefused,
    EtcdUnavailable,
    b64,
    key_value,
    prefix_end,
    unb64,
)
from narwhal.discovery.view import EngineView, KeyEvent, StoredKey, ViewChange
from narwhal.errors import NarwhalError

__all__ = ["EtcdWatcher", "ViewUpdate", "WatchStatus", "WatchedView"]

# Bound on one line of the watch stream (one response, possibly many events); past it, list instead.
MAX_LINE_BYTES = 16 * 1024 * 1024
_decode_line = msgspec.json.Decoder()
# etcd's "require leader" metadata (clientv3.WithRequireLeader), through the gateway: a member cut off from
# its leader refuses the watch, or cancels it, instead of keeping it open and silent.
_WATCH_HEADERS = {"content-type": "application/json", "grpc-metadata-hasleader": "true"}


class WatchedView(Protocol):
    """What the watcher keeps up to date: discovery's ``EngineView``, or a replica's fleet records."""

    revision: int

    @property
    def engines(self) -> dict[str, EngineSpec]: ...
    def reset(self, keys: list[StoredKey], revision: int) -> ViewChange: ...
    def apply(self, events: list[KeyEvent]) -> ViewChange: ...


class WatchStatus(msgspec.Struct, frozen=True, kw_only=True):
    """Where the watch stands, for ``/admin/discovery`` and the fleet page (times are wall clock)."""

    revision: int = 0
    listed: bool = False  # a first full list has been applied
    connected: bool = False  # a watch stream is open now
    last_event_at: float | None = None  # the last change the store told us of
    current_at: float | None = None  # the last time etcd confirmed the view (a list, a watch line)
    degraded: str | None = None  # why etcd cannot be read, while it cannot
    degraded_since: float | None = None
    endpoint: str = ""


class ViewUpdate(msgspec.Struct, frozen=True, kw_only=True):
    """The full view after a change, what changed, and why ``on_update`` was called."""

    reason: Literal["listed", "events", "degraded", "recovered"]
    engines: Mapping[str, EngineSpec]
    change: ViewChange
    status: WatchStatus


# What an answer that is not etcd's raises while it is read: the watch goes on, degraded, never stops.
_UNEXPECTED = (msgspec.MsgspecError, ValueError, TypeError, AttributeError, KeyError)


class _Relist(NarwhalError):
    """The watch cannot go on from its revision: list again."""


class EtcdWatcher:
    """Lists and watches ``prefix`` on ``endpoints``; ``run(on_update)`` reports every change."""

    def __init__(self, endpoints: Sequence[str], *, prefix: str = "/narwhal/engines/", timeout_s: float = 5.0,
                 idle_s: float = 30.0, resync_interval_s: float = 300.0, retry_min_s: float = 0.2,
                 retry_max_s: float = 5.0, page_size: int = 500, max_keys: int = 100_000,
                 client: httpx.AsyncClient | None = None, wall_clock: Callable[[], float] = time.time,
                 view: WatchedView | None = None) -> None:
        """``view``: what the keys mean (default: engine registrations, discovery's ``EngineView``)."""
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.idle_s = idle_s
        self.resync_interval_s = resync_interval_s
        self.retry_min_s = retry_min_s
        self.retry_max_s = retry_max_s
        self.page_size = page_size
        self.max_keys = max_keys
        self.wall_clock = wall_clock
        self._http = EtcdHttp(endpoints, timeout_s=timeout_s, client=client)
        # Each watch on a connection of its own: a pooled one may have died silently since its last use.
        self._stream_client = client or httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0))
        self._view: WatchedView = view if view is not None else EngineView(prefix)
        self._range = {"key": b64(prefix), "range_end": b64(prefix_end(prefix))}
        self._status = WatchStatus(endpoint=self._http.endpoints[0])
        self._cluster_id = ""
        self._opened = False  # the current watch stream has said "created"
        self._on_update: Callable[[ViewUpdate], None] = lambda update: None
        # Set by retry_now(): the current backoff, or the next one, ends at once (cleared by any contact).
        self._retry = trio.Event()

    @property
    def engines(self) -> dict[str, EngineSpec]:
        return self._view.engines

    @property
    def status(self) -> WatchStatus:
        return msgspec.structs.replace(self._status, revision=self._view.revision)

    def _set(self, **fields: Any) -> None:
        self._status = msgspec.structs.replace(self._status, **fields)

    def retry_now(self) -> None:
        """etcd answered another caller again (an outage is over): end this watch's backoff now rather than
        after up to ``retry_max_s``. One call ends at most one backoff; a watch in contact ignores it."""
        self._retry.set()

    async def _backoff(self, delay: float) -> None:
        """Wait ``delay`` before the next attempt, or until ``retry_now()``."""
        with trio.move_on_after(delay):
            await self._retry.wait()
        if self._retry.is_set():
            self._retry = trio.Event()

    def _report(self, reason: Literal["listed", "events", "degraded", "recovered"], change: ViewChange) -> None:
        self._on_update(ViewUpdate(reason=reason, engines=self._view.engines, change=change, status=self.status))

    async def run(self, on_update: Callable[[ViewUpdate], None], *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Watch until cancelled, calling ``on_update`` (at once, in this task: it must not block or raise).

        Started once the first list is applied or has failed (the view is then empty and the status
        degraded): a router starts either way and serves what it learns later.
        """
        self._on_update = on_update
        started = False
        need_list = True
        next_resync = listed_at = 0.0
        delay = self.retry_min_s
        while True:
            try:
                if need_list or trio.current_time() >= next_resync:
                    await self._list()
                    listed_at = trio.current_time()
                    need_list = False
                    next_resync = trio.current_time() + self.resync_interval_s
                if not started:
                    task_status.started()
                    started = True
                opened = trio.current_time()
                with trio.move_on_after(max(0.0, next_resync - trio.current_time())):
                    await self._watch()
                if trio.current_time() - opened > 1.0:
                    delay = self.retry_min_s
                else:
                    # A stream that ends as soon as it opens (a proxy, an overloaded member): do not spin.
                    await self._backoff(delay)
                    delay = min(delay * 2, self.retry_max_s)
            except _Relist:
                need_list = True
                if trio.current_time() - listed_at < 1.0:
                    # Listed a moment ago and must list again (compacted again at once?): do not spin.
                    await self._backoff(delay)
                    delay = min(delay * 2, self.retry_max_s)
            except EtcdUnavailable as exc:
                self._set(connected=False)
                self._degraded(str(exc))
                if not started:
                    task_status.started()
                    started = True
                await self._backoff(delay)
                delay = min(delay * 2, self.retry_max_s)

    def _degraded(self, reason: str) -> None:
        if self._status.degraded is None:
            self._set(degraded=reason, degraded_since=self.wall_clock())
            self._report("degraded", ViewChange())
        else:
            self._set(degraded=reason)  # the latest error shows; degraded is reported once

    def _contact(self) -> None:
        """etcd answered: the view is current as of now, and an outage is over."""
        self._set(current_at=self.wall_clock(), endpoint=self._http.endpoints[self._http.current])
        if self._retry.is_set():
            self._retry = trio.Event()  # in contact: a wake-up asked for meanwhile has nothing left to end
        if self._status.degraded is not None:
            self._set(degraded=None, degraded_since=None)
            self._report("recovered", ViewChange())

    def _check_header(self, header: Mapping[str, Any]) -> None:
        """A store with another cluster id, or a revision below ours, was restored or replaced: list again."""
        cluster_id = str(header.get("cluster_id") or "")
        if cluster_id and self._cluster_id and cluster_id != self._cluster_id:
            self._cluster_id = cluster_id
            raise _Relist
        revision = int(header.get("revision") or 0)
        if revision and revision < self._view.revision:
            raise _Relist

    # -- list ----------------------------------------------------------------------------

    async def _list(self) -> None:
        """Read every key under the prefix at one revision, page by page, and apply the difference."""
        for _ in range(3):
            try:
                keys, revision, cluster_id = await self._read_all()
            except EtcdRefused as exc:
                if exc.compacted:
                    continue  # compacted between two pages: start again at the new revision
                raise
            except _UNEXPECTED as exc:
                raise EtcdUnavailable(f"etcd answered a range with something else: {type(exc).__name__}: {exc}") \
                    from None
            self._cluster_id = cluster_id
            first = not self._status.listed
            change = self._view.reset(keys, revision)
            self._set(listed=True)
            if change.engines_changed:
                self._set(last_event_at=self.wall_clock())
            self._contact()
            if change or first:
                self._report("listed", change)
            return
        raise EtcdUnavailable("etcd compacted the prefix three times while it was being listed")

    async def _read_all(self) -> tuple[list[StoredKey], int, str]:
        keys: list[StoredKey] = []
        revision = 0
        cluster_id = ""
        body: dict[str, Any] = {**self._range, "limit": str(self.page_size)}
        while True:
            answer = await self._http.post("/v3/kv/range", body)
            header = answer.get("header") or {}
            if not revision:
                revision = int(header.get("revision") or 0)
                cluster_id = str(header.get("cluster_id") or "")
                body["revision"] = str(revision)  # every page at the first page's revision
            kvs = [key_value(entry) for entry in answer.get("kvs") or []]
            keys.extend(StoredKey(kv.key_text, kv.value_bytes, kv.mod_revision) for kv in kvs)
            if len(keys) > self.max_keys:
                raise EtcdUnavailable(f"more than {self.max_keys} keys under {self.prefix!r}: not listing them")
            if not answer.get("more") or not kvs:
                return keys, revision, cluster_id
            body["key"] = b64(unb64(kvs[-1].key) + b"\0")  # the next page starts after the last key

    # -- watch ---------------------------------------------------------------------------

    async def _watch(self) -> None:
        """One watch stream from ``revision + 1``; returns when it ends or goes quiet for ``idle_s``.

        Raises EtcdUnavailable when no endpoint opens one, _Relist when the watch cannot go on.
        """
        http = self._http
        body = msgspec.json.encode({"create_request": {**self._range, "start_revision": str(self._view.revision + 1),
                                                       "progress_notify": True}})
        timeout = httpx.Timeout(self.timeout_s, read=self.idle_s)
        problems: list[str] = []
        count = len(http.endpoints)
        start = http.current
        for step in range(count):
            index = (start + step) % count
            endpoint = http.endpoints[index]
            self._opened = False
            try:
                async with self._stream_client.stream("POST", f"{endpoint}/v3/watch", content=body, timeout=timeout,
                                                      headers=_WATCH_HEADERS) as response:
                    if response.status_code != 200:
                        problems.append(f"{endpoint}: HTTP {response.status_code}")
                        continue
                    http.current = index
                    try:
                        await self._read_stream(response)
                    finally:
                        self._set(connected=False)
            except httpx.HTTPError as exc:
                if self._opened:
                    return  # dropped, or quiet for idle_s (a proxy may have cut it): resume
                problems.append(f"{endpoint}: {type(exc).__name__}")
                continue
            except EtcdUnavailable as exc:
                # This member refused the watch or broke it off (no leader, an error line): next time, another.
                http.current = (index + 1) % count
                if self._opened:
                    raise
                problems.append(f"{endpoint}: {exc}")
                continue
            if self._opened:
                return  # etcd closed a watch it had opened: resume
            problems.append(f"{endpoint}: the watch stream ended before it was created")
        raise EtcdUnavailable(f"etcd watch unreachable: {'; '.join(problems)}")

    async def _read_stream(self, response: httpx.Response) -> None:
        buffer = bytearray()
        stop: Exception | None = None
        # Leaving the stream by an exception of ours would abandon httpx's generators mid-read; a cancel
        # lands inside the innermost read, so every generator of the chain ends as it would on a dropped line.
        with trio.CancelScope() as reading:
            async for chunk in response.aiter_bytes():
                if stop is not None:
                    continue  # already leaving: the next read raises Cancelled
                buffer += chunk
                try:
                    while (end := buffer.find(b"\n")) >= 0:
                        line = bytes(buffer[:end])
                        del buffer[:end + 1]
                        if line.strip():
                            self._line(line)
                    if len(buffer) > MAX_LINE_BYTES:
                        raise _Relist  # one response too big to hold: the paginated list reads the same state
                except (_Relist, EtcdUnavailable) as exc:
                    stop = exc
                    reading.cancel()
        if stop is not None:
            raise stop

    def _line(self, line: bytes) -> None:
        try:
            message = _decode_line.decode(line)
            if not isinstance(message, dict):
                raise TypeError("not a JSON object")
            change = self._message(message)
        except _UNEXPECTED as exc:
            raise EtcdUnavailable(f"etcd watch sent something else: {type(exc).__name__}: {exc}") from None
        # on_update is called out here: what it raises is the caller's, not etcd's.
        self._contact()
        if change:
            self._report("events", change)

    def _message(self, message: dict[str, Any]) -> ViewChange:
        """Apply one line of the watch stream; what changed."""
        if "error" in message:
            error = message["error"]
            text = error.get("message") if isinstance(error, dict) else error
            if "compacted" in str(text):
                raise _Relist
            raise EtcdUnavailable(f"etcd watch error: {text}")
        result = message.get("result") or {}
        header = result.get("header") or {}
        if int(result.get("compact_revision") or 0):
            raise _Relist  # etcd compacted past our revision: events were lost to us, the state was not
        if result.get("canceled"):
            raise EtcdUnavailable(f"etcd canceled the watch: {result.get('cancel_reason') or 'no reason given'}")
        self._check_header(header)
        if result.get("created"):
            self._opened = True
            self._set(connected=True)
        events = [self._event(entry) for entry in result.get("events") or []]
        if not events:
            return ViewChange()
        change = self._view.apply(events)
        if change.engines_changed:
            self._set(last_event_at=self.wall_clock())
        return change

    @staticmethod
    def _event(entry: Mapping[str, Any]) -> KeyEvent:
        kv = key_value(entry.get("kv") or {})
        kind: Literal["put", "delete"] = "delete" if entry.get("type") == "DELETE" else "put"
        return KeyEvent(kind, kv.key_text, kv.mod_revision, kv.value_bytes if kind == "put" else b"")

    async def aclose(self) -> None:
        await self._http.aclose()
        await self._stream_client.aclose()
