"""Watch the engines Kubernetes runs: list the Pods each label selector selects, then watch them, forever.

For each selector (one per role) it lists ``/api/v1/namespaces/NS/pods`` in
chunks (``limit``/``continue``), then watches from the list's resourceVersion
with bookmarks, and re-watches from the last resourceVersion it saw (an event's
or a bookmark's) when the server ends the watch, as it does after
``timeoutSeconds``. On ``410 Gone`` (an HTTP status, or an ERROR event with
code 410) it lists again and applies the difference. A Pod is an engine, named
after the Pod, at ``http://POD_IP:PORT``, only while Running with its Ready
condition true and not being deleted. While the API cannot be read the last
known view stands; ``on_update`` hears ``degraded`` once and ``recovered`` when
every selector is read again. httpx against the API: no Kubernetes client
library runs under trio (lightkube's async watch sleeps with asyncio).
"""

from __future__ import annotations

import os
import ssl
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

import httpx
import msgspec
import trio

from narwhal.config import EngineSpec
from narwhal.discovery.entry import EntryProblem
from narwhal.discovery.pods import (
    Pod,
    PodList,
    PodState,
    Role,
    compose_engines,
    decode_api_status,
    decode_pod,
    decode_pod_list,
    decode_watch_event,
    newest_resource_version,
    pod_engine,
)
from narwhal.discovery.view import ViewChange, diff_views
from narwhal.errors import NarwhalError

__all__ = ["IN_CLUSTER_DIR", "ClusterAccess", "KubernetesStatus", "KubernetesWatcher", "ViewUpdate",
           "in_cluster_access"]

IN_CLUSTER_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# What an answer that is not the API's raises while it is read: the watch goes on, degraded, never stops.
_UNEXPECTED = (msgspec.MsgspecError, ValueError, TypeError, AttributeError, KeyError)
# Bounds: one watch line (one Pod, at most ~1.5 MiB in etcd), one list page, the Pods a selector may select.
MAX_LINE_BYTES = 4 * 1024 * 1024
MAX_PAGE_BYTES = 64 * 1024 * 1024
MAX_TOKEN_BYTES = 64 * 1024


class ClusterAccess(msgspec.Struct, frozen=True, kw_only=True):
    """Where the API is and how to prove who we are: the in-cluster defaults, or ``[discovery]``'s overrides."""

    api_url: str
    token_file: str | None = None
    ca_file: str | None = None
    namespace: str | None = None  # the Pod's own namespace, when it runs in one


def in_cluster_access(environ: Mapping[str, str] | None = None, directory: str = IN_CLUSTER_DIR) -> ClusterAccess:
    """The service account's API address, token, CA and namespace; ValueError outside a cluster."""
    env = os.environ if environ is None else environ
    host = env.get("KUBERNETES_SERVICE_HOST", "")
    if not host:
        raise ValueError("not running in a Kubernetes cluster (KUBERNETES_SERVICE_HOST is not set): "
                         "give [discovery] api_url")
    port = env.get("KUBERNETES_SERVICE_PORT", "443")
    host = f"[{host}]" if ":" in host else host
    namespace = None
    try:
        with open(os.path.join(directory, "namespace"), encoding="utf-8") as file:
            namespace = file.read(256).strip() or None
    except OSError:
        pass
    return ClusterAccess(api_url=f"https://{host}:{port}", token_file=os.path.join(directory, "token"),
                         ca_file=os.path.join(directory, "ca.crt"), namespace=namespace)


class KubernetesStatus(msgspec.Struct, frozen=True, kw_only=True):
    """Where the watch stands (times wall clock); resourceVersions are opaque strings, one per selector."""

    resource_version: str = ""  # the newest of resource_versions (or the last applied, were they not numbers)
    resource_versions: dict[str, str] = {}  # {role: resourceVersion}
    listed: bool = False  # every selector has been listed once
    connected: bool = False  # every selector's watch is open now
    last_event_at: float | None = None
    current_at: float | None = None  # the last time the API confirmed the view
    degraded: str | None = None
    degraded_since: float | None = None
    endpoint: str = ""  # the API's URL


