"""Discovery in the router: runs the store's watcher and applies file engines + discovered engines as one set.

The watcher (etcd's ``EtcdWatcher``, or the Kubernetes one) keeps the view of
the store; this service turns each update into the engine set
(``narwhal.discovery.union``) and applies it through ``EngineSet.apply``, the
path a config reload takes, so a discovered engine enters placement only
through readmission and a vanished one leaves as a removed one does.

Only the router that acts applies: with a lease, the holder (``is_active``);
a standby watches too and applies its view the moment it takes over (checked
every ``poll_s``). An outage (``degraded``) never changes the set: the watcher
keeps its last view. A changed ``[discovery]`` section (a reload) restarts the
watch; the engines discovered so far stay until the new watch has listed.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, Literal, Protocol

import msgspec
import trio

from narwhal.config import Config, DiscoveryConfig, EngineSpec, RunningConfig
from narwhal.discovery.etcd_watch import WatchStatus
from narwhal.discovery.events import Update, log_update
from narwhal.discovery.union import Refused, union_entries
from narwhal.errors import StartupError
from narwhal.fleet.registry import EngineEntry
from narwhal.obs.logs import log_event

__all__ = ["DiscoveredEngine", "DiscoveryService", "DiscoveryView", "Watcher", "build_watcher"]


class Watcher(Protocol):
    """What the service runs: ``EtcdWatcher`` and the Kubernetes watcher have this shape.

    ``run`` calls ``on_update`` with updates shaped as ``narwhal.discovery.events.Update`` (etcd's
    ``ViewUpdate``): ``reason`` (listed, events, degraded, recovered), ``engines`` (the whole view),
    ``change`` and ``status``; ``/admin/discovery`` reads the status's ``revision`` (etcd) or
    ``resource_version`` (Kubernetes), ``listed``, ``connected``, ``last_event_at``, ``current_at``,
    ``degraded``, ``degraded_since`` and ``endpoint`` where it has them, and a ``status`` property of
    the watcher, when there is one, for the current state. An ``aclose()``, when there is one, is
    awaited once the watch ends.
    """

    async def run(self, on_update: Callable[[Any], None], *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None: ...


def build_watcher(config: Config) -> Watcher:
    """The watcher for ``config``'s ``[discovery] backend`` (not "none"); StartupError when it cannot be built."""
    discovery = config.discovery
    if discovery.backend == "etcd":
        from narwhal.discovery.etcd_watch import EtcdWatcher
        return EtcdWatcher(config.discovery_endpoints, prefix=discovery.prefix)
    return _kubernetes_watcher(discovery)


def _kubernetes_watcher(discovery: DiscoveryConfig) -> Watcher:
    """The Kubernetes watcher: ``[discovery]``'s api_url, token_file, ca_file and namespace over the in-cluster
    defaults (the service account's), and the model label's engines with no model on [fleet] model."""
    from narwhal.discovery.kubernetes import KubernetesWatcher, in_cluster_access

    access = None
    if discovery.api_url is None or discovery.namespace is None:
        try:
            access = in_cluster_access()
        except ValueError as exc:
            if discovery.api_url is None:
                raise StartupError(f"discovery.api_url: {exc}") from None
    namespace = discovery.namespace or (access.namespace if access is not None else None)
    if namespace is None:
        raise StartupError("discovery.namespace: not set, and no service account namespace to take it from")
    return KubernetesWatcher(
        namespace, api_url=discovery.api_url or (access.api_url if access is not None else ""),
        prefill_selector=discovery.prefill_selector, decode_selector=discovery.decode_selector,
        port=discovery.port, model_label=discovery.model_label,
        # None: [fleet] model, as an etcd entry without one (a reload of [fleet] model is followed).
        default_model=None,
        token_file=discovery.token_file or (access.token_file if access is not None else None),
        ca_file=discovery.ca_file or (access.ca_file if access is not None else None))


def _key_of(discovery: DiscoveryConfig, name: str) -> str:
    """Where a discovered engine comes from, as ``discovery_entry_invalid``'s ``key`` names it."""
    if discovery.backend == "etcd":
        return f"{discovery.prefix}{name}"
    return f"pods/{discovery.namespace}/{name}" if discovery.namespace else f"pods/{name}"


