"""The vLLM plugin's self-registration in etcd: what ``narwhal register`` does, from inside the engine.

With ``$NARWHAL_REGISTER_ETCD`` set, the plugin keeps the key ``<prefix><engine_id>`` =
``{"url", "role", "model"}`` bound to an etcd lease while the engine's ``/health``
answers 200, keeps the lease alive every ttl/3, registers again with a new lease
after an etcd outage longer than the TTL, and revokes it at shutdown.

Standard library only (urllib, json, base64, threading), like the plugin: it runs in
vLLM's process, where narwhal is installed without its dependencies. A daemon thread
does the work so that no call ever waits on vLLM's event loop.
"""

from __future__ import annotations

import atexit
import base64
import dataclasses
import json
import logging
import math
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from narwhal.errors import NarwhalError

__all__ = [
    "DEFAULT_PREFIX",
    "DEFAULT_TTL_S",
    "REGISTER_ETCD_ENV",
    "REGISTER_PREFIX_ENV",
    "REGISTER_ROLE_ENV",
    "REGISTER_TTL_ENV",
    "REGISTER_URL_ENV",
    "PluginRegistrar",
    "Registration",
    "registration_from_environment",
]

REGISTER_ETCD_ENV = "NARWHAL_REGISTER_ETCD"
REGISTER_URL_ENV = "NARWHAL_REGISTER_URL"
REGISTER_PREFIX_ENV = "NARWHAL_REGISTER_PREFIX"
REGISTER_TTL_ENV = "NARWHAL_REGISTER_TTL_S"
REGISTER_ROLE_ENV = "NARWHAL_REGISTER_ROLE"

DEFAULT_PREFIX = "/narwhal/engines/"
DEFAULT_TTL_S = 10.0

# An etcd answer to a lease or key call is well under a kilobyte; past this it is not etcd.
_MAX_ANSWER_BYTES = 1 << 20
# Health answers other than 200 in a row before the registration is revoked: an engine busy enough
# to miss one health deadline is still serving, and flapping would cost it a readmission each time.
_HEALTH_FAILURES = 2

# The KV role an engine needs to serve each placement role (the router checks the same at readmission).
_NEEDED_KV_ROLE = {"prefill": "producer", "decode": "consumer"}

_log = logging.getLogger("narwhal.engine_plugin")


@dataclasses.dataclass(frozen=True)
class Registration:
    """What the plugin registers, and where."""

    endpoints: tuple[str, ...]
    name: str
    url: str
    role: str
    model: str
    prefix: str = DEFAULT_PREFIX
    ttl_s: float = DEFAULT_TTL_S

    @property
    def key(self) -> str:
        return f"{self.prefix}{self.name}"

    @property
    def health_url(self) -> str:
        return f"{self.url.rstrip('/')}/health"

    @property
    def grant_ttl_s(self) -> int:
        # etcd counts lease TTLs in whole seconds: round up, never down.
        return max(1, math.ceil(self.ttl_s))

    @property
    def interval_s(self) -> float:
        return self.ttl_s / 3

    def value(self) -> bytes:
        return json.dumps({"url": self.url, "role": self.role, "model": self.model},
                          separators=(",", ":")).encode()


def registration_from_environment(environ: Mapping[str, str], *, engine_id: str | None, model: str | None,
                                  kv_roles: Sequence[str],
                                  identity_problems: Sequence[str] = ()) -> Registration | str | None:
    """The registration the environment asks for; None when it asks for none; a one-line problem when it is wrong."""
    etcd = environ.get(REGISTER_ETCD_ENV, "").strip()
    if not etcd:
        return None
    endpoints = tuple(endpoint.strip().rstrip("/") for endpoint in etcd.split(",") if endpoint.strip())
    for endpoint in endpoints:
        problem = _url_problem(endpoint)
        if problem is not None:
            return f"{REGISTER_ETCD_ENV}: {problem}"
    url = environ.get(REGISTER_URL_ENV, "").strip()
    if not url:
        return f"{REGISTER_URL_ENV} is not set: it must say where the router reaches this engine (http://HOST:PORT)"
    problem = _url_problem(url)
    if problem is not None:
        return f"{REGISTER_URL_ENV}: {problem}"
    if identity_problems:
        return "the engine cannot identify itself: " + "; ".join(identity_problems)
    if not engine_id or not model:
        return "the engine has no engine id or model"
    if "/" in engine_id:
        return f"NARWHAL_ENGINE_ID {engine_id!r} must be one key segment (no '/') to register"
    prefix = environ.get(REGISTER_PREFIX_ENV, DEFAULT_PREFIX)
    if not prefix:
        return f"{REGISTER_PREFIX_ENV} must not be empty"
    ttl_text = environ.get(REGISTER_TTL_ENV, "").strip()
    try:
        ttl_s = float(ttl_text) if ttl_text else DEFAULT_TTL_S
    except ValueError:
        ttl_s = math.nan
    if not math.isfinite(ttl_s) or ttl_s <= 0:
        return f"{REGISTER_TTL_ENV}={ttl_text!r} is not a positive number of seconds"
    role = _role(environ.get(REGISTER_ROLE_ENV, "").strip().lower(), kv_roles)
    if role.startswith("!"):
        return role[1:]
    return Registration(endpoints=endpoints, name=engine_id, url=url, role=role, model=model, prefix=prefix,
                        ttl_s=ttl_s)