class ViewUpdate(msgspec.Struct, frozen=True, kw_only=True):
    """The full view after a change, what changed, and why ``on_update`` was called."""

    reason: Literal["listed", "events", "degraded", "recovered"]
    engines: Mapping[str, EngineSpec]
    change: ViewChange
    status: KubernetesStatus


def _describe(exc: BaseException) -> str:
    """``ConnectError: [SSL: CERTIFICATE_VERIFY_FAILED] ...``: httpx's own text is often empty, its cause's is not."""
    text, cause = str(exc), exc.__cause__ or exc.__context__
    for _ in range(5):
        if text or cause is None:
            break
        text, cause = str(cause), cause.__cause__ or cause.__context__
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def _read_body(response: httpx.Response, limit: int) -> bytes | None:
    """The body, or None past ``limit`` bytes."""
    body = bytearray()
    # Stopped by a cancel, not a break or a raise: every generator of httpx's chain then ends as on a dropped line.
    with trio.CancelScope() as reading:
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > limit:
                reading.cancel()
    return None if len(body) > limit else bytes(body)


class _Unavailable(NarwhalError):
    """The API cannot be read now: degraded, retried."""


class _Gone(NarwhalError):
    """410: the resourceVersion (or continue token) is too old: list again."""


class _Selection:
    """One selector's Pods, as of ``resource_version``."""

    def __init__(self, role: Role, selector: str) -> None:
        self.role = role
        self.selector = selector
        self.pods: dict[str, PodState] = {}
        self.resource_version = ""
        self.listed = False
        self.connected = False
        self.tried = False  # a first list has been tried (applied or failed)
        # A watch broke off with an error after it opened: an answered list or a watch that opens proves nothing
        # (they did last time too); only a watch line or a watch run to its end says the outage is over.
        self.suspect = False


