"""``narwhal register``: keep an engine registered in etcd while its ``/health`` answers 200.

A sidecar for any engine. It grants an etcd lease of ``--ttl-s``, puts
``<prefix><name>`` = ``{"url", "role", "model"}`` bound to it, and every
ttl/3 checks the engine's health and keeps the lease alive. When the health
stops answering 200 it revokes the lease (the key vanishes at once) and
registers again once it answers 200; when the lease is gone (etcd was out for
longer than the TTL, or the key was deleted) it registers again with a new
one. SIGTERM or SIGINT revokes and exits 0; a registrar that dies without a
word (kill -9) leaves the key to vanish after its TTL.

Logs (JSON lines on stderr): ``register_started``, ``registered`` (with a
``reason``: started, healthy, lease_lost, key_missing), ``deregistered`` (with
a ``reason``: unhealthy, signal), ``etcd_unavailable`` (once per outage).
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import sys
from typing import Any

import httpx
import msgspec
import trio

from narwhal.config import EngineSpec
from narwhal.discovery.entry import EngineRegistration, EntryProblem, encode_registration, engine_name
from narwhal.discovery.etcd_http import EtcdHttp, EtcdRefused, EtcdUnavailable, b64
from narwhal.obs.logs import configure_logging, flush_logs, log_event, run_log_flusher
from narwhal.tools.cli_args import http_url

__all__ = ["DEFAULT_PREFIX", "RegisterOptions", "Registrar", "add_parser", "run_register"]

DEFAULT_PREFIX = "/narwhal/engines/"


class RegisterOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What to register, where, and how it is kept."""

    endpoints: tuple[str, ...]
    name: str
    url: str
    role: str
    model: str | None = None
    ttl_s: float = 10.0
    health_url: str | None = None  # default: url + "/health"
    prefix: str = DEFAULT_PREFIX
    # Consecutive health answers other than 200 before the registration is revoked.
    health_failures: int = 1

    @property
    def key(self) -> str:
        return f"{self.prefix}{self.name}"

    @property
    def health(self) -> str:
        return self.health_url or f"{self.url.rstrip('/')}/health"

    @property
    def grant_ttl_s(self) -> int:
        # etcd counts lease TTLs in whole seconds: round up, never down.
        return max(1, math.ceil(self.ttl_s))

    @property
    def interval_s(self) -> float:
        return self.ttl_s / 3

    def problem(self) -> str | None:
        """Why these options cannot register, in one line; None when they can."""
        if not self.endpoints:
            return "--etcd: at least one endpoint is needed"
        if not self.prefix:
            return "--prefix: must not be empty"
        name = engine_name(self.key, self.prefix)
        if isinstance(name, EntryProblem):
            return f"--name: {name.problem}"
        if not math.isfinite(self.ttl_s) or self.ttl_s <= 0:
            return f"--ttl-s: must be a positive number of seconds, got {self.ttl_s!r}"
        if self.health_failures < 1:
            return "--health-failures: must be at least 1"
        try:
            # The router checks a registration as it checks [[engines]]: refuse here what it would refuse there.
            EngineSpec(name=self.name, url=self.url, role=self.role, model=self.model)  # type: ignore[arg-type]
        except (ValueError, msgspec.ValidationError) as exc:
            return f"--url/--role/--model: {exc}"
        return None

    def value(self) -> bytes:
        return encode_registration(EngineRegistration(url=self.url, role=self.role,  # type: ignore[arg-type]
                                                      model=self.model))


