"""An in-process Kubernetes API server double for Pods in one namespace: list and watch, over real HTTP on trio.

Follows the API's contract for ``GET /api/v1/namespaces/NS/pods``:
- every change gets the next resourceVersion (a counter, sent as a string as the API does; clients must treat
  it as opaque); a list answers ``metadata.resourceVersion``, each object carries its own;
- ``limit``/``continue``: chunked lists, every page from one snapshot; a continue token past its expiry
  (``expire_continue_tokens()``, or compaction past its snapshot) answers HTTP 410 with a Status ``Expired``;
- ``watch=1&resourceVersion=RV``: the events after RV (ADDED / MODIFIED / DELETED with the whole Pod), then
  live ones; RV older than the compacted history (``compact()``) answers 410 ``Gone``, as an ERROR event
  carrying a Status with code 410 (the API's way for a watch) or, with ``gone_as_status=True``, as HTTP 410;
- ``allowWatchBookmarks=true``: a BOOKMARK event (a Pod with only ``metadata.resourceVersion``) every
  ``bookmark_interval_s``, and ``bookmark_now()`` on demand;
- ``timeoutSeconds``: the server ends the watch (a clean end of the chunked stream) after it;
- a watch with a ``labelSelector`` sees an object that stops matching as DELETED, one that starts as ADDED;
- ``labelSelector``: equality-based (``a=b``, ``a==b``, ``a!=b``) and set-based (``a in (x,y)``,
  ``a notin (x)``, ``a``, ``!a``) requirements, comma-separated, all must hold;
- ``Authorization: Bearer TOKEN``: anything else answers HTTP 401 with a Status ``Unauthorized``.

Not followed: any other resource, verb, or namespace list; fieldSelector; watch without a resourceVersion or
with ``resourceVersion=0`` (synthetic ADDED events) and resourceVersionMatch; sendInitialEvents / watch lists;
protobuf, HTTP/2, client certificates (TLS is served when given an ssl_context); the watch cache's own
windows and its random shortening of timeoutSeconds; server-side apply, finalizers, graceful deletion timing
(a test sets deletionTimestamp itself); priority and fairness (429).
``outage()`` makes it close every connection without an answer, and ends every open watch: an outage;
``stall = True`` makes new watches silent forever (headers, then nothing).
"""

from __future__ import annotations

import base64
import copy
import json
import re
import ssl
import urllib.parse
from typing import Any

import trio

__all__ = ["ApiDouble", "make_pod", "selector_matches"]