class KubernetesWatcher:
    """Lists and watches the Pods ``prefill_selector`` / ``decode_selector`` select; ``run`` reports changes."""

    def __init__(self, namespace: str, *, api_url: str, prefill_selector: str | None = None,
                 decode_selector: str | None = None, port: int | str = 8000, model_label: str | None = None,
                 default_model: str | None = None, token_file: str | None = None, ca_file: str | None = None,
                 timeout_s: float = 5.0, watch_timeout_s: float = 240.0, resync_interval_s: float = 600.0,
                 retry_min_s: float = 0.2, retry_max_s: float = 5.0, page_size: int = 500, max_pods: int = 10_000,
                 client: httpx.AsyncClient | None = None, wall_clock: Callable[[], float] = time.time) -> None:
        if prefill_selector is None and decode_selector is None:
            raise ValueError("give prefill_selector, decode_selector or both")
        self.namespace = namespace
        self.api_url = api_url.rstrip("/")
        self.port: int | str = int(port) if isinstance(port, str) and port.isdigit() else port
        self.model_label = model_label or None
        self.default_model = default_model
        self.token_file = token_file
        self.timeout_s = timeout_s
        self.watch_timeout_s = watch_timeout_s
        self.resync_interval_s = resync_interval_s
        self.retry_min_s = retry_min_s
        self.retry_max_s = retry_max_s
        self.page_size = page_size
        self.max_pods = max_pods
        self.wall_clock = wall_clock
        self._url = f"{self.api_url}/api/v1/namespaces/{namespace}/pods"
        verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca_file) if ca_file else True
        self._client = client or httpx.AsyncClient(verify=verify)
        # Each watch on a connection of its own: a pooled one may have died silently since its last use.
        self._stream_client = client or httpx.AsyncClient(
            verify=verify, limits=httpx.Limits(max_keepalive_connections=0))
        roles: tuple[tuple[Role, str | None], ...] = (("prefill", prefill_selector), ("decode", decode_selector))
        self._selections = [_Selection(role, selector) for role, selector in roles if selector is not None]
        self._engines: dict[str, EngineSpec] = {}
        self._reported: dict[str, str] = {}  # invalid Pods already logged, with the problem logged
        self._failures: dict[str, str] = {}  # {role: why its selector cannot be read}
        self._status = KubernetesStatus(endpoint=self.api_url)
        self._on_update: Callable[[ViewUpdate], None] = lambda update: None

    @property
    def engines(self) -> dict[str, EngineSpec]:
        return dict(self._engines)

    @property
    def status(self) -> KubernetesStatus:
        versions = {s.role: s.resource_version for s in self._selections}
        return msgspec.structs.replace(
            self._status, resource_version=newest_resource_version(versions.values()) or self._status.resource_version,
            resource_versions=versions,
            listed=all(s.listed for s in self._selections), connected=all(s.connected for s in self._selections))

    def _set(self, **fields: Any) -> None:
        self._status = msgspec.structs.replace(self._status, **fields)

    def _report(self, reason: Literal["listed", "events", "degraded", "recovered"], change: ViewChange) -> None:
        self._on_update(ViewUpdate(reason=reason, engines=self.engines, change=change, status=self.status))

    async def run(self, on_update: Callable[[ViewUpdate], None], *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Watch until cancelled, calling ``on_update`` (at once, in this task: it must not block or raise).

        Started once every selector's first list is applied or has failed (then the status is degraded).
        """
        self._on_update = on_update
        tried = trio.Event()
        async with trio.open_nursery() as nursery:
            for selection in self._selections:
                nursery.start_soon(self._follow, selection, tried)
            await tried.wait()
            task_status.started()

    async def _follow(self, selection: _Selection, tried: trio.Event) -> None:
        need_list = True
        next_resync = listed_at = 0.0
        delay = self.retry_min_s
        while True:
            try:
                if need_list or trio.current_time() >= next_resync:
                    await self._list(selection)
                    listed_at = trio.current_time()
                    need_list = False
                    next_resync = listed_at + self.resync_interval_s
                self._tried(selection, tried)
                opened = trio.current_time()
                ended = False
                with trio.move_on_after(max(0.0, next_resync - trio.current_time())):
                    ended = await self._watch(selection)
                if trio.current_time() - opened > 1.0:
                    if ended:
                        self._contact(selection, live=True)  # a watch that ran to the server's end of it
                    delay = self.retry_min_s
                else:
                    await trio.sleep(delay)  # a watch that ends as soon as it opens: do not spin
                    delay = min(delay * 2, self.retry_max_s)
            except _Gone:
                need_list = True
                if trio.current_time() - listed_at < 1.0:
                    await trio.sleep(delay)  # gone again right after a list: do not spin
                    delay = min(delay * 2, self.retry_max_s)
            except _Unavailable as exc:
                selection.connected = False
                self._failing(selection.role, str(exc))
                self._tried(selection, tried)
                await trio.sleep(delay)
                delay = min(delay * 2, self.retry_max_s)

    def _tried(self, selection: _Selection, tried: trio.Event) -> None:
        selection.tried = True
        if all(s.tried for s in self._selections):
            tried.set()

    def _failing(self, role: str, reason: str) -> None:
        self._failures[role] = reason
        if self._status.degraded is None:
            self._set(degraded=reason, degraded_since=self.wall_clock())
            self._report("degraded", ViewChange())
        else:
            self._set(degraded=reason)  # the latest error shows; degraded is reported once

    def _contact(self, selection: _Selection, *, live: bool = False) -> None:
        """The API answered: the view is current; the outage is over once every selector answers."""
        if live:
            selection.suspect = False
        if selection.suspect:
            return
        self._failures.pop(selection.role, None)
        self._set(current_at=self.wall_clock())
        if self._status.degraded is not None and not self._failures:
            self._set(degraded=None, degraded_since=None)
            self._report("recovered", ViewChange())

    def _state(self, pod: Pod, role: Role) -> PodState:
        return pod_engine(pod, role=role, namespace=self.namespace, port=self.port, model_label=self.model_label,
                          default_model=self.default_model)

    def _recompute(self) -> ViewChange:
        """The engines from every selection's Pods; a Pod two selectors select is no engine, and is logged."""
        engines, problems = compose_engines({s.role: s.pods for s in self._selections}, self.namespace)
        fresh = tuple(EntryProblem(key=key, problem=problem) for key, problem in sorted(problems.items())
                      if self._reported.get(key) != problem)
        self._reported = problems
        change = diff_views(self._engines, engines)
        self._engines = engines
        if change.engines_changed:
            self._set(last_event_at=self.wall_clock())
        return msgspec.structs.replace(change, problems=fresh)

    # -- HTTP --------------------------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        headers = {"accept": "application/json"}
        if self.token_file:
            # Read every time: bound service account tokens are rotated in the file by the kubelet.
            try:
                with open(self.token_file, "rb") as file:
                    token = file.read(MAX_TOKEN_BYTES).decode().strip()
            except (OSError, UnicodeDecodeError) as exc:
                raise _Unavailable(f"cannot read token_file {self.token_file!r}: {exc}") from None
            headers["authorization"] = f"Bearer {token}"
        return headers

    @staticmethod
    async def _refusal(response: httpx.Response) -> Exception:
        """What a status other than 200 means: 410 lists again, anything else is an outage (named)."""
        if response.status_code == 410:
            return _Gone()
        try:
            body = await _read_body(response, 64 * 1024)
            message = decode_api_status.decode(body).message if body is not None else ""
        except (httpx.HTTPError, *_UNEXPECTED):
            message = ""
        text = f"HTTP {response.status_code} {response.reason_phrase}"
        return _Unavailable(f"{text}: {message}" if message else text)

    # -- list --------------------------------------------------------------------------------

    async def _list(self, selection: _Selection) -> None:
        """Read every Pod the selector selects, page by page at one resourceVersion, and apply the difference."""
        for _ in range(3):
            try:
                pods, resource_version = await self._read_all(selection)
            except _Gone:
                continue  # the continue token expired between two pages: start again
            first = not selection.listed
            selection.pods = pods
            selection.resource_version = resource_version
            selection.listed = True
            self._set(resource_version=resource_version)
            change = self._recompute()
            self._contact(selection)
            # The first time every selector is listed is reported even if empty: the view is then whole.
            if change or (first and all(s.listed for s in self._selections)):
                self._report("listed", change)
            return
        raise _Unavailable("the list's continue token expired three times in a row")

    async def _read_all(self, selection: _Selection) -> tuple[dict[str, PodState], str]:
        params = {"labelSelector": selection.selector, "limit": str(self.page_size)}
        pods: dict[str, PodState] = {}
        resource_version = ""
        while True:
            page = await self._page(params)
            resource_version = resource_version or page.metadata.resourceVersion
            for pod in page.items or ():
                pods[pod.metadata.name] = self._state(pod, selection.role)
            if len(pods) > self.max_pods:
                raise _Unavailable(f"{selection.role}_selector selects more than {self.max_pods} pods")
            if not page.metadata.continue_:
                if not resource_version:
                    raise _Unavailable("the API answered a list without a resourceVersion")
                return pods, resource_version
            params["continue"] = page.metadata.continue_

    async def _page(self, params: dict[str, str]) -> PodList:
        try:
            async with self._client.stream("GET", self._url, params=params, headers=self._headers(),
                                           timeout=self.timeout_s) as response:
                if response.status_code != 200:
                    raise await self._refusal(response)
                with trio.fail_after(self.timeout_s * 4):  # a deadline for the whole page, not each read
                    body = await _read_body(response, MAX_PAGE_BYTES)
            if body is None:
                raise _Unavailable(f"a list page over {MAX_PAGE_BYTES} bytes: lower page_size")
            return decode_pod_list.decode(body)
        except httpx.HTTPError as exc:
            raise _Unavailable(f"{self.api_url}: {_describe(exc)}") from None
        except trio.TooSlowError:
            raise _Unavailable(f"{self.api_url}: a list page took over {self.timeout_s * 4} s") from None
        except _UNEXPECTED as exc:
            raise _Unavailable(f"the API answered a list with something else: {type(exc).__name__}: {exc}") \
                from None

    # -- watch -------------------------------------------------------------------------------

    async def _watch(self, selection: _Selection) -> bool:
        """One watch from the selection's resourceVersion; True when the server ended it, False when it dropped
        or went quiet."""
        params = {"labelSelector": selection.selector, "watch": "1", "allowWatchBookmarks": "true",
                  "resourceVersion": selection.resource_version,
                  "timeoutSeconds": str(max(1, int(self.watch_timeout_s)))}
        # Quiet past the server's own timeout (plus slack): the stream is dead without a word, reopen it.
        timeout = httpx.Timeout(self.timeout_s, read=self.watch_timeout_s + self.timeout_s)
        opened = False
        try:
            async with self._stream_client.stream("GET", self._url, params=params, headers=self._headers(),
                                                  timeout=timeout) as response:
                if response.status_code != 200:
                    raise await self._refusal(response)
                opened = selection.connected = True
                self._contact(selection)
                try:
                    await self._read_stream(selection, response)
                finally:
                    selection.connected = False
            return True
        except httpx.HTTPError as exc:
            if opened:
                return False  # dropped, or quiet too long: resume from the last resourceVersion
            raise _Unavailable(f"{self.api_url}: {_describe(exc)}") from None

    async def _read_stream(self, selection: _Selection, response: httpx.Response) -> None:
        buffer = bytearray()
        stop: Exception | None = None
        # Leaving by an exception of ours would abandon httpx's generators mid-read; a cancel ends them cleanly.
        with trio.CancelScope() as reading:
            async for chunk in response.aiter_bytes():
                if stop is not None:
                    continue
                buffer += chunk
                try:
                    while (end := buffer.find(b"\n")) >= 0:
                        line = bytes(buffer[:end])
                        del buffer[:end + 1]
                        if line.strip():
                            self._line(selection, line)
                    if len(buffer) > MAX_LINE_BYTES:
                        raise _Gone  # one event too big to hold: a list reads the same state in pages
                except (_Gone, _Unavailable) as exc:
                    selection.suspect = isinstance(exc, _Unavailable)
                    stop = exc
                    reading.cancel()
        if stop is not None:
            raise stop

    def _line(self, selection: _Selection, line: bytes) -> None:
        try:
            event = decode_watch_event.decode(line)
            if event.type == "ERROR":
                status = decode_api_status.decode(event.object)
                if status.code == 410:
                    raise _Gone
                raise _Unavailable(f"watch error {status.code} {status.reason}: {status.message}")
            pod = decode_pod.decode(event.object)
        except _UNEXPECTED as exc:
            raise _Unavailable(f"the watch sent something else: {type(exc).__name__}: {exc}") from None
        resource_version = pod.metadata.resourceVersion or selection.resource_version
        if event.type == "BOOKMARK":
            selection.resource_version = resource_version  # nothing changed up to here: resume from it
            self._contact(selection, live=True)
            return
        name = pod.metadata.name
        if event.type in ("ADDED", "MODIFIED"):
            if name not in selection.pods and len(selection.pods) >= self.max_pods:
                raise _Unavailable(f"{selection.role}_selector selects more than {self.max_pods} pods")
            selection.pods[name] = self._state(pod, selection.role)
        elif event.type == "DELETED":
            selection.pods.pop(name, None)
        else:
            raise _Unavailable(f"the watch sent an event of type {event.type!r}")
        selection.resource_version = resource_version
        self._set(resource_version=resource_version)
        change = self._recompute()
        self._contact(selection, live=True)
        if change:
            self._report("events", change)

    async def aclose(self) -> None:
        await self._client.aclose()
        await self._stream_client.aclose()