class Registrar:
    """One engine's registration: ``step()`` does one round (health, then etcd), ``run()`` repeats it."""

    def __init__(self, options: RegisterOptions, *, etcd_client: httpx.AsyncClient | None = None,
                 health_client: httpx.AsyncClient | None = None) -> None:
        self.options = options
        # Each round must end well within the TTL: bound every call by a share of the interval.
        self.call_timeout_s = max(0.2, min(5.0, options.interval_s / 2))
        self._etcd = EtcdHttp(options.endpoints, timeout_s=self.call_timeout_s, client=etcd_client)
        self._health_client = health_client or httpx.AsyncClient(timeout=self.call_timeout_s)
        self.lease_id = 0
        self._value = options.value()
        self._failures = 0
        self._etcd_down = False
        self._ever_registered = False
        self._was_unhealthy = False

    @property
    def registered(self) -> bool:
        return self.lease_id != 0

    def _fields(self) -> dict[str, Any]:
        return {"engine": self.options.name, "key": self.options.key}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Register and keep the registration until cancelled (the caller then calls ``deregister``)."""
        options = self.options
        log_event("register_started", **self._fields(), url=options.url, role=options.role, model=options.model,
                  etcd=list(options.endpoints), ttl_s=options.ttl_s, health_url=options.health)
        task_status.started()
        while True:
            # Rounds start every interval whatever a round took: a slow health check does not delay keepalives.
            next_round = trio.current_time() + options.interval_s
            await self.step()
            await trio.sleep_until(next_round)

    async def step(self) -> None:
        """Keep the lease alive, check health, then register or revoke as it says.

        The lease first, every round while registered: with ``--health-failures`` over 1, a health check that
        fails once or answers late must not let the lease lapse before the rule has decided anything.
        """
        try:
            if self.registered:
                await self._keep()
                self._etcd_up()
            healthy, detail = await self._check_health()
            if not healthy:
                self._failures += 1
                if self.registered and self._failures >= self.options.health_failures:
                    await self.deregister("unhealthy", detail=detail)
                self._was_unhealthy = True
                return
            self._failures = 0
            if not self.registered:
                reason = ("started" if not self._ever_registered else "healthy" if self._was_unhealthy
                          else "lease_lost")
                await self._register(reason)
            self._was_unhealthy = False
            self._etcd_up()
        except (EtcdUnavailable, ValueError, TypeError, AttributeError) as exc:
            # Unreachable, or answering what etcd would not (behind a wrong proxy): the next round tries again.
            if not self._etcd_down:
                self._etcd_down = True
                log_event("etcd_unavailable", level=logging.WARNING, **self._fields(), error=str(exc),
                          lease=self.lease_id)

    def _etcd_up(self) -> None:
        self._etcd_down = False

    async def _check_health(self) -> tuple[bool, str]:
        try:
            response = await self._health_client.get(self.options.health, timeout=self.call_timeout_s)
        except httpx.HTTPError as exc:
            return False, f"{type(exc).__name__} on {self.options.health}"
        if response.status_code != 200:
            return False, f"HTTP {response.status_code} on {self.options.health}"
        return True, ""

    async def _register(self, reason: str) -> None:
        granted = await self._etcd.post("/v3/lease/grant", {"TTL": str(self.options.grant_ttl_s)})
        lease_id = int(granted.get("ID") or 0)
        if not lease_id:
            raise EtcdUnavailable(f"etcd granted no lease: {granted.get('error') or granted}")
        # Known before the put: a SIGTERM during it still revokes the lease, and the key with it.
        self.lease_id = lease_id
        try:
            await self._put(lease_id)
        except EtcdUnavailable:
            self.lease_id = 0
            await self._revoke_quietly(lease_id)
            raise
        self._ever_registered = True
        log_event("registered", **self._fields(), reason=reason, lease=lease_id, ttl_s=int(granted.get("TTL") or 0))

    async def _put(self, lease_id: int) -> None:
        await self._etcd.post("/v3/kv/put", {"key": b64(self.options.key), "value": b64(self._value),
                                             "lease": str(lease_id)})

    async def _keep(self) -> None:
        """Keep the lease alive (forgotten when gone: the round's health check decides whether to register
        again); put the key again when it is gone and the lease is not."""
        try:
            answer = await self._etcd.post("/v3/lease/keepalive", {"ID": str(self.lease_id)})
            alive = int((answer.get("result") or {}).get("TTL") or 0) > 0
        except EtcdRefused:
            alive = False
        if not alive:
            # Expired (etcd was out, or unreachable from here, for longer than the TTL), or revoked by hand.
            self.lease_id = 0
            return
        answer = await self._etcd.post("/v3/kv/range", {"key": b64(self.options.key)})
        kvs = answer.get("kvs") or []
        if not kvs:
            await self._put(self.lease_id)  # deleted by hand: the lease is ours still
            log_event("registered", **self._fields(), reason="key_missing", lease=self.lease_id,
                      ttl_s=self.options.grant_ttl_s)

    async def _revoke_quietly(self, lease_id: int) -> bool:
        try:
            await self._etcd.post("/v3/lease/revoke", {"ID": str(lease_id)})
        except EtcdRefused:
            return True  # "lease not found": gone already
        except EtcdUnavailable:
            return False  # it expires by itself within its TTL
        return True

    async def deregister(self, reason: str, *, detail: str = "") -> None:
        """Revoke the lease (the key goes with it); unreachable etcd lets it expire within the TTL instead."""
        lease_id, self.lease_id = self.lease_id, 0
        if not lease_id:
            return
        revoked = await self._revoke_quietly(lease_id)
        fields: dict[str, Any] = {"detail": detail} if detail else {}
        log_event("deregistered", **self._fields(), reason=reason, lease=lease_id, revoked=revoked, **fields)

    async def aclose(self) -> None:
        await self._etcd.aclose()
        await self._health_client.aclose()


async def serve_registration(options: RegisterOptions) -> None:
    """Run a Registrar until SIGTERM or SIGINT, then revoke."""
    registrar = Registrar(options)
    try:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run_log_flusher, 0.05)
                await nursery.start(registrar.run)
                async for signum in signals:
                    log_event("signal", signal=signal.Signals(signum).name)
                    break
                nursery.cancel_scope.cancel()
        with trio.move_on_after(2 * registrar.call_timeout_s * len(options.endpoints) + 1.0):
            await registrar.deregister("signal")
    finally:
        await registrar.aclose()


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``register`` on the top-level CLI; sets ``run`` for dispatch."""
    p = subparsers.add_parser(
        "register", help="register an engine in etcd while its /health answers 200 (a sidecar)",
        description="Keep one engine registered for the router's etcd discovery: a key under the prefix, "
                    "bound to an etcd lease kept alive while the engine's /health answers 200.")
    p.add_argument("--etcd", required=True, metavar="URL[,URL]", help="etcd client URLs, comma-separated")
    p.add_argument("--name", required=True, help="the engine's name (the key's last segment)")
    p.add_argument("--url", required=True, type=http_url, help="the engine, http://HOST:PORT")
    p.add_argument("--role", required=True, choices=("prefill", "decode"), help="the engine's role")
    p.add_argument("--model", help="the model it serves (default: the router's [fleet] model)")
    p.add_argument("--ttl-s", type=float, default=10.0,
                   help="the lease's TTL: the key vanishes this long after the registrar stops (default 10)")
    p.add_argument("--health-url", type=http_url, help="what must answer 200 (default URL/health)")
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help=f"the key prefix (default {DEFAULT_PREFIX})")
    p.add_argument("--health-failures", type=int, default=1, metavar="N",
                   help="health answers other than 200 in a row before deregistering (default 1)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="the least severe log events written to stderr (default info)")
    p.set_defaults(run=run_register)


def run_register(args: argparse.Namespace) -> int:
    """``narwhal register``: 0 after SIGTERM/SIGINT, 2 for bad arguments."""
    options = RegisterOptions(
        endpoints=tuple(endpoint.strip() for endpoint in args.etcd.split(",") if endpoint.strip()),
        name=args.name, url=args.url, role=args.role, model=args.model, ttl_s=args.ttl_s,
        health_url=args.health_url, prefix=args.prefix, health_failures=args.health_failures)
    problem = options.problem()
    if problem is None:
        for endpoint in options.endpoints:
            try:
                http_url(endpoint)
            except argparse.ArgumentTypeError as exc:
                problem = f"--etcd: {exc}"
                break
    if problem is not None:
        print(f"narwhal register: {problem}", file=sys.stderr)
        return 2
    configure_logging(args.log_level)
    try:
        trio.run(serve_registration, options)
    finally:
        flush_logs()
    return 0