class DiscoveredEngine(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    url: str
    role: str
    model: str


class DiscoveryView(msgspec.Struct, frozen=True, kw_only=True):
    """``GET /admin/discovery``; times are wall clock (seconds since the epoch)."""

    backend: str
    state: Literal["ok", "degraded", "off"]
    # This router applies what it discovers (false on a standby, which only watches).
    acting: bool = False
    revision: int | None = None  # etcd
    resource_version: str | None = None  # kubernetes
    last_event_at: float | None = None
    # Seconds since the store last confirmed the view (a list, a watch line or bookmark).
    view_age_s: float | None = None
    degraded: str | None = None
    degraded_since: float | None = None
    connected: bool = False
    endpoint: str | None = None
    engines: list[DiscoveredEngine] = []
    # Discovered engines left out of the engine set, and why.
    refused: list[dict[str, str]] = []


class DiscoveryService:
    """Runs the watcher of ``[discovery]`` and applies file + discovered engines when this router acts."""

    def __init__(self, *, config: Config, file_entries: Callable[[], list[EngineEntry]],
                 apply: Callable[[list[EngineEntry]], None], is_active: Callable[[], bool],
                 build: Callable[[Config], Watcher] = build_watcher, poll_s: float = 0.2,
                 wall_clock: Callable[[], float] = time.time, on_view: Callable[[], None] = lambda: None,
                 problem: Callable[[EngineSpec], str | None] = lambda spec: None, role_changes: bool = True) -> None:
        """``problem(spec)``: the router's own reason to refuse a discovered engine (one that is the router).

        ``role_changes``: whether ``is_active`` can change (a lease); only then is it looked at every ``poll_s``.
        """
        self.config = config
        self._file_entries = file_entries
        self._apply = apply
        self._is_active = is_active
        self._build = build
        self.poll_s = poll_s
        self._wall_clock = wall_clock
        self._on_view = on_view
        self._problem = problem
        self._role_changes = role_changes
        self._following_role = False
        # The store's view as the watcher last reported it, and its status.
        self._view: dict[str, EngineSpec] = {}
        self._status: Any = None
        self._listed = False
        # The discovered engines in the engine set now (what a reload's union uses); None: none applied yet.
        self._applied: dict[str, EngineSpec] | None = None
        self._refused: list[Refused] = []
        self._reported: set[tuple[str, str]] = set()
        self._starting = True
        self._nursery: trio.Nursery | None = None
        self._watch_scope: trio.CancelScope | None = None
        self._watcher: Watcher | None = None

    def __repr__(self) -> str:
        return (f"<DiscoveryService {self.config.discovery.backend} [view: {sorted(self._view) or '-'} | "
                f"applied: {sorted(self._applied or {}) or '-'}]>")

    @property
    def enabled(self) -> bool:
        return self.config.discovery.enabled

    # -- what the router asks ----------------------------------------------------------

    def watched_entries(self) -> list[EngineEntry]:
        """The file's engines plus the discovered ones as the store holds them now (applied or not)."""
        entries, _ = union_entries(self._file_entries(), self._view, default_model=self.config.fleet.model,
                                   problem=self._problem)
        return entries

    def startup_problem(self) -> str | None:
        """A discovered engine named like a file engine, at startup: the router refuses to start."""
        _, refused = union_entries(self._file_entries(), self._view, default_model=self.config.fleet.model,
                                   problem=self._problem)
        for problem in refused:
            if problem.in_file:
                return (f"discovery: engine {problem.name!r} is both in the config file's [[engines]] and "
                        f"discovered at {_key_of(self.config.discovery, problem.name)}: rename one")
        return None

    def configure(self, running: RunningConfig) -> None:
        """A reload: a changed ``[discovery]`` restarts the watch (or stops it); the router applies the set."""
        old = self.config.discovery
        self.config = running.config
        new = running.config.discovery
        if new == old or self._nursery is None:
            return
        if self._watch_scope is not None:
            self._watch_scope.cancel()
            self._watch_scope = None
        self._status = None
        self._watcher = None
        self._listed = False
        if not new.enabled:
            # Off: the discovered engines leave with the set the reload applies next.
            self._view = {}
            self._applied = {} if self._applied is not None else None
            return
        self._nursery.start_soon(self._watch, new)
        self._follow_role_if_needed()

    def view(self) -> DiscoveryView:
        """What ``GET /admin/discovery`` shows."""
        discovery = self.config.discovery
        if not discovery.enabled:
            return DiscoveryView(backend=discovery.backend, state="off")
        # The watcher's status as of now when it shows one (connected, age), else the one last reported.
        live = getattr(self._watcher, "status", None) if self._watcher is not None else None
        status = live if live is not None and self._status is not None else self._status
        degraded = getattr(status, "degraded", None) if status is not None else None
        current_at = getattr(status, "current_at", None)
        model = self.config.fleet.model
        return DiscoveryView(
            backend=discovery.backend, state="degraded" if degraded is not None or not self._listed else "ok",
            acting=self._is_active(),
            revision=getattr(status, "revision", None) if discovery.backend == "etcd" else None,
            resource_version=getattr(status, "resource_version", None) if discovery.backend == "kubernetes" else None,
            last_event_at=getattr(status, "last_event_at", None),
            view_age_s=None if current_at is None else max(0.0, self._wall_clock() - current_at),
            degraded=degraded if status is not None else "not listed yet",
            degraded_since=getattr(status, "degraded_since", None),
            connected=bool(getattr(status, "connected", False)), endpoint=getattr(status, "endpoint", None),
            engines=[DiscoveredEngine(name=name, url=spec.url, role=spec.role,
                                      model=spec.model if spec.model is not None else model)
                     for name, spec in sorted(self._view.items())],
            refused=[{"name": problem.name, "problem": problem.problem} for problem in self._refused])

    # -- running -------------------------------------------------------------------------

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Own the watch and the takeover check, until cancelled; started once the first list is in (or failed)."""
        problem = None
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                if self.enabled:
                    await nursery.start(self._watch, self.config.discovery)
                problem = self.startup_problem()
                if problem is not None:
                    nursery.cancel_scope.cancel()  # the watch ends; the error is raised below, ungrouped
                else:
                    self._starting = False
                    self._act()
                    self._follow_role_if_needed()
                    task_status.started()
                    await trio.sleep_forever()
            finally:
                self._nursery = None
        if problem is not None:
            raise StartupError(problem)

    async def _watch(self, discovery: DiscoveryConfig, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        try:
            watcher = self._watcher = self._build(self.config)
        except StartupError as exc:
            if self._starting:
                raise
            # A reload asked for a watcher this build cannot make: the engines discovered so far stay.
            self._status = WatchStatus(degraded=str(exc), degraded_since=self._wall_clock())
            log_event("discovery_degraded", level=logging.WARNING, source=discovery.backend, error=str(exc))
            task_status.started()
            return
        scope = self._watch_scope = trio.CancelScope()
        try:
            with scope:
                await watcher.run(functools.partial(self._on_update, scope), task_status=task_status)
        finally:
            close = getattr(watcher, "aclose", None)
            if close is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                    await close()

    def _follow_role_if_needed(self) -> None:
        if self._role_changes and self.enabled and not self._following_role and self._nursery is not None:
            self._following_role = True
            self._nursery.start_soon(self._follow_role)

    async def _follow_role(self) -> None:
        # A standby that takes over applies its view at once (within poll_s): it watched all along.
        # Only with a lease and discovery on: a router without either has no role change to wait for.
        try:
            while self.enabled:
                await trio.sleep(self.poll_s)
                self._act()
        finally:
            self._following_role = False

    def _on_update(self, scope: trio.CancelScope, update: Update) -> None:
        if scope is not self._watch_scope:
            return  # a watch a reload replaced, reporting on its way out
        log_update(update, source=self.config.discovery.backend, default_model=self.config.fleet.model)
        self._status = update.status
        if update.reason == "degraded":
            return  # the watcher keeps its last view: the set stays as it is
        self._listed = self._listed or update.reason == "listed" or bool(getattr(update.status, "listed", False))
        engines = dict(update.engines)
        if engines != self._view:
            self._view = engines
            self._on_view()
        self._act()

    def _act(self) -> None:
        """Apply the view when this router acts and the set does not hold it yet."""
        if self._starting or not self.enabled or not self._listed or not self._is_active():
            return
        if self._applied == self._view:
            return
        self._applied = dict(self._view)
        self._apply(self.apply_entries())

    def apply_entries(self) -> list[EngineEntry]:
        """The engine set: the file's engines plus the discovered ones applied (a reload applies this too).

        Each discovered engine newly refused is logged once (``discovery_entry_invalid``).
        """
        entries, refused = union_entries(self._file_entries(), self._applied or {},
                                         default_model=self.config.fleet.model, problem=self._problem)
        self._refused = refused
        now = {(problem.name, problem.problem) for problem in refused}
        for problem in refused:
            if (problem.name, problem.problem) not in self._reported:
                log_event("discovery_entry_invalid", level=logging.WARNING, source=self.config.discovery.backend,
                          key=_key_of(self.config.discovery, problem.name), problem=problem.problem)
        self._reported = now
        return entries

