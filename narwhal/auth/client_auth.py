"""The request path's client auth: the caller's key, the models it may use, its limits and its place in line.

``ClientAuth`` is what the request core asks, in this order, before any engine
sees a request: ``identify`` (401 ``invalid_api_key``), ``check_model`` (403
``model_not_allowed``), ``admit`` (429 ``rate_limit_exceeded`` with OpenAI's
``x-ratelimit-*`` headers), then the priority gate's ``enter`` (503
``overloaded`` / ``pool_saturated`` / ``queue_full`` with ``retry-after``).
``finish`` gives back what ``admit`` and ``enter`` took and charges the tokens
the request used. Without a keys file the data plane builds no ``ClientAuth``:
nothing of this runs (and the bounded policy waits for capacity as before,
without the gate). ``AuthSettings(keys=None)`` (every caller the anonymous
tenant) exists for the gate's own tests; the router never builds it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec
import trio

from narwhal.auth.keys import KeyEntry, KeyStore, read_keys_file
from narwhal.auth.limits import TenantLimits
from narwhal.auth.priority import GateRefused, PriorityGate, Ticket
from narwhal.config import Config, ConfigError, resolve_config_path
from narwhal.errors import NarwhalError

__all__ = ["ANONYMOUS", "Admitted", "AuthRefused", "AuthSettings", "ClientAuth", "read_client_keys"]

# The one tenant when a ClientAuth has no keys (its own tests; the router builds none without a keys file).
ANONYMOUS = KeyEntry(name="-", sha256="0" * 64)


def read_client_keys(config: Config, base_dir: Path | None) -> list[KeyEntry] | None:
    """The entries of ``[auth] keys_file`` (None when unset); a ConfigError naming ``auth.keys_file`` otherwise."""
    if config.auth.keys_file is None:
        return None
    path = resolve_config_path(config.auth.keys_file, base_dir)
    try:
        return list(read_keys_file(path).keys)
    except ConfigError as exc:
        raise ConfigError(f"auth.keys_file: {exc}") from None


class AuthSettings(msgspec.Struct, frozen=True, kw_only=True):
    """What the data plane needs of ``[auth]`` (the keys as read by the controller) and ``serving.max_queue``."""

    keys: list[KeyEntry] | None = None  # None: no client auth
    reserve_high: float = 0.0
    max_queue: int = 256
    # This router's part of each limit (1 / routers serving, x 1 / worker processes).
    share: float = 1.0


class AuthRefused(NarwhalError):
    """A request refused by client auth: the status, the OpenAI error body's fields and the headers to send."""

    def __init__(self, status: int, message: str, type_: str, code: str, reason: str,
                 headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        # The refusal's reason label (narwhal_tenant_refusals_total): invalid_api_key, model, requests, ...
        self.reason = reason
        self.headers = list(headers)


class Admitted:
    """One admitted request's holdings: its tenant and its gate ticket (and how long it waited for it).

    A served request carries no ``x-ratelimit-*`` headers (a refused one does): computing them costs a refill
    and six formatted values per request, for headers OpenAI's clients read only on a 429.
    """

    __slots__ = ("key", "queue_wait_s", "ticket")

    def __init__(self, key: KeyEntry, ticket: Ticket | None, queue_wait_s: float) -> None:
        self.key = key
        self.ticket = ticket
        self.queue_wait_s = queue_wait_s


def _retry_after(seconds: float) -> tuple[bytes, bytes]:
    return b"retry-after", str(max(1, math.ceil(seconds))).encode()


class ClientAuth:
    """Keys, limits and the priority gate of one data-plane process."""

    def __init__(self, settings: AuthSettings, *, capacity: int, bounded: bool,
                 clock: Callable[[], float] = trio.current_time) -> None:
        self._clock = clock
        self._bounded = bounded
        self.enabled = settings.keys is not None
        self.store = KeyStore(settings.keys or [])
        self.limits = TenantLimits()
        self.limits.configure(settings.keys or [], share=settings.share)
        self.gate = PriorityGate(capacity=capacity, reserve_high=settings.reserve_high,
                                 max_queue=settings.max_queue, clock=clock)
        self._capacity = capacity
        self.settings = settings

    def configure(self, settings: AuthSettings) -> None:
        """A reload (or a new share): keys added are admitted at once, keys removed refused at once."""
        if settings == self.settings:
            return
        self.settings = settings
        self.enabled = settings.keys is not None
        self.store = KeyStore(settings.keys or [])
        self.limits.configure(settings.keys or [], share=settings.share)
        self.gate.reconfigure(capacity=self._capacity, reserve_high=settings.reserve_high,
                              max_queue=settings.max_queue)

    def identify(self, authorization: bytes | None) -> KeyEntry:
        """The caller's key entry; 401 for a missing, malformed or unknown key."""
        if not self.enabled:
            return ANONYMOUS
        key = self.store.lookup(authorization)
        if key is None:
            what = "no API key" if authorization is None else "an invalid API key"
            raise AuthRefused(401, f"this router needs a valid API key (Authorization: Bearer KEY); the request "
                              f"had {what}", "invalid_request_error", "invalid_api_key", "invalid_api_key",
                              [(b"www-authenticate", b'Bearer realm="narwhal"')])
        return key

    def check_model(self, key: KeyEntry, names: Sequence[str]) -> None:
        """403 when the key may use none of ``names`` (the model as asked, and the served model it names)."""
        allowed = key.models
        if allowed is None or any(name in allowed for name in names):
            return
        raise AuthRefused(403, f"the API key {key.name!r} may not use the model {names[0]!r}",
                          "invalid_request_error", "model_not_allowed", "model")

    async def admit(self, key: KeyEntry, deadline: float) -> Admitted:
        """Take the tenant's limits and a place in the gate (waiting in line under the bounded policy)."""
        now = self._clock()
        limits = self.limits
        refusal = limits.admit(key.name, now) if self.enabled else None
        if refusal is not None:
            limit = {"requests": "requests per minute", "tokens": "tokens per minute",
                     "concurrent": "concurrent requests"}[refusal.reason]
            raise AuthRefused(429, f"rate limit reached for {key.name!r}: {limit}; retry after "
                              f"{max(1, math.ceil(refusal.retry_after_s))} s", "requests", "rate_limit_exceeded",
                              refusal.reason, refusal.headers)
        try:
            if self._bounded:
                ticket, waited = await self.gate.enter(key.name, key.priority, deadline)
            else:
                ticket, waited = self.gate.try_enter(key.name, key.priority), 0.0
        except GateRefused as exc:
            if self.enabled:
                limits.release(key.name)
            message = {"overloaded": f"the router is at capacity for {key.priority} priority requests",
                       "pool_saturated": "router saturated: no free data connection",
                       "queue_full": "the queue for capacity is full"}[exc.code]
            raise AuthRefused(503, message, "service_unavailable", exc.code, exc.code,
                              [_retry_after(exc.retry_after_s)]) from None
        except BaseException:
            if self.enabled:
                limits.release(key.name)
            raise
        return Admitted(key, ticket, waited)

    def finish(self, admitted: Admitted, tokens: int) -> None:
        """The request ended: its gate slot and concurrency back, its tokens charged."""
        if admitted.ticket is not None:
            self.gate.leave(admitted.ticket)
            admitted.ticket = None
        if self.enabled:
            name = admitted.key.name
            self.limits.release(name)
            if tokens > 0:
                self.limits.charge(name, tokens, self._clock())