def make_pod(name: str, *, labels: dict[str, str], ip: str | None = "10.0.0.1", ready: bool = True,
             phase: str = "Running", ports: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A Pod object with what the watcher reads (the double fills in resourceVersion)."""
    status: dict[str, Any] = {"phase": phase,
                              "conditions": [{"type": "Ready", "status": "True" if ready else "False"},
                                             {"type": "PodScheduled", "status": "True"}]}
    if ip is not None:
        status["podIP"] = ip
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": dict(labels), "uid": f"uid-{name}"},
            "spec": {"containers": [{"name": "engine", "image": "engine:1", "ports": ports or []}]},
            "status": status}


_REQUIREMENT = re.compile(r"^\s*(!?)\s*([A-Za-z0-9_./-]+)\s*(?:(==|=|!=)\s*([A-Za-z0-9_.-]*)|\s+(in|notin)\s*"
                          r"\(([^)]*)\))?\s*$")


def _split(selector: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in selector:
        depth += char == "("
        depth -= char == ")"
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [part for part in parts if part.strip()]


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """Whether ``labels`` satisfy every requirement of ``selector``; ValueError for one it cannot parse."""
    for requirement in _split(selector):
        match = _REQUIREMENT.match(requirement)
        if match is None:
            raise ValueError(f"unparsable requirement {requirement!r}")
        negated, key, op, value, set_op, values = match.groups()
        if negated and (op or set_op):
            raise ValueError(f"unparsable requirement {requirement!r}")
        if op in ("=", "=="):
            ok = labels.get(key) == value
        elif op == "!=":
            ok = labels.get(key) != value
        elif set_op:
            members = {v.strip() for v in values.split(",") if v.strip()}
            ok = labels.get(key) in members if set_op == "in" else labels.get(key) not in members
        else:
            ok = (key in labels) != bool(negated)
        if not ok:
            return False
    return True


def _as_filtered(kind: str, matched_before: bool, matches: bool) -> str | None:
    """What a watch with a label selector sees of a change: an object that leaves the selection is DELETED to it,
    one that enters it ADDED, as the API server's filtered watches do."""
    if kind != "MODIFIED":
        return kind if matches else None
    if matched_before and matches:
        return "MODIFIED"
    if matches:
        return "ADDED"
    return "DELETED" if matched_before else None


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


class ApiDouble:
    """Pods in ``namespace``; tests change them with ``put``/``delete`` and watch what the watcher makes of it."""

    def __init__(self, *, namespace: str = "serving", token: str = "s3cret", bookmark_interval_s: float = 60.0,
                 gone_as_status: bool = False, ssl_context: ssl.SSLContext | None = None) -> None:
        self.namespace = namespace
        self.token = token
        self.bookmark_interval_s = bookmark_interval_s
        self.gone_as_status = gone_as_status
        self.ssl_context = ssl_context  # set: it serves https with it
        self.down = False
        self.stall = False  # watches opened while set send nothing, ever, whatever timeoutSeconds says
        self.url = ""
        self.resource_version = 100
        self.compacted = 100  # events at or below this are forgotten: a watch from below it is 410 Gone
        self.pods: dict[str, dict[str, Any]] = {}
        # (resourceVersion, type, the object, the labels it had before: a filtered watch needs both)
        self.events: list[tuple[int, str, dict[str, Any], dict[str, str]]] = []
        self.requests: list[dict[str, str]] = []  # the query of every request, in order
        self._continues: dict[str, tuple[int, list[dict[str, Any]]]] = {}
        self._changed = trio.Event()
        self._kick = trio.Event()  # set: every open watch ends (or sends a bookmark, see bookmark_now)
        self._bookmark = trio.Event()

    # -- what tests do -------------------------------------------------------------------------

    def put(self, pod: dict[str, Any]) -> int:
        """Create or replace a Pod; its resourceVersion."""
        self.resource_version += 1
        pod = copy.deepcopy(pod)
        pod["metadata"]["namespace"] = self.namespace
        pod["metadata"]["resourceVersion"] = str(self.resource_version)
        old = self.pods.get(pod["metadata"]["name"])
        kind = "MODIFIED" if old is not None else "ADDED"
        self.pods[pod["metadata"]["name"]] = pod
        self._record(kind, pod, (old or pod)["metadata"].get("labels") or {})
        return self.resource_version

    def delete(self, name: str) -> int:
        self.resource_version += 1
        pod = copy.deepcopy(self.pods.pop(name))
        pod["metadata"]["resourceVersion"] = str(self.resource_version)
        self._record("DELETED", pod, pod["metadata"].get("labels") or {})
        return self.resource_version

    def compact(self) -> None:
        """Forget every event so far (etcd compaction): older resourceVersions and continue tokens are gone."""
        self.compacted = self.resource_version
        self.events.clear()

    def outage(self, down: bool = True) -> None:
        """While down, every connection is closed without an answer and open watches break off mid-stream."""
        self.down = down
        if down:
            self.close_watches()

    def expire_continue_tokens(self) -> None:
        self._continues.clear()

    def close_watches(self) -> None:
        """The server ends every open watch, cleanly, as it does after timeoutSeconds."""
        self._kick.set()
        self._kick = trio.Event()

    def bookmark_now(self) -> None:
        self._bookmark.set()
        self._bookmark = trio.Event()

    def watch_requests(self) -> list[dict[str, str]]:
        return [query for query in self.requests if query.get("watch") in ("1", "true")]

    def list_requests(self) -> list[dict[str, str]]:
        return [query for query in self.requests if query.get("watch") not in ("1", "true")]

    def _record(self, kind: str, pod: dict[str, Any], before: dict[str, str]) -> None:
        self.events.append((self.resource_version, kind, pod, before))
        del self.events[:-10_000]  # a bounded history, as the watch cache's
        self._changed.set()
        self._changed = trio.Event()

    # -- the server ------------------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        tcp = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = tcp[0].socket.getsockname()[1]
        listeners: list[Any] = list(tcp)
        if self.ssl_context is not None:
            listeners = [trio.SSLListener(listener, self.ssl_context, https_compatible=True) for listener in tcp]
        self.url = f"{'https' if self.ssl_context else 'http'}://127.0.0.1:{port}"
        task_status.started()
        await trio.serve_listeners(self._connection, listeners)

    async def _connection(self, stream: Any) -> None:
        async with stream:
            try:
                head = await self._read_head(stream)
            except (trio.BrokenResourceError, trio.ClosedResourceError, ValueError):
                return  # a TLS handshake that failed lands here too
            if head is None or self.down:
                return
            method, target, headers = head
            parts = urllib.parse.urlsplit(target)
            query = dict(urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
            self.requests.append(query)
            try:
                await self._answer(stream, method, parts.path, query, headers)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

    @staticmethod
    async def _read_head(stream: Any) -> tuple[str, str, dict[str, str]] | None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return None
            data += chunk
            if len(data) > 64 * 1024:
                raise ValueError("head too long")
        lines = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        return method, target, headers

    async def _send_json(self, stream: Any, code: int, reason: str, body: dict[str, Any]) -> None:
        payload = json.dumps(body).encode()
        await stream.send_all(f"HTTP/1.1 {code} {reason}\r\ncontent-type: application/json\r\n"
                              f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n".encode() + payload)

    async def _answer(self, stream: Any, method: str, path: str, query: dict[str, str],
                      headers: dict[str, str]) -> None:
        if headers.get("authorization") != f"Bearer {self.token}":
            await self._send_json(stream, 401, "Unauthorized", _status(401, "Unauthorized", "Unauthorized"))
            return
        if method != "GET" or path != f"/api/v1/namespaces/{self.namespace}/pods":
            await self._send_json(stream, 404, "Not Found", _status(404, "NotFound", f"{method} {path}"))
            return
        selector = query.get("labelSelector", "")
        try:
            selector_matches(selector, {})
        except ValueError as exc:
            await self._send_json(stream, 400, "Bad Request", _status(400, "BadRequest", str(exc)))
            return
        if query.get("watch") in ("1", "true"):
            await self._watch(stream, selector, query)
        else:
            await self._list(stream, selector, query)

    async def _list(self, stream: Any, selector: str, query: dict[str, str]) -> None:
        limit = int(query.get("limit") or 0)
        token = query.get("continue")
        if token:
            if token not in self._continues or self._continues[token][0] < self.compacted:
                message = "The provided continue parameter is too old to display a consistent list result."
                await self._send_json(stream, 410, "Gone", _status(410, "Expired", message))
                return
            snapshot, remaining = self._continues.pop(token)
        else:
            snapshot = self.resource_version
            remaining = [copy.deepcopy(pod) for _, pod in sorted(self.pods.items())
                         if selector_matches(selector, pod["metadata"].get("labels") or {})]
        page, rest = (remaining[:limit], remaining[limit:]) if limit else (remaining, [])
        metadata: dict[str, Any] = {"resourceVersion": str(snapshot)}
        if rest:
            next_token = base64.urlsafe_b64encode(json.dumps([snapshot, len(self.requests)]).encode()).decode()
            self._continues[next_token] = (snapshot, rest)
            metadata["continue"] = next_token
            metadata["remainingItemCount"] = len(rest)
        await self._send_json(stream, 200, "OK", {"kind": "PodList", "apiVersion": "v1", "metadata": metadata,
                                                  "items": page})

    async def _watch(self, stream: Any, selector: str, query: dict[str, str]) -> None:
        since = int(query.get("resourceVersion") or 0)
        if since < self.compacted and self.gone_as_status:
            message = f"too old resource version: {since} ({self.compacted})"
            await self._send_json(stream, 410, "Gone", _status(410, "Gone", message))
            return
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                              b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n")
        if self.stall:
            await trio.sleep_forever()  # a watch gone silent (a proxy, a wedged server): never a byte, never an end

        async def send(event: dict[str, Any]) -> None:
            line = json.dumps(event).encode() + b"\n"
            await stream.send_all(f"{len(line):x}\r\n".encode() + line + b"\r\n")

        if since < self.compacted:
            message = f"too old resource version: {since} ({self.compacted})"
            await send({"type": "ERROR", "object": _status(410, "Expired", message)})
            await stream.send_all(b"0\r\n\r\n")
            return
        bookmarks = query.get("allowWatchBookmarks") == "true"
        timeout = float(query.get("timeoutSeconds") or 1800)
        sent = since
        with trio.move_on_after(timeout):
            while not self.down:
                changed, kick, bookmark = self._changed, self._kick, self._bookmark
                for revision, kind, pod, before in [event for event in self.events if event[0] > sent]:
                    seen = _as_filtered(kind, selector_matches(selector, before),
                                        selector_matches(selector, pod["metadata"].get("labels") or {}))
                    if seen is not None:
                        await send({"type": seen, "object": pod})
                    sent = revision
                if not changed.is_set():
                    sent = self.resource_version  # nothing newer exists: a bookmark may say so
                woke = ""
                async with trio.open_nursery() as nursery:
                    async def wait(event: trio.Event, name: str) -> None:
                        nonlocal woke
                        await event.wait()
                        woke = woke or name
                        nursery.cancel_scope.cancel()
                    nursery.start_soon(wait, changed, "changed")
                    nursery.start_soon(wait, kick, "kick")
                    nursery.start_soon(wait, bookmark, "bookmark")
                    nursery.start_soon(self._sleep_then, self.bookmark_interval_s, nursery)
                if kick.is_set():
                    break  # ended, even if a change woke this watch first
                if self.down:
                    return  # an outage: no clean end
                if bookmarks and woke in ("bookmark", ""):
                    await send({"type": "BOOKMARK", "object": {
                        "kind": "Pod", "apiVersion": "v1",
                        "metadata": {"resourceVersion": str(sent),
                                     "annotations": {"k8s.io/initial-events-end": "false"}}}})
        if not self.down:
            await stream.send_all(b"0\r\n\r\n")

    @staticmethod
    async def _sleep_then(seconds: float, nursery: trio.Nursery) -> None:
        await trio.sleep(seconds)
        nursery.cancel_scope.cancel()