def _role(asked: str, kv_roles: Sequence[str]) -> str:
    """The placement role, or ``"!problem"``: NARWHAL_REGISTER_ROLE, else the one the KV role allows."""
    allowed = [role for role, needed in _NEEDED_KV_ROLE.items() if needed in kv_roles]
    shown = "[" + ", ".join(kv_roles) + "]"
    if asked:
        if asked not in _NEEDED_KV_ROLE:
            return f"!{REGISTER_ROLE_ENV}={asked!r} is not prefill or decode"
        if asked not in allowed:
            return (f"!{REGISTER_ROLE_ENV}={asked} needs kv_role {_NEEDED_KV_ROLE[asked]}, but this engine's "
                    f"kv_roles are {shown}: the router would refuse it")
        return asked
    if len(allowed) == 1:
        return allowed[0]
    if not allowed:
        return (f"!cannot tell this engine's role: no KV role (kv_roles {shown}); start vLLM with "
                f"--kv-transfer-config kv_producer (prefill) or kv_consumer (decode)")
    return f"!cannot tell this engine's role: kv_roles {shown} allow prefill and decode: set {REGISTER_ROLE_ENV}"


def _url_problem(url: str) -> str | None:
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port  # urlsplit parses the port lazily: reading it validates it
    except ValueError:
        return f"bad port in {url!r}"
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        return f"expected http://HOST:PORT, got {url!r}"
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        return f"must have no path, query or fragment: {url!r}"
    return None


class _EtcdRefused(NarwhalError):
    """etcd answered 4xx (a lease it does not know, a bad request)."""


class _EtcdUnavailable(NarwhalError):
    """No endpoint answered as etcd does."""


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


class _Etcd:
    """POSTs to etcd's JSON gateway, to the first endpoint that answers, starting with the last that did."""

    def __init__(self, endpoints: Sequence[str], timeout_s: float) -> None:
        self.endpoints = list(endpoints)
        self.timeout_s = timeout_s
        self.current = 0

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        problems: list[str] = []
        payload = json.dumps(body).encode()
        for step in range(len(self.endpoints)):
            index = (self.current + step) % len(self.endpoints)
            endpoint = self.endpoints[index]
            request = urllib.request.Request(f"{endpoint}{path}", data=payload, method="POST",
                                             headers={"content-type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:  # noqa: S310 - http(s) only
                    content = response.read(_MAX_ANSWER_BYTES + 1)
            except urllib.error.HTTPError as exc:
                with exc:
                    text = exc.read(300).decode(errors="replace")
                if 400 <= exc.code < 500:
                    self.current = index
                    raise _EtcdRefused(f"HTTP {exc.code} {text}") from None
                problems.append(f"{endpoint}: HTTP {exc.code} {text!r}")
                continue
            except (OSError, ValueError) as exc:  # URLError, timeouts, resets, a broken status line
                problems.append(f"{endpoint}: {type(exc).__name__}")
                continue
            if len(content) > _MAX_ANSWER_BYTES:
                problems.append(f"{endpoint}: answer over {_MAX_ANSWER_BYTES} bytes")
                continue
            try:
                # A lease keepalive answers as a stream of objects: the first is ours.
                answer = json.loads(content.split(b"\n", 1)[0])
            except ValueError:
                problems.append(f"{endpoint}: not JSON")
                continue
            if not isinstance(answer, dict):
                problems.append(f"{endpoint}: not a JSON object")
                continue
            self.current = index
            return answer
        raise _EtcdUnavailable("etcd unreachable: " + "; ".join(problems))


class PluginRegistrar:
    """One engine's registration, kept by a daemon thread: ``start()`` once, ``stop()`` revokes."""

    def __init__(self, registration: Registration) -> None:
        self.registration = registration
        # Each round must end well within the TTL: bound every call by a share of the interval.
        self.call_timeout_s = max(0.2, min(5.0, registration.interval_s / 2))
        self._etcd = _Etcd(registration.endpoints, self.call_timeout_s)
        self._value = registration.value()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.lease_id = 0
        self._failures = 0
        self._etcd_down = False
        self._ever_registered = False
        self._was_unhealthy = False

    @property
    def registered(self) -> bool:
        return self.lease_id != 0

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        """Start the thread (once; later calls do nothing) and revoke at process exit if nobody stopped it."""
        with self._start_lock:
            if self._thread is not None:
                return
            r = self.registration
            _log.info("narwhal registration: registering %s as %s in etcd %s while %s answers 200 "
                      "(role=%s model=%s ttl_s=%g)", r.url, r.key, ",".join(r.endpoints), r.health_url, r.role,
                      r.model, r.ttl_s)
            self._thread = threading.Thread(target=self._run, name="narwhal-register", daemon=True)
            self._thread.start()
            atexit.register(self.stop)

    def stop(self) -> None:
        """Stop renewing and revoke the lease (the key vanishes at once); bounded by the calls' deadlines."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            # A revoke tries every endpoint once, after at most one round in flight (health, then two calls).
            thread.join(self.call_timeout_s * (3 + 2 * len(self.registration.endpoints)) + 1.0)
        atexit.unregister(self.stop)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                # Rounds start every interval whatever a round took: a slow health check does not delay keepalives.
                next_round = time.monotonic() + self.registration.interval_s
                self.step()
                self._stop.wait(max(0.0, next_round - time.monotonic()))
        except Exception:  # a bug here must not take the engine down: say so, and let the lease expire
            _log.exception("narwhal registration: stopped by an unexpected error")
        finally:
            self._deregister("shutdown")

    def step(self) -> None:
        """One round: keep the lease alive, check health, then register or revoke as it says.

        The lease first, every round while registered: a health check that fails once, or answers late (a busy
        API server), must not let the lease lapse before the health rule (two failures in a row) has decided
        anything; the key vanishing then took a slow engine out of every router's fleet.
        """
        try:
            if self.registered:
                self._keep()
                self._etcd_down = False
            healthy, detail = self._check_health()
            if not healthy:
                self._failures += 1
                if self.registered and self._failures >= _HEALTH_FAILURES:
                    self._deregister("unhealthy", detail=detail)
                if self._failures >= _HEALTH_FAILURES:
                    self._was_unhealthy = True
                return
            self._failures = 0
            if not self.registered:
                reason = ("started" if not self._ever_registered else "healthy" if self._was_unhealthy
                          else "lease_lost")
                self._register(reason)
            self._was_unhealthy = False
            self._etcd_down = False
        except (_EtcdUnavailable, _EtcdRefused, ValueError, TypeError, AttributeError) as exc:
            # Unreachable, or answering what etcd would not (behind a wrong proxy): the next round tries again.
            if not self._etcd_down:
                self._etcd_down = True
                _log.warning("narwhal registration: etcd unavailable, key=%s lease=%s: %s",
                             self.registration.key, self.lease_id, exc)

    def _check_health(self) -> tuple[bool, str]:
        url = self.registration.health_url
        try:
            with urllib.request.urlopen(url, timeout=self.call_timeout_s) as response:  # noqa: S310 - http(s) only
                status = response.status
        except urllib.error.HTTPError as exc:
            exc.close()
            status = exc.code
        except (OSError, ValueError) as exc:
            return False, f"{type(exc).__name__} on {url}"
        if status != 200:
            return False, f"HTTP {status} on {url}"
        return True, ""

    def _register(self, reason: str) -> None:
        granted = self._etcd.post("/v3/lease/grant", {"TTL": str(self.registration.grant_ttl_s)})
        lease_id = int(granted.get("ID") or 0)
        if not lease_id:
            raise _EtcdUnavailable(f"etcd granted no lease: {granted.get('error') or granted}")
        self.lease_id = lease_id  # known before the put: a stop during it still revokes the lease
        try:
            self._put(lease_id)
        except (_EtcdUnavailable, _EtcdRefused):
            self.lease_id = 0
            self._revoke_quietly(lease_id)
            raise
        self._ever_registered = True
        _log.info("narwhal registration: registered key=%s lease=%s reason=%s", self.registration.key, lease_id,
                  reason)

    def _put(self, lease_id: int) -> None:
        self._etcd.post("/v3/kv/put", {"key": _b64(self.registration.key), "value": _b64(self._value),
                                       "lease": str(lease_id)})

    def _keep(self) -> None:
        """Keep the lease alive (forgotten when gone: the round's health check decides whether to register
        again); put the key again when it is gone and the lease is not."""
        try:
            answer = self._etcd.post("/v3/lease/keepalive", {"ID": str(self.lease_id)})
            alive = int((answer.get("result") or {}).get("TTL") or 0) > 0
        except _EtcdRefused:
            alive = False
        if not alive:
            # Expired (etcd was out, or unreachable from here, for longer than the TTL), or revoked by hand.
            self.lease_id = 0
            return
        answer = self._etcd.post("/v3/kv/range", {"key": _b64(self.registration.key)})
        if not answer.get("kvs"):
            self._put(self.lease_id)  # deleted by hand: the lease is ours still
            _log.info("narwhal registration: registered key=%s lease=%s reason=key_missing",
                      self.registration.key, self.lease_id)

    def _revoke_quietly(self, lease_id: int) -> bool:
        try:
            self._etcd.post("/v3/lease/revoke", {"ID": str(lease_id)})
        except _EtcdRefused:
            return True  # "lease not found": gone already
        except _EtcdUnavailable:
            return False  # it expires by itself within its TTL
        return True

    def _deregister(self, reason: str, *, detail: str = "") -> None:
        lease_id, self.lease_id = self.lease_id, 0
        if not lease_id:
            return
        revoked = self._revoke_quietly(lease_id)
        _log.info("narwhal registration: deregistered key=%s lease=%s reason=%s revoked=%s%s",
                  self.registration.key, lease_id, reason, revoked, f" ({detail})" if detail else "")
